"""Replays on a virtual clock: serve a workload with time simulated by a ``StepCost``
(``engine/virtual_clock.py`` explains why), and ``calibrate`` a ``StepCost`` to this machine.

Tooling around the engine, not part of it: the engine offers ``LLMEngine.simulated_time``;
this module drives it with a workload's arrivals.
"""

from __future__ import annotations

from collections.abc import Hashable

import numpy as np

from minillm.engine.virtual_clock import StepCost
from minillm.outputs import RequestOutput
from minillm.sampling import SamplingParams
from minillm.tools.workloads import WorkloadRequest


def _next_event(engine, pending: list[WorkloadRequest], i: int, now: float) -> float:
    """When something can change for an engine that could not run a step: the next arrival, or
    a dynamic batch's timeout expiring."""
    events = [pending[i].arrival_time] if i < len(pending) else []
    scheduler = engine.scheduler
    if scheduler.policy == "dynamic" and scheduler.waiting:
        events.append(min(s.metrics.arrival_time for s in scheduler.waiting) + scheduler.batch_timeout)
    later = [t for t in events if t > now]
    # Rounding can leave a timeout a hair short of "expired"; nudge past it rather than stall.
    return min(later) if later else now + 1e-6


def virtual_replay(engine, requests: list[WorkloadRequest], cost: StepCost) -> list[RequestOutput]:
    """Serve ``requests`` on ``engine`` with time simulated by ``cost``; return the outputs in
    the order of ``requests``.

    Every timestamp (arrivals, token times, step records) is in simulated seconds from 0, the
    start of the run; a request arriving at ``arrival_time`` is added before the first step
    that starts at or after it. The engine's own clock and runner are restored afterwards.
    """
    pending = sorted(requests, key=lambda r: r.arrival_time)
    outputs: dict[Hashable, RequestOutput] = {}
    with engine.simulated_time(cost) as clock:  # the engine's clock and runner come back afterwards
        i = 0
        while i < len(pending) or engine.has_unfinished_requests():
            while i < len(pending) and pending[i].arrival_time <= clock.now:
                r = pending[i]
                engine.add_request(
                    r.prompt_token_ids,
                    r.sampling_params(),
                    request_id=r.request_id,
                    arrival_time=r.arrival_time,
                    priority=r.priority,
                )
                i += 1
            if not engine.has_unfinished_requests():
                clock.advance_to(pending[i].arrival_time)  # idle: nothing happens until the next arrival
                continue
            steps_before = engine.num_steps
            for delta in engine.step():
                if delta.output is not None:
                    outputs[delta.request_id] = delta.output
            if engine.num_steps == steps_before:  # nothing could run (a dynamic batch filling up)
                clock.advance_to(_next_event(engine, pending, i, clock.now))
    return [outputs[r.request_id] for r in requests]


def calibrate(engine, prompt_lengths=(16, 64, 128, 256), decode_batches=(1, 4, 16), repeats=3) -> StepCost:
    """Fit ``StepCost`` to this machine: time real prefill steps (one prompt of each length) and
    decode steps (batches of each size) of ``engine`` on the wall clock, then least squares.

    Each point is the median of ``repeats`` steps; coefficients are clipped at 0."""
    vocab = engine.model_config.vocab_size
    rng = np.random.default_rng(0)
    points: list[tuple[int, float]] = []

    def timed_steps(prompts: list[list[int]], max_tokens: int) -> list:
        for p in prompts:
            engine.add_request(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        first = engine.num_steps
        while engine.has_unfinished_requests():
            engine.step()
        return [r for r in engine.step_records if r.index >= first]

    def prompt(n: int) -> list[int]:
        return rng.integers(min(256, vocab - 1), vocab, size=n).tolist()

    for n in prompt_lengths:
        durations = []
        for _ in range(repeats):
            records = timed_steps([prompt(n)], 1)
            durations += [r.duration for r in records if r.num_prefill_tokens == n and not r.num_decode_tokens]
        if durations:
            points.append((n, float(np.median(durations))))
    for b in decode_batches:
        records = timed_steps([prompt(8) for _ in range(b)], repeats + 1)
        durations = [r.duration for r in records if r.num_decode_tokens == b and not r.num_prefill_tokens]
        if durations:
            points.append((b, float(np.median(durations))))
    engine.step_records.clear()  # leave the engine as a fresh one: no records, no cached prefixes
    engine.num_steps = 0
    if engine.block_manager is not None:
        engine.block_manager.reset_prefix_cache()
    tokens = np.array([p[0] for p in points], dtype=float)
    seconds = np.array([p[1] for p in points])
    (per_token, overhead), *_ = np.linalg.lstsq(np.stack([tokens, np.ones_like(tokens)], 1), seconds, rcond=None)
    return StepCost(overhead=max(float(overhead), 1e-6), per_token=max(float(per_token), 0.0))
