"""Parallelism (chapter 09): one model over many processes, on ``torch.distributed``.

- ``worker.py``, ``executor.py``, ``processes.py``: the shard workers, the driver's runner, and the
  ownership of worker processes (failures named, nothing left behind);
- ``planner.py``: the arithmetic of memory and traffic per device for real models;
- ``launch.py``: ``run_ranks`` for one function on several ranks (tests, checks, benchmarks).

Who holds which part of a layer (heads, columns, vocabulary rows, stages) lives with the layers
(``minillm/layers/tensor_parallel.py``), and so does offloading (``minillm/layers/offload.py``);
data parallelism and disaggregation, which run whole engines, live above the engine in
``minillm/cluster/``.
"""

from minillm.parallel.planner import DEVICES, MODELS, Plan, plan

__all__ = ["DEVICES", "MODELS", "Plan", "plan"]
