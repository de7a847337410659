"""A quantized KV cache: int8 keys and values with one scale per token and head.

At long contexts and large batches the KV cache, not the weights, fills memory and dominates
what a decode step reads. Storing K and V in int8 halves their bytes (against bf16/fp16), so
the same pool holds about twice the tokens — twice the sequences at a given length.

Each token's key (and value) vector of each head gets its own symmetric scale,
``s = max|x| / 127``: scales are computed as the token is written (no calibration), and one
scale per (token, head) keeps an outlier head or token from costing the others precision.
The cost is a scale (4 bytes) per 64-128 values, and a quantize on write / dequantize on read,
done here in PyTorch by the reference attention backend.
"""

from __future__ import annotations

import torch

SCALE_DTYPE = torch.float32


def quantize_kv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x[..., D]`` → ``(int8 [..., D], scale [...])`` with ``x ≈ q * scale[..., None]``."""
    scale = x.detach().float().abs().amax(dim=-1).clamp(min=1e-8) / 127.0
    q = torch.round(x.float() / scale[..., None]).clamp(-127, 127).to(torch.int8)
    return q, scale.to(SCALE_DTYPE)


def dequantize_kv(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.to(torch.float32) * scale[..., None].float()).to(dtype)
