"""The paged model runner: a scheduled step → flat tensors → one forward pass → logits.

The scheduler hands over chunks — ``num_tokens`` tokens of a sequence from position
``start`` on. The runner lays their tokens out flat (decodes first), computes each token's
**slot** in the pool from its sequence's block table, and describes what each sequence
attends to. There is no padding anywhere except in the gathered K/V of the decode group.
"""

from __future__ import annotations

import torch

from minillm.attention.paged import (
    DecodeBucket,
    PagedAttentionMetadata,
    PrefillSpan,
    bucket_rows,
    decode_mask,
    prefix_mask,
)
from minillm.engine.cuda_graphs import DecodeGraphs
from minillm.engine.scheduler import ScheduledChunk
from minillm.kvcache.paged import PagedKVCache
from minillm.models.llama import LlamaForCausalLM, PagedForwardBatch


def slot_mapping(block_table: list[int], start: int, num_tokens: int, block_size: int) -> list[int]:
    """Flat pool slots of positions ``start .. start+num_tokens-1``: token ``p`` lives in block
    ``block_table[p // block_size]`` at offset ``p % block_size``."""
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, start + num_tokens)]


class PagedModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        cache: PagedKVCache,
        block_tables,
        window: int | None = None,
        graphs: DecodeGraphs | None = None,
    ):
        """``block_tables(seq)`` returns the sequence's current block table (the block manager's;
        entries of blocks released behind a sliding window are ``-1``, read as the null block and
        masked). ``graphs``: run pure decode steps through static buffers / CUDA graphs."""
        self.window = window
        self.model = model
        self.cache = cache
        self.block_tables = block_tables
        self.graphs = graphs
        self.device = model.embed_tokens.weight.device

    def prepare(self, chunks: list[ScheduledChunk]) -> tuple[PagedForwardBatch, list[ScheduledChunk]]:
        """The forward batch for ``chunks`` and, in logit-row order, the chunks that sample."""
        bs = self.cache.block_size
        # Decodes sorted by context length, so the reference can attend in buckets of similar lengths.
        decodes = sorted((c for c in chunks if c.num_tokens == 1), key=lambda c: c.start)
        prefills = [c for c in chunks if c.num_tokens > 1]
        order = decodes + prefills  # the flat layout: decodes first, then prefill chunks
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        cu_seqlens = [0]
        logit_rows: list[int] = []
        sampled: list[ScheduledChunk] = []
        for c in order:
            ids.extend(c.seq.tokens(c.start, c.start + c.num_tokens))
            positions.extend(range(c.start, c.start + c.num_tokens))
            slots.extend(slot_mapping(self.block_tables(c.seq), c.start, c.num_tokens, bs))
            cu_seqlens.append(len(ids))
            if c.samples:
                logit_rows.append(len(ids) - 1)
                sampled.append(c)
        meta = PagedAttentionMetadata(
            self.cache,
            self._tensor(slots),
            cu_seqlens=self._tensor(cu_seqlens),
            context_lens=self._tensor([c.start + c.num_tokens for c in order]),
            num_decodes=len(decodes),
            window=self.window,
        )
        if decodes:
            context = [c.start + 1 for c in decodes]
            width = -(-max(context) // bs)
            tables = [self.block_tables(c.seq)[:width] for c in decodes]
            meta.decode_block_tables = self._table_tensor(tables, width)
            meta.decode_context_lens = self._tensor(context)
            meta.decode_max_context = max(context)
            for start, end in bucket_rows(context):
                meta.decode_buckets.append(self._decode_bucket(start, end, context[start:end], tables[start:end]))
        row = len(decodes)
        for c in prefills:
            context = c.start + c.num_tokens
            span = PrefillSpan(row, row + c.num_tokens, context)
            if c.start > 0:  # continuing a prefix already in the pool
                table = self.block_tables(c.seq)[: -(-context // bs)]
                span.block_table = self._table_tensor([table], len(table))
                span.mask = prefix_mask(context, c.num_tokens, self.device, self.window)
            elif self.window is not None and c.num_tokens > self.window:  # a long prompt: the window bites
                span.mask = prefix_mask(context, c.num_tokens, self.device, self.window)
            meta.prefills.append(span)
            row += c.num_tokens
        if prefills:
            tables = [self.block_tables(c.seq)[: -(-(c.start + c.num_tokens) // bs)] for c in prefills]
            meta.prefill_block_tables = self._table_tensor(tables, max(len(t) for t in tables))
            meta.prefill_cu_seqlens = self._tensor([cu - len(decodes) for cu in cu_seqlens[len(decodes) :]])
            meta.prefill_context_lens = self._tensor([c.start + c.num_tokens for c in prefills])
            meta.prefill_max_tokens = max(c.num_tokens for c in prefills)
        batch = PagedForwardBatch(self._tensor(ids), self._tensor(positions), meta, self._tensor(logit_rows))
        return batch, sampled

    def execute(self, chunks: list[ScheduledChunk], copies: list[tuple[int, int]]):
        """Run one step: copy-on-write copies, then the forward pass. Returns (logits, sampled chunks)."""
        self.cache.copy_blocks(copies)
        if self.graphs is not None and self.graphs.supports(chunks):
            logits = self.graphs.run(chunks, self.block_tables)
            rows = [i for i, c in enumerate(chunks) if c.samples]
            if len(rows) < len(chunks):  # a one-token chunk in the middle of a prompt: no token to sample
                logits = logits[torch.tensor(rows, device=logits.device, dtype=torch.long)]
            return logits, [chunks[i] for i in rows]
        batch, sampled = self.prepare(chunks)
        logits = self.model(batch)
        return logits, sampled

    def _decode_bucket(self, start: int, end: int, context: list[int], tables: list[list[int]]) -> DecodeBucket:
        width = -(-max(context) // self.cache.block_size)
        bucket = DecodeBucket(start, end, self._table_tensor([t[:width] for t in tables], width))
        if min(context) == max(context) and (self.window is None or context[0] <= self.window):
            bucket.length = context[0]
        else:
            bucket.mask = decode_mask(self._tensor(context), width * self.cache.block_size, self.window)
        return bucket

    def _table_tensor(self, tables: list[list[int]], width: int) -> torch.Tensor:
        """Block tables as one ``[rows, width]`` tensor: short rows padded, released blocks (-1)
        replaced — both with the null block, whose slots the attention masks out."""
        null = self.cache.null_block
        return self._tensor([[b if b >= 0 else null for b in t] + [null] * (width - len(t)) for t in tables])

    def _tensor(self, values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)
