"""Per-request state: a ``Sequence`` is one request as the engine sees it.

Its token ids (prompt then output), its sampling parameters and random generator, its text
so far, and the timestamps metrics are computed from. What callers get back
(``RequestOutput``, ``StreamDelta``) lives in ``outputs.py``.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Hashable

import torch

import minillm.hooks as hooks
from minillm.outputs import RequestMetrics, RequestOutput, TokenLogprob
from minillm.sampling import SamplingParams
from minillm.tokenizer import IncrementalDetokenizer, Tokenizer


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again: its blocks were taken, it will be recomputed
    FINISHED = "finished"


class Sequence:
    """One request, or one sample of a request with ``SamplingParams.n > 1``.

    Such a request starts as one sequence (sample 0, holding the request's id) that prefills the
    prompt once. When its first logits come, the engine draws all n first tokens from them and
    forks samples ``1..n-1`` (``request_id = SampleId(id, i)``, ``group_id = id``), sharing the
    prompt's KV blocks copy-on-write; from then on every sample is an ordinary sequence that
    decodes, is preempted and finishes on its own. Sample 0 keeps the group: ``samples`` (all of
    them, index order) and, until the fork, ``pending_generators`` (the others' generators).
    """

    _counter = 0  # creation order, the last tie-breaker between equal priority and arrival

    def __init__(
        self,
        request_id: int,
        prompt: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        tokenizer: Tokenizer,
        generator: torch.Generator,
        max_model_len: int,
        arrival_time: float | None = None,
        priority: int = 0,
    ):
        self.request_id = request_id  # the engine's key for this sequence (blocks, runner, speculator)
        self.group_id: Hashable = request_id  # the request's id, what callers see (differs for samples >= 1)
        self.index = 0  # sample number within the request
        self.samples: list[Sequence] = [self]  # sample 0: every sample of the request, once forked
        self.pending_generators: list[torch.Generator] = []  # sample 0 before its fork: samples 1..n-1's
        self.priority = priority  # lower runs first; ties go to the earlier arrival (FCFS)
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache (paged engine)
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache when first scheduled
        self.num_preemptions = 0
        self.draft_tokens: list[int] = []  # speculative proposals for this step (set by the engine)
        Sequence._counter += 1
        self._order = Sequence._counter
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.params = params
        self.generator = generator
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.metrics = RequestMetrics(arrival_time=time.perf_counter() if arrival_time is None else arrival_time)
        self.text = ""
        self.logprobs: list[TokenLogprob] | None = None if params.logprobs is None else []
        self.num_emitted_chars = 0  # characters of `text` already handed to a stream
        self.detokenizer = IncrementalDetokenizer(tokenizer)
        self.eos_token_ids = tokenizer.eos_token_ids  # a request ends at one unless params.ignore_eos
        # A request never outgrows the context: it stops with "length" at max_model_len.
        self.max_output = min(params.max_tokens, max_model_len - len(self.prompt_token_ids))

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def tokens(self, start: int, end: int) -> list[int]:
        """``token_ids[start:end]`` without building the whole list (a decode step needs one token)."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    def __len__(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_decoding(self) -> bool:
        """Past its prompt: one new token to run per step."""
        return len(self) - self.num_computed_tokens == 1

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def request_finished(self) -> bool:
        """(Sample 0) every sample of the request has finished. The fork happens in the step
        of sample 0's first token, so a finished sample 0 without its siblings was aborted."""
        return all(s.is_finished for s in self.samples)

    @property
    def fan_out(self) -> int:
        """Running sequences this one becomes: n before its first token (it will fork), else 1."""
        return 1 if self.output_token_ids else self.params.n

    def append_token(self, token_id: int, now: float | None = None) -> None:
        """Record a generated token, update the text, and decide whether the request is done
        (``hooks.append_token``: chapter 01's exercise plugs in there)."""
        now = time.perf_counter() if now is None else now
        self.metrics.token_times.append(now)
        reason = hooks.append_token(self, token_id)
        if reason is not None:
            self._finish(reason, now)

    def append_tokens(self, token_ids: list[int], now: float | None = None) -> int:
        """Append several tokens produced in one step (e.g. accepted speculative tokens), up to
        the first that finishes the request; returns how many were appended."""
        for i, token_id in enumerate(token_ids):
            self.append_token(token_id, now)
            if self.is_finished:
                return i + 1
        return len(token_ids)

    @property
    def sort_key(self) -> tuple:
        """Scheduling order: priority first, then arrival (FCFS), then id for a total order."""
        return (self.priority, self.metrics.arrival_time, self._order)

    def abort(self, now: float | None = None) -> None:
        self.text += self.detokenizer.flush()
        self._finish("abort", now)

    def _finish(self, reason: str, now: float | None = None) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.metrics.finished_time = time.perf_counter() if now is None else now

    def take_stream_text(self) -> str:
        """The text a stream may show now (``hooks.take_stream_text``), marked as shown."""
        return hooks.take_stream_text(self)

    def to_output(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.group_id,
            prompt=self.prompt,
            prompt_token_ids=list(self.prompt_token_ids),
            text=self.text,
            token_ids=list(self.output_token_ids),
            finish_reason=self.finish_reason,
            metrics=self.metrics,
            num_cached_tokens=self.num_cached_tokens,
            num_preemptions=self.num_preemptions,
            index=self.index,
            logprobs=None if self.logprobs is None else list(self.logprobs),
        )


@hooks.reference("append_token")
def append_token(seq: Sequence, token_id: int) -> str | None:
    """Append ``token_id`` to ``seq``, its text to ``seq.text``, and say whether the request ends:
    ``"stop"``, ``"length"`` or ``None``.

    Why in this order: a stop token (one of ``params.stop_token_ids``, or an EOS id unless
    ``params.ignore_eos``) ends the request *without* its text — a chat model's end-of-turn marker
    is not part of the answer — but whatever the detokenizer still holds is flushed. Otherwise the
    token's text is added and the stop strings searched; a match ends the request and the text is
    cut *before* the earliest match (OpenAI's and vLLM's ``stop``: the stop string is not returned).
    Only a match that ends in the new text can be new (an older one would have stopped the request
    already), so the search starts just far enough back for the longest stop string to end in it:
    a step costs the same at token 10 and at token 10,000. Last, the length: ``seq.max_output`` is
    ``max_tokens`` or whatever room the context has left, whichever is smaller.
    """
    seq.output_token_ids.append(token_id)
    params = seq.params
    if token_id in params.stop_token_ids or (not params.ignore_eos and token_id in seq.eos_token_ids):
        seq.text += seq.detokenizer.flush()
        return "stop"
    text_before = len(seq.text)
    seq.text += seq.detokenizer.add(token_id)
    if params.stop:
        longest = max(len(s) for s in params.stop)
        search_from = max(0, text_before - longest + 1)
        hits = [i for s in params.stop if (i := seq.text.find(s, search_from)) != -1]
        if hits:
            seq.text = seq.text[: min(hits)]
            return "stop"
    if len(seq.output_token_ids) >= seq.max_output:
        seq.text += seq.detokenizer.flush()
        return "length"
    return None


@hooks.reference("take_stream_text")
def take_stream_text(seq: Sequence) -> str:
    """The text a stream may show now, marked as shown (``seq.num_emitted_chars``).

    Why hold anything back: while a request runs, the last ``len(longest stop string) - 1``
    characters may be the start of a stop string that the next token completes — and a stop
    string is never shown. Once finished (its text already cut), everything left is shown. The
    end never moves back (early on the text may be shorter than what is held)."""
    running_with_stops = not seq.is_finished and seq.params.stop
    hold = max(len(s) for s in seq.params.stop) - 1 if running_with_stops else 0
    end = max(seq.num_emitted_chars, len(seq.text) - hold)
    delta = seq.text[seq.num_emitted_chars : end]
    seq.num_emitted_chars = end
    return delta
