"""Helpers for the PagedAttention course, in floors the tree shows: ``core/`` (the ground floor: types, environment
and profiles, device discipline, host copies, state), the engine's floors on top of it (``memory/``, ``cache/``,
``kernels/``, ``model/``, ``serving/``, ``disagg/``), and above them what the lessons use to measure and check the
engine (``lab/``, ``checks/``), which no engine floor imports. One concept per module."""

__version__ = "0.1.0"
