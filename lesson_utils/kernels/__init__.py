"""Lesson 04's Triton kernels (``paged_attention``), lesson 08's unified kernel (``unified_attention``) and their
ahead-of-time compile report (``aot``).

Importing this package picks Triton's mode for the profile (:func:`lesson_utils.core.env.configure_triton`: the
interpreter everywhere but the ``gpu`` profile) before any of its kernels is defined. The course's public kernel
entry points are importable from here: ``lesson_utils.kernels.paged_attention_decode`` and
``lesson_utils.kernels.write_kv_to_cache`` (other code relies on these paths).
"""

from lesson_utils.core import env

env.configure_triton()

import inspect  # noqa: E402

from lesson_utils.kernels.paged_attention import paged_attention_decode, write_kv_to_cache  # noqa: E402


def source_of(fn) -> str:
    """The source of a kernel (a ``@triton.jit`` function: the Python function it wraps) or of its launcher - what
    the lessons print where Triton's tutorials show the code."""
    return inspect.getsource(getattr(fn, "fn", fn))


def source_lines(fn, first: str, last: str) -> str:
    """The lines of :func:`source_of` ``fn`` from the first that contains ``first`` to the next that contains
    ``last`` (both included): the part of a kernel a lesson is about, verbatim."""
    lines = source_of(fn).splitlines()
    a = next(i for i, line in enumerate(lines) if first in line)
    b = next(i for i in range(a, len(lines)) if last in lines[i])
    return "\n".join(lines[a : b + 1])


__all__ = ["paged_attention_decode", "source_lines", "source_of", "write_kv_to_cache"]
