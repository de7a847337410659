"""Serving replays on a virtual clock: the real scheduler and model, simulated time.

Why: a wall-clock replay (``tools/workloads.py``'s ``replay``) measures the machine as much as the policy.
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

This module holds the engine's side — the cost model, the clock, the timed runner that
``LLMEngine.simulated_time`` swaps in; the replay loop and ``calibrate`` are tooling around
the engine and live in ``tools/replay.py``.

What the model leaves out: attention's cost growing with the context, and the noise of a real
machine; the step *decisions* (who runs, how many tokens) are the engine's own.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass

import torch

from minillm.runtime.runner import StepInputs


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
