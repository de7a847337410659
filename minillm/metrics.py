"""Run reports: what a serving run achieved, in the numbers serving papers use.

Per request (from ``RequestMetrics``): TTFT (arrival → first token: queueing + prefill), TPOT
(mean gap between later tokens), end-to-end latency, queueing time. Per run: throughput
(output tokens/s, requests/s), latency percentiles (p50/p95/p99 — tails matter more than
means to a user), **goodput** (requests per second that met a latency SLO: throughput that
counts only satisfied users) and, from the engine's step records, KV blocks over time,
preemptions and decode stalls.
"""

from __future__ import annotations

import statistics
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field

import numpy as np

from minillm.outputs import RequestOutput


@dataclass
class StepPhases:
    """Where one step's wall time went, in seconds, by the engine's own ``perf_counter`` stamps.

    Why keep this per step: with a small model on a big accelerator (or a tiny one on a CPU) the
    engine's own Python work — choosing who runs, building the inputs, appending tokens — can
    cost more than the forward pass, and only a split like this one shows it (chapter 04's
    breakdown, ``benchmarks/bench_step_overhead.py``)."""

    schedule: float = 0.0  # speculative proposals and the scheduler's decision
    inputs: float = 0.0  # the step as plain data, then the runner's tensors (token ids, slots, tables)
    model: float = 0.0  # the forward pass (with copy-on-write copies): logits
    sample: float = 0.0  # tokens chosen from the logits (and logprobs)
    output: float = 0.0  # tokens appended: detokenized, stop checks, deltas, blocks committed and freed

    @property
    def total(self) -> float:
        return self.schedule + self.inputs + self.model + self.sample + self.output

    @property
    def host(self) -> float:
        """Everything but the forward pass: the engine's own work."""
        return self.total - self.model


PHASE_NAMES = ("schedule", "inputs", "model", "sample", "output")


def median_phases(records: Iterable[StepRecord]) -> StepPhases:
    """Each phase's median over ``records`` that kept their phases: a typical step's split
    (a median, so the odd step a busy machine stretched does not set it)."""
    kept = [r.phases for r in records if r.phases is not None]
    if not kept:
        raise ValueError("no step record holds its phases (max_step_records=0, or no step ran the model)")
    return StepPhases(**{name: statistics.median(getattr(p, name) for p in kept) for name in PHASE_NAMES})


@dataclass
class StepRecord:
    """What one engine step did (``engine.step_records`` keeps the most recent ones). The pool
    fields are None for the naive and contiguous rungs, which have no paged pool."""

    index: int
    start: float
    end: float
    chunks: list[tuple[Hashable, int, int, bool]]  # (request id, start position, tokens, is decode)
    preempted: list[Hashable]
    num_running: int
    num_waiting: int
    blocks_used: int | None
    blocks_cached: int | None
    blocks_free: int | None
    tokens_stored: int | None  # tokens in the cache of running requests (a shared prefix counted per request)
    reserved_slots: int | None  # slots in referenced blocks (a shared block counted once)
    wasted_slots: int | None  # reserved but unused slots in referenced blocks
    contiguous_reserved_slots: int  # what a max_model_len-per-request contiguous cache would reserve
    block_tables: dict[Hashable, list[int]] | None = None  # when engine.record_block_tables
    block_hashes: list[bool] | None = None  # which blocks are registered in the prefix cache
    block_refs: list[int] | None = None
    phases: StepPhases | None = None  # where the step's time went (``StepPhases``)

    @property
    def duration(self) -> float:
        return self.end - self.start

    @property
    def num_prefill_tokens(self) -> int:
        return sum(n for _, _, n, decode in self.chunks if not decode)

    @property
    def num_decode_tokens(self) -> int:
        return sum(n for _, _, n, decode in self.chunks if decode)


def percentiles(values: Iterable[float], qs=(50, 95, 99)) -> dict[str, float]:
    values = [v for v in values if v is not None]
    if not values:
        return {f"p{q}": float("nan") for q in qs} | {"mean": float("nan")}
    arr = np.asarray(values, dtype=float)
    return {"mean": float(arr.mean())} | {f"p{q}": float(np.percentile(arr, q)) for q in qs}


@dataclass
class SLO:
    """A latency objective per request: first token within ``ttft`` s, then ``tpot`` s per token."""

    ttft: float = 1.0
    tpot: float = 0.2

    def met_by(self, out: RequestOutput) -> bool:
        m = out.metrics
        if m.ttft is None or m.ttft > self.ttft:
            return False
        return m.tpot is None or m.tpot <= self.tpot


