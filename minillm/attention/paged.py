"""Paged attention in PyTorch: the reference every paged kernel is tested against.

It reads the step's neutral ``StepLayout`` (``layout.py``): new tokens flat, decodes first.
For every layer we (1) write the new K/V into the pool through the slot mapping, then
(2) attend: the decodes in **buckets** of similar context length (each bucket's blocks are
gathered into one padded batch, a mask hiding each row's padding), then each prefill chunk on
its own (queries at positions ``start .. start+T-1`` see keys ``0 .. start+T-1``). Any
padded-batch attention function (``torch`` or ``sdpa``) does the arithmetic.

``StaticDecodeStep`` is the same decode with every shape fixed by its inputs' tensors — no
buckets, no Python lists — so ``torch.compile`` traces it once and the graph serves every
context length (``runtime/compiled_decode.py``).

The Triton backend (``triton_paged.py``) does the same step with kernels that read the blocks
in place instead of gathering copies.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import minillm.hooks as hooks
from minillm.attention.layout import KVPool, StepLayout
from minillm.attention.torch_ref import attention, causal_mask
from minillm.kvcache.addressing import blocks_for
from minillm.kvcache.quantization import dequantize_kv


@dataclass
class PrefillSpan:
    """One sequence's chunk of new tokens: rows ``start:end`` of the flat batch, at positions
    ``context_len - (end - start) .. context_len - 1``."""

    start: int
    end: int
    context_len: int
    block_table: torch.Tensor | None = None  # [1, blocks]; None when the chunk is the whole context
    mask: torch.Tensor | None = None  # [1, 1, T, context_len] when continuing a cached prefix


@dataclass
class DecodeBucket:
    """Decode rows ``start:end`` (consecutive in the flat batch) attended together: their blocks
    are gathered into one batch padded to the longest row of the bucket."""

    start: int
    end: int
    block_tables: torch.Tensor  # [rows, blocks]
    mask: torch.Tensor | None = None  # [rows, 1, 1, blocks * block_size] when lengths differ
    length: int | None = None  # instead of a mask, when every row sees exactly this many keys


def bucket_rows(context_lens: list[int], overhead: int = 1024) -> list[tuple[int, int]]:
    """Split rows, sorted by context length, into consecutive buckets minimising the padded work
    ``Σ rows × longest`` plus ``overhead`` (in token-rows) per extra bucket — the cost of one more
    gather and attention call per layer. One long row among short ones gets a bucket of its own;
    similar lengths share one. Exact dynamic programme; batches are at most a few hundred rows."""
    n = len(context_lens)
    best = [0.0] + [float("inf")] * n  # best[j]: cost of rows 0..j-1
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        for i in range(j):
            cost = best[i] + (j - i) * context_lens[j - 1] + overhead
            if cost < best[j]:
                best[j], cut[j] = cost, i
    buckets, j = [], n
    while j > 0:
        buckets.append((cut[j], j))
        j = cut[j]
    return buckets[::-1]


def write_kv(
    pool: KVPool, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Store ``k, v[N, kv_heads, D]`` (one row per new token) at ``slot_mapping[N]`` —
    quantized first when the pool is int8 or fp8 — and return them *as stored*.

    With a quantized pool the returned K/V are the dequantized stored values, so a prompt that
    attends to its own new tokens sees exactly what a later decode step will read back: the
    model then behaves the same whether a prefix was just computed, recomputed after a
    preemption, or found in the prefix cache."""
    if pool.k_scales is None:
        pool.k_slots[layer].index_copy_(0, slot_mapping, k)
        pool.v_slots[layer].index_copy_(0, slot_mapping, v)
        return k, v
    stored = []
    for new, slots, scales in ((k, pool.k_slots, pool.k_scales), (v, pool.v_slots, pool.v_scales)):
        q, scale = hooks.quantize_kv(new, pool.kv_cache_dtype)  # chapter 07's exercise plugs in here
        slots[layer].index_copy_(0, slot_mapping, q)
        scales[layer].index_copy_(0, slot_mapping, scale)
        stored.append(dequantize_kv(q, scale, new.dtype))
    return stored[0], stored[1]


