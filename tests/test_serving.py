"""The serving core: paged engine, scheduler policies, preemption, prefix caching, online API.

The invariance rung of the correctness ladder: under greedy decoding every request's tokens
are identical whether it runs alone, in a static batch, under continuous batching with
chunked prefill, after preemption, or with its prefix served from the cache.
"""

from __future__ import annotations

import time

import pytest
import torch

from minillm import LLM, LLMEngine, SamplingParams
from minillm.kvcache.addressing import kv_bytes_per_token
from minillm.metrics import SLO, run_report
from minillm.tools.workloads import Lengths, load_jsonl, poisson_workload, replay, save_jsonl, shared_prefix_workload

PROMPTS = [
    [5, 17, 42, 8, 99, 3, 250, 61, 7, 12, 19, 33, 8, 1, 2, 3, 4, 5, 6],
    [11, 12],
    [300, 4, 77, 77, 150, 20, 21],
    [9] * 33,
    [1, 2, 3, 4, 5, 6, 7, 8],
]
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


def pool_bytes(folder, blocks: int, block_size: int) -> int:
    from minillm.config import ModelConfig

    return blocks * block_size * kv_bytes_per_token(ModelConfig.from_folder(folder), torch.float32)


@pytest.fixture(scope="module")
def reference(tiny_model):
    """Each prompt alone through the contiguous-cache engine: the rung below paging."""
    llm = LLM(tiny_model, dtype="fp32", mode="contiguous")
    return [llm.generate([p], GREEDY)[0].token_ids for p in PROMPTS]


def tokens(outputs):
    return [o.token_ids for o in outputs]


@pytest.mark.parametrize(
    "engine_args",
    [
        dict(),  # continuous, chunked prefill, prefix caching
        dict(scheduling_policy="static"),
        dict(scheduling_policy="dynamic", batch_timeout=0.0),
        dict(enable_chunked_prefill=False),
        dict(max_num_batched_tokens=7, block_size=4),  # prompts cut into many chunks
        dict(max_num_seqs=2, block_size=1),
        dict(enable_prefix_caching=False, block_size=32),
        dict(attention_backend="torch"),
    ],
    ids=lambda a: ",".join(f"{k}={v}" for k, v in a.items()) or "default",
)
def test_paged_engine_matches_contiguous_cache(tiny_model, reference, engine_args):
    llm = LLM(tiny_model, dtype="fp32", **engine_args)
    assert tokens(llm.generate(PROMPTS, GREEDY)) == reference
    llm.engine.block_manager.check_invariants()
    assert llm.engine.block_manager.num_used_blocks == 0  # everything freed


@pytest.mark.parametrize("policy", ["static", "continuous"])
def test_preemption_under_memory_pressure_loses_nothing(tiny_model, reference, policy):
    # 12 blocks of 4 = 48 slots: one request (up to 57 tokens) barely fits; five must take turns.
    memory = pool_bytes(tiny_model, 15, 4)
    llm = LLM(tiny_model, dtype="fp32", block_size=4, kv_cache_memory=memory, scheduling_policy=policy)
    outputs = llm.generate(PROMPTS, GREEDY)
    assert tokens(outputs) == reference
    assert sum(o.num_preemptions for o in outputs) > 0
    assert all(o.finish_reason == "length" for o in outputs)
    bm = llm.engine.block_manager
    bm.check_invariants()
    assert bm.num_used_blocks == 0
    preempted = [rid for r in llm.engine.step_records for rid in r.preempted]
    assert preempted, "the step records name the preempted requests"


