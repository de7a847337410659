"""The Llama-family decoder and its weight loader."""

from minillm.models.llama import LlamaForCausalLM
from minillm.models.loader import load_model

__all__ = ["LlamaForCausalLM", "load_model"]
