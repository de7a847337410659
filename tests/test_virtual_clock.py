"""Serving replays on a virtual clock (``minillm/engine/virtual_clock.py``).

The mechanics first (time moves by the cost model and only by it; the engine is left as it
was), then every claim chapter 04 makes from its virtual-clock runs, on the chapter's own
workloads: the chapter prints the numbers, these tests hold the conclusions to them.
"""

from __future__ import annotations

import statistics
import time

import pytest

from minillm import LLMEngine
from minillm.engine.virtual_clock import StepCost, TimedRunner, VirtualClock
from minillm.metrics import SLO, run_report
from minillm.tools.replay import calibrate, virtual_replay
from minillm.tools.workloads import poisson_workload

MODEL = "tiny-shakespeare-1m"
ENGINE = dict(dtype="fp32", cpu_prepack=False)  # as in the chapter
COST = StepCost(overhead=0.005, per_token=0.0001)  # the chapter's constants


def small_workload(seed: int = 0):
    return poisson_workload(8, rate=50.0, prompt_lengths=(8, 64), output_lengths=(4, 16), vocab_size=4096, seed=seed)


def trace(outputs, records):
    """Everything time-dependent a replay produced, for exact comparison."""
    return (
        [
            (o.request_id, o.token_ids, o.metrics.arrival_time, o.metrics.token_times, o.metrics.finished_time)
            for o in outputs
        ],
        [(r.start, r.end, r.chunks) for r in records],
    )


# ------------------------------------------------------------------------------------------------
# Mechanics
# ------------------------------------------------------------------------------------------------


def test_step_cost_and_clock():
    assert COST(0) == pytest.approx(0.005) and COST(100) == pytest.approx(0.015)
    assert str(COST) == "5.00 ms + 0.100 ms per token"
    for bad in (
        dict(overhead=-1, per_token=0),
        dict(overhead=0, per_token=float("nan")),
        dict(overhead=0, per_token=0),
    ):
        with pytest.raises(ValueError):
            StepCost(**bad)
    clock = VirtualClock()
    clock.advance(0.25)
    clock.advance_to(0.1)  # never backwards
    assert clock() == 0.25
    with pytest.raises(ValueError):
        clock.advance(-1)


def test_same_workload_same_metrics_twice():
    runs = []
    for _ in range(2):
        engine = LLMEngine(MODEL, **ENGINE, max_num_seqs=4)
        outputs = virtual_replay(engine, small_workload(), COST)
        runs.append(trace(outputs, engine.step_records))
    assert runs[0] == runs[1]


def test_time_moves_by_the_cost_model_only():
    workload = small_workload(seed=1)
    engine = LLMEngine(MODEL, **ENGINE, max_num_seqs=4)
    wall = time.perf_counter()
    outputs = virtual_replay(engine, workload, COST)
    records = list(engine.step_records)
    for r in records:  # every step lasts exactly its modelled cost
        assert r.duration == pytest.approx(COST(r.num_prefill_tokens + r.num_decode_tokens))
    for a, b in zip(records, records[1:]):  # and the next starts when it ends, or later (idle)
        assert b.start >= a.end
    for request, out in zip(workload, outputs):
        assert out.metrics.arrival_time == request.arrival_time  # simulated seconds from 0
        assert out.metrics.finished_time == out.metrics.token_times[-1]
        assert len(out.token_ids) == request.max_tokens
        assert out.metrics.first_scheduled_time >= request.arrival_time
    assert records[-1].end < 10  # simulated seconds, nowhere near perf_counter()
    # The engine has its own clock and runner back, and runs on the wall clock again.
    assert engine.clock is time.perf_counter and not isinstance(engine.runner, TimedRunner)
    engine.add_request([300, 301, 302], request_id="after")
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.step_records[-1].end > wall


def test_idle_engine_jumps_to_the_next_arrival():
    workload = small_workload()
    for i, r in enumerate(workload):  # far apart: each request runs alone
        r.arrival_time = 10.0 * i
    engine = LLMEngine(MODEL, **ENGINE)
    outputs = virtual_replay(engine, workload, COST)
    for r, out in zip(workload, outputs):
        assert out.metrics.first_scheduled_time == r.arrival_time
        assert out.metrics.ttft == pytest.approx(COST(len(r.prompt_token_ids)))


def test_dynamic_batch_starts_at_its_timeout():
    workload = small_workload()[:2]
    workload[0].arrival_time, workload[1].arrival_time = 0.0, 5.0
    engine = LLMEngine(MODEL, **ENGINE, scheduling_policy="dynamic", max_num_seqs=8, batch_timeout=0.25)
    first, second = virtual_replay(engine, workload, COST)
    assert first.metrics.first_scheduled_time == pytest.approx(0.25)
    assert second.metrics.first_scheduled_time == pytest.approx(5.25)


def test_calibrate_fits_positive_costs_and_leaves_a_fresh_engine():
    engine = LLMEngine(MODEL, **ENGINE)
    cost = calibrate(engine, prompt_lengths=(16, 64), decode_batches=(1, 4), repeats=2)
    assert cost.overhead > 0 and cost.per_token >= 0
    assert cost(64) < 1.0  # a 1M-parameter model: well under a second per 64-token step
    assert not engine.step_records and engine.num_steps == 0 and not engine.has_unfinished_requests()


