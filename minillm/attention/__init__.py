"""Attention backends.

Every backend computes the same thing: causal scaled-dot-product attention with grouped K/V
heads. A backend has two faces:

- ``padded(q, k, v, mask, is_causal, scale)`` for ``q[B, H, T, D]`` against ``k, v[B, KV, S, D]``
  — the naive and contiguous-cache engines (``contiguous.py``);
- ``paged_step(layout)`` — builds, once per step, what the backend needs from the paged
  engine's neutral ``StepLayout`` (``layout.py``) and returns an object whose
  ``attend(layer, q, k, v, scale)`` each layer calls.

The backends:

- ``torch``: the readable reference (matmul → mask → softmax → matmul), what the course
  builds and every other backend is tested against; paged steps gather blocks (``paged.py``);
- ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention``, PyTorch's fused kernels
  (the fastest choice on CPU, and the default there), with the same paged reference;
- ``cpu``: ``sdpa``, with the paged decode rows attended by our C++ kernel, which reads the
  blocks in place (``cpu_paged.py``; compiled at first use). The default for the paged engine on CPU;
- ``triton``: our own kernels (``triton_kernels.py``) — FlashAttention for prefill, paged
  attention for decode (``triton_paged.py``); padded batches use SDPA. The default on CUDA.
  Without a GPU the kernels run under Triton's interpreter (correct, slow: for learning and tests).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import minillm.hooks as hooks
from minillm.attention.paged import ReferencePagedStep, StaticDecodeStep
from minillm.attention.torch_ref import attention, causal_mask
from minillm.config import ATTENTION_BACKENDS, triton_available

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None", bool, float], torch.Tensor]


@hooks.reference("torch_attention")
def torch_attention(q, k, v, mask, is_causal, scale):
    """The ``torch`` backend's arithmetic (the readable reference); the backend calls it through
    hook ``torch_attention``, where chapters 01 and 05 plug in their attention."""
    if is_causal and mask is None:
        t = q.shape[2]
        mask = causal_mask(torch.arange(k.shape[2] - t, k.shape[2], device=q.device).expand(q.shape[0], -1), k.shape[2])
    return attention(q, k, v, mask, scale)


def hooked_torch_attention(q, k, v, mask, is_causal, scale):
    """The ``torch`` backend's ``padded`` function: whatever hook ``torch_attention`` holds now."""
    return hooks.torch_attention(q, k, v, mask, is_causal, scale)


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


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    padded: AttentionFn
    # The dtype paged decode attention computes in (None: the model's); see precision.py.
    decode_dtype: torch.dtype | None = None

    def paged_step(self, layout):
        """The per-step attention object for a paged ``StepLayout``."""
        if self.name == "triton":
            from minillm.attention.triton_paged import TritonPagedStep  # imports triton only when used

            return TritonPagedStep(layout)
        if layout.static_decode and layout.in_place_decode:
            from minillm.attention.cpu_paged import StaticKernelDecodeStep

            return StaticKernelDecodeStep(layout)
        if layout.static_decode:
            # The pool's logical dtype (an 8-bit pool's storage dtype is only how it is stored).
            return StaticDecodeStep(layout, self.decode_dtype or layout.pool.dtype or layout.pool.k_slots[0].dtype)
        if self.name == "cpu":
            from minillm.attention.cpu_paged import CpuPagedStep

            return CpuPagedStep(layout, self.padded, self.decode_dtype)
        return ReferencePagedStep(layout, self.padded, self.decode_dtype)


def get_backend(name: str, decode_dtype: torch.dtype | None = None) -> AttentionBackend:
    """``torch`` | ``sdpa`` | ``cpu`` | ``triton`` (the engine's builder resolves ``auto`` first)."""
    if name in ("sdpa", "cpu", "triton"):
        return AttentionBackend(name, sdpa_attention, decode_dtype)
    if name == "torch":
        return AttentionBackend(name, hooked_torch_attention, decode_dtype)
    raise ValueError(f"attention_backend={name!r}; expected one of {ATTENTION_BACKENDS}")


__all__ = [
    "AttentionBackend",
    "AttentionFn",
    "attention",
    "causal_mask",
    "get_backend",
    "sdpa_attention",
    "torch_attention",
    "triton_available",
]