def test_prefix_cache_hits_give_identical_tokens(tiny_model):
    system = list(range(40, 80))  # 40 shared tokens
    prompts = [system + [5, 6, 7], system + [9], system[:32]]
    ref = tokens(LLM(tiny_model, dtype="fp32", mode="contiguous").generate(prompts, GREEDY))
    llm = LLM(tiny_model, dtype="fp32", block_size=8)
    first = llm.generate(prompts[0], GREEDY)[0]
    assert first.num_cached_tokens == 0
    later = [llm.generate(p, GREEDY)[0] for p in prompts[1:]]
    assert [first.token_ids] + tokens(later) == ref
    assert later[0].num_cached_tokens == 40  # five full blocks of the shared prefix
    assert later[1].num_cached_tokens == 31  # fully cached prompt: its last token is recomputed
    assert llm.engine.block_manager.prefix_hit_rate > 0.5
    # The same again, all at once: shared blocks while running, copy-on-write for the full hit.
    assert tokens(llm.generate(prompts, GREEDY)) == ref
    llm.engine.block_manager.check_invariants()


def test_online_requests_join_while_others_run(tiny_model, reference):
    engine = LLMEngine(tiny_model, dtype="fp32", max_num_batched_tokens=8)
    ids = [engine.add_request(PROMPTS[0], GREEDY)]
    pending = PROMPTS[1:]
    results = {}
    steps = 0
    while engine.has_unfinished_requests() or pending:
        if pending and steps % 4 == 3:
            ids.append(engine.add_request(pending.pop(0), GREEDY))  # a new arrival every 4 steps
        for delta in engine.step():
            if delta.output is not None:
                results[delta.request_id] = delta.output.token_ids
        steps += 1
    assert [results[i] for i in ids] == reference
    # At some step prefill chunks and decodes ran together.
    assert any(r.num_prefill_tokens and r.num_decode_tokens for r in engine.step_records)


def test_stream_deltas_add_up(tiny_model):
    engine = LLMEngine(tiny_model, dtype="fp32")
    rid = engine.add_request(PROMPTS[1], GREEDY, request_id="mine")
    assert rid == "mine"
    deltas = []
    while engine.has_unfinished_requests():
        deltas += engine.step()
    assert [d.token_id for d in deltas] == deltas[-1].output.token_ids
    assert "".join(d.text for d in deltas) == deltas[-1].output.text
    assert [d.finish_reason for d in deltas].count("length") == 1


def test_abort_frees_blocks_and_others_continue(tiny_model, reference):
    engine = LLMEngine(tiny_model, dtype="fp32")
    keep = engine.add_request(PROMPTS[0], GREEDY)
    drop = engine.add_request(PROMPTS[3], GREEDY)
    engine.step()
    used = engine.block_manager.num_used_blocks
    out = engine.abort(drop)
    assert out.finish_reason == "abort"
    assert engine.block_manager.num_used_blocks < used
    queued = engine.add_request(PROMPTS[2], GREEDY)
    engine.abort(queued)  # aborting a waiting request works too
    results = {}
    while engine.has_unfinished_requests():
        results |= {d.request_id: d.output for d in engine.step() if d.output}
    assert list(results) == [keep] and results[keep].token_ids == reference[0]
    engine.block_manager.check_invariants()
    assert engine.block_manager.num_used_blocks == 0
    with pytest.raises(ValueError, match="no unfinished request with id 'nope'"):
        engine.abort("nope")
    with pytest.raises(ValueError, match=f"no unfinished request with id {drop}"):
        engine.abort(drop)


def test_request_that_can_never_fit_is_rejected_at_add(tiny_model, reference):
    engine = LLMEngine(tiny_model, dtype="fp32", block_size=4, kv_cache_memory=pool_bytes(tiny_model, 6, 4))
    ok = engine.add_request(PROMPTS[1], SamplingParams(max_tokens=10, ignore_eos=True))
    with pytest.raises(ValueError, match="can never fit in the KV pool.*33 prompt \\+ 24 output tokens need 15 blocks"):
        engine.add_request(PROMPTS[3], GREEDY)
    done = {}
    while engine.has_unfinished_requests():
        done |= {d.request_id: d.output for d in engine.step() if d.output}
    assert list(done) == [ok] and done[ok].token_ids == reference[1][:10]


