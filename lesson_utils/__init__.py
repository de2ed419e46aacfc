"""Helpers for the PagedAttention course: environment and profiles, the OPT model and its compact
forward, KV caches, workloads, simulators, exercise checkers and plots. One concept per module."""

__version__ = "0.1.0"
