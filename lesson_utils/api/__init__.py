"""Lesson 13: the course's engine served over HTTP the way learners meet engines next - an OpenAI-compatible API.

The floor above ``serving/``: it drives an :class:`~lesson_utils.serving.engine.Engine` through ``add_request``,
``step`` and ``scheduler.abort`` (one sample cancelled wherever it is), reads each sequence's ``status``,
``samples`` and ``output_ids`` and the manager's free blocks, and adds no engine internals of its own.

* :mod:`.detokenizer` - text that is safe to send while tokens still arrive (a character split across tokens is
  held back, never sent as U+FFFD), and stop strings found across token boundaries;
* :mod:`.engine_loop` - one thread that steps the engine while any request runs and sleeps when none does; requests
  come in and outputs go out through thread-safe queues; a bounded waiting line; aborts;
* :mod:`.protocol` - the OpenAI request and response shapes, and its error shape;
* :mod:`.metrics` - Prometheus metrics (running, waiting, KV blocks used, time to first token, inter-token latency);
* :mod:`.app` - the FastAPI application (``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``, ``/metrics``,
  a chat page at ``/``);
* :mod:`.server` - start it in a background thread (a notebook, Colab) or from the command line.
"""
