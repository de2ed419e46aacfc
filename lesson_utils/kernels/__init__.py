"""Lesson 04's Triton kernels (``paged_attention``), lesson 08's unified kernel (``unified_attention``) and their
ahead-of-time compile report (``aot``).

Importing this package picks Triton's mode for the profile (:func:`lesson_utils.env.configure_triton`: the
interpreter everywhere but the ``gpu`` profile) before any of its kernels is defined. The course's public kernel
entry points are importable from here: ``lesson_utils.kernels.paged_attention_decode`` and
``lesson_utils.kernels.write_kv_to_cache`` (other code relies on these paths).
"""

from lesson_utils import env

env.configure_triton()

from lesson_utils.kernels.paged_attention import paged_attention_decode, write_kv_to_cache  # noqa: E402

__all__ = ["paged_attention_decode", "write_kv_to_cache"]
