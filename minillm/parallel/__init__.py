"""Parallelism (chapter 09), so far: the planner (how a model spreads over devices), a launcher
that runs ranks on torch.distributed and never leaves one behind, and the tensor-parallel
SwiGLU, attention and vocabulary-parallel embedding blocks, and the data-parallel router
(round robin, least loaded, prefix aware)."""

from minillm.parallel.planner import DEVICES, MODELS, Plan, plan

__all__ = ["DEVICES", "MODELS", "Plan", "plan"]
