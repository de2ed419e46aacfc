"""Exercise checkers: one module per lesson, sharing the machinery in ``core``."""

from .core import CheckResult, ExerciseFailed, is_strict

__all__ = ["CheckResult", "ExerciseFailed", "is_strict"]
