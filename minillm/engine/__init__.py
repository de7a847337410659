"""The engine: turning requests into batches, batches into forward passes, logits into tokens."""

from minillm.engine.llm import LLM

__all__ = ["LLM"]
