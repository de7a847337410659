"""Attention backends.

Every backend computes the same thing for ``q[B, H, T, D]`` against ``k, v[B, KV, S, D]``:
causal scaled-dot-product attention with grouped K/V heads. They differ in how:

- ``torch``: the readable reference (matmul → mask → softmax → matmul), what the course
  builds and every other backend is tested against;
- ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention``, PyTorch's fused kernels
  (the fastest choice on CPU, and the default).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from minillm.attention.torch_ref import attention, causal_mask

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None", bool, float], torch.Tensor]

BACKENDS = ("torch", "sdpa")


def torch_attention(q, k, v, mask, is_causal, scale):
    if is_causal and mask is None:
        t = q.shape[2]
        mask = causal_mask(torch.arange(k.shape[2] - t, k.shape[2], device=q.device).expand(q.shape[0], -1), k.shape[2])
    return attention(q, k, v, mask, scale)


def sdpa_attention(q, k, v, mask, is_causal, scale):
    return F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=mask,
        is_causal=is_causal and mask is None,
        scale=scale,
        enable_gqa=k.shape[1] != q.shape[1],
    )


def get_backend(name: str) -> AttentionFn:
    if name == "auto":
        name = "sdpa"
    if name == "torch":
        return torch_attention
    if name == "sdpa":
        return sdpa_attention
    raise ValueError(f"attention_backend={name!r}; expected one of {('auto',) + BACKENDS}")


__all__ = ["BACKENDS", "attention", "causal_mask", "get_backend", "sdpa_attention", "torch_attention"]
