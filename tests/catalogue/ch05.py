"""Chapter 05, attention variants: the answers its exercises' checks are tested against (see
``catalogue/__init__.py``)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from catalogue.answers import Answers

ANSWERS = Answers()
right, wrong = ANSWERS.right, ANSWERS.wrong


# ---- 05: attention variants -----------------------------------------------------------------


def gqa_attention(q, k, v, mask, scale):
    b, h, t, d = q.shape
    kv, s = k.shape[1], k.shape[2]
    g = h // kv
    scores = (q.reshape(b, kv, g * t, d) @ k.transpose(-1, -2)).float() * scale
    if mask is not None:
        scores = scores.view(b, kv, g, t, s).masked_fill(~mask.unsqueeze(2), float("-inf")).view(b, kv, g * t, s)
    out = torch.softmax(scores, dim=-1).to(v.dtype) @ v
    return out.view(b, h, t, d)


def gqa_attention_einsum(q, k, v, mask, scale):
    b, h, t, d = q.shape
    kv = k.shape[1]
    grouped = q.reshape(b, kv, h // kv, t, d)
    scores = torch.einsum("bkgtd,bksd->bkgts", grouped, k) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask[:, :, None], float("-inf"))
    weights = torch.softmax(scores.float(), dim=-1).to(v.dtype)
    return torch.einsum("bkgts,bksd->bkgtd", weights, v).reshape(b, h, t, d)


def _gqa_repeat(q, k, v, mask, scale, tile=False, scaled=True, masked=True):
    g = q.shape[1] // k.shape[1]
    if tile:
        k, v = k.repeat(1, g, 1, 1), v.repeat(1, g, 1, 1)
    else:
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    scores = (q @ k.transpose(-1, -2)) * (scale if scaled else 1.0)
    if masked and mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, -1) @ v


def gqa_view(q, k, v, mask, scale):
    b, h, t, d = q.shape
    q.view(b, k.shape[1], (h // k.shape[1]) * t, d)  # raises on a non-contiguous q
    return gqa_attention(q, k, v, mask, scale)


def gqa_mask_interleaved(q, k, v, mask, scale):
    b, h, t, d = q.shape
    kv, g = k.shape[1], h // k.shape[1]
    scores = (q.reshape(b, kv, g * t, d) @ k.transpose(-1, -2)).float() * scale
    if mask is not None:
        scores = scores.masked_fill(~mask.repeat_interleave(g, dim=2), float("-inf"))  # rows are g-major
    return (torch.softmax(scores, -1) @ v).reshape(b, h, t, d)


def gqa_expand_reshape(q, k, v, mask, scale):
    b, kv, s, d = k.shape
    g = q.shape[1] // kv
    k = k[:, :, None].expand(b, kv, g, s, d).reshape(b, kv * g, s, d)
    v = v[:, :, None].expand(b, kv, g, s, d).reshape(b, kv * g, s, d)
    scores = (q @ k.transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, -1) @ v


right("check_gqa_attention", gqa_attention)
right("check_gqa_attention", gqa_attention_einsum)
wrong("check_gqa_attention", "made a copy of K/V 3× their size", _gqa_repeat)
wrong("check_gqa_attention", "wrong K/V heads", lambda *a: _gqa_repeat(*a, tile=True))
wrong("check_gqa_attention", "your code raised RuntimeError", gqa_view)
wrong("check_gqa_attention", "differs from the reference", gqa_mask_interleaved)
wrong("check_gqa_attention", "made a copy of K/V 3× their size", gqa_expand_reshape)
wrong("check_gqa_attention", "differs from the reference", lambda q, k, v, m, s: gqa_attention(q, k, v, None, s))
wrong("check_gqa_attention", "differs from the reference", lambda q, k, v, m, s: gqa_attention(q, k, v, m, 1.0))


def blocks_behind_window(num_computed_tokens, window, block_size):
    return max(0, num_computed_tokens - window + 1) // block_size


def blocks_behind_window_loop(num_computed_tokens, window, block_size):
    first_visible = num_computed_tokens - window + 1
    count = 0
    while (count + 1) * block_size <= first_visible:  # the whole block ends before the window
        count += 1
    return count


right("check_window_release", blocks_behind_window)
right("check_window_release", blocks_behind_window_loop)
wrong("check_window_release", "(position 11) sees positions 4..11", lambda n, w, b: max(0, n - w) // b)
wrong("check_window_release", "still sees position 1", lambda n, w, b: max(0, -(-(n - w + 1) // b)))
wrong("check_window_release", "shorter than the window", lambda n, w, b: n // b)
wrong("check_window_release", "behind the window", lambda n, w, b: 0)
wrong("check_window_release", "returned -1, expected 0", lambda n, w, b: (n - w + 1) // b)
wrong("check_window_release", "shorter than the window", lambda n, w, b: w // b)


# ---- ch05: more wrong answers a learner writes


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


# ---- Chapter 05's paged attention layer (``check_paged_attention``): right answers written
# independently, and the wrong ones a learner writes, one slip each (``attention(...)``).


PA = "check_paged_attention"


def attention(**slip):
    def paged_attention(q, k, v, k_slots, v_slots, query_lens, context_lens, block_tables, block_size, scale,
                        window=None):  # fmt: skip
        heads, kv_heads = q.shape[1], k_slots.shape[1]
        if heads % kv_heads and not slip.get("no_refusal"):
            if slip.get("refuse_late"):
                k_slots[0] = 0.0  # "clear the scratch slot first"
            raise ValueError(f"{heads} heads over {kv_heads} K/V heads")
        if slip.get("copies_pool"):
            k_slots, v_slots = k_slots.clone(), v_slots.clone()  # "so the caller's pool stays clean"
        new_k, new_v = k, v
        out, row = [], 0
        for n, ctx, table in zip(query_lens, context_lens, block_tables.tolist()):
            seen = len(table) * block_size if slip.get("whole_blocks") else ctx
            first = 0
            if window is not None and not (slip.get("whole_blocks") or slip.get("read_released")):
                first = max(0, ctx - window) if slip.get("last_query_edge") else max(0, ctx - n - window + 1)
                if slip.get("edge_one_early"):
                    first = max(0, first - 1)
            if slip.get("block_index"):
                slots = torch.arange(first, seen)  # the position as the slot: as if the blocks were in order
            else:
                slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(first, seen)])
            mine = slots[ctx - n - first : ctx - first]
            if slip.get("last_query_edge"):  # the new tokens' slots on their own: the read is the slip
                mine = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(ctx - n, ctx)])
            if slip.get("write_from_zero"):
                mine = slots[:n]  # "the new tokens go first"
            if slip.get("write_all_rows"):
                mine, rows = slots[ctx - n - first : ctx - first], slice(0, n)  # every sequence writes q's first rows
            else:
                rows = slice(row, row + n)
            if not (slip.get("no_write") or slip.get("write_after")):
                k_slots[mine] = new_k[rows]
                (k_slots if slip.get("v_into_k") else v_slots)[mine] = new_v[rows]
            k, v = k_slots[slots], v_slots[slots]
            if slip.get("write_after"):
                k_slots[mine], v_slots[mine] = new_k[rows], new_v[rows]
            if slip.get("tile"):
                k, v = k.repeat(1, heads // kv_heads, 1), v.repeat(1, heads // kv_heads, 1)
            else:
                k, v = k.repeat_interleave(heads // kv_heads, dim=1), v.repeat_interleave(heads // kv_heads, dim=1)
            s = scale if not slip.get("no_scale") else 1.0
            if slip.get("sqrt_scale"):
                s = 1 / math.sqrt(q.shape[-1]) ** 0.5
            scores = torch.einsum("thd,shd->hts", q[row : row + n], k) * s
            start = 0 if slip.get("from_zero") else ctx - n
            pos = torch.arange(start, start + n)[:, None]
            keys = torch.arange(first, seen)[None, :]
            allowed = keys <= pos if not slip.get("no_causal") else torch.ones(n, seen - first, dtype=torch.bool)
            if slip.get("whole_blocks") and n == 1:  # "a decode sees everything": no mask for one query
                allowed = torch.ones(n, seen - first, dtype=torch.bool)
            if window is not None and not slip.get("no_window"):
                reach = window + 1 if slip.get("window_plus_one") else window - 1 if slip.get("window_minus_one") else window
                allowed = allowed & (keys > pos - reach)
            scores = scores.masked_fill(~allowed, float("-inf"))
            probs = torch.softmax(scores, dim=-2 if slip.get("softmax_over_queries") else -1)
            out.append(torch.einsum("hts,shd->thd", probs, v))
            row += n
        return torch.cat(out)

    return paged_attention


def paged_sdpa(q, k, v, k_slots, v_slots, query_lens, context_lens, block_tables, block_size, scale, window=None):
    """Writes the whole step's K/V with one index_copy_ per pool, views the pool as blocks, gathers
    whole blocks with index_select, and lets SDPA do the rest (GQA through enable_gqa, a boolean mask)."""
    tables = block_tables.tolist()
    mapping = torch.tensor([tables[i][p // block_size] * block_size + p % block_size
                            for i, (n, ctx) in enumerate(zip(query_lens, context_lens)) for p in range(ctx - n, ctx)])  # fmt: skip
    if q.shape[1] % k_slots.shape[1]:
        raise ValueError(f"q has {q.shape[1]} heads, not a multiple of the pool's {k_slots.shape[1]}")
    k_slots.index_copy_(0, mapping, k)
    v_slots.index_copy_(0, mapping, v)
    blocks = k_slots.view(-1, block_size, *k_slots.shape[1:]), v_slots.view(-1, block_size, *v_slots.shape[1:])
    outs, row = [], 0
    for i, (n, ctx) in enumerate(zip(query_lens, context_lens)):
        start = 0 if window is None else max(0, ctx - n - window + 1)
        skip, need = start // block_size, -(-ctx // block_size)  # whole blocks behind the window: released
        ids = block_tables[i, skip:need]
        k, v = (b.index_select(0, ids).flatten(0, 1)[start - skip * block_size : ctx - skip * block_size]
                for b in blocks)  # [ctx - start, KV, D]  # fmt: skip
        pos = torch.arange(ctx - n, ctx)
        keys = torch.arange(start, ctx)
        mask = keys[None] <= pos[:, None]
        if window is not None:
            mask &= keys[None] > (pos[:, None] - window)
        o = F.scaled_dot_product_attention(q[row : row + n].transpose(0, 1)[None], k.transpose(0, 1)[None],
                                           v.transpose(0, 1)[None], attn_mask=mask, scale=scale, enable_gqa=True)  # fmt: skip
        outs.append(o[0].transpose(0, 1))
        row += n
    return torch.cat(outs)


def attention_in_place(q, k, v, k_slots, v_slots, query_lens, context_lens, block_tables, block_size, scale,
                       window=None):  # fmt: skip
    """Scales q in place "to save a multiply per score"."""
    q.mul_(scale)
    return attention()(q, k, v, k_slots, v_slots, query_lens, context_lens, block_tables, block_size, 1.0, window)


right(PA, attention())
right(PA, paged_sdpa)

for slip, message in (
    ({"tile": True}, "K/V heads were repeated as [0, 1, 0, 1]"),
    ({"whole_blocks": True}, "past its context"),
    ({"from_zero": True}, "the causal mask put a chunk's queries at positions 0..n-1"),
    ({"window_plus_one": True}, "the window lets a query see window + 1 keys"),
    ({"no_window": True}, "the sliding window was left out of the mask"),
    ({"window_minus_one": True}, "the window lets a query see only window - 1 keys"),
    ({"last_query_edge": True}, "a chunk read its keys from its last query's window edge"),
    ({"read_released": True}, "sequence 0 (the decode at context 7) came out NaN — it read keys behind the window"),
    ({"edge_one_early": True}, "sequence 0 (the decode at context 7) came out NaN"),
    ({"no_refusal": True}, "with 3 query heads over 2 K/V heads raised RuntimeError"),
    ({"refuse_late": True}, "wrote into the pool before raising ValueError"),
    ({"no_scale": True}, "not multiplied by `scale`"),
    ({"block_index": True}, "position 6 used as the slot number"),
    ({"no_causal": True}, "paged_attention on the example step: sequence 1"),
    ({"softmax_over_queries": True}, "paged_attention on the example step: sequence 0"),
    ({"sqrt_scale": True}, "paged_attention on the example step: sequence 0"),
):
    wrong(PA, message, attention(**slip))
wrong(PA, "changed one of its inputs in place (q)", attention_in_place)
wrong(PA, "k_slots is as it was: write this step's new k into the pool first", attention(no_write=True))
wrong(PA, "the queries read the pool before this step's K/V were in it", attention(write_after=True))
wrong(PA, "row 0 went to slot 20, its position 0's: new tokens sit at context_len - n", attention(write_from_zero=True))
wrong(PA, "slot 4 of k_slots should hold row 1 of k (the fresh 5-token prompt's position 0", attention(write_all_rows=True))
wrong(PA, "it holds a row of v — k goes to k_slots, v to v_slots", attention(v_into_k=True))
wrong(PA, "shape", lambda q, *args, **kwargs: attention()(q, *args, **kwargs)[None])
wrong(PA, "in place (k_slots[slot] = ..., not into a copy)", attention(copies_pool=True))
