"""An object's state at one moment, to put back later: what makes a refused engine step all or nothing.

:func:`capture` copies an object's attributes one level deep: every list, dict, deque, set and bytearray it holds
is copied, and a dict's values too where they are containers or :class:`Record` s (a manager's block tables, a
prefix cache's hash chains). Everything else - sequences, tensors, functions, a nested allocator - is kept by
reference: each part of the engine that owns state captures its own, so one capture never reaches into another
part's objects. :meth:`Captured.restore` puts the attributes back and the object keeps its identity (a caller's
``Sequence`` is still the same object afterwards).

Tensors are not copied: K/V data is protected block by block where a step is about to overwrite it
(:mod:`lesson_utils.serving.checkpoint`).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass


class Record:
    """A small mutable record kept as a dict's value (a block table): captured as a copy, its lists copied."""

    def copy_record(self):
        new = object.__new__(type(self))
        vars(new).update({k: _shallow(v) if type(v) in _SHALLOW else v for k, v in vars(self).items()})
        return new


def _deque(v: deque) -> deque:
    return deque(v, v.maxlen)


_SHALLOW = {list: list.copy, dict: dict.copy, OrderedDict: OrderedDict.copy, set: set.copy, bytearray: bytearray,
            deque: _deque}  # fmt: skip
_KEPT = {int, float, str, bool, type(None), tuple, frozenset}  # immutable: kept as they are


def _shallow(v):
    return _SHALLOW[type(v)](v)


def _copy_item(x):
    t = type(x)
    if t in _KEPT:
        return x
    if t in _SHALLOW:
        return _SHALLOW[t](x)
    return x.copy_record() if isinstance(x, Record) else _copy_value(x)


def _copy_value(v):
    """One attribute's value: containers copied (a dict's container and record values too), the rest kept."""
    t = type(v)
    if t in _KEPT:
        return v
    if t is dict or t is OrderedDict:  # keep the order; values one level deeper where they need it
        kinds = set(map(type, v.values()))
        if kinds <= _KEPT:
            return t(v)
        return t((k, _copy_item(x)) for k, x in v.items())
    if t in _SHALLOW:
        return _SHALLOW[t](v)
    if isinstance(v, Record):
        return v.copy_record()
    if isinstance(v, (list, dict, set, bytearray)):  # a subclass of a container: copied as one
        return t(v)
    if isinstance(v, deque):
        return t(v, v.maxlen)
    return v  # an object of its own (a sequence, a tensor, a function, another part's state): by reference


@dataclass
class Captured:
    """One object's attributes as they were; :meth:`restore` puts them back (as often as asked)."""

    obj: object
    attrs: dict

    def restore(self) -> None:
        state = vars(self.obj)
        state.clear()
        state.update({k: _copy_value(v) for k, v in self.attrs.items()})


def capture(obj) -> Captured:
    """``obj``'s attributes now (see the module docstring for how deep the copy goes)."""
    return Captured(obj, {k: _copy_value(v) for k, v in vars(obj).items()})
