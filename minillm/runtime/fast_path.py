"""Decode fast paths: one protocol, and the one input builder every paged step uses.

A pure decode step (one new token per sequence) has the same shape step after step, which
two fast paths exploit: CUDA graphs replay recorded kernel launches (``cuda_graphs.py``), and
on a CPU ahead-of-time compiled graphs run the whole step as generated code
(``compiled_decode.py``). Both need *static* shapes, so both pad a batch up to a fixed row
count, and both implement ``DecodeFastPath``: the paged runner asks ``supports(chunks)`` and,
if so, calls ``run(chunks, block_tables)`` instead of the eager model.

**The padding rule** lives here, once (``pad_decode_rows``, ``pad_table_rows``): a padding row
decodes token 0 at position 0, writes its K/V into the pool's *null block* (slot
``null_block * block_size``), attends over a context of one token, and its block table is all
null blocks — so it never reads or writes a real sequence's K/V. Released block-table entries
(behind a sliding window) become the null block too (``kvcache/addressing.py``).

``flat_inputs`` lays out any step's chunks — the paged runner's ragged steps as well as the
fast paths' decode rows — so token ids, positions and slots are computed one way everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

import minillm.hooks as hooks
from minillm.kvcache import addressing
from minillm.runtime.block_table_rows import BlockTableRows
from minillm.runtime.runner import ChunkInput, long_tensor


@runtime_checkable
class DecodeFastPath(Protocol):
    """A static-shape path for pure decode steps (``DecodeGraphs``, ``CompiledDecode``)."""

    def supports(self, chunks: list[ChunkInput]) -> bool:
        """Whether ``run`` takes this step: decode rows (and, for the compiled CPU step, verify
        chunks as rows: ``token_rows``), at most the largest static row count."""

    def run(self, chunks: list[ChunkInput], block_tables: BlockTableRows) -> torch.Tensor:
        """Logits ``[rows, vocab]``, one row per token of ``chunks`` in order (a decode step: one
        per chunk); ``block_tables``: the runner's persistent rows."""


@dataclass
class FlatInputs:
    """A step's tokens laid out flat, chunk after chunk (plain lists; the caller makes tensors)."""

    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slot_mapping: list[int] | torch.Tensor = field(default_factory=list)  # a tensor from gathered tables
    query_lens: list[int] = field(default_factory=list)  # tokens per chunk
    context_lens: list[int] = field(default_factory=list)  # tokens each chunk's sequence has after this step
    visible: list[int] = field(default_factory=list)  # per chunk: a one-token row's ancestor bits (-1: causal)


