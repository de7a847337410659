"""What the engine hands back to callers: finished requests, streamed tokens, their timings.

These are plain data, free of the engine's internals, so a caller — a notebook, a benchmark,
the HTTP server — can hold, compare and serialise them without touching a ``Sequence``.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field


@dataclass
class RequestMetrics:
    """Timestamps (``time.perf_counter()`` seconds) and the latencies derived from them.

    TTFT (time to first token) = first token − arrival: queueing plus prefill.
    TPOT (time per output token) = mean gap between later tokens: the decode speed a reader feels.
    """

    arrival_time: float
    first_scheduled_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished_time: float | None = None
    # Speculative decoding: target forward passes that produced tokens for this request, and
    # the proposals made / accepted over its verify steps.
    num_forward_passes: int = 0
    num_verify_steps: int = 0
    spec_proposed: int = 0
    spec_accepted: int = 0

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted / proposed tokens (None: nothing was proposed)."""
        return self.spec_accepted / self.spec_proposed if self.spec_proposed else None

    @property
    def mean_accepted_length(self) -> float | None:
        """Proposals accepted per verify step (each step also emits one token of the target's own)."""
        return self.spec_accepted / self.num_verify_steps if self.num_verify_steps else None

    @property
    def forward_passes_per_token(self) -> float | None:
        """Target forward passes per output token: 1 without speculation, lower with it."""
        return self.num_forward_passes / len(self.token_times) if self.token_times else None

    @property
    def first_token_time(self) -> float | None:
        return self.token_times[0] if self.token_times else None

    @property
    def ttft(self) -> float | None:
        return None if not self.token_times else self.token_times[0] - self.arrival_time

    @property
    def queueing_time(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def inter_token_latencies(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def tpot(self) -> float | None:
        gaps = self.inter_token_latencies
        return statistics.fmean(gaps) if gaps else None

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time

    def as_dict(self) -> dict[str, float | None]:
        return {
            "arrival_time": self.arrival_time,
            "ttft": self.ttft,
            "tpot": self.tpot,
            "e2e_latency": self.e2e_latency,
            "queueing_time": self.queueing_time,
            "num_tokens": len(self.token_times),
            "forward_passes_per_token": self.forward_passes_per_token,
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
        }


@dataclass
class TokenLogprob:
    """One output token's log-probability and (``SamplingParams.logprobs = k``) the ``k`` most
    likely tokens at its position, ``(token_id, logprob)`` sorted by logprob descending.

    Log-probabilities are ``log_softmax`` of the model's raw logits in fp32 — before repetition
    penalty, temperature, top-k/top-p/min-p — as vLLM returns by default and OpenAI clients
    expect: they describe the model, not the sampler's reshaped distribution.
    """

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass(frozen=True)
class SampleId:
    """The engine's internal key of sample ``index >= 1`` of a request with ``n > 1``.

    Sample 0 keeps the request's own id. A dedicated type (not a tuple) cannot clash with an id a
    caller chose. Callers never need it: outputs and deltas carry the request's id and ``index``;
    it shows up only in scheduler/step-record internals (block tables, ``StepRecord.chunks``).
    """

    request_id: Hashable
    index: int


@dataclass
class RequestOutput:
    """One sample of a request, or (``LLM.generate``) the request.

    ``index`` is the sample's number, 0..n-1 (``SamplingParams.n``); every sample of a request
    has the request's ``request_id``. ``samples``: filled by ``LLM.generate`` (and
    ``LLMEngine.request_output``) for ``n > 1`` only — all n samples in index order, each a
    plain ``RequestOutput`` with empty ``samples``; this output's own fields are sample 0's
    (``samples[0]`` repeats them). ``logprobs``: one ``TokenLogprob`` per entry of
    ``token_ids`` when ``SamplingParams.logprobs`` is set, else None.
    """

    request_id: Hashable
    prompt: str
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    metrics: RequestMetrics
    num_cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache
    num_preemptions: int = 0
    index: int = 0
    logprobs: list[TokenLogprob] | None = None
    samples: list[RequestOutput] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class StreamDelta:
    """What ``LLM.stream`` yields: the token(s) just produced and the text they made visible
    (one token per step, or several when speculative decoding accepted proposals).

    ``text`` may be empty (half a UTF-8 character, or text held back because it could be the
    start of a stop string) and is released by a later delta. The last delta has
    ``finish_reason`` set.

    With ``SamplingParams.n > 1`` the deltas of all n samples share ``request_id`` and differ
    by ``index``; each sample's last delta has ``finish_reason`` (and its own ``output``), and
    the request is over at the delta with ``request_finished`` — exactly one per request, the
    last (for ``n = 1`` the one with ``finish_reason``). ``logprobs`` is aligned with
    ``token_ids`` when the request asked for them.
    """

    request_id: Hashable
    token_id: int | None  # the last token of this delta
    text: str
    finish_reason: str | None = None
    output: RequestOutput | None = None  # the complete result, on the last delta of a request
    token_ids: list[int] = field(default_factory=list)  # every token of this delta (several after a verify step)
    index: int = 0  # which sample of the request (SamplingParams.n)
    logprobs: list[TokenLogprob] | None = None  # one per token_ids entry, if requested
    request_finished: bool = False  # the request's last delta: every sample has finished


class DeferredDelta(StreamDelta):
    """A ``StreamDelta`` whose ``text`` (and, on a sample's last delta, ``output``) is made
    when first read, by its sequence's ``settle_deltas`` — detokenization off the step.

    The step that produced the tokens only appends ids; the text is made by whoever reads it —
    ``LLM.stream``'s caller, the HTTP server's event loop while the engine's thread runs the next
    step (as vLLM V1's front end detokenizes apart from its engine core) — or never, when nobody
    reads it. A sequence's deltas are settled in order, each exactly once, whichever is read
    first, so every delta's text is what it would have been on the step. Once settled it is a
    plain ``StreamDelta``."""

    _ready = True  # one built by the dataclass __init__ (dataclasses.replace) is plain from the start

    @classmethod
    def pending(cls, seq, request_id: Hashable, token_ids: list[int], finish_reason: str | None, index: int,
                logprobs: list[TokenLogprob] | None, detokenize_step: Callable) -> DeferredDelta:  # fmt: skip
        """A delta of ``seq`` to be settled later (built field by field: one is made per running
        request per step, so it skips the dataclass ``__init__`` and its property setters)."""
        delta = object.__new__(cls)
        delta.__dict__ = {
            "request_id": request_id, "token_id": token_ids[-1], "_text": "", "finish_reason": finish_reason,
            "_output": None, "token_ids": token_ids, "index": index, "logprobs": logprobs,
            "request_finished": False, "_ready": False, "_seq": seq, "_upto": len(seq.output_token_ids),
            "_wants_output": finish_reason is not None, "_detokenize_step": detokenize_step,
        }  # fmt: skip
        return delta

    @property
    def text(self) -> str:
        if not self._ready:
            self._seq.settle_deltas(self)
        return self._text

    @text.setter
    def text(self, value: str) -> None:
        self._text = value

    @property
    def output(self) -> RequestOutput | None:
        if not self._ready:
            self._seq.settle_deltas(self)
        return self._output

    @output.setter
    def output(self, value: RequestOutput | None) -> None:
        self._output = value

    def __reduce__(self):  # pickled or deep-copied as the plain delta it settles to
        return StreamDelta, (self.request_id, self.token_id, self.text, self.finish_reason, self.output,
                             self.token_ids, self.index, self.logprobs, self.request_finished)  # fmt: skip
