"""The decode fast paths' one protocol and one input builder (runtime/fast_path.py)."""

from __future__ import annotations

import random

import pytest
import torch

import minillm.hooks as hooks
from minillm.kvcache.addressing import padded_block_tables
from minillm.runtime.compiled_decode import CompiledDecode
from minillm.runtime.cuda_graphs import DecodeGraphs
from minillm.runtime.fast_path import DecodeFastPath, flat_inputs, pad_decode_rows, pad_table_rows
from minillm.runtime.runner import ChunkInput

BS, NULL = 4, 9


def _decode(rid, token, start, table):
    return ChunkInput(rid, [token], start, 1, table)


def test_flat_inputs_lay_out_every_chunk_in_order():
    chunks = [ChunkInput("a", [5, 6, 7], 2, 1, [3, 4]), _decode("b", 8, 5, [1, 2])]
    flat = flat_inputs(chunks, BS)
    assert flat.input_ids == [5, 6, 7, 8]
    assert flat.positions == [2, 3, 4, 5]
    assert flat.slot_mapping == [3 * BS + 2, 3 * BS + 3, 4 * BS + 0, 2 * BS + 1]
    assert flat.query_lens == [3, 1] and flat.context_lens == [5, 6]


def test_padding_rows_touch_only_the_null_block():
    chunks = [_decode("a", 11, 6, [2, 7]), _decode("b", 12, 0, [5])]
    rows = pad_decode_rows(chunks, 4, BS, NULL)
    assert rows.input_ids == [11, 12, 0, 0]
    assert rows.positions == [6, 0, 0, 0]
    assert rows.slot_mapping == [7 * BS + 2, 5 * BS, NULL * BS, NULL * BS]
    assert rows.context_lens == [7, 1, 1, 1] and rows.query_lens == [1, 1, 1, 1]
    silent = pad_decode_rows(chunks, 2, BS, NULL, write=False)  # a compile's example step writes nothing real
    assert silent.slot_mapping == [NULL * BS, NULL * BS]
    tables = pad_table_rows(torch.tensor([[2, 7], [5, NULL]]), 4, NULL)
    assert tables.tolist() == [[2, 7], [5, NULL], [NULL, NULL], [NULL, NULL]]


def _random_step(rng: random.Random, decodes_only: bool) -> list[ChunkInput]:
    chunks = []
    for i in range(rng.randrange(1, 40)):
        n = 1 if decodes_only or rng.random() < 0.6 else rng.randrange(1, 13)
        start = rng.randrange(0, 40)
        table = [rng.randrange(0, 50) for _ in range(-(-(start + n) // BS))]
        chunks.append(ChunkInput(i, [rng.randrange(1000) for _ in range(n)], start, 1, table))
    return chunks


@pytest.mark.parametrize("decodes_only", [True, False])
def test_slots_from_the_gathered_tables_are_the_hooks_slots(decodes_only):
    """Given the step's gathered block tables, the slots come from one tensor expression; they
    must be exactly what the ``slot_mapping`` hook gives chunk by chunk, on random steps."""
    rng = random.Random(decodes_only)
    for _ in range(50):
        chunks = _random_step(rng, decodes_only)
        width = max(len(c.block_table) for c in chunks)
        tables = torch.tensor(padded_block_tables([c.block_table for c in chunks], width, NULL))
        slow, fast = flat_inputs(chunks, BS), flat_inputs(chunks, BS, tables)
        assert isinstance(fast.slot_mapping, torch.Tensor)
        assert fast.slot_mapping.tolist() == slow.slot_mapping
        assert (fast.input_ids, fast.positions, fast.query_lens, fast.context_lens) == (
            slow.input_ids, slow.positions, slow.query_lens, slow.context_lens
        )
        padded = pad_decode_rows(chunks, len(chunks) + 3, BS, NULL, tables=tables) if decodes_only else None
        if padded is not None:
            assert padded.slot_mapping.tolist() == pad_decode_rows(chunks, len(chunks) + 3, BS, NULL).slot_mapping


def test_a_learners_slot_mapping_is_called_for_every_chunk_even_with_tables():
    """Chapter 03's ``slot_mapping`` plugs into the real engine: with it in force the builder
    calls it chunk by chunk, and its answer (even a wrong one) is what the step uses."""
    chunks = [_decode("a", 11, 6, [2, 7]), ChunkInput("b", [1, 2], 0, 1, [5])]
    tables = torch.tensor(padded_block_tables([c.block_table for c in chunks], 2, NULL))
    calls = []

    def mine(table, start, n, block_size):
        calls.append((start, n))
        return [-1] * n  # wrong on purpose: it must still be what comes out

    with hooks.override(slot_mapping=mine):
        flat = flat_inputs(chunks, BS, tables)
    assert calls == [(6, 1), (0, 2)]
    assert flat.slot_mapping == [-1, -1, -1]


def test_the_builder_refuses_what_is_not_a_static_decode_batch():
    with pytest.raises(ValueError, match="decode chunks only"):
        pad_decode_rows([ChunkInput("a", [1, 2], 0, 1, [0])], 2, BS, NULL)
    with pytest.raises(ValueError, match="3 decode rows do not fit a static batch of 2"):
        pad_decode_rows([_decode(i, 1, 0, [0]) for i in range(3)], 2, BS, NULL)


def test_both_fast_paths_are_decode_fast_paths():
    for cls in (DecodeGraphs, CompiledDecode):
        assert {"supports", "run"} <= set(vars(cls)), cls
    assert issubclass(DecodeGraphs, DecodeFastPath) and issubclass(CompiledDecode, DecodeFastPath)


def test_a_verify_chunk_runs_as_one_token_rows():
    """``token_rows``: a chunk that wants logits at each of its tokens (a speculative verify
    chunk) becomes one decode row per token, at its own position over the same block table;
    a prompt chunk (logits at its end only) or a long one does not run as rows."""
    from minillm.runtime.fast_path import MAX_ROWS_PER_CHUNK, runs_as_rows, token_rows

    decode = ChunkInput("a", [5], 9, 1, [0, 1, 2])
    verify = ChunkInput("b", [7, 8, 9], 4, 3, [3, 4])
    rows = token_rows([decode, verify])
    assert rows[0] is decode
    assert [(r.request_id, r.token_ids, r.start, r.num_logits, r.block_table) for r in rows[1:]] == [
        ("b", [7], 4, 1, [3, 4]), ("b", [8], 5, 1, [3, 4]), ("b", [9], 6, 1, [3, 4]),
    ]  # fmt: skip
    assert runs_as_rows(decode) and runs_as_rows(verify)
    assert not runs_as_rows(ChunkInput("c", [1, 2, 3], 0, 1, [0]))  # a prompt chunk
    assert not runs_as_rows(ChunkInput("d", [1] * (MAX_ROWS_PER_CHUNK + 1), 0, MAX_ROWS_PER_CHUNK + 1, [0]))
