"""The front doors a caller opens: ``LLM`` (offline generation and streaming; ``llm.py``).

It sits above the engine (one engine in this process) and the multi-engine layer (``cluster/``:
``LLM(model, data_parallel_size=N)`` drives N replicas), as vLLM's ``vllm/entrypoints/`` does,
so that neither of those imports upwards to reach the other.
"""

from minillm.entrypoints.llm import LLM

__all__ = ["LLM"]
