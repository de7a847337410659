"""Serving replays on a virtual clock: the real scheduler and model, simulated time.

Why: a wall-clock replay (``workloads.replay``) measures the machine as much as the policy.
On a busy or slow machine the model falls behind the arrivals, queues grow without bound,
and the same workload can make every policy miss every latency target — or reverse the
ordering of two policies from one run to the next. It also takes as long as the simulated
traffic lasts, at least.

A virtual clock separates the two. The engine runs for real — the real scheduler decides
every step, the real model computes every token — but time does not come from the wall
clock: each step *takes* a modelled time,

    step time = overhead + per_token × (tokens run in the step)

the shape of a step on any hardware: a fixed cost paid once per step (reading every weight,
launching the kernels) plus work that grows with the tokens in the batch (chapter 01's
roofline). Requests arrive at their scheduled times on the same clock, and when the engine
is idle the clock jumps to the next arrival. Same workload and same ``StepCost`` → the same
timestamps, on every machine and every run; the replay runs as fast as the model computes.
``calibrate`` measures the two constants of this machine from a few real steps, so a replay
can also be made to stand for it.

    cost = StepCost(overhead=0.005, per_token=0.0002)   # 5 ms + 0.2 ms per token
    outputs = virtual_replay(engine, workload, cost)     # metrics in simulated seconds

What the model leaves out: attention's cost growing with the context, and the noise of a real
machine; the step *decisions* (who runs, how many tokens) are the engine's own.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np
import torch

from minillm.outputs import RequestOutput
from minillm.runtime.runner import StepInputs
from minillm.sampling import SamplingParams
from minillm.workloads import WorkloadRequest


@dataclass(frozen=True)
class StepCost:
    """Seconds one engine step takes: ``overhead + per_token × tokens`` in the step."""

    overhead: float  # per step, whatever its size (weights read once, kernel launches)
    per_token: float  # per token run in the step (a prefill token or a decode token alike)

    def __post_init__(self) -> None:
        for name in ("overhead", "per_token"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"StepCost.{name}={value!r} must be a finite number of seconds >= 0")
        if self.overhead == 0 and self.per_token == 0:
            raise ValueError("StepCost needs overhead > 0 or per_token > 0: steps that take no time never end")

    def __call__(self, num_tokens: int) -> float:
        return self.overhead + self.per_token * num_tokens

    def __str__(self) -> str:
        return f"{1000 * self.overhead:.2f} ms + {1000 * self.per_token:.3f} ms per token"


class VirtualClock:
    """A clock that moves only when told: ``clock()`` is the current simulated time (seconds)."""

    def __init__(self, start: float = 0.0):
        self.now = float(start)

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"a clock does not go back (advance by {seconds})")
        self.now += seconds

    def advance_to(self, time: float) -> None:
        self.now = max(self.now, time)


class TimedRunner:
    """A runner that takes simulated time: it runs the real runner, then moves the clock on by
    the step's modelled cost (so the tokens it produced are stamped at the step's end)."""

    def __init__(self, runner, clock: VirtualClock, cost: StepCost):
        self.runner, self.clock, self.cost = runner, clock, cost

    def execute(self, inputs: StepInputs) -> torch.Tensor:
        logits = self.runner.execute(inputs)
        self.clock.advance(self.cost(sum(c.num_tokens for c in inputs.chunks)))
        return logits

    def release(self, request_id: Hashable) -> None:
        self.runner.release(request_id)

    def keep_tree_branch(self, block_table: list[int], first: int, path: list[int]) -> None:
        self.runner.keep_tree_branch(block_table, first, path)

    @property
    def last_hidden(self):
        return self.runner.last_hidden


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