def test_duplicate_request_id_and_bad_priority(tiny_model):
    engine = LLMEngine(tiny_model, dtype="fp32")
    engine.add_request([1, 2], GREEDY, request_id="a")
    with pytest.raises(ValueError, match="request_id='a' is already in use"):
        engine.add_request([1, 2], GREEDY, request_id="a")
    with pytest.raises(TypeError, match="priority"):
        engine.add_request([1, 2], GREEDY, priority="high")
    chosen = engine.add_request([1, 2], GREEDY, request_id=engine._next_id)
    assert engine.add_request([1, 2], GREEDY) != chosen  # automatic ids skip ids callers chose


@pytest.mark.parametrize(
    ("engine_args", "message"),
    [
        (dict(block_size=0), "block_size=0"),
        (dict(kv_cache_memory=100), "kv_cache_memory=100 gives 100 bytes, less than one KV block"),
        (dict(kv_cache_memory=1.5), "kv_cache_memory=1.5"),
        (dict(kv_cache_memory=-1), "kv_cache_memory=-1"),
        (dict(scheduling_policy="fifo"), "scheduling_policy='fifo'"),
        (dict(max_num_batched_tokens=0), "max_num_batched_tokens=0"),
        (dict(batch_timeout=-1.0), "batch_timeout=-1.0"),
    ],
)
def test_invalid_engine_config(tiny_model, engine_args, message):
    with pytest.raises(ValueError, match=message):
        LLMEngine(tiny_model, dtype="fp32", **engine_args)


def test_priority_is_honoured(tiny_model):
    engine = LLMEngine(tiny_model, dtype="fp32", max_num_seqs=1, scheduling_policy="continuous")
    low = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=3, ignore_eos=True), priority=5)
    high = engine.add_request(PROMPTS[1], SamplingParams(max_tokens=3, ignore_eos=True), priority=0)
    order = []
    while engine.has_unfinished_requests():
        order += [d.request_id for d in engine.step() if d.output]
    assert order == [high, low]


def test_static_batch_waits_for_all_members(tiny_model):
    engine = LLMEngine(tiny_model, dtype="fp32", scheduling_policy="static")
    engine.add_request(PROMPTS[0], SamplingParams(max_tokens=8, ignore_eos=True))
    engine.add_request(PROMPTS[1], SamplingParams(max_tokens=2, ignore_eos=True))
    engine.step()
    late = engine.add_request(PROMPTS[2], SamplingParams(max_tokens=2, ignore_eos=True))
    started = []
    while engine.has_unfinished_requests():
        engine.step()
        started.append(any(s.request_id == late for s in engine.scheduler.running))
    # The late request only starts once the 8-token request has finished.
    assert started.index(True) >= 6


def test_dynamic_batch_waits_for_timeout(tiny_model):
    start = time.perf_counter()
    engine = LLMEngine(tiny_model, dtype="fp32", scheduling_policy="dynamic", batch_timeout=30.0, max_num_seqs=4)
    assert time.perf_counter() - start < 15  # its own warm-up request does not wait for a batch (it did: 30 s)
    rid = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=2, ignore_eos=True))
    assert engine.step() == [] and not engine.step_records  # one request of four: wait
    engine.requests[rid].metrics.arrival_time -= 31.0  # as if it had waited past the timeout
    engine.step()
    assert engine.step_records  # the timeout started the batch


def test_kv_naive_modes_run_through_the_same_api(tiny_model, reference):
    for mode in ("naive", "contiguous"):
        engine = LLMEngine(tiny_model, dtype="fp32", mode=mode)
        a = engine.add_request(PROMPTS[0], GREEDY)
        b = engine.add_request(PROMPTS[1], GREEDY)
        engine.abort(b)
        out = {}
        while engine.has_unfinished_requests():
            out |= {d.request_id: d.output for d in engine.step() if d.output}
        assert out[a].token_ids == reference[0]


