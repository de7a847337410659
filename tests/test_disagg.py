"""Prefill/decode disaggregation: the prefill worker's K/V blocks, sent over torch.distributed
into the decode worker's prefix cache, continue exactly where one engine would (greedy tokens
identical); only full blocks travel, their bytes are the formula's; a dead worker is named."""

from __future__ import annotations

import os
import signal

import pytest

from minillm import LLM, SamplingParams
from minillm.cluster.disagg import DisaggregatedLLM
from minillm.config import ModelConfig
from minillm.kvcache.block_manager import BlockManager
from minillm.parallel.launch import RankFailed

GREEDY = SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True)


def _single(folder, prompts, params):
    with LLM(folder, dtype="float32", num_threads=1) as llm:
        return [o.token_ids for o in llm.generate(prompts, params)]


def test_disaggregated_tokens_equal_one_engine(tiny_model):
    prompts = [list(range(3, 30)), [7, 8, 9], list(range(40, 48)), [5] * 21]  # 27, 3 (< a block), 8 (2 full), 21
    want = _single(tiny_model, prompts, GREEDY)
    config = ModelConfig.from_folder(tiny_model)
    per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim * 4  # K and V, fp32
    with DisaggregatedLLM(tiny_model, dtype="float32", block_size=4) as llm:
        outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == want
    for prompt, out in zip(prompts, outs):
        full = len(prompt) // 4
        assert out.transfer_bytes == full * 4 * per_token  # only full blocks travel
        assert out.recomputed_tokens == len(prompt) + 1 - min(full * 4, len(prompt))  # the tail and the first token
        assert out.ttft > 0 and out.tpot > 0 and len(out.token_times) == len(out.token_ids)


def test_requests_done_at_prefill_never_reach_the_decode_worker(tiny_model):
    with DisaggregatedLLM(tiny_model, dtype="float32", block_size=4) as llm:
        (out,) = llm.generate([list(range(3, 20))], SamplingParams(max_tokens=1, temperature=0.0))
    assert len(out.token_ids) == 1 and out.transfer_bytes == 0 and out.finish_reason == "length"


def test_arrivals_replayed_in_real_time(tiny_model):
    prompts = [list(range(3, 3 + n)) for n in (12, 25, 6)]
    want = _single(tiny_model, prompts, GREEDY)
    with DisaggregatedLLM(tiny_model, dtype="float32", block_size=4) as llm:
        outs = llm.generate(prompts, GREEDY, arrivals=[0.3, 0.0, 0.15])
    assert [o.token_ids for o in outs] == want
    assert outs[0].arrival_time - outs[1].arrival_time == pytest.approx(0.3, abs=0.01)


@pytest.mark.slow
def test_smollm2_disaggregated_greedy(smollm2_dir):
    prompts = ["The capital of France is a city that", "def fibonacci(n):\n    "]
    want = _single(smollm2_dir, prompts, GREEDY)
    with DisaggregatedLLM(smollm2_dir, dtype="float32") as llm:
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == want


def test_a_dead_decode_worker_is_named(tiny_model):
    llm = DisaggregatedLLM(tiny_model, dtype="float32", block_size=4)
    os.kill(llm.workers.procs[1].pid, signal.SIGKILL)
    with pytest.raises(RankFailed, match="rank 1 failed"):
        llm.generate([list(range(3, 20))], GREEDY)
    assert not any(p.is_alive() for p in llm.workers.procs)


@pytest.mark.parametrize(
    "args, message",
    [(dict(enable_prefix_caching=False), "prefix cache"), (dict(tensor_parallel_size=2), "no tensor/pipeline")],
)
def test_bad_settings_are_refused(tiny_model, args, message):
    with pytest.raises(ValueError, match=message):
        DisaggregatedLLM(tiny_model, dtype="float32", **args)


def test_imported_blocks_become_a_cached_prefix():
    manager = BlockManager(num_blocks=6, block_size=4)
    tokens = list(range(11))  # two full blocks and a partial one
    held, to_fill = manager.reserve_imported(tokens)
    assert len(held) == 2 and [j for j, _ in to_fill] == [0, 1]
    manager.release_imported(held)
    manager.check_invariants()
    again, refill = manager.reserve_imported(tokens)  # already cached here: nothing to write
    assert again == held and refill == []
    manager.release_imported(again)

    class Seq:
        request_id, token_ids, num_computed_tokens = "r", tokens + [99], 0

    assert manager.match_prefix(Seq) == 8  # the request finds both blocks as a cached prefix
    manager.check_invariants()


def test_bad_requests_are_refused_and_the_workers_keep_serving(tiny_model):
    with DisaggregatedLLM(tiny_model, dtype="float32", block_size=4, max_model_len=64) as llm:
        good = llm.generate([[5, 6, 7]], GREEDY)
        for prompts, params, message in [
            ([[5, 6], [10**6]], GREEDY, "prompt 1 has token id"),
            ([list(range(3, 80))], GREEDY, "max_model_len=64"),
            ([[5, 6], [7]], [GREEDY, SamplingParams(max_tokens=3, n=2)], "prompt 1: DisaggregatedLLM serves n=1"),
            ([[5, 6]], SamplingParams(max_tokens=3, stop=["x"]), "stop strings"),
        ]:
            with pytest.raises(ValueError, match=message):
                llm.generate(prompts, params)
        assert [o.token_ids for o in llm.generate([[5, 6, 7]], GREEDY)] == [good[0].token_ids]  # nothing stale
    with pytest.raises(ValueError, match="prefill_threads=0"):
        DisaggregatedLLM(tiny_model, prefill_threads=0)