def flat_inputs(chunks: list[ChunkInput], block_size: int, tables: torch.Tensor | None = None) -> FlatInputs:
    """Token ids, positions and pool slots of ``chunks``, in order.

    ``tables``: the chunks' block-table rows as gathered for this step (``BlockTableRows``).
    Given, and with the package's own ``slot_mapping`` in force, every slot comes from one
    tensor expression over them — ``table[p // block_size] * block_size + p % block_size`` for
    all the step's tokens at once — instead of a call per chunk (``slot_mapping`` is then a
    tensor). A learner's ``slot_mapping`` (chapter 03) is called chunk by chunk, as it must be.

    Slots come from each token's *address* (``start + i``), positions from ``ChunkInput.positions``:
    the two differ only for a speculative tree's nodes (``token_rows``)."""
    visible = [c.visible for c in chunks]
    if tables is None or hooks.slot_mapping is not addressing.slot_mapping:
        out = FlatInputs(visible=visible)
        for c in chunks:
            n = c.num_tokens
            out.input_ids.extend(c.token_ids)
            out.positions.extend(c.positions)
            out.slot_mapping.extend(hooks.slot_mapping(c.block_table, c.start, n, block_size))
            out.query_lens.append(n)
            out.context_lens.append(c.start + n)
        return out
    query_lens = [len(c.token_ids) for c in chunks]
    starts = [c.start for c in chunks]
    if len(query_lens) == sum(query_lens):  # a decode step: one token per chunk
        input_ids, addresses, rows = [c.token_ids[0] for c in chunks], starts, torch.arange(len(chunks))
        positions = [c.start if c.position is None else c.position for c in chunks]
    else:
        input_ids, positions, addresses = [], [], []
        for c in chunks:
            input_ids.extend(c.token_ids)
            positions.extend(c.positions)
            addresses.extend(range(c.start, c.start + len(c.token_ids)))
        rows = torch.arange(len(chunks)).repeat_interleave(long_tensor(query_lens))
    at = long_tensor(addresses)
    slots = tables[rows, at // block_size] * block_size + at % block_size
    context_lens = [s + n for s, n in zip(starts, query_lens)]
    return FlatInputs(input_ids, positions, slots, query_lens, context_lens, visible)


# A chunk the compiled step runs as rows: every token wants its logits (a speculative verify
# chunk: the last token and k <= 16 proposals), and it is short.
MAX_ROWS_PER_CHUNK = 17


def runs_as_rows(chunk: ChunkInput) -> bool:
    """Whether ``chunk`` can run as one-token rows (``token_rows``): a decode, or a short chunk
    that wants logits at every token — a speculative verify chunk, a chain or a tree."""
    return chunk.is_decode or chunk.num_tokens == chunk.num_logits <= MAX_ROWS_PER_CHUNK


def ancestor_bits(parents: list[int], node: int) -> int:
    """Node ``node`` of a tree verified as rows: which keys just before its own it sees, as the
    CPU kernel reads them (bit ``j``: the key ``j`` addresses back). Node ``i`` lies at address
    ``start + 1 + i``, so bit 0 is itself, bit ``i - a`` its ancestor ``a``, and every bit from
    ``i + 1`` on — the chunk's first token (the sequence's last) and the sequence before it — is
    set. Its siblings' bits stay clear: a branch never sees another branch's guesses."""
    if not 0 <= node < 62:
        raise ValueError(f"tree node {node}: a tree verified as rows has at most 62 nodes")
    bits, at = -1 << (node + 1), node
    while at >= 0:
        bits |= 1 << (node - at)
        at = parents[at]
    return bits


def token_rows(chunks: list[ChunkInput]) -> list[ChunkInput]:
    """Each chunk's tokens as one-token rows: token ``i`` of a chunk from ``start`` becomes a
    decode row at position ``start + i`` whose context is ``start + i + 1`` keys.

    Why this is exact: every layer writes all the step's new keys and values into the pool
    before any row attends (``write_kv``, then attention), so row ``i`` finds the keys of the
    chunk's earlier tokens in the pool, and its context length stops it at its own position —
    the causal mask of a multi-token chunk, as per-row lengths. A verify chunk of ``k + 1``
    tokens thus runs on a decode step's static shape (``compiled_decode.py``).

    A tree chunk (``tree_parents``) the same way, with two more things per node row: its
    position is its depth's (``ChunkInput.positions``), and its ancestor bits hide the nodes
    between it and the root that are not its ancestors (``ancestor_bits``) — the tree attention
    mask, row by row."""
    rows = []
    for c in chunks:
        if c.is_decode:
            rows.append(c)
            continue
        if c.tree_parents is None:
            for i, token in enumerate(c.token_ids):
                rows.append(ChunkInput(c.request_id, [token], c.start + i, 1, c.block_table, c.max_len))
            continue
        positions, parents = c.positions, c.tree_parents
        rows.append(ChunkInput(c.request_id, c.token_ids[:1], c.start, 1, c.block_table, c.max_len))
        for i, token in enumerate(c.token_ids[1:]):
            rows.append(ChunkInput(c.request_id, [token], c.start + 1 + i, 1, c.block_table, c.max_len,
                                   position=positions[1 + i], visible=ancestor_bits(parents, i)))  # fmt: skip
    return rows


def pad_decode_rows(chunks: list[ChunkInput], rows: int, block_size: int, null_block: int,
                    write: bool = True, tables: torch.Tensor | None = None) -> FlatInputs:  # fmt: skip
    """The decode rows of ``chunks`` padded to ``rows`` rows by the padding rule (module
    docstring). ``write=False``: the real rows write their K/V into the null block too (a
    compile's example step, which must not touch the pool's real blocks). ``tables``: the
    rows' gathered block tables, for ``flat_inputs``' one-expression slots."""
    if not all(c.is_decode for c in chunks):
        raise ValueError("pad_decode_rows takes decode chunks only (one token each)")
    if len(chunks) > rows:
        raise ValueError(f"{len(chunks)} decode rows do not fit a static batch of {rows}")
    out = flat_inputs(chunks, block_size, tables)
    null_slot = null_block * block_size
    if not write:
        out.slot_mapping = [null_slot] * len(chunks)
    pad = rows - len(chunks)
    out.input_ids += [0] * pad
    out.positions += [0] * pad
    if isinstance(out.slot_mapping, torch.Tensor):
        out.slot_mapping = torch.cat([out.slot_mapping, torch.full((pad,), null_slot, dtype=torch.long)])
    else:
        out.slot_mapping += [null_slot] * pad
    out.query_lens += [1] * pad
    out.context_lens += [1] * pad
    out.visible += [-1] * pad
    return out


def pad_table_rows(tables: torch.Tensor, rows: int, null_block: int) -> torch.Tensor:
    """``tables[n, width]`` with ``rows - n`` rows of null blocks appended."""
    pad = torch.full((rows - tables.shape[0], tables.shape[1]), null_block, dtype=tables.dtype, device=tables.device)
    return torch.cat([tables, pad])
