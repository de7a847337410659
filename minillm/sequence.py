"""Per-request state: a ``Sequence`` is one request as the engine sees it.

Its token ids (prompt then output), its sampling parameters and random generator, its text
so far, and the timestamps metrics are computed from. What callers get back
(``RequestOutput``, ``StreamDelta``) lives in ``outputs.py``.

**Text off the step.** A request without stop strings needs no text to be decided: its stop
tokens and its length are token facts. So while ``hooks.append_token`` and
``hooks.take_stream_text`` are the package's own, the step only appends such a request's ids
(``_append_id``) and hands out ``DeferredDelta``s; the text is made when a delta (or the output)
is read — ``settle_deltas`` runs the same incremental detokenizer (``hooks.detokenize_step``,
chapter 10) and ``take_stream_text`` (chapter 01) delta by delta, in order, so every text is
exactly what the step would have made. A request with stop strings is detokenized on the step,
where a stop string must end it. With a learner's ``append_token`` or ``take_stream_text``
(chapter 01) the text is made on the step again, from the next token on.
"""

from __future__ import annotations

import enum
import threading
import time
import weakref
from collections import deque
from collections.abc import Hashable

import torch

import minillm.hooks as hooks
from minillm.outputs import DeferredDelta, RequestMetrics, RequestOutput, TokenLogprob
from minillm.sampling import SamplingParams
from minillm.tokenizer import IncrementalDetokenizer, Tokenizer

# Held while a deferred text is made: a reader in another thread (the server's event loop) and
# the engine's thread (an abort) never settle one sequence's deltas at once. One lock for every
# sequence (the work under it is short), so a Sequence stays copyable (course checks deep-copy them).
_TEXT_LOCK = threading.RLock()


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
        # Their parents when they form a tree (speculative/tree.py; -1: the sequence's last token,
        # parents before children); None: a chain.
        self.draft_parents: list[int] | None = None
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
        # Text off the step (module docstring): output tokens whose text belongs to the answer
        # (all but a final stop token), how many of them the detokenizer has taken, and the
        # deltas whose text is still to be made — weakly held: a delta its caller dropped unread
        # costs neither memory nor a text of its own (its text goes to the next delta read).
        self.deferred_text = not params.stop
        self.num_text_tokens = 0
        self.num_detokenized = 0
        self.pending_deltas: deque[weakref.ref[DeferredDelta]] = deque()
        self._flushed = False
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
        (``hooks.append_token``: chapter 01's exercise plugs in there). Without stop strings, and
        with the package's ``append_token``, the text waits (module docstring)."""
        now = time.perf_counter() if now is None else now
        self.metrics.token_times.append(now)
        if self.deferred_text and (hooks.append_token is not append_token or hooks.take_stream_text is not take_stream_text):
            self.settle_deltas()  # a learner's stopping code (chapter 01) makes the text itself from here on
            self.deferred_text = False
        reason = self._append_id(token_id) if self.deferred_text else hooks.append_token(self, token_id)
        if reason is not None:
            self._finish(reason, now)

    def _append_id(self, token_id: int) -> str | None:
        """``append_token`` without the text, for a request without stop strings: the same
        decisions in the same order (a stop token ends it without its text, then the length)."""
        out = self.output_token_ids
        out.append(token_id)
        params = self.params
        if token_id in params.stop_token_ids or (not params.ignore_eos and token_id in self.eos_token_ids):
            return "stop"
        self.num_text_tokens = len(out)
        if len(out) >= self.max_output:
            return "length"
        return None

    def append_tokens(self, token_ids: list[int], now: float | None = None) -> int:
        """Append several tokens produced in one step (e.g. accepted speculative tokens), up to
        the first that finishes the request; returns how many were appended."""
        for i, token_id in enumerate(token_ids):
            self.append_token(token_id, now)
            if self.is_finished:
                return i + 1
        return len(token_ids)

    def deferred_delta(self, token_ids: list[int], logprobs: list[TokenLogprob] | None) -> DeferredDelta:
        """The delta of this step's ``token_ids``, its text (and output) made when first read —
        by the ``detokenize_step`` in force now (chapter 10's, inside its ``hooks.override``), even
        if that is after the override has ended: the text the step would have made."""
        delta = DeferredDelta.pending(
            self, self.group_id, token_ids, self.finish_reason, self.index, logprobs, hooks.detokenize_step
        )
        pending = self.pending_deltas
        while pending and pending[0]() is None:  # dropped unread: nothing to make for them
            pending.popleft()
        pending.append(weakref.ref(delta))
        return delta

    def settle_deltas(self, through: DeferredDelta | None = None) -> None:
        """Make the text of the pending deltas, oldest first, through ``through`` (all: None):
        detokenize each one's tokens, then take what a stream may show of the text."""
        with _TEXT_LOCK:
            pending = self.pending_deltas
            while pending and (through is None or not through._ready):
                delta = pending.popleft()()
                if delta is None:
                    continue  # dropped unread (generate keeps only the last): its text goes to the next one read
                self._detokenize(delta._upto, delta._detokenize_step)
                delta._text = hooks.take_stream_text(self)
                delta._output = self._output() if delta._wants_output else None
                delta._ready, delta._seq, delta._detokenize_step = True, None, None  # a plain delta now
            if through is None:
                self._detokenize(len(self.output_token_ids))  # tokens no delta carries yet (an abort)

    def _detokenize(self, upto: int, step=None) -> None:
        """Feed the detokenizer the answer's tokens among the first ``upto`` output tokens
        (through ``step``, a ``detokenize_step``); once the request has finished and every token
        is in, flush what it still holds."""
        if not self.deferred_text:
            return
        end = min(upto, self.num_text_tokens)
        if self.num_detokenized < end:
            add, text = self.detokenizer.add, self.text
            for token_id in self.output_token_ids[self.num_detokenized : end]:
                text += add(token_id, step)
            self.text, self.num_detokenized = text, end
        if not self._flushed and self.status is SequenceStatus.FINISHED and upto >= len(self.output_token_ids):
            self.text += self.detokenizer.flush()
            self._flushed = True

    @property
    def sort_key(self) -> tuple:
        """Scheduling order: priority first, then arrival (FCFS), then id for a total order."""
        return (self.priority, self.metrics.arrival_time, self._order)

    def abort(self, now: float | None = None) -> None:
        with _TEXT_LOCK:
            self.settle_deltas()  # the deltas handed out so far keep their own text
            self._finish("abort", now)
            if self.deferred_text:
                self._detokenize(len(self.output_token_ids))
            else:
                self.text += self.detokenizer.flush()

    def _finish(self, reason: str, now: float | None = None) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.metrics.finished_time = time.perf_counter() if now is None else now

    def take_stream_text(self) -> str:
        """The text a stream may show now (``hooks.take_stream_text``), marked as shown."""
        return hooks.take_stream_text(self)

    def to_output(self) -> RequestOutput:
        """What the request has produced so far (its text made first, if it waits)."""
        with _TEXT_LOCK:
            if self.deferred_text:
                self.settle_deltas()
            return self._output()

    def _output(self) -> RequestOutput:
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
