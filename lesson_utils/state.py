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

import copy
from collections import OrderedDict, deque
from dataclasses import dataclass

_CONTAINERS = (list, dict, OrderedDict, deque, set, bytearray)


class Record:
    """A small mutable record kept as a dict's value (a block table): captured as a copy, its lists copied."""

    def copy_record(self):
        new = copy.copy(self)
        for k, v in vars(self).items():
            if isinstance(v, _CONTAINERS):
                setattr(new, k, _shallow(v))
        return new


def _shallow(v):
    return deque(v, v.maxlen) if isinstance(v, deque) else type(v)(v)


_DEEPER = set(_CONTAINERS)


def _copy_value(v):
    if isinstance(v, dict):  # dict and OrderedDict keep their order; containers and records among the values copied
        kinds = set(map(type, v.values()))
        if not (kinds & _DEEPER or any(issubclass(k, Record) for k in kinds)):
            return type(v)(v)
        return type(v)(
            (k, x.copy_record() if isinstance(x, Record) else _shallow(x) if isinstance(x, _CONTAINERS) else x)
            for k, x in v.items()
        )
    if isinstance(v, _CONTAINERS):
        return _shallow(v)
    if isinstance(v, Record):
        return v.copy_record()
    return v


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
