"""The attention backend: one object per engine that says how attention runs — its padded
function (naive and contiguous engines) and the per-step object it builds for a paged step.
Which backends exist and what each is for: ``attention/__init__.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import minillm.hooks as hooks
from minillm.attention.cpu_paged import CpuPagedStep, StaticKernelDecodeStep
from minillm.attention.paged import ReferencePagedStep, StaticDecodeStep
from minillm.attention.torch_ref import attention, causal_mask
from minillm.attention.triton_paged import TritonPagedStep
from minillm.config import ATTENTION_BACKENDS

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
            return TritonPagedStep(layout)
        if layout.static_decode and layout.in_place_decode:
            return StaticKernelDecodeStep(layout)
        if layout.static_decode:
            # The pool's logical dtype (an 8-bit pool's storage dtype is only how it is stored).
            return StaticDecodeStep(layout, self.decode_dtype or layout.pool.dtype or layout.pool.k_slots[0].dtype)
        if self.name == "cpu":
            return CpuPagedStep(layout, self.padded, self.decode_dtype)
        return ReferencePagedStep(layout, self.padded, self.decode_dtype)


def get_backend(name: str, decode_dtype: torch.dtype | None = None) -> AttentionBackend:
    """``torch`` | ``sdpa`` | ``cpu`` | ``triton`` (the engine's builder resolves ``auto`` first)."""
    if name in ("sdpa", "cpu", "triton"):
        return AttentionBackend(name, sdpa_attention, decode_dtype)
    if name == "torch":
        return AttentionBackend(name, hooked_torch_attention, decode_dtype)
    raise ValueError(f"attention_backend={name!r}; expected one of {ATTENTION_BACKENDS}")
