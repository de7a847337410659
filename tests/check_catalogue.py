"""The catalogue of answers every course check is tested against.

For every exercise: at least two correct answers written independently (they must pass) and at
least twelve typical wrong answers, each with a fragment of the message it must fail with — the
mistakes learners make (returning the prompt too, a LIFO eviction, a hash that ignores block
order, a scheduler that admits while preempting, ...). ``test_check_catalogue.py`` runs them all.

An answer is the tuple of arguments the check is called with (most exercises have one function).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import struct

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from minillm.course import forward_logits, forward_step, new_cache
from minillm.engine.scheduler import SchedulerOutput
from minillm.sequence import SequenceStatus

RIGHT: dict[str, list[tuple]] = {}
WRONG: dict[str, list[tuple[tuple, str]]] = {}


def right(check: str, *fns) -> None:
    RIGHT.setdefault(check, []).append(fns)


def wrong(check: str, message: str, *fns) -> None:
    WRONG.setdefault(check, []).append((fns, message))


# ---- 01: the naive loop ---------------------------------------------------------------------


def generate_naive(model, prompt_ids, max_new_tokens):
    ids, new = list(prompt_ids), []
    for _ in range(max_new_tokens):
        token = int(forward_logits(model, ids)[-1].argmax())
        new.append(token)
        ids.append(token)
    return new


def generate_naive_tensors(model, prompt_ids, max_new_tokens):
    ids = torch.tensor(prompt_ids)
    start = len(ids)
    while len(ids) < start + max_new_tokens:
        logits = forward_logits(model, ids.tolist())
        ids = torch.cat([ids, logits[-1:].argmax(-1)])
    return ids[start:].tolist()


right("check_generate_naive", generate_naive)
right("check_generate_naive", generate_naive_tensors)
wrong("check_generate_naive", "returned 31 tokens, expected 32", lambda m, p, n: generate_naive(m, p, n - 1))
wrong(
    "check_generate_naive",
    "token 1 is",
    lambda m, p, n: [int(forward_logits(m, list(p))[-1].argmax()) for _ in range(n)],
)
wrong("check_generate_naive", "prompt tokens followed by", lambda m, p, n: list(p) + generate_naive(m, p, n))
wrong(
    "check_generate_naive",
    "list of Python ints",
    lambda m, p, n: [torch.tensor(t) for t in generate_naive(m, p, n)],
)


def naive_first_row(model, prompt_ids, n):
    ids = list(prompt_ids)
    for _ in range(n):
        ids.append(int(forward_logits(model, ids)[0].argmax()))
    return ids[len(prompt_ids) :]


def naive_no_context(model, prompt_ids, n):
    new, last = [], list(prompt_ids)
    for _ in range(n):
        token = int(forward_logits(model, last)[-1].argmax())
        new.append(token)
        last = [token]
    return new


wrong("check_generate_naive", "token 0 is", naive_first_row)
wrong("check_generate_naive", "the reference engine produced", naive_no_context)

# ---- 01: causal attention -------------------------------------------------------------------


def causal_attention(q, k, v):
    t = q.shape[-2]
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    future = torch.ones(t, t, dtype=torch.bool).triu(diagonal=1)
    return torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1) @ v


def _masked(q, k, v, keep, scale=True, dim=-1):
    s = q @ k.transpose(-1, -2) / (math.sqrt(q.shape[-1]) if scale else 1.0)
    return torch.softmax(s.masked_fill(~keep, float("-inf")), dim=dim) @ v


def _tril(q, offset=0):
    t = q.shape[-2]
    return torch.ones(t, t, dtype=torch.bool).tril(offset)


right("check_causal_attention", causal_attention)
right("check_causal_attention", lambda q, k, v: _masked(q, k, v, torch.ones(q.shape[-2], q.shape[-2]).tril().bool()))
# torch's fused attention computes the whole answer: the exercise asks for the computation (issue 46)
wrong("check_causal_attention", "calls torch's scaled_dot_product_attention, which computes this exercise's whole",
      lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True))  # fmt: skip
wrong("check_causal_attention", "not scaled", lambda q, k, v: _masked(q, k, v, _tril(q), scale=False))
wrong("check_causal_attention", "no causal mask", lambda q, k, v: _masked(q, k, v, torch.ones_like(_tril(q))))
wrong("check_causal_attention", "wrong axis", lambda q, k, v: _masked(q, k, v, _tril(q), dim=-2))
wrong("check_causal_attention", "inverted", lambda q, k, v: _masked(q, k, v, ~_tril(q, -1)).nan_to_num())
wrong("check_causal_attention", "diagonal", lambda q, k, v: _masked(q, k, v, _tril(q, -1)))
wrong("check_causal_attention", "has shape (2, 5, 3, 8)", lambda q, k, v: causal_attention(q, k, v).transpose(1, 2))

# ---- 02: the KV cache -----------------------------------------------------------------------


def kv_write(k_cache, v_cache, k_new, v_new, start):
    t = k_new.shape[2]
    k_cache[:, :, start : start + t] = k_new
    v_cache[:, :, start : start + t] = v_new


def kv_write_narrow(k_cache, v_cache, k_new, v_new, start):
    for cache, new in ((k_cache, k_new), (v_cache, v_new)):
        cache.narrow(2, start, new.shape[2]).copy_(new)


def kv_write_rebinds(k_cache, v_cache, k_new, v_new, start):
    k_cache = k_new  # noqa: F841 - the mistake under test
    v_cache = v_new  # noqa: F841


def kv_write_keys_only(k_cache, v_cache, k_new, v_new, start):
    k_cache[:, :, start : start + k_new.shape[2]] = k_new


def kv_write_heads_axis(k_cache, v_cache, k_new, v_new, start):
    k_cache[:, start : start + k_new.shape[2]] = k_new
    v_cache[:, start : start + v_new.shape[2]] = v_new


def kv_write_swapped(k_cache, v_cache, k_new, v_new, start):
    kv_write(k_cache, v_cache, v_new, k_new, start)


def kv_write_first_token_only(k_cache, v_cache, k_new, v_new, start):
    k_cache[:, :, start] = k_new[:, :, 0]
    v_cache[:, :, start] = v_new[:, :, 0]


right("check_kv_write", kv_write)
right("check_kv_write", kv_write_narrow)
wrong("check_kv_write", "still all zeros", kv_write_rebinds)
wrong("check_kv_write", "positions [6, 7], expected [5, 6]", lambda kc, vc, k, v, s: kv_write(kc, vc, k, v, s + 1))
wrong("check_kv_write", "value cache is still all zeros", kv_write_keys_only)
wrong("check_kv_write", "your code raised RuntimeError", kv_write_heads_axis)
wrong("check_kv_write", "k_cache[:, :, 5:7] after kv_write differs", kv_write_swapped)
wrong("check_kv_write", "positions [5], expected [5, 6]", kv_write_first_token_only)



def generate_cached(model, prompt_ids, max_new_tokens):
    cache = new_cache(model, len(prompt_ids) + max_new_tokens)
    logits = forward_step(model, list(prompt_ids), 0, cache)
    new = [int(logits[-1].argmax())]
    while len(new) < max_new_tokens:
        logits = forward_step(model, [new[-1]], len(prompt_ids) + len(new) - 1, cache)
        new.append(int(logits[-1].argmax()))
    return new


def generate_cached_positions(model, prompt_ids, max_new_tokens):
    cache = new_cache(model, len(prompt_ids) + max_new_tokens)
    position, feed, out = 0, list(prompt_ids), []
    for _ in range(max_new_tokens):
        token = int(forward_step(model, feed, position, cache)[-1].argmax())
        out.append(token)
        position += len(feed)
        feed = [token]
    return out


def cached_wrong_position(model, prompt, n):
    cache = new_cache(model, len(prompt) + n + 1)
    new = [int(forward_step(model, list(prompt), 0, cache)[-1].argmax())]
    while len(new) < n:
        new.append(int(forward_step(model, [new[-1]], len(prompt) + len(new), cache)[-1].argmax()))
    return new


def cached_no_reuse(model, prompt, n):
    new = []
    for _ in range(n):
        cache = new_cache(model, len(prompt) + n)
        new.append(int(forward_step(model, list(prompt) + new, 0, cache)[-1].argmax()))
    return new


def cached_one_extra_step(model, prompt, n):
    cache = new_cache(model, len(prompt) + n + 1)
    new = [int(forward_step(model, list(prompt), 0, cache)[-1].argmax())]
    for i in range(n):
        new.append(int(forward_step(model, [new[-1]], len(prompt) + i, cache)[-1].argmax()))
    return new[:n]


def cached_split_prefill(model, prompt, n):
    cache = new_cache(model, len(prompt) + n)
    forward_step(model, list(prompt[:-1]), 0, cache)  # the prompt but its last token...
    new = [int(forward_step(model, [prompt[-1]], len(prompt) - 1, cache)[-1].argmax())]  # ...then that one
    while len(new) < n:
        new.append(int(forward_step(model, [new[-1]], len(prompt) + len(new) - 1, cache)[-1].argmax()))
    return new


right("check_generate_cached", generate_cached)
right("check_generate_cached", generate_cached_positions)
wrong("check_generate_cached", "decode step 1 ran at position", cached_wrong_position)
wrong("check_generate_cached", "feed only the newest token", cached_no_reuse)
wrong("check_generate_cached", "one too many", cached_one_extra_step)
wrong("check_generate_cached", "prompt tokens followed by", lambda m, p, n: list(p) + generate_cached(m, p, n))
wrong("check_generate_cached", "the first forward pass wrote positions 0..9", cached_split_prefill)
wrong("check_generate_cached", "never ran the model through the cache", generate_naive)

# ---- 03: the paged KV cache -----------------------------------------------------------------


def grow_table(table, num_computed, num_new, block_size, ref_count, take, release):
    copies = []
    first = num_computed // block_size
    if first < len(table) and ref_count(table[first]) > 1:
        private = take()
        copies.append((table[first], private))
        release(table[first])
        table[first] = private
    while len(table) * block_size < num_computed + num_new:
        table.append(take())
    return copies


def grow_table_counted(table, num_computed, num_new, block_size, ref_count, take, release):
    """Right, written differently: count the blocks needed first; copy on write by index."""
    need = math.ceil((num_computed + num_new) / block_size)
    out = []
    j = num_computed // block_size
    if j < len(table) and ref_count(table[j]) >= 2:
        old, new = table[j], take()
        release(old)
        table[j] = new
        out.append((old, new))
    table.extend(take() for _ in range(need - len(table)))
    return out


BT = "check_block_table"  # chapter 03's block table: grow_table, then slot_mapping


def slots_right(fn) -> None:
    right(BT, grow_table, fn)


def slots_wrong(message: str, fn) -> None:
    wrong(BT, message, grow_table, fn)


def slot_mapping(block_table, start, num_tokens, block_size):
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, start + num_tokens)]


def slot_mapping_divmod(block_table, start, num_tokens, block_size):
    slots = []
    for position in range(start, start + num_tokens):
        block, offset = divmod(position, block_size)
        slots.append(block_table[block] * block_size + offset)
    return slots


right(BT, grow_table, slot_mapping)
right(BT, grow_table_counted, slot_mapping_divmod)
slots_wrong("positions themselves", lambda t, s, n, b: list(range(s, s + n)))
slots_wrong("offsets inside blocks", lambda t, s, n, b: [p % b for p in range(s, s + n)])
slots_wrong(
    "expected [31, 8, 9, 10]",
    lambda t, s, n, b: [t[p // b] + p % b for p in range(s, s + n)],
)
slots_wrong(
    "your code raised IndexError",
    lambda t, s, n, b: [t[p % b] * b + p // b for p in range(s, s + n)],
)
slots_wrong("expected [31, 8, 9, 10]", lambda t, s, n, b: slot_mapping(t, s + 1, n, b))
slots_wrong("expected [31, 8, 9, 10]", lambda t, s, n, b: torch.tensor(slot_mapping(t, s, n, b)))


def gather_kv(slots, block_tables, block_size):
    b, n = block_tables.shape
    blocks = slots.view(-1, block_size, *slots.shape[1:])
    return blocks[block_tables].reshape(b, n * block_size, *slots.shape[1:]).transpose(1, 2)


def gather_kv_rows(slots, block_tables, block_size):
    rows = []
    for table in block_tables.tolist():
        index = torch.tensor([blk * block_size + i for blk in table for i in range(block_size)])
        rows.append(slots.index_select(0, index).permute(1, 0, 2))
    return torch.stack(rows)


right("check_gather_kv", gather_kv)
right("check_gather_kv", gather_kv_rows)
wrong("check_gather_kv", "heads before positions", lambda s, t, b: gather_kv(s, t, b).transpose(1, 2))
wrong("check_gather_kv", "one slot per block table entry", lambda s, t, b: s[t])
wrong("check_gather_kv", "one slot per block table entry", lambda s, t, b: s[t * b])
wrong("check_gather_kv", "block-table order", lambda s, t, b: gather_kv(s, t.sort(dim=1).values, b))
wrong("check_gather_kv", "differs from the reference", lambda s, t, b: gather_kv(s, t[:1].expand_as(t), b))
wrong("check_gather_kv", "has shape (2, 12, 3, 2)", lambda s, t, b: gather_kv(s, t, b).transpose(1, 2).transpose(2, 3))




def block_hash(parent_hash, token_ids):
    h = hashlib.sha256()
    h.update((parent_hash or 0).to_bytes(8, "little"))
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return int.from_bytes(h.digest()[:8], "little")


def block_hash_text(parent_hash, token_ids):
    text = f"{parent_hash}|{','.join(map(str, token_ids))}"
    return int(hashlib.blake2b(text.encode(), digest_size=8).hexdigest(), 16)


def _sha_tokens(token_ids):
    return int(hashlib.sha256(repr(list(token_ids)).encode()).hexdigest()[:15], 16)


right("check_block_hash", block_hash)
right("check_block_hash", block_hash_text)
wrong("check_block_hash", "different prefixes", lambda parent, ids: _sha_tokens(ids))
wrong("check_block_hash", "swapped order", lambda parent, ids: (parent or 0) ^ _sha_tokens(ids))
wrong("check_block_hash", "built-in hash()", lambda parent, ids: hash((parent, tuple(ids))))
wrong("check_block_hash", "ignores the order", lambda parent, ids: (parent or 0) * 31 + sum(ids))
wrong(
    "check_block_hash",
    "should return an int",
    lambda parent, ids: hashlib.sha256(repr((parent, ids)).encode()).hexdigest(),
)
wrong(
    "check_block_hash",
    "different results for the same tokens",
    lambda parent, ids: int(hashlib.sha256(repr((parent, ids)).encode()).hexdigest()[:15], 16),
)
wrong(
    "check_block_hash",
    ".digest() returns bytes, and block_hash must return an int",
    lambda parent, ids: hashlib.blake2b(repr((parent, tuple(ids))).encode(), digest_size=8).digest(),
)

# ---- 04: batching ---------------------------------------------------------------------------


def chunk_tokens(remaining, budget, chunked_prefill, step_is_empty):
    if chunked_prefill:
        return min(remaining, budget)
    return remaining if remaining <= budget or step_is_empty else 0


def chunk_tokens_nested(remaining, budget, chunked_prefill, step_is_empty):
    fits = remaining <= budget
    if fits:
        return remaining
    if chunked_prefill:
        return budget
    if step_is_empty:
        return remaining  # a prompt longer than the whole budget runs alone
    return 0


right("check_chunk_tokens", chunk_tokens)
right("check_chunk_tokens", chunk_tokens_nested)
wrong("check_chunk_tokens", "waits for a later step", lambda r, b, c, e: min(r, b))
wrong("check_chunk_tokens", "runs alone in an empty step", lambda r, b, c, e: chunk_tokens(r, b, c, False))
wrong("check_chunk_tokens", "takes what is left of the budget", lambda r, b, c, e: r)
wrong("check_chunk_tokens", "a decode needs one token", lambda r, b, c, e: b if c else chunk_tokens(r, b, c, e))
wrong("check_chunk_tokens", "an exhausted budget runs nothing", lambda r, b, c, e: max(1, chunk_tokens(r, b, c, e)))
wrong(
    "check_chunk_tokens",
    "exactly the size of the budget",
    lambda r, b, c, e: min(r, b) if c else (r if r < b or e else 0),
)


def choose_victim(seq, candidates):
    victim = max(candidates, key=lambda s: s.sort_key, default=seq)
    return seq if victim.sort_key < seq.sort_key else victim


def choose_victim_sorted(seq, candidates):
    return sorted([seq, *candidates], key=lambda s: s.sort_key)[-1]


right("check_choose_victim", choose_victim)
right("check_choose_victim", choose_victim_sorted)
wrong("check_choose_victim", "latest arrival among equals", lambda seq, c: c[0] if c else seq)
wrong("check_choose_victim", "must not depend on the order", lambda seq, c: c[-1] if c else seq)
wrong("check_choose_victim", "latest arrival", lambda seq, c: min(c, key=lambda s: s.sort_key, default=seq))
wrong("check_choose_victim", "seq preempts itself", lambda seq, c: max(c, key=lambda s: s.sort_key, default=seq))
wrong("check_choose_victim", "latest arrival", lambda seq, c: seq)
wrong(
    "check_choose_victim",
    "a lower priority",
    lambda seq, c: max([seq, *c], key=lambda s: s.sort_key[1]),
)


def schedule_continuous(scheduler):
    out = SchedulerOutput()
    budget = scheduler.max_num_batched_tokens
    for seq in scheduler.running_in_order():
        if budget == 0:
            break
        if seq.status is not SequenceStatus.RUNNING:
            continue
        n = scheduler.tokens_to_run(seq, budget, out)
        if n and scheduler.reserve(seq, n, out):
            budget -= n
    if not out.preempted:
        for seq in scheduler.waiting_in_order():
            if len(scheduler.running) >= scheduler.max_num_seqs or budget == 0:
                break
            n = scheduler.try_admit(seq, budget, out)
            if n == 0:
                break
            budget -= n
    return out


def schedule_continuous_queue(scheduler):
    """Independent: counts what is used instead of what is left, walks the queue by index."""
    out = SchedulerOutput()
    used = 0
    for seq in [s for s in scheduler.running_in_order()]:
        if seq.status != SequenceStatus.RUNNING or used >= scheduler.max_num_batched_tokens:
            continue
        n = scheduler.tokens_to_run(seq, scheduler.max_num_batched_tokens - used, out)
        if n > 0 and scheduler.reserve(seq, n, out):
            used += n
    queue = scheduler.waiting_in_order()
    i = 0
    while not out.preempted and i < len(queue) and len(scheduler.running) < scheduler.max_num_seqs:
        left = scheduler.max_num_batched_tokens - used
        if left <= 0:
            break
        n = scheduler.try_admit(queue[i], left, out)
        if not n:
            break
        used += n
        i += 1
    return out


def _decodes(scheduler, out, budget, check_status=True):
    for seq in scheduler.running_in_order():
        if budget == 0:
            break
        if check_status and seq.status is not SequenceStatus.RUNNING:
            continue
        n = scheduler.tokens_to_run(seq, budget, out)
        if n and scheduler.reserve(seq, n, out):
            budget -= n
    return budget


def _admit(scheduler, out, budget, order=None, fcfs=True, after_preempt=False):
    if out.preempted and not after_preempt:
        return
    for seq in order if order is not None else scheduler.waiting_in_order():
        if len(scheduler.running) >= scheduler.max_num_seqs or budget == 0:
            break
        n = scheduler.try_admit(seq, budget, out)
        if n == 0:
            if fcfs:
                break
            continue
        budget -= n


def schedule_static_like(scheduler):
    out = SchedulerOutput()
    budget = _decodes(scheduler, out, scheduler.max_num_batched_tokens)
    if not scheduler.running:
        _admit(scheduler, out, budget)
    return out


def schedule_admit_only(scheduler):
    out = SchedulerOutput()
    _admit(scheduler, out, scheduler.max_num_batched_tokens)
    return out


def schedule_no_status_check(scheduler):
    out = SchedulerOutput()
    _admit(scheduler, out, _decodes(scheduler, out, scheduler.max_num_batched_tokens, check_status=False))
    return out


def schedule_admits_after_preempting(scheduler):
    out = SchedulerOutput()
    _admit(scheduler, out, _decodes(scheduler, out, scheduler.max_num_batched_tokens), after_preempt=True)
    return out


def schedule_newest_first(scheduler):
    out = SchedulerOutput()
    budget = _decodes(scheduler, out, scheduler.max_num_batched_tokens)
    _admit(scheduler, out, budget, order=scheduler.waiting_in_order()[::-1])
    return out


def schedule_over_budget(scheduler):
    out = SchedulerOutput()
    for seq in scheduler.running_in_order():
        if seq.status is SequenceStatus.RUNNING:
            n = scheduler.tokens_to_run(seq, scheduler.max_num_batched_tokens, out)
            if n:
                scheduler.reserve(seq, n, out)
    _admit(scheduler, out, scheduler.max_num_batched_tokens)
    return out


right("check_continuous_schedule", schedule_continuous)
right("check_continuous_schedule", schedule_continuous_queue)
wrong("check_continuous_schedule", "static batching", schedule_static_like)
wrong("check_continuous_schedule", "unfinished", schedule_admit_only)
wrong("check_continuous_schedule", "preempted earlier in the same step", schedule_no_status_check)
wrong("check_continuous_schedule", "admit only in a step that preempted nothing", schedule_admits_after_preempting)
wrong("check_continuous_schedule", "first come, first served", schedule_newest_first)
wrong("check_continuous_schedule", "over the budget", schedule_over_budget)

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

# ---- 06: FlashAttention (the online softmax; the Triton kernel is in test_check_catalogue) ---


def online_softmax_update(m, l_sum, acc, scores, v):
    m_new = torch.maximum(m, scores.max(dim=-1).values)
    alpha = torch.exp(m - m_new)
    p = torch.exp(scores - m_new[:, None])
    return m_new, l_sum * alpha + p.sum(-1), acc * alpha[:, None] + p @ v


def online_softmax_logsumexp(m, l_sum, acc, scores, v):
    tile_max = scores.amax(dim=1)
    new_max = torch.where(tile_max > m, tile_max, m)
    old_weight = (m - new_max).exp()
    weights = (scores - new_max.unsqueeze(1)).exp()
    return new_max, old_weight * l_sum + weights.sum(1), old_weight.unsqueeze(1) * acc + weights @ v


def _online(m, l_sum, acc, scores, v, rescale_l=True, rescale_acc=True, running=True, subtract=True):
    m_new = torch.maximum(m, scores.max(-1).values) if running else scores.max(-1).values
    alpha = torch.exp(m - m_new)
    p = torch.exp(scores - m_new[:, None]) if subtract else torch.exp(scores)
    return (
        m_new,
        (l_sum * alpha if rescale_l else l_sum) + p.sum(-1),
        (acc * alpha[:, None] if rescale_acc else acc) + p @ v,
    )


right("check_online_softmax", online_softmax_update)
right("check_online_softmax", online_softmax_logsumexp)
wrong("check_online_softmax", "never rescaled", lambda *a: _online(*a, rescale_l=False))
wrong("check_online_softmax", "rescale the accumulator", lambda *a: _online(*a, rescale_acc=False))
wrong("check_online_softmax", "running max m", lambda *a: _online(*a, running=False))
wrong(
    "check_online_softmax",
    "plain sum of exp(scores)",
    lambda *a: _online(*a, subtract=False, rescale_l=False, rescale_acc=False),
)
wrong("check_online_softmax", "should return (m, l, acc)", lambda *a: _online(*a)[1:])

# ---- 07: quantization -------------------------------------------------------------------------


def quantize_per_channel(weight):
    w = weight.float()
    scale = w.abs().amax(dim=1) / 127
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def quantize_rows_loop(weight):
    """Independent: one row at a time, the magnitude as max(max, -min)."""
    qs, scales = [], []
    for row in weight.to(torch.float32):
        s = torch.maximum(row.max(), -row.min()) / 127.0
        qs.append(torch.clamp(torch.round(row / s), min=-127, max=127).to(torch.int8))
        scales.append(s)
    return torch.stack(qs), torch.stack(scales)


def quantize_floor_half(weight):
    """Independent: the infinity norm with keepdim, rounding as floor(x + 0.5)."""
    w = weight.double()
    s = torch.linalg.vector_norm(w, ord=float("inf"), dim=1, keepdim=True) / 127
    q = torch.floor(w / s + 0.5).clamp(-127, 127).to(torch.int8)
    return q, s.squeeze(1).float()


def _int8_variant(weight, reduce=lambda w: w.abs().amax(dim=1), divisor=127, keepdim=False, rounding=torch.round,
                  clamp=True, cast=True, transpose=False, upcast=True):  # fmt: skip
    w = weight.float() if upcast else weight  # without it a bf16 weight is quantized in bf16
    s = reduce(w) / divisor
    expand = s if s.dim() == 0 else (s[None, :] if transpose else s[:, None])
    q = rounding(w / expand)
    if clamp:
        q = q.clamp(-127, 127)
    if cast:
        q = q.to(torch.int8)
    return q, (s[:, None] if keepdim else s)


CH = "check_quantize_per_channel"
right(CH, quantize_per_channel)
right(CH, quantize_rows_loop)
right(CH, quantize_floor_half)
wrong(CH, "per-tensor", lambda w: _int8_variant(w, reduce=lambda w: w.abs().max()))
wrong(CH, "every row has the same scale", lambda w: _int8_variant(w, reduce=lambda w: w.abs().max().expand(w.shape[0])))
wrong(CH, "largest *value*", lambda w: _int8_variant(w, reduce=lambda w: w.amax(dim=1)))
wrong(CH, "max|w| / 128", lambda w: _int8_variant(w, divisor=128))
wrong(CH, "wrapped around", lambda w: _int8_variant(w, divisor=128, clamp=False))
wrong(CH, "max|w| / 255", lambda w: _int8_variant(w, divisor=255))
wrong(CH, "truncated toward zero", lambda w: _int8_variant(w, rounding=lambda t: t))
wrong(CH, "one per input column", lambda w: _int8_variant(w, reduce=lambda w: w.abs().amax(dim=0), transpose=True))
wrong(CH, "q is torch.float32", lambda w: _int8_variant(w, cast=False))
wrong(CH, "shape (48, 1)", lambda w: _int8_variant(w, keepdim=True))
wrong(CH, "scale is torch.bfloat16: compute in float32", lambda w: _int8_variant(w, upcast=False))


def pack_int4(q):
    return (q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8)


def unpack_int4(packed):
    low, high = packed & 0xF, packed >> 4
    return torch.stack([low, high], dim=-1).reshape(packed.shape[0], -1)


def pack_int4_arithmetic(q):
    """Independent: pairs as a trailing axis, base-16 arithmetic in int64."""
    pairs = q.reshape(q.shape[0], -1, 2).long()
    return (pairs[..., 0] + 16 * pairs[..., 1]).to(torch.uint8)


def unpack_int4_arithmetic(packed):
    out = torch.empty(packed.shape[0], 2 * packed.shape[1], dtype=torch.uint8)
    out[:, 0::2] = packed % 16
    out[:, 1::2] = packed // 16
    return out


CP = "check_pack_int4"
right(CP, pack_int4, unpack_int4)
right(CP, pack_int4_arithmetic, unpack_int4_arithmetic)
wrong(CP, "high nibble", lambda q: ((q[:, 0::2] << 4) | q[:, 1::2]).to(torch.uint8), unpack_int4)
wrong(CP, "two halves of a row", lambda q: q[:, : q.shape[1] // 2] | (q[:, q.shape[1] // 2 :] << 4), unpack_int4)
wrong(CP, "neighbouring *rows*", lambda q: (q[0::2] | (q[1::2] << 4)).to(torch.uint8), unpack_int4)
wrong(CP, "only its low nibble", lambda q: (q[:, 0::2] | (q[:, 1::2] << 8)).to(torch.uint8), unpack_int4)
wrong(CP, "pack_int4 returned torch.int64", lambda q: q[:, 0::2].long() | (q[:, 1::2].long() << 4), unpack_int4)
wrong(
    CP,
    "needs a mask",
    pack_int4,
    lambda p: torch.stack([p, p >> 4], dim=-1).reshape(p.shape[0], -1),
)
wrong(CP, "swaps each pair", pack_int4, lambda p: torch.stack([p >> 4, p & 0xF], dim=-1).reshape(p.shape[0], -1))
wrong(
    CP,
    "every odd column came back 0",
    pack_int4,
    lambda p: torch.stack([p & 0xF, p >> 8], dim=-1).reshape(p.shape[0], -1),
)
wrong(CP, "unpack_int4 returned torch.int64", pack_int4, lambda p: unpack_int4(p).long())
wrong(CP, "all low nibbles first", pack_int4, lambda p: torch.cat([p & 0xF, p >> 4], dim=-1))


def quantize_kv_on_write(x):
    scale = x.float().abs().amax(dim=-1) / 127
    q = torch.round(x.float() / scale[..., None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def quantize_kv_inf_norm(x):
    """Independent: the infinity norm with keepdim, squeezed at the end."""
    xf = x.to(torch.float32)
    s = torch.linalg.vector_norm(xf, ord=float("inf"), dim=-1, keepdim=True) / 127.0
    q = (xf / s).round().clamp(min=-127, max=127).to(torch.int8)
    return q, s.squeeze(-1)


def _kv_variant(x, reduce=lambda x: x.abs().amax(dim=-1), divisor=127, rounding=torch.round, cast=True,
                upcast=True, keepdim=False, scale_as_float=False):  # fmt: skip
    xf = x.float() if upcast else x
    s = reduce(xf) / divisor
    full = s.reshape(s.shape + (1,) * (3 - s.dim())) if s.dim() < 3 else s
    if s.dim() == 1 and s.shape[0] == x.shape[1] and s.shape[0] != x.shape[0]:  # one per head: [1, heads, 1]
        full = s[None, :, None]
    q = rounding(xf / full).clamp(-127, 127)
    if cast:
        q = q.to(torch.int8)
    if keepdim:
        s = s[..., None]
    return q, (s.float() if scale_as_float else s)


CK = "check_quantize_kv"
right(CK, quantize_kv_on_write)
right(CK, quantize_kv_inf_norm)
wrong(CK, "one scale per token", lambda x: _kv_variant(x, reduce=lambda x: x.abs().amax(dim=(1, 2))))
wrong(
    CK,
    "one scale per token",
    lambda x: _kv_variant(
        x, reduce=lambda x: x.abs().amax(dim=(1, 2), keepdim=True).squeeze(-1).expand(-1, x.shape[1])
    ),
)
wrong(CK, "per-tensor", lambda x: _kv_variant(x, reduce=lambda x: x.abs().max()))
wrong(CK, "one scale per head over all the tokens", lambda x: _kv_variant(x, reduce=lambda x: x.abs().amax(dim=(0, 2))))
wrong(CK, "max|x| / 255", lambda x: _kv_variant(x, divisor=255))
wrong(CK, "truncated toward zero", lambda x: _kv_variant(x, rounding=lambda t: t))
wrong(CK, "largest *value*", lambda x: _kv_variant(x, reduce=lambda x: x.amax(dim=-1)))
wrong(CK, "q is torch.float32", lambda x: _kv_variant(x, cast=False))
wrong(CK, "(6, 3, 1)", lambda x: _kv_variant(x, keepdim=True))
wrong(CK, "the pool stores float32 scales", lambda x: _kv_variant(x, upcast=False))
wrong(CK, "compute in float32", lambda x: _kv_variant(x, upcast=False, scale_as_float=True))
wrong(
    CK,
    "a floor (or epsilon) on max|x|",
    lambda x: _kv_variant(x, reduce=lambda x: x.abs().amax(dim=-1).clamp(min=1e-2)),
)
wrong(CK, "a floor (or epsilon) on max|x|", lambda x: _kv_variant(x, reduce=lambda x: x.abs().amax(dim=-1) + 1e-3))

# ---- 08: speculative decoding ---------------------------------------------------------------------


def accept_greedy(target_tokens, draft_tokens):
    out = []
    for i, d in enumerate(draft_tokens):
        if d != target_tokens[i]:
            return out + [target_tokens[i]]
        out.append(d)
    return out + [target_tokens[len(draft_tokens)]]


def accept_greedy_zip(target_tokens, draft_tokens):
    """Independent: count the agreeing prefix first, then slice."""
    n = 0
    while n < len(draft_tokens) and draft_tokens[n] == target_tokens[n]:
        n += 1
    return list(draft_tokens[:n]) + [int(target_tokens[n])]


def _greedy_variant(target, drafts, on_mismatch="target", stop=True, bonus=0, shift=0, only_accepted=False):
    out = []
    for i, d in enumerate(drafts):
        t = target[i + shift]
        if d != t:
            if only_accepted:
                return out
            out.append(t if on_mismatch == "target" else d)
            if stop:
                return out
            continue
        out.append(d)
    if only_accepted:
        return out
    return out + ([] if bonus is None else [target[len(drafts) + bonus]])


CG = "check_accept_greedy"
right(CG, accept_greedy)
right(CG, accept_greedy_zip)
wrong(CG, "the bonus token", lambda t, d: _greedy_variant(t, d, bonus=None))
wrong(CG, "kept the draft's token", lambda t, d: _greedy_variant(t, d, on_mismatch="draft"))
wrong(CG, "went on after the first disagreement", lambda t, d: _greedy_variant(t, d, stop=False))
wrong(CG, "not target_tokens[k - 1]", lambda t, d: _greedy_variant(t, d, bonus=-1))
wrong(CG, "only the accepted proposals", lambda t, d: _greedy_variant(t, d, only_accepted=True))
wrong(CG, "compared proposal i with target_tokens[i + 1]", lambda t, d: _greedy_variant(t, d, shift=1))
wrong(CG, "list of Python ints", lambda t, d: torch.tensor(accept_greedy(t, d)))


def accept_sampled(target_probs, draft_probs, draft_tokens, generator=None):
    out = []
    for i, d in enumerate(draft_tokens):
        p = target_probs[i]
        if draft_probs is None:
            q = torch.zeros_like(p)
            q[d] = 1.0
        else:
            q = draft_probs[i]
        u = torch.rand((), generator=generator)
        if u * q[d] < p[d]:
            out.append(d)
            continue
        r = (p - q).clamp(min=0)
        return out + [int(torch.multinomial(r / r.sum(), 1, generator=generator))]
    return out + [int(torch.multinomial(target_probs[len(draft_tokens)], 1, generator=generator))]


def accept_sampled_cdf(target_probs, draft_probs, draft_tokens, generator=None):
    """Independent: all uniforms drawn up front, float64, inverse-CDF sampling, min(1, p/q)."""
    k = len(draft_tokens)
    p_all = target_probs.double()
    us = torch.rand(k + 1, generator=generator, dtype=torch.float64)

    def draw(weights, u):
        cdf = torch.cumsum(weights / weights.sum(), 0)
        return min(int(torch.searchsorted(cdf, u.reshape(1), right=True)), len(weights) - 1)

    for i, d in enumerate(draft_tokens):
        p = p_all[i]
        q_d = 1.0 if draft_probs is None else float(draft_probs[i][d])
        if q_d > 0 and float(us[i]) < min(1.0, float(p[d]) / q_d):
            continue
        if draft_probs is None:
            residual = p.clone()
            residual[d] = 0
        else:
            residual = torch.clamp(p - draft_probs[i].double(), min=0)
        extra = torch.rand((), generator=generator, dtype=torch.float64)
        return list(draft_tokens[:i]) + [draw(residual, extra)]
    return list(draft_tokens) + [draw(p_all[k], us[k])]


def _sampled_variant(target_probs, draft_probs, draft_tokens, generator=None, keep="ratio", replace="residual",
                     bonus=True, normalize=True, seeded=True, none_ok=True, one_u=False):  # fmt: skip
    gen = generator if seeded else None
    shared = float(torch.rand((), generator=gen)) if one_u else None  # one uniform for the whole pass
    out = []
    for i, d in enumerate(draft_tokens):
        p = target_probs[i]
        if draft_probs is None and none_ok:
            q = torch.zeros_like(p)
            q[d] = 1.0
        else:
            q = draft_probs[i]
        u = shared if one_u else float(torch.rand((), generator=gen))
        kept = {
            "ratio": u * float(q[d]) < float(p[d]),
            "inverse": u * float(p[d]) < float(q[d]),
            "deterministic": float(p[d]) >= float(q[d]),
        }[keep]
        if kept:
            out.append(d)
            continue
        if replace == "p":
            return out + [int(torch.multinomial(p, 1, generator=gen))]
        r = (p - q).clamp(min=0)
        if normalize:
            return out + [int(torch.multinomial(r / r.sum(), 1, generator=gen))]
        v = float(torch.rand((), generator=gen))
        return out + [int((r.cumsum(0) < v).sum())]  # an unnormalized cdf: can run past the vocabulary
    if not bonus:
        return out
    return out + [int(torch.multinomial(target_probs[len(draft_tokens)], 1, generator=gen))]


CS = "check_accept_sampled"
right(CS, accept_sampled)
right(CS, accept_sampled_cdf)
wrong(CS, "replaced by a draw from p", lambda *a: _sampled_variant(*a, replace="p"))
wrong(CS, "upside down", lambda *a: _sampled_variant(*a, keep="inverse"))
wrong(CS, "with no random draw", lambda *a: _sampled_variant(*a, keep="deterministic"))
wrong(CS, "normalize it", lambda *a: _sampled_variant(*a, normalize=False))
wrong(CS, "sample the bonus from target_probs[k]", lambda *a: _sampled_variant(*a, bonus=False))
wrong(CS, "with draft_probs=None your code raised TypeError", lambda *a: _sampled_variant(*a, none_ok=False))
wrong(CS, "draw every random number from the generator", lambda *a: _sampled_variant(*a, seeded=False))
wrong(CS, "one draw per position", lambda *a: _sampled_variant(*a, one_u=True))


def blocks_to_roll_back(table, num_tokens, block_size):
    from minillm.kvcache.addressing import RELEASED

    keep = -(-num_tokens // block_size)
    return table[:keep], [b for b in reversed(table[keep:]) if b != RELEASED]


def blocks_to_roll_back_loop(table, num_tokens, block_size):
    """Independent: walk the table from the end, by the first position each block holds."""
    kept, freed = list(table), []
    while kept and (len(kept) - 1) * block_size >= num_tokens:
        block = kept.pop()
        if block >= 0:
            freed.append(block)
    return kept, freed


def _rollback_variant(table, num_tokens, block_size, keep=None, order=-1, skip_released=True, free=True, overlap=False,
                      real=lambda b: b >= 0, released="keep"):  # fmt: skip
    if released == "filter":  # the placeholders dropped from the whole table before splitting it
        table = [b for b in table if b >= 0]
    n = -(-num_tokens // block_size) if keep is None else keep(num_tokens, block_size)
    tail = table[n - 1 :] if overlap and n else table[n:]
    freed = [b for b in tail[::order] if real(b) or not skip_released]
    kept = [b for b in table[:n] if b >= 0] if released == "drop" else table[:n]
    return kept, (freed if free else [])


CR = "check_rollback"
right(CR, blocks_to_roll_back)
right(CR, blocks_to_roll_back_loop)
wrong(CR, "tail first", lambda *a: _rollback_variant(*a, order=1))
wrong(CR, "not `b > 0`", lambda *a: _rollback_variant(*a, real=lambda b: b > 0))
wrong(CR, "not given back", lambda *a: _rollback_variant(*a, real=lambda b: b >= 0 and b != a[0][-1]))
wrong(CR, "last kept block is only partly filled", lambda *a: _rollback_variant(*a, keep=lambda n, b: n // b))
wrong(CR, "holds only rejected positions", lambda *a: _rollback_variant(*a, keep=lambda n, b: n // b + 1))
wrong(CR, "must be kept", lambda *a: _rollback_variant(*a, keep=lambda n, b: max(0, (n - 1) // b)))
wrong(CR, "(RELEASED)", lambda *a: _rollback_variant(*a, skip_released=False))
wrong(CR, "they would leak", lambda *a: _rollback_variant(*a, free=False))
wrong(CR, "both kept and given back", lambda *a: _rollback_variant(*a, overlap=True))
wrong(CR, "placeholders must stay in the table, in place", lambda *a: _rollback_variant(*a, released="drop"))
wrong(CR, "placeholders must stay in the table, in place", lambda *a: _rollback_variant(*a, released="filter"))
wrong(CR, "tuple (kept, freed)", lambda t, n, b: blocks_to_roll_back(t, n, b)[0])

# ---- 09: parallelism -------------------------------------------------------------------------------
# The ranks run an answer from its source (a notebook's function cannot be pickled into a spawned
# process), so the tensor-parallel answers are self-contained module-level defs: no lambdas, no helpers.


def tp_mlp(x, gate, up, down, rank, world_size):
    """The reference: rows of gate/up and the same columns of down, then one all-reduce."""
    per = gate.shape[0] // world_size
    mine = slice(rank * per, (rank + 1) * per)
    out = (F.silu(x @ gate[mine].T) * (x @ up[mine].T)) @ down[:, mine].T
    dist.all_reduce(out)
    return out


def tp_mlp_chunks(x, gate, up, down, rank, world_size):
    """Independent: chunk/F.linear, the collective spelled out in full."""
    g, u = gate.chunk(world_size, dim=0)[rank], up.chunk(world_size, dim=0)[rank]
    partial = F.linear(F.silu(F.linear(x, g)) * F.linear(x, u), down.chunk(world_size, dim=1)[rank])
    torch.distributed.all_reduce(partial, op=torch.distributed.ReduceOp.SUM)
    return partial


def tp_mlp_whole(x, gate, up, down, rank, world_size):
    return (F.silu(x @ gate.T) * (x @ up.T)) @ down.T


def tp_mlp_no_reduce(x, gate, up, down, rank, world_size):
    per = gate.shape[0] // world_size
    mine = slice(rank * per, (rank + 1) * per)
    return (F.silu(x @ gate[mine].T) * (x @ up[mine].T)) @ down[:, mine].T


def tp_mlp_reduce_intermediate(x, gate, up, down, rank, world_size):
    per = gate.shape[0] // world_size
    mine = slice(rank * per, (rank + 1) * per)
    h = F.silu(x @ gate[mine].T) * (x @ up[mine].T)
    dist.all_reduce(h)
    return h @ down[:, mine].T


def tp_mlp_unpaired(x, gate, up, down, rank, world_size):
    per = gate.shape[0] // world_size
    mine = slice(rank * per, (rank + 1) * per)
    out = (F.silu(x @ gate[mine].T) * (x @ up[rank::world_size].T)) @ down[:, mine].T
    dist.all_reduce(out)
    return out


def tp_mlp_down_rows(x, gate, up, down, rank, world_size):
    per = gate.shape[0] // world_size
    mine = slice(rank * per, (rank + 1) * per)
    out = (F.silu(x @ gate[mine].T) * (x @ up[mine].T)) @ down[mine].T
    dist.all_reduce(out)
    return out


def tp_mlp_two_reduces(x, gate, up, down, rank, world_size):
    per = gate.shape[0] // world_size
    mine = slice(rank * per, (rank + 1) * per)
    out = (F.silu(x @ gate[mine].T) * (x @ up[mine].T)) @ down[:, mine].T
    dist.all_reduce(out)
    dist.all_reduce(out)
    return out


def tp_mlp_rank0_only(x, gate, up, down, rank, world_size):
    per = gate.shape[0] // world_size
    mine = slice(rank * per, (rank + 1) * per)
    out = (F.silu(x @ gate[mine].T) * (x @ up[mine].T)) @ down[:, mine].T
    dist.all_reduce(out)
    return out if rank == 0 else None


def tp_mlp_reduce_on_rank0(x, gate, up, down, rank, world_size):
    per = gate.shape[0] // world_size
    mine = slice(rank * per, (rank + 1) * per)
    out = (F.silu(x @ gate[mine].T) * (x @ up[mine].T)) @ down[:, mine].T
    if rank == 0:
        dist.all_reduce(out)
    return out


def tp_mlp_helper(x, gate, up, down, rank, world_size):
    return tp_mlp(x, gate, up, down, rank, world_size)  # fine in the notebook, undefined on the ranks


def tp_mlp_full_weights_reduced(x, gate, up, down, rank, world_size):
    out = (F.silu(x @ gate.T) * (x @ up.T)) @ down.T
    dist.all_reduce(out)
    return out


def tp_mlp_divided(x, gate, up, down, rank, world_size):
    per = gate.shape[0] // world_size
    mine = slice(rank * per, (rank + 1) * per)
    out = (F.silu(x @ gate[mine].T) * (x @ up[mine].T)) @ down[:, mine].T
    dist.all_reduce(out)
    out /= world_size  # "the average over the ranks"
    return out


def tp_mlp_reduce_not_all(x, gate, up, down, rank, world_size):
    per = gate.shape[0] // world_size
    mine = slice(rank * per, (rank + 1) * per)
    out = (F.silu(x @ gate[mine].T) * (x @ up[mine].T)) @ down[:, mine].T
    dist.reduce(out, dst=0)  # the sum lands on rank 0 only
    return out


TM = "check_tp_mlp"
right(TM, tp_mlp)
right(TM, tp_mlp_chunks)
wrong(TM, "each rank computed the whole MLP: no communication", tp_mlp_whole)
wrong(TM, "rank outputs are partial sums", tp_mlp_no_reduce)
wrong(TM, "the intermediate activation, before the down projection", tp_mlp_reduce_intermediate)
wrong(TM, "the slices do not pair", tp_mlp_unpaired)
wrong(TM, "the matching columns down[:, lo:hi]", tp_mlp_down_rows)
wrong(TM, "called all_reduce [2, 2] times", tp_mlp_two_reduces)
wrong(TM, "rank 1 returned None: every rank must return", tp_mlp_rank0_only)
wrong(TM, "the output is 2× the MLP's", tp_mlp_full_weights_reduced)
wrong(TM, "waited in a collective the other ranks never joined", tp_mlp_reduce_on_rank0)
wrong(TM, "define helpers and imports inside it", tp_mlp_helper)
wrong(TM, "not a lambda", lambda x, gate, up, down, rank, world_size: x)
wrong(
    TM,
    "the all-reduce already sums the partial outputs into the full output; dividing by world_size averages them",
    tp_mlp_divided,
)
wrong(TM, "reduce leaves the sum on rank 0 only; every rank needs the full output", tp_mlp_reduce_not_all)


def heads_of_rank(num_heads, num_kv_heads, rank, tp_size):
    """The reference: deal whole groups, or replicate each K/V head and share its query heads."""
    group = num_heads // num_kv_heads
    if num_kv_heads >= tp_size:
        base, extra = divmod(num_kv_heads, tp_size)
        first = rank * base + min(rank, extra)
        kv = range(first, first + base + (rank < extra))
        return range(kv.start * group, kv.stop * group), kv
    replicas = tp_size // num_kv_heads
    if tp_size % num_kv_heads or group % replicas:
        raise ValueError(f"{tp_size} ranks cannot share {num_kv_heads} K/V heads of {group} query heads equally")
    kv_head, share = divmod(rank, replicas)
    per = group // replicas
    return range(kv_head * group + share * per, kv_head * group + (share + 1) * per), range(kv_head, kv_head + 1)


def heads_of_rank_lists(num_heads, num_kv_heads, rank, tp_size):
    """Independent: lists, built by walking the K/V heads (the larger shares last)."""
    group = num_heads // num_kv_heads
    if num_kv_heads < tp_size:
        copies, left = divmod(tp_size, num_kv_heads)
        if left or group % copies:
            raise ValueError("the query heads of a K/V head do not split evenly over its copies")
        kv = rank // copies
        q = [kv * group + i for i in range(group) if i * copies // group == rank % copies]
        return q, [kv]
    owner = [(k * tp_size) // num_kv_heads for k in range(num_kv_heads)]
    kv = [k for k in range(num_kv_heads) if owner[k] == rank]
    return [h for k in kv for h in range(k * group, (k + 1) * group)], kv


def heads_of_rank_ignoring_groups(num_heads, num_kv_heads, rank, tp_size):
    q_per, kv_per = num_heads // tp_size, max(1, num_kv_heads // tp_size)
    return range(rank * q_per, (rank + 1) * q_per), range(rank * kv_per, (rank + 1) * kv_per)


def heads_of_rank_no_replication(num_heads, num_kv_heads, rank, tp_size):
    group = num_heads // num_kv_heads
    kv = range(rank * num_kv_heads // tp_size, (rank + 1) * num_kv_heads // tp_size)
    return range(kv.start * group, kv.stop * group), kv


def heads_of_rank_query_split(num_heads, num_kv_heads, rank, tp_size):
    group = num_heads // num_kv_heads
    base, extra = divmod(num_heads, tp_size)
    first = rank * base + min(rank, extra)
    q = range(first, first + base + (rank < extra))
    return q, range(q.start // group, (q.stop - 1) // group + 1)


def heads_of_rank_whole_group_copies(num_heads, num_kv_heads, rank, tp_size):
    group = num_heads // num_kv_heads
    if num_kv_heads >= tp_size:
        return heads_of_rank(num_heads, num_kv_heads, rank, tp_size)
    kv = rank // (tp_size // num_kv_heads)
    return range(kv * group, (kv + 1) * group), range(kv, kv + 1)


def heads_of_rank_never_raises(num_heads, num_kv_heads, rank, tp_size):
    group = num_heads // num_kv_heads
    if num_kv_heads >= tp_size:
        return heads_of_rank(num_heads, num_kv_heads, rank, tp_size)
    replicas = tp_size // num_kv_heads
    kv_head, share = divmod(rank, replicas)
    per = max(1, group // replicas)
    return range(kv_head * group + share * per, kv_head * group + (share + 1) * per), range(kv_head, kv_head + 1)


def heads_of_rank_rest_to_last(num_heads, num_kv_heads, rank, tp_size):
    group = num_heads // num_kv_heads
    if num_kv_heads < tp_size:
        return heads_of_rank(num_heads, num_kv_heads, rank, tp_size)
    per = num_kv_heads // tp_size
    kv = range(rank * per, num_kv_heads if rank == tp_size - 1 else (rank + 1) * per)
    return range(kv.start * group, kv.stop * group), kv


def heads_of_rank_extra_to_last(num_heads, num_kv_heads, rank, tp_size):
    """Deals whole groups evenly, but the extra ones go to the last ranks."""
    group = num_heads // num_kv_heads
    if num_kv_heads < tp_size:
        return heads_of_rank(num_heads, num_kv_heads, rank, tp_size)
    base, extra = divmod(num_kv_heads, tp_size)
    start = rank * base + max(0, rank - (tp_size - extra))
    kv = range(start, start + base + (rank >= tp_size - extra))
    return range(kv.start * group, kv.stop * group), kv


def heads_of_rank_interleaved(num_heads, num_kv_heads, rank, tp_size):
    group = num_heads // num_kv_heads
    kv = list(range(rank, num_kv_heads, tp_size)) if num_kv_heads >= tp_size else [rank % num_kv_heads]
    return [h for k in kv for h in range(k * group, (k + 1) * group)], kv


def heads_of_rank_query_heads_only(num_heads, num_kv_heads, rank, tp_size):
    return list(range(num_heads))


KH = "check_kv_heads"
right(KH, heads_of_rank)
right(KH, heads_of_rank_lists)
wrong(KH, "query head 3 reads K/V head 1, which rank 0 does not hold", heads_of_rank_ignoring_groups)
wrong(KH, "holds no K/V head", heads_of_rank_no_replication)
wrong(KH, "serve [3, 2] query heads", heads_of_rank_query_split)
wrong(KH, "query head 0 is on ranks [0, 1]", heads_of_rank_whole_group_copies)
wrong(KH, "instead of raising ValueError", heads_of_rank_never_raises)
wrong(KH, "deal whole groups as evenly as possible", heads_of_rank_rest_to_last)
wrong(KH, "are not consecutive", heads_of_rank_interleaved)
wrong(KH, "gives the 1 extra group to the first ranks: [2, 1]", heads_of_rank_extra_to_last)
wrong(KH, "return two ranges", heads_of_rank_query_heads_only)
wrong(KH, "not a lambda", lambda num_heads, num_kv_heads, rank, tp_size: (range(num_heads), range(num_kv_heads)))


def prefix_rule(matched_blocks, load, max_imbalance):
    """The reference: most matched blocks among the replicas near the lightest; ties least loaded, then lowest."""
    lightest = min(load)
    eligible = [r for r in range(len(load)) if load[r] - lightest <= max_imbalance]
    return max(eligible, key=lambda r: (matched_blocks[r], -load[r], -r))


def prefix_rule_loop(matched_blocks, load, max_imbalance):
    """Independent: one pass, keeping the best so far."""
    best = None
    for r, (matched, busy) in enumerate(zip(matched_blocks, load)):
        if busy > min(load) + max_imbalance:
            continue
        if best is None or matched > matched_blocks[best] or (matched == matched_blocks[best] and busy < load[best]):
            best = r
    return best


def prefix_rule_busiest_on_ties(matched_blocks, load, max_imbalance):
    eligible = [r for r in range(len(load)) if load[r] <= min(load) + max_imbalance]
    return max(eligible, key=lambda r: (matched_blocks[r], load[r]))  # new prefixes pile onto the busiest


def _round_robin_rule():
    turn = itertools.count()
    return lambda matched_blocks, load, max_imbalance: next(turn) % len(load)


PR = "check_prefix_rule"
right(PR, prefix_rule)
right(PR, prefix_rule_loop)
wrong(PR, "within the cap", _round_robin_rule())
wrong(PR, "within the cap", lambda m, load, k: load.index(min(load)))
wrong(PR, "nothing matches: the least loaded", lambda m, load, k: m.index(max(m)))
wrong(PR, "within the cap", lambda m, load, k: m.index(min(m)))
wrong(PR, "within the cap", lambda m, load, k: load.index(max(load)))
wrong(PR, "nothing matches: the least loaded", prefix_rule_busiest_on_ties)
wrong(PR, "not a float", lambda m, load, k: float(prefix_rule(m, load, k)))


def prefix_rule_absolute_cap(matched_blocks, load, max_imbalance):
    """Forgot to subtract the lightest replica's load (falls back to every replica when none fits)."""
    eligible = [r for r in range(len(load)) if load[r] <= max_imbalance] or list(range(len(load)))
    return max(eligible, key=lambda r: (matched_blocks[r], -load[r], -r))


