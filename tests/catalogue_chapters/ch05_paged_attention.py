"""Chapter 05's paged attention layer (``check_paged_attention``): right answers written
independently, and the wrong ones a learner writes, one slip each (``attention(...)``)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from check_catalogue import right, wrong

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
