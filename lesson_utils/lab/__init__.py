"""The lesson and measurement helpers: what the notebooks use to measure, compare and draw the engine, never what
the engine runs on. KV arithmetic (``kv_math``), lesson 00's decode loop (``decoding``), request streams
(``workloads``), Fig. 15's accounting (``sharing_sim``), serving measurements (``benchmark``), plots (``plotting``,
``memory_plots``), a shipped text (``texts``), the timing protocol (``timing``), verdicts over repeated runs
(``verdicts``), a decode step's profile (``step_profile``), and the identity rule against HF (``identity``).

No module of the engine's floors (``core``, ``memory``, ``cache``, ``kernels``, ``model``, ``serving``,
``disagg``) imports this package (the architecture test holds this)."""
