"""Reference attention in plain PyTorch, with grouped K/V heads and a position mask.

MHA, GQA and MQA are one code path: ``num_heads`` query heads share ``num_kv_heads`` key/value
heads in groups of ``G = num_heads // num_kv_heads`` (G = 1 is MHA; ``num_kv_heads = 1`` is MQA).
Instead of repeating K/V ``G`` times in memory, we fold each group's query heads into the
query-length axis, so one batched matmul per KV head serves the whole group.
"""

from __future__ import annotations

import torch


def causal_mask(query_positions: torch.Tensor, kv_len: int, window: int | None = None) -> torch.Tensor:
    """``mask[B, 1, T, S]``: a query at position ``p`` may attend to key positions ``0..p``
    (with a sliding ``window``, only the last ``window`` of them: ``p-window+1..p``).

    This single rule also hides padding: a row's padded query slots sit past its real tokens,
    and real queries never look beyond their own position.
    """
    keys = torch.arange(kv_len, device=query_positions.device)[None, None, :]
    queries = query_positions[:, :, None]
    allowed = keys <= queries
    if window is not None:
        allowed = allowed & (keys > queries - window)
    return allowed.unsqueeze(1)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """``softmax(q kᵀ · scale + mask) v`` for ``q[B, H, T, D]``, ``k, v[B, KV, S, D]``.

    The softmax runs in fp32 whatever the input dtype (as Hugging Face's reference does) so
    long contexts do not lose probability mass to bf16 rounding. Returns ``[B, H, T, D]``.
    """
    batch, num_heads, t, dim = q.shape
    num_kv_heads, s = k.shape[1], k.shape[2]
    group = num_heads // num_kv_heads
    q = q.reshape(batch, num_kv_heads, group * t, dim)  # heads h = kv * G + g stay in order
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale  # [B, KV, G*T, S]
    if mask is not None:
        scores = scores.view(batch, num_kv_heads, group, t, s)
        scores = scores.masked_fill(~mask.unsqueeze(2), float("-inf"))
        scores = scores.view(batch, num_kv_heads, group * t, s)
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    out = torch.matmul(probs, v)  # [B, KV, G*T, D]
    return out.view(batch, num_heads, t, dim)
