"""The engine's own work per step: where a step's time goes (``StepPhases``) and the fast paths
under it — NumPy's argmax, the Rust tokenizer's decode, allocation that ends early. Each fast
path is held to the slow one it replaced."""

from __future__ import annotations

import time

import pytest
import torch

import minillm.hooks as hooks
from minillm import LLMEngine, SamplingParams
from minillm.metrics import StepPhases
from minillm.sampling import argmax_rows
from minillm.tokenizer import Tokenizer, _backend_decode

TINY = "data/tiny-shakespeare-1m"


@pytest.fixture(scope="module")
def engine():
    engine = LLMEngine(TINY, compile=False, max_num_seqs=8)
    yield engine
    engine.close()


def test_every_step_records_where_its_time_went(engine):
    for i in range(5):
        engine.add_request(f"To be or not {i}", SamplingParams(max_tokens=6, ignore_eos=True))
    walls = []
    engine.step_records.clear()
    while engine.has_unfinished_requests():
        started = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - started)
    records = list(engine.step_records)
    assert len(records) == len(walls) > 1
    for record, wall in zip(records, walls):
        phases = record.phases
        assert isinstance(phases, StepPhases)
        parts = [phases.schedule, phases.inputs, phases.model, phases.sample, phases.output]
        assert all(p >= 0 for p in parts), phases
        # The stamps lie inside the step: their sum cannot exceed the time the call took.
        assert phases.total <= wall
        assert phases.host == pytest.approx(phases.total - phases.model)
    # The paged runner's tensors are counted as inputs (a prefill step builds them too).
    assert all(r.phases.inputs > 0 for r in records)


def test_a_step_that_runs_nothing_records_nothing(engine):
    engine.step_records.clear()
    assert engine.step() == []
    assert list(engine.step_records) == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64, torch.bfloat16])
def test_argmax_rows_is_torchs_argmax(dtype):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(37, 513, generator=generator).to(dtype)
    x[3, 10] = x[3, 400] = x[3].max() + 1  # a tie: the first wins
    x[5, 7] = float("nan")  # a NaN counts as the maximum
    x[6, 2] = x[6, 9] = float("nan")  # the first NaN
    x[8] = float("-inf")  # a row of -inf: index 0
    x[9, 100] = float("inf")
    assert argmax_rows(x) == x.argmax(dim=-1).tolist()
    assert argmax_rows(x.t().contiguous().t()) == x.argmax(dim=-1).tolist()  # not contiguous
    assert argmax_rows(x[::2]) == x[::2].argmax(dim=-1).tolist()


def test_the_sampler_draws_the_same_tokens_row_by_row_as_in_a_batch():
    """Each sampled row's noise comes from its own generator, whatever else is in the batch:
    drawing rows one at a time gives the batch's tokens."""
    from minillm.sampling import sample

    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(1))
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.0, seed=1),
        SamplingParams(temperature=0.7, top_p=0.9, seed=2),
        SamplingParams(temperature=1.3, top_k=20, seed=3),
        SamplingParams(temperature=0.5, min_p=0.1, seed=4),
    ]

    def generators():
        return [torch.Generator().manual_seed(i) for i in range(5)]

    batch = sample(logits, params, generators())
    alone = [sample(logits[i : i + 1], [params[i]], [g])[0] for i, g in enumerate(generators())]
    assert batch == alone


@pytest.mark.parametrize("folder", [TINY, "data/tiny-shakespeare-tokenizer"])
def test_the_rust_decode_gives_transformers_text(folder):
    tokenizer = Tokenizer(folder)
    assert tokenizer._backend_decode is not None
    generator = torch.Generator().manual_seed(0)
    size = tokenizer.vocab_size
    for _ in range(200):
        ids = torch.randint(0, size, (int(torch.randint(1, 12, (1,), generator=generator)),), generator=generator)
        ids = ids.tolist() + list(tokenizer.hf.all_special_ids)[:1]
        for skip in (True, False):
            assert tokenizer.decode(ids, skip) == tokenizer.hf.decode(ids, skip_special_tokens=skip)


def test_ids_that_are_not_a_list_still_decode_as_transformers_does():
    """A tensor or a tuple of ids (a learner's detokenize_step may pass one) goes through
    transformers, which converts it; the Rust call takes a list only."""
    tokenizer = Tokenizer(TINY)
    ids = [5, 17, 300, 2]
    for other in (torch.tensor(ids), tuple(ids)):
        assert tokenizer.decode(other) == tokenizer.hf.decode(ids, skip_special_tokens=True)


def test_a_tokenizer_whose_decode_adds_to_the_rust_one_keeps_transformers_path():
    tokenizer = Tokenizer(TINY)
    hf = tokenizer.hf
    original = hf.decode

    def tidied(ids, skip_special_tokens=False):  # what clean_up_tokenization_spaces would do
        return original(ids, skip_special_tokens=skip_special_tokens).replace(" ,", ",") + "!"

    hf.decode = tidied
    try:
        assert _backend_decode(hf) is None
    finally:
        del hf.decode


def test_a_decode_token_that_fits_its_block_takes_nothing_and_skips_grow_table(engine):
    """grow_table (chapter 03's exercise) runs only when a block must be taken or copied."""
    calls = []
    package = hooks.default("grow_table")

    def counted(*args):
        table, computed, new, size = args[:4]
        calls.append((len(table), computed, new, size))
        return package(*args)

    with hooks.override(grow_table=counted):
        engine.add_request(list(range(1, 6)), SamplingParams(max_tokens=30, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
    block = engine.block_manager.block_size
    # 5 prompt tokens + 30 outputs (the last is never run): positions 0..33 fill 3 blocks of 16,
    # one grow per block, none for the tokens that fit.
    assert len(calls) == -(-(5 + 29) // block) == 3
    # and each call had a block to take: its tokens reach past the table it was handed.
    assert all(-(-(computed + new) // size) > held for held, computed, new, size in calls), calls