def test_workloads_are_seeded_and_round_trip(tmp_path):
    a = poisson_workload(
        20, rate=5.0, prompt_lengths=(4, 30), output_lengths=Lengths(2, 40, "lognormal"), vocab_size=400, seed=3
    )
    b = poisson_workload(
        20, rate=5.0, prompt_lengths=(4, 30), output_lengths=Lengths(2, 40, "lognormal"), vocab_size=400, seed=3
    )
    assert a == b
    assert all(4 <= len(r.prompt_token_ids) <= 30 and 2 <= r.max_tokens <= 40 for r in a)
    assert all(x.arrival_time < y.arrival_time for x, y in zip(a, a[1:]))
    assert abs(a[-1].arrival_time / 20 - 1 / 5.0) < 0.15  # mean gap ~ 1/rate
    path = tmp_path / "w.jsonl"
    save_jsonl(a, path)
    assert load_jsonl(path) == a
    shared = shared_prefix_workload(5, None, prefix_length=12, vocab_size=400, seed=1)
    assert all(r.prompt_token_ids[:12] == shared[0].prompt_token_ids[:12] for r in shared)
    with pytest.raises(ValueError, match="low <= high"):
        Lengths(10, 5)
    with pytest.raises(ValueError, match="rate=0"):
        poisson_workload(3, rate=0)
    (tmp_path / "bad.jsonl").write_text('{"nope": 1}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        load_jsonl(tmp_path / "bad.jsonl")


def test_replay_and_run_report(tiny_model):
    workload = poisson_workload(12, rate=200.0, prompt_lengths=(4, 40), output_lengths=(2, 12), vocab_size=400, seed=0)
    engine = LLMEngine(tiny_model, dtype="fp32", block_size=4)
    outputs = replay(engine, workload)
    assert [o.request_id for o in outputs] == [r.request_id for r in workload]
    assert [len(o.token_ids) for o in outputs] == [r.max_tokens for r in workload]
    report = run_report(outputs, engine.step_records, SLO(ttft=10.0, tpot=10.0), engine.memory_report())
    summary = report.summary()
    assert summary["memory_kv_pool_bytes"] == engine.kv_cache.nbytes and summary["memory_weights_bytes"] > 0
    assert report.num_requests == 12 and report.output_tokens == sum(r.max_tokens for r in workload)
    assert report.slo_attainment == 1.0 and report.goodput == pytest.approx(report.request_throughput)
    assert report.ttft["p50"] <= report.ttft["p95"] <= report.ttft["p99"]
    assert 0 <= report.mean_kv_waste < report.mean_contiguous_waste < 1
    assert report.blocks_over_time and max(b for _, b in report.blocks_over_time) > 0
    strict = run_report(outputs, None, SLO(ttft=0.0, tpot=0.0))
    assert strict.slo_attainment == 0.0 and strict.goodput == 0.0
    with pytest.raises(ValueError, match="at least one"):
        run_report([])


def test_interrupted_generate_leaves_the_engine_usable(tiny_model, reference, monkeypatch):
    llm = LLM(tiny_model, dtype="fp32")
    calls = {"n": 0}
    real_step = llm.engine.step

    def interrupted_step():
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real_step()

    monkeypatch.setattr(llm.engine, "step", interrupted_step)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, GREEDY)
    monkeypatch.setattr(llm.engine, "step", real_step)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.block_manager.num_used_blocks == 0
    assert tokens(llm.generate(PROMPTS, GREEDY)) == reference


def test_sequence_token_slices(tiny_model):
    engine = LLMEngine(tiny_model, dtype="fp32")
    seq = engine.make_sequence([1, 2, 3, 4], GREEDY)
    seq.output_token_ids += [5, 6, 7]
    for start, end in [(0, 2), (0, 4), (2, 6), (4, 7), (6, 7), (0, 7)]:
        assert seq.tokens(start, end) == seq.token_ids[start:end]
