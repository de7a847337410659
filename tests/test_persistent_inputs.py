"""The step's tensors kept from step to step — block-table rows updated only where a table
changed, slots computed from them in one expression — against the same tensors rebuilt from
scratch, step after step, on random schedules: requests join and leave at random, prompts share
prefixes (cached blocks, copy-on-write), some ask for several samples (forks), some are aborted,
and the pool is small enough that sequences are preempted and come back with new tables."""

from __future__ import annotations

import random

import pytest
import torch

import minillm.hooks as hooks
from minillm import LLMEngine, SamplingParams
from minillm.config import ModelConfig
from minillm.kvcache import addressing
from minillm.runtime.fast_path import flat_inputs

TINY = "data/tiny-shakespeare-1m"


def scratch_layout(runner, chunks):
    """What the step's inputs must be, built without anything kept from earlier steps."""
    bs, null = runner.cache.block_size, runner.cache.null_block
    decodes = sorted((c for c in chunks if c.is_decode), key=lambda c: c.start)
    order = decodes + [c for c in chunks if not c.is_decode]
    flat = flat_inputs(order, bs)  # the slot_mapping hook, chunk by chunk
    width = addressing.blocks_for(max(flat.context_lens), bs)
    tables = addressing.padded_block_tables([c.block_table for c in order], width, null)
    return flat, torch.tensor(tables)


@pytest.mark.parametrize("seed, window", [(0, None), (1, None), (2, 8)])
def test_kept_inputs_equal_inputs_rebuilt_from_scratch_on_random_schedules(seed, window):
    """(``window``: sliding-window attention, whose blocks behind the window are released.)"""
    rng = random.Random(seed)
    config = ModelConfig.from_folder(TINY)
    per_token = addressing.kv_bytes_per_token(config, torch.float32)
    engine = LLMEngine(TINY, compile=False, max_num_seqs=12, max_num_batched_tokens=64, block_size=4,
                       kv_cache_memory=(12 if window else 24) * 4 * per_token, max_model_len=96,
                       sliding_window=window)  # fmt: skip
    checked = {"steps": 0, "decodes": 0, "prefills": 0}

    def checked_layout(runner, chunks):
        layout = hooks.default("step_layout")(runner, chunks)
        flat, tables = scratch_layout(runner, chunks)
        assert layout.input_ids[0].tolist() == flat.input_ids
        assert layout.positions[0].tolist() == flat.positions
        assert layout.slot_mapping.tolist() == flat.slot_mapping
        assert layout.context_lens == flat.context_lens and layout.query_lens == flat.query_lens
        assert torch.equal(layout.block_tables, tables)
        checked["steps"] += 1
        checked["decodes"] += layout.num_decodes
        checked["prefills"] += len(chunks) - layout.num_decodes
        return layout

    stems = ["To be, or not to be", "Friends, Romans, countrymen", "Now is the winter"]
    live, preemptions = [], 0
    with hooks.override(step_layout=checked_layout):
        for _ in range(120):
            if rng.random() < 0.6:
                prompt = rng.choice(stems) + " " * rng.randrange(3) + str(rng.randrange(50))
                params = SamplingParams(max_tokens=rng.randrange(1, 30), n=rng.choice([1, 1, 1, 2]),
                                        temperature=rng.choice([0.0, 0.8]), seed=rng.randrange(99), ignore_eos=True)  # fmt: skip
                live.append(engine.add_request(prompt, params))
            if live and rng.random() < 0.04:
                victim = live.pop(rng.randrange(len(live)))
                if victim in engine.requests:
                    engine.abort(victim)
            deltas = engine.step()
            preemptions += sum(d.output.num_preemptions for d in deltas if d.output is not None)
        while engine.has_unfinished_requests():
            deltas = engine.step()
            preemptions += sum(d.output.num_preemptions for d in deltas if d.output is not None)
    # What the random schedule covered: without preemptions the test would not test re-admission.
    assert checked["steps"] > 100 and checked["decodes"] > 200 and checked["prefills"] > 20, checked
    assert preemptions > 0
    bm = engine.block_manager
    assert bm.num_used_blocks == 0, "every block came back"
    engine.close()