def prefix_rule_absolute_cap_no_fallback(matched_blocks, load, max_imbalance):
    eligible = [r for r in range(len(load)) if load[r] <= max_imbalance]
    return max(eligible, key=lambda r: (matched_blocks[r], -load[r], -r))


def prefix_rule_ties_to_highest(matched_blocks, load, max_imbalance):
    lightest = min(load)
    eligible = [r for r in range(len(load)) if load[r] - lightest <= max_imbalance]
    return max(eligible, key=lambda r: (matched_blocks[r], -load[r], r))


wrong(PR, "you capped load[r] itself", prefix_rule_absolute_cap)
wrong(PR, "you capped load[r] itself", prefix_rule_absolute_cap_no_fallback)
wrong(PR, "the lowest index on ties", prefix_rule_ties_to_highest)
wrong(PR, "numpy integer", lambda m, load, k: np.argmax(m))
wrong(PR, "expected a replica index in [0, 4)", lambda m, load, k: prefix_rule(m, load, k) + 1)

# ---- 10: the response cache's key -------------------------------------------------------------------


def cache_key_canonical(endpoint, body):
    """The reference: canonical JSON of the fields that change the answer."""
    if body.get("temperature", 1.0) != 0 or body.get("stream"):
        return None
    kept = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "user", "metadata")}
    return endpoint + " " + json.dumps(kept, sort_keys=True)


