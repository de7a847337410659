"""Parallelism (chapter 09), so far: the planner (how a model spreads over devices), a launcher
that runs ranks on torch.distributed and never leaves one behind, and the tensor-parallel
SwiGLU block (column- then row-parallel, one all-reduce)."""

from minillm.parallel.planner import DEVICES, MODELS, Plan, plan

__all__ = ["DEVICES", "MODELS", "Plan", "plan"]