@dataclass
class RunReport:
    num_requests: int
    duration: float  # first arrival → last finish, seconds
    prompt_tokens: int
    output_tokens: int
    ttft: dict[str, float]
    tpot: dict[str, float]
    e2e_latency: dict[str, float]
    queueing_time: dict[str, float]
    inter_token_latency: dict[str, float]
    max_inter_token_latency: float
    slo: SLO
    slo_attainment: float  # fraction of requests meeting the SLO
    num_preemptions: int
    prefix_cached_tokens: int
    blocks_over_time: list[tuple[float, int]] = field(default_factory=list)  # (seconds since start, blocks used)
    mean_kv_waste: float | None = None  # paged: wasted / reserved slots, averaged over steps
    mean_contiguous_waste: float | None = None  # the same for a max-length contiguous reservation
    memory: dict[str, int | None] | None = None  # engine.memory_report(): weights, KV pool, (CUDA) peak
    # Speculative decoding, over every request: proposals made and accepted, verify steps, and
    # the target forward passes that produced output tokens.
    spec_proposed: int = 0
    spec_accepted: int = 0
    verify_steps: int = 0
    forward_passes: int = 0

    @property
    def acceptance_rate(self) -> float | None:
        return self.spec_accepted / self.spec_proposed if self.spec_proposed else None

    @property
    def mean_accepted_length(self) -> float | None:
        return self.spec_accepted / self.verify_steps if self.verify_steps else None

    @property
    def forward_passes_per_token(self) -> float | None:
        return self.forward_passes / self.output_tokens if self.output_tokens else None

    @property
    def output_throughput(self) -> float:
        return self.output_tokens / self.duration if self.duration > 0 else float("nan")

    @property
    def request_throughput(self) -> float:
        return self.num_requests / self.duration if self.duration > 0 else float("nan")

    @property
    def goodput(self) -> float:
        """Requests per second that met the SLO."""
        return self.slo_attainment * self.request_throughput

    def summary(self) -> dict[str, float]:
        """The headline figures, flat, for tables and JSON."""
        return {
            "requests": self.num_requests,
            "duration_s": self.duration,
            "output_tok_per_s": self.output_throughput,
            "req_per_s": self.request_throughput,
            "ttft_mean_s": self.ttft["mean"],
            "ttft_p50_s": self.ttft["p50"],
            "ttft_p95_s": self.ttft["p95"],
            "ttft_p99_s": self.ttft["p99"],
            "tpot_p50_s": self.tpot["p50"],
            "tpot_p99_s": self.tpot["p99"],
            "e2e_p50_s": self.e2e_latency["p50"],
            "e2e_p99_s": self.e2e_latency["p99"],
            "queueing_mean_s": self.queueing_time["mean"],
            "itl_max_s": self.max_inter_token_latency,
            "slo_attainment": self.slo_attainment,
            "goodput_req_per_s": self.goodput,
            "preemptions": self.num_preemptions,
            "prefix_cached_tokens": self.prefix_cached_tokens,
            "kv_waste_paged": self.mean_kv_waste,
            "kv_waste_contiguous": self.mean_contiguous_waste,
            "spec_acceptance_rate": self.acceptance_rate,
            "spec_mean_accepted_length": self.mean_accepted_length,
            "forward_passes_per_token": self.forward_passes_per_token,
        } | {f"memory_{k}": v for k, v in (self.memory or {}).items()}


def run_report(
    outputs: list[RequestOutput],
    step_records: list[StepRecord] | None = None,
    slo: SLO | None = None,
    memory: dict[str, int | None] | None = None,
) -> RunReport:
    """Summarise finished requests (and, for the paged engine, its step records and
    ``engine.memory_report()``)."""
    if not outputs:
        raise ValueError("run_report needs at least one finished request")
    slo = slo or SLO()
    start = min(o.metrics.arrival_time for o in outputs)
    end = max(o.metrics.finished_time or o.metrics.arrival_time for o in outputs)
    gaps = [g for o in outputs for g in o.metrics.inter_token_latencies]
    records = step_records or []
    records = [r for r in records if r.blocks_used is not None]  # steps of a paged pool only
    waste = [r.wasted_slots / r.reserved_slots for r in records if r.reserved_slots]
    contiguous = [1 - r.tokens_stored / r.contiguous_reserved_slots for r in records if r.contiguous_reserved_slots]
    return RunReport(
        num_requests=len(outputs),
        duration=end - start,
        prompt_tokens=sum(len(o.prompt_token_ids) for o in outputs),
        output_tokens=sum(len(o.token_ids) for o in outputs),
        ttft=percentiles(o.metrics.ttft for o in outputs),
        tpot=percentiles(o.metrics.tpot for o in outputs),
        e2e_latency=percentiles(o.metrics.e2e_latency for o in outputs),
        queueing_time=percentiles(o.metrics.queueing_time for o in outputs),
        inter_token_latency=percentiles(gaps),
        max_inter_token_latency=max(gaps, default=float("nan")),
        slo=slo,
        slo_attainment=statistics.fmean(slo.met_by(o) for o in outputs),
        num_preemptions=sum(o.num_preemptions for o in outputs),
        prefix_cached_tokens=sum(o.num_cached_tokens for o in outputs),
        blocks_over_time=[(r.end - start, r.blocks_used) for r in records],
        mean_kv_waste=statistics.fmean(waste) if waste else None,
        mean_contiguous_waste=statistics.fmean(contiguous) if contiguous else None,
        memory=memory,
        spec_proposed=sum(o.metrics.spec_proposed for o in outputs),
        spec_accepted=sum(o.metrics.spec_accepted for o in outputs),
        verify_steps=sum(o.metrics.num_verify_steps for o in outputs),
        forward_passes=sum(o.metrics.num_forward_passes for o in outputs),
    )
