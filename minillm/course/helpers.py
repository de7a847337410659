"""Small, explicit helpers the chapters hand to learners, so exercises focus on one idea each.

They wrap the real model's ``forward`` in the shapes the chapters talk about: a list of token
ids in, ``[T, V]`` logits out.
"""

from __future__ import annotations

import torch

from minillm.kvcache import ContiguousKVCache
from minillm.models.llama import ForwardBatch, LlamaForCausalLM


def _device(model: LlamaForCausalLM) -> torch.device:
    return model.device


def forward_logits(model: LlamaForCausalLM, ids: list[int]) -> torch.Tensor:
    """One full forward pass over ``ids`` (no cache): logits ``[T, V]``, one row per position."""
    tokens = torch.tensor([ids], device=_device(model))
    positions = torch.arange(len(ids), device=tokens.device)[None]
    return model(ForwardBatch(tokens, positions))[0]


def new_cache(model: LlamaForCausalLM, max_len: int) -> ContiguousKVCache:
    """An empty KV cache for one sequence of up to ``max_len`` tokens."""
    return ContiguousKVCache(model.config, 1, max_len, model.dtype, model.device)


def forward_step(model: LlamaForCausalLM, ids: list[int], start: int, cache: ContiguousKVCache) -> torch.Tensor:
    """Run ``ids`` (new tokens at positions ``start, start+1, ...``) against ``cache``.

    Writes their keys/values into the cache and returns logits ``[T, V]`` for the new tokens.
    """
    tokens = torch.tensor([ids], device=_device(model))
    positions = torch.arange(start, start + len(ids), device=tokens.device)[None]
    batch = ForwardBatch(tokens, positions, cache, kv_len=start + len(ids), same_start=start)
    return model(batch)[0]
