"""Paged attention in PyTorch: the reference every paged kernel is tested against.

A continuous-batching step mixes sequences in different states, so there is no padding:
the step's new tokens are laid out **flat**, ``[N, heads, head_dim]``, sequence after
sequence (``cu_seqlens`` marks where each starts). Decodes come first — one token each —
then prefill chunks, each possibly continuing a prefix already in the pool.

For every layer we (1) write the new K/V into the pool through the slot mapping, then
(2) attend: all decodes together (their K/V gathered through the block tables into one
padded batch, a mask hiding each row's padding), then each prefill chunk on its own
(queries at positions ``start .. start+T-1`` see keys ``0 .. start+T-1``).

``paged_attention`` does this with PyTorch operations (any padded-batch attention function
inside); ``triton_paged_attention`` does the same step with the Triton kernels of
``triton_kernels.py``, which read the blocks in place instead of gathering copies.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from minillm.attention.torch_ref import causal_mask
from minillm.kvcache.paged import PagedKVCache


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


@dataclass
class PagedAttentionMetadata:
    cache: PagedKVCache
    slot_mapping: torch.Tensor  # [N]: where each new token's K/V goes
    cu_seqlens: torch.Tensor | None = None  # [num_seqs + 1]: sequence i's new tokens are rows cu[i]:cu[i+1]
    context_lens: torch.Tensor | None = None  # [num_seqs]: tokens each sequence attends to (cached + new)
    num_decodes: int = 0  # rows 0..num_decodes-1 are decode tokens, one per sequence
    decode_buckets: list[DecodeBucket] = field(default_factory=list)  # the reference's grouping of decodes
    decode_block_tables: torch.Tensor | None = None  # [num_decodes, max_blocks], for kernels that take all rows
    decode_context_lens: torch.Tensor | None = None  # [num_decodes]
    decode_max_context: int = 0
    prefills: list[PrefillSpan] = field(default_factory=list)
    # The prefill chunks again as tensors, for kernels that take them all in one launch.
    prefill_cu_seqlens: torch.Tensor | None = None  # [P + 1], relative to the first prefill row
    prefill_context_lens: torch.Tensor | None = None  # [P]
    prefill_block_tables: torch.Tensor | None = None  # [P, max_blocks]
    prefill_max_tokens: int = 0
    window: int | None = None  # sliding-window attention: each query sees its last `window` keys


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer: int,
    meta: PagedAttentionMetadata,
    scale: float,
    attention_fn,
) -> torch.Tensor:
    """``q[N, H, D]``, ``k, v[N, KV, D]`` for the step's new tokens → ``out[N, H, D]``."""
    meta.cache.write(layer, meta.slot_mapping, k, v)
    if meta.num_decodes == q.shape[0]:  # a pure decode step: no output buffer to fill piecewise
        return _decode(q, layer, meta, scale, attention_fn)
    out = torch.empty_like(q)
    if meta.num_decodes:
        out[: meta.num_decodes] = _decode(q[: meta.num_decodes], layer, meta, scale, attention_fn)
    for span in meta.prefills:
        qs = q[span.start : span.end].transpose(0, 1).unsqueeze(0)  # [1, H, T, D]
        if span.block_table is None:  # a fresh prompt: its keys are exactly the new tokens
            ks = k[span.start : span.end].transpose(0, 1).unsqueeze(0)
            vs = v[span.start : span.end].transpose(0, 1).unsqueeze(0)
            o = attention_fn(qs, ks, vs, span.mask, span.mask is None and span.end - span.start > 1, scale)
        else:  # continuing a prefix that is already in the pool
            ks, vs = meta.cache.gather(layer, span.block_table)
            ks, vs = ks[:, :, : span.context_len], vs[:, :, : span.context_len]
            o = attention_fn(qs, ks, vs, span.mask, False, scale)
        out[span.start : span.end] = o[0].transpose(0, 1)
    return out


def _decode(q, layer, meta, scale, attention_fn) -> torch.Tensor:
    """All decode rows, bucket by bucket (rows are sorted by context length, so little padding)."""
    if len(meta.decode_buckets) == 1:
        return _decode_bucket(q, layer, meta.decode_buckets[0], meta.cache, scale, attention_fn)
    out = torch.empty_like(q)
    for bucket in meta.decode_buckets:
        rows = slice(bucket.start, bucket.end)
        out[rows] = _decode_bucket(q[rows], layer, bucket, meta.cache, scale, attention_fn)
    return out


def _decode_bucket(q, layer, bucket: DecodeBucket, cache: PagedKVCache, scale, attention_fn) -> torch.Tensor:
    ks, vs = cache.gather(layer, bucket.block_tables)  # [B, KV, S, D]
    if bucket.length is not None:  # equal lengths (always so for one sequence): no mask needed,
        ks, vs = ks[:, :, : bucket.length], vs[:, :, : bucket.length]  # and fused kernels run faster
    o = attention_fn(q.unsqueeze(2), ks, vs, bucket.mask, False, scale)  # [B, H, 1, D]
    return o.squeeze(2)


def triton_paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer: int,
    meta: PagedAttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """The same step with the Triton kernels: fused K/V write, paged decode, paged FlashAttention
    for the prefill chunks (which read their keys — cached prefix and new tokens alike — from
    the pool)."""
    from minillm.attention.triton_kernels import flash_attention, paged_decode, write_kv

    cache = meta.cache
    k_pool, v_pool = cache.k_slots[layer], cache.v_slots[layer]
    write_kv(k, v, k_pool, v_pool, meta.slot_mapping)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    nd = meta.num_decodes
    if nd:
        out[:nd] = paged_decode(
            q[:nd],
            k_pool,
            v_pool,
            meta.decode_block_tables,
            meta.decode_context_lens,
            scale,
            cache.block_size,
            meta.decode_max_context,
            window=meta.window,
        )
    if meta.prefills:
        out[nd:] = flash_attention(
            q[nd:],
            k_pool,
            v_pool,
            meta.prefill_cu_seqlens,
            meta.prefill_context_lens,
            meta.prefill_max_tokens,
            scale,
            causal=True,
            block_tables=meta.prefill_block_tables,
            block_size=cache.block_size,
            window=meta.window,
        )
    return out


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
