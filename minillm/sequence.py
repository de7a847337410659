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
        self._emitted = 0  # characters of `text` already handed to a stream
        self._detok = IncrementalDetokenizer(tokenizer)
        self._stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            self._stop_ids |= tokenizer.eos_token_ids
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
        """Record a generated token, update the text, and decide whether the request is done."""
        self.output_token_ids.append(token_id)
        now = time.perf_counter() if now is None else now
        self.metrics.token_times.append(now)
        if token_id in self._stop_ids:
            self.text += self._detok.flush()
            self._finish("stop", now)
            return
        text_before = len(self.text)
        self.text += self._detok.add(token_id)
        if self.params.stop and self._cut_at_stop_string(text_before):
            self._finish("stop", now)
        elif len(self.output_token_ids) >= self.max_output:
            self.text += self._detok.flush()
            self._finish("length", now)

    def append_tokens(self, token_ids: list[int], now: float | None = None) -> int:
        """Append several tokens produced in one step (e.g. accepted speculative tokens), up to
        the first that finishes the request; returns how many were appended."""
        for i, token_id in enumerate(token_ids):
            self.append_token(token_id, now)
            if self.is_finished:
                return i + 1
        return len(token_ids)

    def _cut_at_stop_string(self, text_before: int) -> bool:
        longest = max(len(s) for s in self.params.stop)
        # Only a match that ends in the new text can be new; start just far enough back.
        search_from = max(0, text_before - longest + 1)
        hits = [i for s in self.params.stop if (i := self.text.find(s, search_from)) != -1]
        if hits:
            self.text = self.text[: min(hits)]
            return True
        return False

    @property
    def sort_key(self) -> tuple:
        """Scheduling order: priority first, then arrival (FCFS), then id for a total order."""
        return (self.priority, self.metrics.arrival_time, self._order)

    def abort(self, now: float | None = None) -> None:
        self.text += self._detok.flush()
        self._finish("abort", now)

    def _finish(self, reason: str, now: float | None = None) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.metrics.finished_time = time.perf_counter() if now is None else now

    def take_stream_text(self) -> str:
        """Text that is safe to show now: all of it once finished, otherwise all but a tail
        that might still grow into a stop string."""
        hold = 0 if self.is_finished or not self.params.stop else max(len(s) for s in self.params.stop) - 1
        end = max(self._emitted, len(self.text) - hold)
        delta = self.text[self._emitted : end]
        self._emitted = end
        return delta

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
