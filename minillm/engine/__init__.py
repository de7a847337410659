"""The engine: turning requests into batches, batches into forward passes, logits into tokens."""

from minillm.engine.llm_engine import LLMEngine

__all__ = ["LLMEngine"]
