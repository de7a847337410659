"""Seeded synthetic serving workloads, and a driver that replays one against an engine.

A serving benchmark needs requests that *arrive over time*: a batch that is all there at
t=0 hides everything interesting about scheduling. We model arrivals as a **Poisson
process** (independent users: exponential gaps with mean ``1/rate``), prompt and output
lengths drawn from distributions, and prompts made of random token ids (the model's output
quality is irrelevant to throughput; every output runs to its drawn length with
``ignore_eos``). ``shared_prefix_workload`` gives every request the same long system prompt,
the case prefix caching is made for.

Workloads are plain data: save them as JSONL, load them back, replay them identically.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from minillm.outputs import RequestOutput
from minillm.sampling import SamplingParams


@dataclass
class WorkloadRequest:
    request_id: str
    arrival_time: float  # seconds after the start of the run
    prompt_token_ids: list[int]
    max_tokens: int
    priority: int = 0

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(max_tokens=self.max_tokens, temperature=0.0, ignore_eos=True)


@dataclass
class Lengths:
    """A length distribution: ``uniform`` integers in ``[low, high]``, or ``lognormal`` (a long
    tail, like real chat traffic) with median ``sqrt(low*high)``, clipped to ``[low, high]``."""

    low: int
    high: int
    kind: str = "uniform"

    def __post_init__(self) -> None:
        if not 1 <= self.low <= self.high:
            raise ValueError(f"lengths need 1 <= low <= high, got low={self.low}, high={self.high}")
        if self.kind not in ("uniform", "lognormal"):
            raise ValueError(f"length distribution kind={self.kind!r}; expected 'uniform' or 'lognormal'")

    def sample(self, rng: np.random.Generator, n: int) -> list[int]:
        if self.kind == "uniform":
            return rng.integers(self.low, self.high + 1, size=n).tolist()
        median = np.sqrt(self.low * self.high)
        sigma = np.log(self.high / self.low) / 4  # ~95% of draws inside [low, high] before clipping
        return np.clip(np.rint(rng.lognormal(np.log(median), sigma, size=n)), self.low, self.high).astype(int).tolist()


def _as_lengths(value: Lengths | tuple[int, int] | int) -> Lengths:
    if isinstance(value, Lengths):
        return value
    if isinstance(value, int):
        return Lengths(value, value)
    return Lengths(*value)


def _arrivals(rng: np.random.Generator, n: int, rate: float | None) -> list[float]:
    """Poisson arrivals at ``rate`` requests/s; ``rate=None`` means everyone at t=0 (offline)."""
    if rate is None:
        return [0.0] * n
    if rate <= 0:
        raise ValueError(f"arrival rate={rate} must be > 0 requests/s (or None for all at once)")
    return np.cumsum(rng.exponential(1.0 / rate, size=n)).tolist()


def _random_tokens(rng: np.random.Generator, n: int, vocab_size: int, first_token: int) -> list[int]:
    return rng.integers(first_token, vocab_size, size=n).tolist()


def poisson_workload(
    num_requests: int,
    rate: float | None,
    prompt_lengths: Lengths | tuple[int, int] | int = (16, 512),
    output_lengths: Lengths | tuple[int, int] | int = (16, 256),
    vocab_size: int = 49152,
    seed: int = 0,
    first_token: int = 256,
) -> list[WorkloadRequest]:
    """``num_requests`` requests arriving at ``rate``/s with random prompts of the given lengths.

    Token ids are drawn from ``[first_token, vocab_size)`` to stay clear of special tokens.
    """
    if num_requests < 1:
        raise ValueError(f"num_requests={num_requests} must be >= 1")
    rng = np.random.default_rng(seed)
    arrivals = _arrivals(rng, num_requests, rate)
    prompts = _as_lengths(prompt_lengths).sample(rng, num_requests)
    outputs = _as_lengths(output_lengths).sample(rng, num_requests)
    return [
        WorkloadRequest(f"req-{i}", arrivals[i], _random_tokens(rng, prompts[i], vocab_size, first_token), outputs[i])
        for i in range(num_requests)
    ]


def shared_prefix_workload(
    num_requests: int,
    rate: float | None,
    prefix_length: int = 384,
    suffix_lengths: Lengths | tuple[int, int] | int = (16, 64),
    output_lengths: Lengths | tuple[int, int] | int = (16, 64),
    vocab_size: int = 49152,
    seed: int = 0,
    first_token: int = 256,
) -> list[WorkloadRequest]:
    """Every prompt = one shared ``prefix_length``-token "system prompt" + its own question."""
    rng = np.random.default_rng(seed)
    prefix = _random_tokens(rng, prefix_length, vocab_size, first_token)
    arrivals = _arrivals(rng, num_requests, rate)
    suffixes = _as_lengths(suffix_lengths).sample(rng, num_requests)
    outputs = _as_lengths(output_lengths).sample(rng, num_requests)
    return [
        WorkloadRequest(
            f"req-{i}", arrivals[i], prefix + _random_tokens(rng, suffixes[i], vocab_size, first_token), outputs[i]
        )
        for i in range(num_requests)
    ]


def save_jsonl(requests: Iterable[WorkloadRequest], path: str | Path) -> None:
    with open(path, "w") as f:
        for r in requests:
            f.write(json.dumps(asdict(r)) + "\n")


def load_jsonl(path: str | Path) -> list[WorkloadRequest]:
    requests = []
    with open(path) as f:
        for line_number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                requests.append(WorkloadRequest(**json.loads(line)))
            except (json.JSONDecodeError, TypeError) as err:
                raise ValueError(f"{path}:{line_number}: not a workload request ({err})") from None
    return requests


def replay(engine, requests: list[WorkloadRequest], realtime: bool = True) -> list[RequestOutput]:
    """Feed ``requests`` to an ``LLMEngine`` at their arrival times while it steps; return the
    outputs in the order of ``requests``.

    Each request is added with its *scheduled* arrival time, so time spent waiting for the
    driver (which adds requests between steps) counts as queueing, as it would for a user.
    ``realtime=False`` adds everything at once (an offline batch with the same requests).
    """
    pending = sorted(requests, key=lambda r: r.arrival_time)
    outputs: dict[str, RequestOutput] = {}
    start = time.perf_counter()
    i = 0
    while i < len(pending) or engine.has_unfinished_requests():
        now = time.perf_counter() - start
        while i < len(pending) and (not realtime or pending[i].arrival_time <= now):
            r = pending[i]
            arrival = start + (r.arrival_time if realtime else 0.0)
            engine.add_request(
                r.prompt_token_ids,
                r.sampling_params(),
                request_id=r.request_id,
                arrival_time=arrival,
                priority=r.priority,
            )
            i += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, pending[i].arrival_time - (time.perf_counter() - start)))
            continue
        steps_before = engine.num_steps
        for delta in engine.step():
            if delta.output is not None:
                outputs[delta.request_id] = delta.output
        if engine.num_steps == steps_before:
            time.sleep(0.001)  # nothing could run (a dynamic batch filling up): don't spin
    return [outputs[r.request_id] for r in requests]
