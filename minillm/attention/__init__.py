"""Attention backends.

Every backend computes the same thing for ``q[B, H, T, D]`` against ``k, v[B, KV, S, D]``:
causal scaled-dot-product attention with grouped K/V heads. They differ in how:

- ``torch``: the readable reference (matmul → mask → softmax → matmul), what the course
  builds and every other backend is tested against;
- ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention``, PyTorch's fused kernels
  (the fastest choice on CPU, and the default there);
- ``triton``: our own kernels (``triton_kernels.py``) — FlashAttention for prefill, paged
  attention for decode — for the paged engine; the default on CUDA. Without a GPU they run
  under Triton's interpreter (correct, slow: for learning and tests).

The paged engine (``mode="paged"``) calls a *paged* attention function per layer instead
(``paged.py``): the reference one runs the ``torch`` or ``sdpa`` function per group of
sequences; the Triton one launches the kernels on the flat batch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from minillm.attention.torch_ref import attention, causal_mask

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None", bool, float], torch.Tensor]

BACKENDS = ("torch", "sdpa", "triton")


def triton_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("triton") is not None


def resolve_backend(name: str, device, mode: str) -> str:
    """``auto`` → ``triton`` for the paged engine on CUDA (when Triton is installed), else ``sdpa``."""
    if name == "auto":
        return "triton" if device.type == "cuda" and mode == "paged" and triton_available() else "sdpa"
    return name


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
    """The attention function for padded ``[B, H, T, D]`` batches. ``triton`` only changes the
    paged engine's attention (see ``get_paged_backend``); padded batches then use SDPA."""
    if name in ("auto", "sdpa", "triton"):
        return sdpa_attention
    if name == "torch":
        return torch_attention
    raise ValueError(f"attention_backend={name!r}; expected one of {('auto',) + BACKENDS}")


def get_paged_backend(name: str):
    """The paged attention function of a backend, ``f(q, k, v, layer, metadata, scale)`` (see ``paged.py``)."""
    from minillm.attention.paged import paged_attention, triton_paged_attention

    if name == "triton":
        return triton_paged_attention
    return functools.partial(paged_attention, attention_fn=get_backend(name))


__all__ = [
    "BACKENDS",
    "attention",
    "causal_mask",
    "get_backend",
    "get_paged_backend",
    "resolve_backend",
    "sdpa_attention",
    "torch_attention",
    "triton_available",
]
