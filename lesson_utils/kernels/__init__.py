"""Lesson 04's Triton kernels (``paged_attention``) and their ahead-of-time compile report (``aot``).

Importing this package picks Triton's mode for the profile (:func:`lesson_utils.env.configure_triton`: the
interpreter everywhere but the ``gpu`` profile) before any of its kernels is defined.
"""

from lesson_utils import env

env.configure_triton()
