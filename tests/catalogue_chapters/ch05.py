"""Chapter 05: more wrong answers a learner writes (see ``check_catalogue``)."""

from __future__ import annotations

import math

import torch
from check_catalogue import right, wrong  # noqa: F401

# ---- grouped-query attention ----------------------------------------------------------------


def _folded(q, k, v, mask, scale, *, scores_scale=None, invert_mask=False, dim=-1, unfold=True, cast="weights"):
    """The folded grouped attention of the solution, with one of a learner's slips."""
    b, h, t, d = q.shape
    kv, s = k.shape[1], k.shape[2]
    g = h // kv
    used = scale if scores_scale is None else scores_scale(scale, d)
    scores = (q.reshape(b, kv, g * t, d) @ k.transpose(-1, -2)).float() * used
    if mask is not None:
        hide = mask if invert_mask else ~mask
        scores = scores.view(b, kv, g, t, s).masked_fill(hide.unsqueeze(2), float("-inf")).view(b, kv, g * t, s)
    weights = torch.softmax(scores, dim=dim)
    if cast == "weights":
        out = weights.to(v.dtype) @ v
    elif cast == "none":
        out = weights @ v  # fp32 weights @ bf16 v: a dtype mismatch
    else:
        out = weights @ v.float()  # runs, but hands back fp32
    return out.view(b, h, t, d) if unfold else out


def gqa_mask_repeat(q, k, v, mask, scale):
    """Correct: the folded rows are G blocks of T queries, and ``repeat`` tiles the mask's T axis
    G times in the same order."""
    b, h, t, d = q.shape
    kv, g = k.shape[1], h // k.shape[1]
    scores = torch.matmul(q.reshape(b, kv, g * t, d), k.transpose(2, 3)).float() * scale
    if mask is not None:
        scores = scores.masked_fill(~mask.repeat(1, 1, g, 1), float("-inf"))
    return torch.matmul(scores.softmax(-1).to(v.dtype), v).reshape(b, h, t, d)


def gqa_index_heads(q, k, v, mask, scale):
    heads = torch.arange(q.shape[1]) // (q.shape[1] // k.shape[1])
    k, v = k[:, heads], v[:, heads]  # the right K/V head for every query head: an indexed copy
    scores = (q @ k.transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, -1) @ v


right("check_gqa_attention", gqa_mask_repeat)
wrong("check_gqa_attention", "the mask is inverted", lambda *a: _folded(*a, invert_mask=True))
wrong(
    "check_gqa_attention",
    "not by the scale argument",
    lambda *a: _folded(*a, scores_scale=lambda scale, d: 1 / math.sqrt(d)),
)
wrong("check_gqa_attention", "divided by scale", lambda *a: _folded(*a, scores_scale=lambda scale, d: 1 / scale))
wrong("check_gqa_attention", "weights do not sum to 1 over the keys", lambda *a: _folded(*a, dim=-2))
wrong("check_gqa_attention", "reshape the result back to [B, H, T, D]", lambda *a: _folded(*a, unfold=False))
wrong("check_gqa_attention", "cast the weights back to v's dtype", lambda *a: _folded(*a, cast="none"))
wrong("check_gqa_attention", "in bfloat16 returned float32", lambda *a: _folded(*a, cast="float"))
wrong("check_gqa_attention", "made a copy of K/V 3× their size (aten.index", gqa_index_heads)

# ---- sliding-window release -----------------------------------------------------------------

wrong("check_window_release", "counts positions, not blocks", lambda n, w, b: max(0, n - w + 1 // b))  # precedence
wrong("check_window_release", "not to the nearest", lambda n, w, b: max(0, round((n - w + 1) / b)))
wrong("check_window_release", "returned -2, expected 0", lambda n, w, b: int((n - w + 1) / b))  # truncates to 0
wrong("check_window_release", "should return an int, got float", lambda n, w, b: max(0, n - w + 1) / b)
wrong("check_window_release", "one token ahead", lambda n, w, b: max(0, n + 1 - w + 1) // b)  # query at n + 1
wrong("check_window_release", "window and block_size the other way round", lambda n, w, b: max(0, n - b + 1) // w)
wrong("check_window_release", "how many blocks the sequence keeps", lambda n, w, b: -(-n // b) - max(0, n - w + 1) // b)
wrong("check_window_release", "block 0 (positions 0-3) is behind", lambda n, w, b: max(0, n // b - w // b))
