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

# ---- pooling K/V heads ----------------------------------------------------------------------


def pool_heads_loop(weight, num_heads, num_kv_heads):
    """Correct: each group's heads sliced out one by one and averaged in fp32."""
    d = weight.shape[0] // num_heads
    g = num_heads // num_kv_heads
    pooled = []
    for j in range(num_kv_heads):
        heads = [weight[(j * g + i) * d : (j * g + i + 1) * d].float() for i in range(g)]
        pooled.append(sum(heads) / g)
    return torch.cat(pooled).to(weight.dtype)


def pool_heads_matrix(weight, num_heads, num_kv_heads):
    """Correct: one matmul with a pooling matrix (1/G where an output row averages an input row)."""
    d = weight.shape[0] // num_heads
    g = num_heads // num_kv_heads
    groups = torch.eye(num_kv_heads).repeat_interleave(g, dim=1) / g  # [KV, H]
    return (torch.kron(groups, torch.eye(d)) @ weight.float()).to(weight.dtype)


def pool_heads_avg_pool(weight, num_heads, num_kv_heads):
    """Correct: the heads as the length axis of avg_pool1d, with kernel and stride G."""
    rows, cols = weight.shape
    by_head = weight.float().reshape(num_heads, -1).T[None]  # [1, D*in, H]
    pooled = torch.nn.functional.avg_pool1d(by_head, num_heads // num_kv_heads)[0]  # [D*in, KV]
    return pooled.T.reshape(-1, cols).to(weight.dtype)


def pool_heads_unflatten(weight, num_heads, num_kv_heads):
    """Correct: averaged in the weight's own dtype (bf16 mean accumulates in fp32 on the CPU)."""
    return weight.unflatten(0, (num_kv_heads, num_heads // num_kv_heads, -1)).mean(1).flatten(0, 1)


def _pool(weight, num_heads, num_kv_heads, *, reduce=lambda g: g.mean(1), layout="kgd", dtype="keep", shape="flat"):
    """The solution's pooling, with one of a learner's slips."""
    rows, cols = weight.shape
    d, g = rows // num_heads, num_heads // num_kv_heads
    w = weight.float()
    if layout == "kgd":
        pooled = reduce(w.view(num_kv_heads, g, d, cols))
    elif layout == "gkd":  # the groups strided: pooled head j from heads j, j+KV, ...
        pooled = w.view(g, num_kv_heads, d, cols).mean(0)
    else:  # "kdg": a head's rows taken as interleaved with the group's other heads
        pooled = w.view(num_kv_heads, d, g, cols).mean(2)
    if shape == "flat":
        pooled = pooled.reshape(-1, cols)
    elif shape == "repeat":
        pooled = pooled.reshape(-1, cols).view(num_kv_heads, d, cols).repeat_interleave(g, 0).reshape(-1, cols)
    out = {"keep": weight.dtype, "fp32": torch.float32, "half": torch.float16}[dtype]
    return pooled.to(out)


def pool_heads_in_place(weight, num_heads, num_kv_heads):
    d, g = weight.shape[0] // num_heads, num_heads // num_kv_heads
    weight /= g  # divides the checkpoint's own tensor
    return weight.view(num_kv_heads, g, d, -1).sum(1).reshape(num_kv_heads * d, -1)


def pool_heads_new_head_dim(weight, num_heads, num_kv_heads):
    d, g = weight.shape[0] // num_kv_heads, num_heads // num_kv_heads  # D from the new head count
    return weight.float().view(num_kv_heads, g, d, -1).mean(1).reshape(num_kv_heads * d, -1).to(weight.dtype)


def pool_heads_short_loop(weight, num_heads, num_kv_heads):
    d, g = weight.shape[0] // num_heads, num_heads // num_kv_heads
    pooled = []
    for j in range(num_kv_heads):
        heads = [weight[(j * g + i) * d : (j * g + i + 1) * d].float() for i in range(g - 1)]  # one short
        pooled.append(sum(heads) / len(heads) if heads else weight[j * g * d : (j * g + 1) * d].float())
    return torch.cat(pooled).to(weight.dtype)


def pool_heads_strided_loop(weight, num_heads, num_kv_heads):
    d = weight.shape[0] // num_heads
    pooled = []
    for j in range(num_kv_heads):
        heads = [weight[h * d : (h + 1) * d].float() for h in range(j, num_heads, num_kv_heads)]  # h % KV == j
        pooled.append(torch.stack(heads).mean(0))
    return torch.cat(pooled).to(weight.dtype)


right("check_head_pooling", pool_heads_loop)
right("check_head_pooling", pool_heads_matrix)
right("check_head_pooling", pool_heads_avg_pool)
right("check_head_pooling", pool_heads_unflatten)
wrong("check_head_pooling", "grouped with a stride", lambda *a: _pool(*a, layout="gkd"))
wrong("check_head_pooling", "grouped with a stride", pool_heads_strided_loop)
wrong("check_head_pooling", "the mean was taken across the groups", lambda *a: _pool(*a, reduce=lambda g: g.mean(0)))
wrong("check_head_pooling", "each head's D rows were averaged", lambda *a: _pool(*a, reduce=lambda g: g.mean(2)))
wrong("check_head_pooling", "summed, not averaged", lambda *a: _pool(*a, reduce=lambda g: g.sum(1)))
wrong(
    "check_head_pooling",
    "divided by num_kv_heads",
    lambda w, h, kv: _pool(w, h, kv, reduce=lambda g: g.sum(1) / kv),
)
wrong("check_head_pooling", "divided by num_heads", lambda w, h, kv: _pool(w, h, kv, reduce=lambda g: g.sum(1) / h))
wrong("check_head_pooling", "only the first head of each group", lambda *a: _pool(*a, reduce=lambda g: g[:, 0]))
wrong("check_head_pooling", "the last head of each group was left out", pool_heads_short_loop)
wrong("check_head_pooling", "the rows of a head were split the wrong way", lambda *a: _pool(*a, layout="kdg"))
wrong("check_head_pooling", "must keep the checkpoint's dtype (bfloat16)", lambda *a: _pool(*a, dtype="fp32"))
wrong("check_head_pooling", "has dtype torch.float16, expected torch.float32", lambda *a: _pool(*a, dtype="half"))
wrong("check_head_pooling", "changed the weight it was given", pool_heads_in_place)
wrong("check_head_pooling", "reshape them to [KV*D, in]", lambda *a: _pool(*a, shape="heads"))
wrong("check_head_pooling", "do not repeat the pooled heads back to H", lambda *a: _pool(*a, shape="repeat"))
wrong("check_head_pooling", "of D = rows // num_heads = 3 rows each", pool_heads_new_head_dim)

# ---- sliding-window release -----------------------------------------------------------------

wrong("check_window_release", "counts positions, not blocks", lambda n, w, b: max(0, n - w + 1 // b))  # precedence
wrong("check_window_release", "not to the nearest", lambda n, w, b: max(0, round((n - w + 1) / b)))
wrong("check_window_release", "returned -2, expected 0", lambda n, w, b: int((n - w + 1) / b))  # truncates to 0
wrong("check_window_release", "should return an int, got float", lambda n, w, b: max(0, n - w + 1) / b)
wrong("check_window_release", "one token ahead", lambda n, w, b: max(0, n + 1 - w + 1) // b)  # query at n + 1
wrong("check_window_release", "window and block_size the other way round", lambda n, w, b: max(0, n - b + 1) // w)
wrong("check_window_release", "how many blocks the sequence keeps", lambda n, w, b: -(-n // b) - max(0, n - w + 1) // b)
wrong("check_window_release", "block 0 (positions 0-3) is behind", lambda n, w, b: max(0, n // b - w // b))
