"""Parallelism (chapter 09): one model over many processes, on ``torch.distributed``.

- ``tensor.py``: who holds which part — heads, columns, vocabulary rows, layers (TP and PP);
- ``worker.py``, ``executor.py``, ``processes.py``: the shard workers, the driver's runner, and the
  ownership of worker processes (failures named, nothing left behind);
- ``router.py``, ``data.py``, ``replicas.py``: data parallelism — the routing policies, the router
  server, and offline replicas (``LLM(model, data_parallel_size=N)``);
- ``disagg.py``: prefill and decode on different workers, the KV cache sent between them;
- ``offload.py``: weights streamed from host memory or a file, the last resort;
- ``planner.py``: the arithmetic of memory and traffic per device for real models;
- ``launch.py``: ``run_ranks`` for one function on several ranks (tests, checks, benchmarks).
"""

from minillm.parallel.planner import DEVICES, MODELS, Plan, plan

__all__ = ["DEVICES", "MODELS", "Plan", "plan"]
