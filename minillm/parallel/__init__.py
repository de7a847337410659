"""Parallelism (chapter 09): so far the planner — how a model spreads over devices."""

from minillm.parallel.planner import DEVICES, MODELS, Plan, plan

__all__ = ["DEVICES", "MODELS", "Plan", "plan"]
