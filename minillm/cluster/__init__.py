"""Several engines as one service (chapter 09): the layer above the engine and the server.

- ``router.py`` — the routing policies (round robin, least loaded, prefix-aware);
- ``data_parallel.py`` — ``minillm serve --data-parallel-size N``: N server replicas behind a
  router that speaks the same OpenAI API;
- ``replicas.py`` — ``LLM(model, data_parallel_size=N)``: offline replicas in worker processes;
- ``disagg.py`` — prefill and decode on different engines, the KV cache sent between them.

It imports the engine, the server and ``minillm.parallel``'s process ownership; none of them
imports it. ``LLM`` (``minillm/entrypoints/``, the floor above) builds ``replicas.py``'s
``DataParallelLLM`` for ``LLM(model, data_parallel_size=N)``.
"""