def cache_key_sorted_items(endpoint, body):
    """Independent: a sorted tuple of (field, value) pairs, written with repr."""
    temperature = body["temperature"] if "temperature" in body else 1
    if temperature != 0 or body.get("stream", False):
        return None
    return repr((endpoint, sorted((k, repr(v)) for k, v in body.items() if k not in {"user", "stream_options"})))


def _key_variant(endpoint, body, default_t=1.0, stream=True, sort=True, drop=("stream", "stream_options", "user"),
                 with_endpoint=True, only=None):  # fmt: skip
    if body.get("temperature", default_t) != 0 or (stream and body.get("stream")):
        return None
    kept = {k: v for k, v in body.items() if k not in drop and (only is None or k in only)}
    return (endpoint if with_endpoint else "") + json.dumps(kept, sort_keys=sort)


CK = "check_cache_key"
right(CK, cache_key_canonical)
right(CK, cache_key_sorted_items)
wrong(CK, "a sampled request", lambda e, b: json.dumps(b, sort_keys=True))
wrong(CK, "default temperature is 1", lambda e, b: _key_variant(e, b, default_t=0))
wrong(CK, "a streamed request", lambda e, b: _key_variant(e, b, stream=False))
wrong(CK, "fields in another order", lambda e, b: _key_variant(e, b, sort=False))
wrong(CK, "leave it out of the key", lambda e, b: _key_variant(e, b, drop=("stream",)))
wrong(CK, "differ only in max_tokens", lambda e, b: _key_variant(e, b, only=("model", "prompt", "temperature")))
wrong(CK, "differ only in endpoint", lambda e, b: _key_variant(e, b, with_endpoint=False))
wrong(CK, "differ only in model", lambda e, b: _key_variant(e, b, drop=("stream", "stream_options", "user", "model")))
wrong(CK, "return a string", lambda e, b: None if _key_variant(e, b) is None else hash(_key_variant(e, b)))
wrong(
    CK,
    ".digest() returns bytes, and cache_key must return a str",
    lambda e, b: None if _key_variant(e, b) is None else hashlib.blake2b(_key_variant(e, b).encode()).digest(),
)
wrong(CK, "KeyError", lambda e, b: None if b["temperature"] else e + json.dumps(b, sort_keys=True))
wrong(
    CK,
    "differ only in n (how many completions)",
    lambda e, b: _key_variant(e, b, only=("model", "prompt", "max_tokens", "stop", "temperature")),
)
wrong(
    CK,
    "differ only in messages (another chat)",
    lambda e, b: _key_variant(e, b, drop=("stream", "stream_options", "user", "messages")),
)
wrong(
    CK,
    "differ only in logprobs",
    lambda e, b: _key_variant(e, b, drop=("stream", "stream_options", "user", "logprobs")),
)
wrong(
    CK,
    "one turn longer",
    lambda e, b: _key_variant(e, b | ({"messages": b["messages"][:1]} if "messages" in b else {})),  # first turn only
)
FIELDS_A_LEARNER_LISTS = ("model", "prompt", "messages", "max_tokens", "max_completion_tokens", "stop", "n",
                          "logprobs", "top_logprobs", "temperature", "top_p", "seed")  # fmt: skip
