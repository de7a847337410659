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

from minillm.attention.backend import (
    AttentionBackend,
    AttentionFn,
    get_backend,
    sdpa_attention,
    torch_attention,
)
from minillm.attention.torch_ref import attention, causal_mask
from minillm.config import triton_available

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