@hooks.reference("gather_kv")  # the attention steps below call it through the hook (chapter 03's exercise)
def gather_kv(
    pool: KVPool, layer: int, block_tables: torch.Tensor, by_slot: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of ``block_tables[B, blocks]`` as ``[B, kv_heads, blocks*block_size, D]`` (a copy).

    Short rows are padded with the null block; the caller masks keys past each row's context.
    ``by_slot``: index the pool's slots directly instead of viewing it as blocks — the compiled
    decode step's way, where the pool's size is a free dimension (viewing ``[slots]`` as
    ``[slots / block_size, block_size]`` makes the tracer prove divisibility for every layer,
    minutes of symbolic reasoning, and ties the graph to one pool size)."""
    b, n = block_tables.shape
    bs = pool.block_size
    if by_slot:
        index = (block_tables[:, :, None] * bs + torch.arange(bs, device=block_tables.device)).flatten()

        def pick(t: torch.Tensor) -> torch.Tensor:
            return t.index_select(0, index)
    else:
        index = block_tables.flatten()  # index_select: ~4x faster than advanced indexing on CPU

        def pick(t: torch.Tensor) -> torch.Tensor:
            return t.view(-1, bs, *t.shape[1:]).index_select(0, index)

    out = []
    scales = (None, None) if pool.k_scales is None else (pool.k_scales[layer], pool.v_scales[layer])
    for slots, scale in zip((pool.k_slots[layer], pool.v_slots[layer]), scales):
        rows = pick(slots).view(b, n * bs, *slots.shape[1:])
        if scale is not None:  # an 8-bit pool: dequantize what was gathered
            rows = dequantize_kv(rows, pick(scale).view(b, n * bs, -1), pool.dtype)
        out.append(rows.transpose(1, 2))
    return out[0], out[1]


class ReferencePagedStep:
    """One step of the reference backend: buckets, spans and masks built once from the layout."""

    def __init__(self, layout: StepLayout, attention_fn, decode_dtype: torch.dtype | None = None):
        """``decode_dtype``: compute the decode rows' attention in this dtype (e.g. fp32 over a
        bf16 pool, on CPUs where that is faster — ``attention/precision.py``); None: the pool's."""
        self.layout, self.pool, self.attention_fn = layout, layout.pool, attention_fn
        self.decode_dtype = decode_dtype
        self.plan_decodes(layout)
        bs, window, nd = layout.pool.block_size, layout.window, layout.num_decodes
        device = layout.slot_mapping.device
        self.prefills: list[PrefillSpan] = []
        row = nd
        for i in range(nd, len(layout.query_lens)):
            n, ctx = layout.query_lens[i], layout.context_lens[i]
            span = PrefillSpan(row, row + n, ctx)
            if ctx > n:  # continuing a prefix already in the pool
                span.block_table = layout.block_tables[i : i + 1, : blocks_for(ctx, bs)]
                span.mask = prefix_mask(ctx, n, device, window)
            elif window is not None and n > window:  # a long prompt: the window bites
                span.mask = prefix_mask(ctx, n, device, window)
            self.prefills.append(span)
            row += n

    def plan_decodes(self, layout: StepLayout) -> None:
        """Split the decode rows into buckets of similar context length (``bucket_rows``)."""
        if layout.visible is not None:
            raise ValueError("a speculative tree's rows (ancestor bits) need the `cpu` attention backend's kernel")
        bs, window, nd = layout.pool.block_size, layout.window, layout.num_decodes
        self.decode_buckets: list[DecodeBucket] = []
        context = layout.context_lens[:nd]
        for start, end in bucket_rows(context):
            rows = context[start:end]
            bucket = DecodeBucket(start, end, layout.block_tables[start:end, : blocks_for(max(rows), bs)])
            if min(rows) == max(rows) and (window is None or rows[0] <= window):
                bucket.length = rows[0]
            else:
                lens = torch.tensor(rows, dtype=torch.long, device=layout.slot_mapping.device)
                bucket.mask = decode_mask(lens, bucket.block_tables.shape[1] * bs, window)
            self.decode_buckets.append(bucket)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """``q[1, N, H, D]``, ``k, v[1, N, KV, D]`` for the step's new tokens → ``[1, N, H, D]``."""
        q, k, v = q[0], k[0], v[0]
        return hooks.paged_attention(self, layer, q, k, v, scale)[None]  # chapter 05's learner writes one

    def attend_written(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """``q[N, H, D]`` against the pool once ``k, v[N, KV, D]`` (the new tokens') are in it."""
        nd = self.layout.num_decodes
        if nd == q.shape[0]:  # a pure decode step: no output buffer to fill piecewise
            return self._decode(q, layer, scale)
        out = torch.empty_like(q)
        if nd:
            out[:nd] = self._decode(q[:nd], layer, scale)
        for span in self.prefills:
            qs = q[span.start : span.end].transpose(0, 1).unsqueeze(0)  # [1, H, T, D]
            if span.block_table is None:  # a fresh prompt: its keys are exactly the new tokens
                ks = k[span.start : span.end].transpose(0, 1).unsqueeze(0)
                vs = v[span.start : span.end].transpose(0, 1).unsqueeze(0)
                o = self.attention_fn(qs, ks, vs, span.mask, span.mask is None and span.end - span.start > 1, scale)
            else:  # continuing a prefix that is already in the pool
                ks, vs = hooks.gather_kv(self.pool, layer, span.block_table)
                ks, vs = ks[:, :, : span.context_len], vs[:, :, : span.context_len]
                o = self.attention_fn(qs, ks, vs, span.mask, False, scale)
            out[span.start : span.end] = o[0].transpose(0, 1)
        return out

    def _decode(self, q: torch.Tensor, layer: int, scale: float) -> torch.Tensor:
        """All decode rows, bucket by bucket (rows are sorted by context length, so little padding)."""
        if len(self.decode_buckets) == 1:
            return self._decode_bucket(q, layer, self.decode_buckets[0], scale)
        out = torch.empty_like(q)
        for bucket in self.decode_buckets:
            rows = slice(bucket.start, bucket.end)
            out[rows] = self._decode_bucket(q[rows], layer, bucket, scale)
        return out

    def _decode_bucket(self, q: torch.Tensor, layer: int, bucket: DecodeBucket, scale: float) -> torch.Tensor:
        ks, vs = hooks.gather_kv(self.pool, layer, bucket.block_tables)  # [B, KV, S, D]
        if bucket.length is not None:  # equal lengths (always so for one sequence): no mask needed,
            ks, vs = ks[:, :, : bucket.length], vs[:, :, : bucket.length]  # and fused kernels run faster
        q = q.unsqueeze(2)
        if self.decode_dtype is not None and self.decode_dtype != q.dtype:
            o = self.attention_fn(q.to(self.decode_dtype), ks.to(self.decode_dtype), vs.to(self.decode_dtype),
                                  bucket.mask, False, scale).to(q.dtype)  # fmt: skip
        else:
            o = self.attention_fn(q, ks, vs, bucket.mask, False, scale)  # [B, H, 1, D]
        return o.squeeze(2)


@hooks.reference("paged_attention")
def paged_attention(
    step: ReferencePagedStep, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """The package's: the step's new K/V into the pool (``write_kv``), then ``step.attend_written``
    (decode rows in buckets of similar length, each prompt chunk on its own). A hook so chapter 05
    can run a learner's layer — the write and the attention — in the engine."""
    k, v = write_kv(step.pool, layer, step.layout.slot_mapping, k, v)
    return step.attend_written(layer, q, k, v, scale)


class StaticDecodeStep:
    """A pure decode step whose every shape comes from its tensors: ``block_tables[B, W]`` is a
    window of ``W`` blocks per row (padded with the null block) and ``context_lens[B]`` says how
    many keys each row sees, as a mask. One traced graph then serves every step of a batch size.

    Attention is the readable reference (matmul → mask → softmax → matmul) in ``compute_dtype``:
    under ``torch.compile`` those few operations fuse with the gather and the casts, and for one
    query per row they beat a fused SDPA call, whose per-call set-up dominates at this size."""

    def __init__(self, layout: StepLayout, compute_dtype: torch.dtype):
        self.layout, self.pool, self.compute_dtype = layout, layout.pool, compute_dtype
        keys = layout.block_tables.shape[1] * layout.pool.block_size
        self.mask = decode_mask(layout.context_lens_tensor, keys, layout.window)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """``q[1, B, H, D]``, ``k, v[1, B, KV, D]`` (one new token per row) → ``[1, B, H, D]``."""
        q, k, v = q[0], k[0], v[0]
        write_kv(self.pool, layer, self.layout.slot_mapping, k, v)
        ks, vs = hooks.gather_kv(self.pool, layer, self.layout.block_tables, by_slot=True)
        dtype = self.compute_dtype
        o = attention(q.unsqueeze(2).to(dtype), ks.to(dtype), vs.to(dtype), self.mask, scale)
        return o.to(q.dtype).squeeze(2)[None]


def prefix_mask(context_len: int, num_new: int, device: torch.device, window: int | None = None) -> torch.Tensor:
    """``[1, 1, T, S]``: new tokens at positions ``S-T .. S-1`` each see keys up to themselves
    (the last ``window`` of them with sliding-window attention)."""
    positions = torch.arange(context_len - num_new, context_len, device=device)[None]
    return causal_mask(positions, context_len, window)


def decode_mask(context_lens: torch.Tensor, max_len: int, window: int | None = None) -> torch.Tensor:
    """``[B, 1, 1, S]``: row ``b`` sees keys ``0 .. context_lens[b]-1`` of its gathered blocks
    (only ``context_lens[b]-window ..`` with sliding-window attention)."""
    keys = torch.arange(max_len, device=context_lens.device)[None]
    allowed = keys < context_lens[:, None]
    if window is not None:
        allowed = allowed & (keys >= context_lens[:, None] - window)
    return allowed[:, None, None]