wrong(CK, "differ only in ignore_eos", lambda e, b: _key_variant(e, b, only=FIELDS_A_LEARNER_LISTS))
wrong(
    CK,
    "differ only in repetition_penalty",
    lambda e, b: _key_variant(e, b, only=FIELDS_A_LEARNER_LISTS + ("ignore_eos",)),
)
wrong(
    CK,
    "differ only in max_completion_tokens in a chat request",
    lambda e, b: _key_variant(e, b, drop=("stream", "stream_options", "user", "max_completion_tokens")),
)
wrong(
    CK,
    "differ only in stop (one more stop string)",
    lambda e, b: _key_variant(e, b | {"stop": str(b.get("stop", [""])[0])}),
)


# ---- 08: the tree attention mask ---------------------------------------------------------


def tree_mask_rows(parents):
    mask = torch.eye(len(parents), dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            mask[i] |= mask[p]
    return mask


def tree_mask_walk(parents):
    """Independent: walk up from every node, marking what it passes."""
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    return mask


def tree_mask_closure(parents):
    """Independent: the reflexive-transitive closure of the parent relation, by squaring."""
    n = len(parents)
    reach = torch.eye(n)
    for i, p in enumerate(parents):
        if p >= 0:
            reach[i, p] = 1
    for _ in range(max(1, n).bit_length()):
        reach = ((reach @ reach) > 0).float()
    return reach > 0


def _parent_only(parents):
    n = len(parents)
    mask = torch.eye(n, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            mask[i, p] = True
    return mask


def _same_depth_siblings(parents):
    """Sees its ancestors and also every earlier node at its own depth (another branch)."""
    mask = tree_mask_rows(parents)
    depth = mask.sum(-1)
    for i in range(len(parents)):
        for j in range(i):
            if depth[i] == depth[j]:
                mask[i, j] = True
    return mask


CT = "check_tree_attention_mask"
right(CT, tree_mask_rows)
right(CT, tree_mask_walk)
right(CT, tree_mask_closure)
wrong(CT, "transposed", lambda p: tree_mask_rows(p).T.contiguous())
wrong(CT, "does not see itself", lambda p: tree_mask_rows(p) & ~torch.eye(len(p), dtype=torch.bool))
wrong(CT, "not only the parent", _parent_only)
wrong(CT, "a causal triangle is right for a chain only", lambda p: torch.ones(len(p), len(p), dtype=torch.bool).tril())
wrong(CT, "is not on its branch", _same_depth_siblings)
wrong(CT, "comes after it", lambda p: torch.ones(len(p), len(p), dtype=torch.bool))
wrong(CT, "return a bool mask", lambda p: tree_mask_rows(p).float())
wrong(CT, "return a torch.Tensor", lambda p: tree_mask_rows(p).tolist())
wrong(CT, "one row and one column per node", lambda p: tree_mask_rows(p)[None])
wrong(CT, "changed its argument", lambda p: (tree_mask_rows(p), p.append(-1))[0])


def _tree_mask_parent_off_by_one(parents):
    mask = torch.eye(len(parents), dtype=torch.bool)
    for i, p in enumerate(parents):
        if 0 <= p and p + 1 < i:
            mask[i] |= mask[p + 1]
    return mask


def _tree_mask_child_into_parent(parents):
    """Swapped the update: the parent's row takes the child's."""
    mask = torch.eye(len(parents), dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            mask[p] |= mask[i]
    return mask


def _tree_mask_roots_share(parents):
    """The root-level alternatives see each other (they all follow the same token...)."""
    mask = tree_mask_rows(parents)
    roots = [i for i, p in enumerate(parents) if p < 0]
    for a in roots:
        for b in roots:
            if b < a:
                mask[a, b] = True
    return mask


def _tree_mask_children_first(parents):
    """Walks the nodes last to first: a parent's row is not complete when its child copies it."""
    mask = torch.eye(len(parents), dtype=torch.bool)
    for i in reversed(range(len(parents))):
        if parents[i] >= 0:
            mask[i] |= mask[parents[i]]
    return mask


wrong(CT, "node 1 cannot see node 0, its ancestor", _tree_mask_parent_off_by_one)
wrong(CT, "comes after it", _tree_mask_child_into_parent)
wrong(CT, "is not on its branch", _tree_mask_roots_share)
wrong(CT, "not only the parent", _tree_mask_children_first)


# ---- 08: verifying a tree (the longest accepted branch) ------------------------------------------


def tree_accept_walk(parents, drafts, target_tokens):
    path, emitted, node = [], [], -1
    while True:
        want = target_tokens[node + 1]
        emitted.append(want)
        child = next((i for i, p in enumerate(parents) if p == node and drafts[i] == want), None)
        if child is None:
            return path, emitted
        path.append(child)
        node = child


def tree_accept_children_map(parents, drafts, target_tokens):
    children = {}
    for i, p in enumerate(parents):
        children.setdefault(p, {})[drafts[i]] = i
    path, node = [], -1
    while target_tokens[node + 1] in children.get(node, {}):
        node = children[node][target_tokens[node + 1]]
        path.append(node)
    return path, [drafts[i] for i in path] + [target_tokens[node + 1]]


def tree_accept_deepest(parents, drafts, target_tokens):
    """Every node accepted iff its token is the target's after its parent and its parent is
    accepted; the deepest accepted node ends the path."""
    ok, depth = [], []
    for i, p in enumerate(parents):
        ok.append(drafts[i] == target_tokens[p + 1] and (p < 0 or ok[p]))
        depth.append(0 if p < 0 else depth[p] + 1)
    best = max((i for i in range(len(parents)) if ok[i]), key=lambda i: depth[i], default=-1)
    path, node = [], best
    while node >= 0:
        path.insert(0, node)
        node = parents[node]
    return path, [drafts[i] for i in path] + [target_tokens[best + 1]]


CA = "check_accept_tree"
right(CA, tree_accept_walk)
right(CA, tree_accept_children_map)
right(CA, tree_accept_deepest)


def _accept_as_chain(parents, drafts, target_tokens):
    """accept_greedy over the nodes in list order: right for a chain only."""
    path = []
    for i, d in enumerate(drafts):
        if d != target_tokens[i]:
            break
        path.append(i)
    return path, [drafts[i] for i in path] + [target_tokens[len(path)]]


def _accept_own_row(parents, drafts, target_tokens):
    """Matches a node against the target's token after the node itself."""
    path, node = [], -1
    while True:
        child = next((i for i, p in enumerate(parents) if p == node and drafts[i] == target_tokens[i + 1]), None)
        if child is None:
            return path, [drafts[i] for i in path] + [target_tokens[node + 1]]
        path.append(child)
        node = child


def _accept_any_branch(parents, drafts, target_tokens):
    """Level by level, any node at the right depth with the right token, whoever its parent."""
    depth = []
    for p in parents:
        depth.append(0 if p < 0 else depth[p] + 1)
    path, node = [], -1
    while True:
        d = len(path)
        child = next((i for i in range(len(parents)) if depth[i] == d and drafts[i] == target_tokens[node + 1]), None)
        if child is None:
            return path, [drafts[i] for i in path] + [target_tokens[node + 1]]
        path.append(child)
        node = child


def _accept_one_level(parents, drafts, target_tokens):
    child = next((i for i, p in enumerate(parents) if p == -1 and drafts[i] == target_tokens[0]), None)
    if child is None:
        return [], [target_tokens[0]]
    return [child], [drafts[child], target_tokens[child + 1]]


def _accept_no_bonus(parents, drafts, target_tokens):
    path, emitted = tree_accept_walk(parents, drafts, target_tokens)
    return path, emitted[:-1]


def _accept_bonus_off_by_one(parents, drafts, target_tokens):
    path, emitted = tree_accept_walk(parents, drafts, target_tokens)
    last = path[-1] if path else -1
    return path, emitted[:-1] + [target_tokens[last + 2 if last + 2 < len(target_tokens) else 0]]


def _accept_reversed(parents, drafts, target_tokens):
    path, emitted = tree_accept_walk(parents, drafts, target_tokens)
    return path[::-1], emitted


def _accept_tokens_as_path(parents, drafts, target_tokens):
    path, emitted = tree_accept_walk(parents, drafts, target_tokens)
    return [drafts[i] for i in path], emitted


def _accept_emitted_only(parents, drafts, target_tokens):
    return tree_accept_walk(parents, drafts, target_tokens)[1]


def _accept_pops_drafts(parents, drafts, target_tokens):
    out = tree_accept_walk(list(parents), list(drafts), target_tokens)
    while len(drafts) > len(out[0]):
        drafts.pop()
    return out


def _accept_tensor_tokens(parents, drafts, target_tokens):
    path, emitted = tree_accept_walk(parents, drafts, target_tokens)
    return path, [torch.tensor(t) for t in emitted]


def _accept_first_child_always(parents, drafts, target_tokens):
    """Follows the first child whether or not it matches, as long as some child does."""
    path, node = [], -1
    while True:
        kids = [i for i, p in enumerate(parents) if p == node]
        if not any(drafts[i] == target_tokens[node + 1] for i in kids):
            return path, [drafts[i] for i in path] + [target_tokens[node + 1]]
        path.append(kids[0])
        node = kids[0]


def _accept_bonus_only_when_rejected(parents, drafts, target_tokens):
    """Adds the target's token only when no node was accepted."""
    path, emitted = tree_accept_walk(parents, drafts, target_tokens)
    return path, emitted if not path else emitted[:-1]


def _accept_emits_draft_not_target(parents, drafts, target_tokens):
    """On a rejection, emits the rejected child's draft instead of the target's token."""
    path, node = [], -1
    while True:
        kids = [i for i, p in enumerate(parents) if p == node]
        child = next((i for i in kids if drafts[i] == target_tokens[node + 1]), None)
        if child is None:
            tail = [drafts[kids[0]]] if kids else [target_tokens[node + 1]]
            return path, [drafts[i] for i in path] + tail
        path.append(child)
        node = child


def _accept_three_levels(parents, drafts, target_tokens):
    """A walk capped at depth 3, the depth the engine's trees happen to have."""
    path, emitted = tree_accept_walk(parents, drafts, target_tokens)
    path = path[:3]
    last = path[-1] if path else -1
    return path, [drafts[i] for i in path] + [target_tokens[last + 1]]


def _accept_first_four_children(parents, drafts, target_tokens):
    path, node = [], -1
    while True:
        kids = [i for i, p in enumerate(parents) if p == node][:4]
        child = next((i for i in kids if drafts[i] == target_tokens[node + 1]), None)
        if child is None:
            return path, [drafts[i] for i in path] + [target_tokens[node + 1]]
        path.append(child)
        node = child


wrong(CA, "stops too early", _accept_three_levels)
wrong(CA, "stops too early", _accept_first_four_children)
wrong(CA, "a path steps from a node to one of its children", _accept_as_chain)
wrong(CA, "token after its parent", _accept_own_row)
wrong(CA, "continues other text", _accept_any_branch)
wrong(CA, "stops too early", _accept_one_level)
wrong(CA, "add the target's own token", _accept_no_bonus)
wrong(CA, "exactly one token, the target's", _accept_bonus_off_by_one)
wrong(CA, "runs leaf to root", _accept_reversed)
wrong(CA, "the path holds node indices", _accept_tokens_as_path)
wrong(CA, "return two lists", _accept_emitted_only)
wrong(CA, "changed its arguments", _accept_pops_drafts)
wrong(CA, "must be a Python int", _accept_tensor_tokens)
wrong(CA, "but the target's token after", _accept_first_child_always)
wrong(CA, "add the target's own token", _accept_bonus_only_when_rejected)
wrong(CA, "exactly one token, the target's", _accept_emits_draft_not_target)


# ---- more wrong answers, one module per chapter -------------------------------------------------


def _load_chapter_modules() -> None:
    import importlib
    import pkgutil

    import catalogue_chapters

    for info in sorted(pkgutil.iter_modules(catalogue_chapters.__path__), key=lambda i: i.name):
        importlib.import_module(f"catalogue_chapters.{info.name}")


_load_chapter_modules()
