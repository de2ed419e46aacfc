"""Loaded before any test module: lesson_utils.env must switch Triton to its interpreter (on a machine
without CUDA) before anything imports triton - Triton fixes the mode when its own library is imported."""

import lesson_utils.env  # noqa: F401