# ------------------------------------------------------------------------------------------------
# Chapter 04's claims, on its workloads
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def policies():
    workload = poisson_workload(
        40, rate=24.0, prompt_lengths=(16, 256), output_lengths=(8, 128), vocab_size=4096, seed=4
    )
    slo = SLO(ttft=0.5, tpot=0.02)
    out = {}
    for policy in ("static", "dynamic", "continuous"):
        engine = LLMEngine(MODEL, **ENGINE, scheduling_policy=policy, max_num_seqs=16, batch_timeout=0.1)
        outputs = virtual_replay(engine, workload, COST)
        steps = list(engine.step_records)
        report = run_report(outputs, steps, slo)
        report.busy = statistics.fmean(s.num_running for s in steps) / 16
        report.idle_with_queue = statistics.fmean(s.num_waiting > 0 and s.num_running < 16 for s in steps)
        out[policy] = report
    return out


@pytest.mark.slow
def test_continuous_batching_beats_static_on_ttft_and_throughput(policies):
    static, dynamic, continuous = policies["static"], policies["dynamic"], policies["continuous"]
    assert static.ttft["p99"] / continuous.ttft["p99"] > 10  # "p99 TTFT 13x lower"
    assert continuous.ttft["p50"] < static.ttft["p50"] / 10
    assert continuous.output_throughput > 1.2 * static.output_throughput  # "x1.26"
    assert continuous.slo_attainment == 1.0 and static.slo_attainment < 0.7 and dynamic.slo_attainment < 0.4
    # Median TPOT a little worse, p99 TPOT better (static batches prefill 512 tokens a step).
    assert 0 < continuous.tpot["p50"] - static.tpot["p50"] < 0.002
    assert continuous.tpot["p99"] < static.tpot["p99"]
    # Seats: static leaves one free while a request waits in most steps; continuous never.
    assert continuous.idle_with_queue == 0 and static.idle_with_queue > 0.5
    assert static.busy < continuous.busy < 1
    # Dynamic: static plus a delay under this load.
    assert dynamic.ttft["p50"] > static.ttft["p50"] and dynamic.goodput < static.goodput


@pytest.mark.slow
def test_chunked_prefill_bounds_decode_stalls_for_long_prompts():
    workload = poisson_workload(
        24, rate=20.0, prompt_lengths=(600, 900), output_lengths=(32, 96), vocab_size=4096, seed=5
    )
    reports, largest = {}, {}
    for chunked in (False, True):
        engine = LLMEngine(MODEL, **ENGINE, max_num_seqs=16, enable_chunked_prefill=chunked,
                           max_num_batched_tokens=128 if chunked else None)  # fmt: skip
        outputs = virtual_replay(engine, workload, COST)
        reports[chunked] = run_report(outputs, engine.step_records)
        largest[chunked] = max(s.num_prefill_tokens + s.num_decode_tokens for s in engine.step_records)
    off, on = reports[False], reports[True]
    assert largest[True] == 128 and largest[False] > 2000
    assert on.max_inter_token_latency == pytest.approx(COST(128))  # no gap longer than one full step
    assert off.inter_token_latency["p99"] > 10 * on.inter_token_latency["p99"]  # "19x lower"
    assert off.tpot["p99"] > 1.5 * on.tpot["p99"]
    # The price: a longer median gap (full steps while prompts wait) and a longer TTFT.
    assert on.inter_token_latency["p50"] > 2 * off.inter_token_latency["p50"]
    assert 1.2 < on.ttft["mean"] / off.ttft["mean"] < 1.5  # "x1.35"


@pytest.mark.slow
def test_preemption_under_pressure_finishes_everything():
    workload = poisson_workload(
        20, rate=50.0, prompt_lengths=(32, 200), output_lengths=(32, 200), vocab_size=4096, seed=6
    )
    engine = LLMEngine(MODEL, **ENGINE, kv_cache_memory=60 * 16 * (2 * 4 * 2 * 32 * 4))
    assert engine.block_manager.num_blocks == 60
    outputs = virtual_replay(engine, workload, COST)
    assert all(len(o.token_ids) == r.max_tokens for o, r in zip(outputs, workload))
    assert sum(o.num_preemptions for o in outputs) > 0


@pytest.mark.slow
def test_the_model_computing_the_tokens_does_not_change_the_numbers(policies):
    """The chapter's aside: with time simulated, swapping the 1M model for the 8M one changes nothing."""
    workload = poisson_workload(
        40, rate=24.0, prompt_lengths=(16, 256), output_lengths=(8, 128), vocab_size=4096, seed=4
    )
    engine = LLMEngine("tiny-shakespeare-8m", **ENGINE, scheduling_policy="continuous", max_num_seqs=16)
    report = run_report(virtual_replay(engine, workload, COST), engine.step_records, SLO(ttft=0.5, tpot=0.02))
    summary, reference = report.summary(), policies["continuous"].summary()
    for key in ("duration_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s", "slo_attainment", "itl_max_s"):
        assert summary[key] == reference[key], key
