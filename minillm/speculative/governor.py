"""Speculation that pays for itself: how many tokens to propose, measured on the engine's own steps.

Speculating costs every step something — the proposer's time, and ``k`` more rows per sequence
in the target's pass — and pays only in the tokens the target accepts. At batch 1 a decode step
is bound by reading the weights, so the extra rows are nearly free; at batch 4 or 8 they are not,
and an EAGLE head whose late guesses are rarely right made a ``k = 4`` engine decode chat at
0.47× the plain engine (`docs/benchmarks.md`, "Speculative decoding"). Whether it pays depends
on the machine, the model, the proposer, the text and the batch, so the governor measures it
rather than predicting it:

- For each batch size — by powers of two: 1, 2-3, 4-7, 8-15, ... decoding sequences — it keeps,
  for each candidate number of proposals (0, that is plain decoding; 1, 2, 4, ... up to the
  configured ``k``), the tokens a pure decode step that used it emitted and the time it took:
  each a plain mean over its first ``1 / SMOOTHING`` steps, then a moving average, so the
  estimate follows the text and the load; the candidate's rate is their ratio. One step's
  tokens swing with how many proposals it happened to accept (at batch 1 with an EAGLE tree,
  by ±50 tok/s around 120): a moving average of weight 0.25 from the first step let one lucky
  step crown a worse candidate for a while.
- Where the proposer can tell what kind of text a step decodes before it proposes, each kind is
  measured apart: prompt lookup tells text being copied — a sequence's last 3 tokens or more
  occur earlier — from free text (``ngram.kind_of_text``), at batch 1; an EAGLE tree engine with
  prompt lookup's branch, whose copying sequences get prompt lookup's chain instead of a tree,
  at every batch size. Copying pays for many guesses and free text for few or none; measured
  together, the choice learnt on one was carried into the other (``ngram.kind_of_text`` has the
  figures). A step in which prompt lookup matches nothing at all proposes nothing and is no
  evidence. A draft model or chain-drafting EAGLE head tells nothing before proposing: one
  measurement per batch size.
- A step uses the best candidate so far. A batch size seen for the first time starts with what
  the nearest batch size measured best on the same kind of text (the configured ``k`` when none
  has: the engine behaves as it always did until there is evidence), then tries every other
  candidate once.
- After that it keeps trying the others now and then — so a choice is revisited when acceptance
  or load changes — each as often as it is cheap to: a try loses its step's time less what the
  best would need for the tokens it made — ``x`` of the best's step-times, say — so with ``n``
  other candidates it waits ``n · x / EXPLORE_BUDGET`` steps between tries (and never fewer
  than ``MIN_GAP``) — twice, then ``BACKOFF`` times as long after costly tries in a row
  (each lost ``COSTLY_TRY`` of the best's step-times or more) that left it slower; a cheap
  try, or one that wins, starts afresh. Exploring thus costs at most about ``EXPLORE_BUDGET``
  of the time in all, a quarter of it where a costly candidate keeps losing (an EAGLE tree
  at batch 8, whose head first catches up on the steps it sat out), and a near-tie, where the
  choice is uncertain and matters least, is re-measured most often. (A first measured version
  explored one step in 8 whatever the candidate cost: at batch 8 a step with 4 proposals took 3
  times a plain one, and the exploring alone cost the engine a fifth of its speed. A second
  gave each candidate its own 2% and weighed every step 0.25: replayed on an EAGLE tree's steps
  at batch 1 it kept 91.3% of the rate of always proposing the best size, this rule 95.9% —
  ``benchmarks/probe_governor.py``, Intel Xeon, 2026-12-06. A third counted a try's loss as
  ``1/r - 1`` step-times for a rate ``r`` of the best's: an EAGLE tree's try at batch 8 emits
  2.5 times a plain step's tokens, and loses 2.5 times that — at batch 8 on chat the tries
  alone cost the engine about 5% of a run: ``benchmarks/probe_batch_steps.py``, 2026-12-07.)

Greedy requests get exactly the target's tokens whatever ``k`` is, and sampled ones keep the
target's distribution. A *seeded* sampled request keeps the configured ``k``: under rejection
sampling the number of proposals decides how many draws its generator makes, and its tokens must
not depend on how fast the machine happened to be. vLLM's engine once had a fixed rule of the
same purpose (``speculative_disable_by_batch_size``: no speculation above a batch size); this one
measures. What it decided is in ``LLMEngine.resolved.speculation``.

What it does not see: a candidate's first measurement stands alone until its next try, so a
one-time cost on that step (a new shape's kernel set-up) makes it look slower for a while; a
draft model or EAGLE head that sat out plain steps first catches up on them when proposals
resume, and that catch-up is charged to the candidate tried; and in a step whose token budget or
pool cuts proposals (``Scheduler.drafts_that_fit``), what is left for a seeded request depends on
what the sequences ahead of it proposed — timing, through the governor.

Steps are timed on the engine's own clock: in a replay on a simulated clock (chapter 04's
virtual clock) its choices are the simulation's, the same on every machine and every run, and
what it measured on one clock is forgotten when the engine moves to the other (as after the
engine's warm-up, whose one-time costs say nothing about speculating).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Candidate:
    """One number of proposals at one batch size: what its steps made, on average."""

    tokens: float = 0.0  # tokens a step emitted: moving average over the steps that used it
    seconds: float = 0.0  # what a step took: moving average over the same steps
    steps: int = 0
    last_tried: int = -1  # the batch size's decision count when it last ran
    misses: int = 0  # costly tries in a row (each lost COSTLY_TRY step-times or more) that left it slower

    @property
    def tokens_per_second(self) -> float | None:
        """Its rate: average tokens over average time — not an average of each step's rate,
        which one step's luck in acceptance or one slow moment of the machine would tilt."""
        return self.tokens / self.seconds if self.steps else None


class SpeculationGovernor:
    EXPLORE_BUDGET = 0.02  # the share of the time the slower candidates together may cost by being re-measured
    MIN_GAP = 8  # steps of a batch size between two tries of the same candidate, at least
    BACKOFF = 4  # a candidate found slower try after try waits up to this many times its gap
    COSTLY_TRY = 0.5  # ... where each of those tries lost at least this many of the best's step-times
    SMOOTHING = 0.05  # a step's weight in its candidate's moving average (after a plain mean of the first 20)

    def __init__(self, k: int):
        self.k = k
        self.candidates = sorted({0, k} | {2**i for i in range(5) if 2**i < k})
        # (batch size class, what the text says) -> candidate k -> what it made; and steps decided
        self.sizes: dict[tuple[int, str | None], dict[int, Candidate]] = {}
        self.decisions: dict[tuple[int, str | None], int] = {}

    @staticmethod
    def size_class(batch: int) -> int:
        """The largest power of two not above ``batch``: 1, 2, 4, 8, ..."""
        return 1 << (max(batch, 1).bit_length() - 1)

    def choose(self, batch: int, text: str | None = None) -> int:
        """How many tokens to propose per sequence in a step of ``batch`` decoding sequences;
        ``text``: what the proposer can tell of the text before proposing (prompt lookup:
        ``"copying"`` or ``"free text"``), measured apart — None where it cannot tell."""
        key = (self.size_class(batch), text)
        if key not in self.sizes:
            self.sizes[key] = {c: Candidate() for c in self.candidates}
        candidates = self.sizes[key]
        n = self.decisions[key] = self.decisions.get(key, 0) + 1
        measured = {c: s.tokens_per_second for c, s in candidates.items() if s.tokens_per_second is not None}
        if not measured:
            pick = self._nearest_best(key)
        else:
            best = pick = max(measured, key=measured.get)
            due = [c for c, cand in candidates.items()
                   if c != best and n - cand.last_tried >= self._gap(candidates, best, c)]  # fmt: skip
            if due:
                pick = min(due, key=lambda c: candidates[c].last_tried)
        candidates[pick].last_tried = n
        return pick

    def _gap(self, candidates: dict[int, Candidate], best: int, c: int) -> float:
        """Steps between two tries of candidate ``c``: never tried, at once; tried but not yet
        measured (its step had a prefill chunk, which is no evidence), ``MIN_GAP``; else by its
        cost: a try's time less what the best needs for the tokens the try made, in the best's
        step-times (a try that emits 20 tokens at 0.6x the best's rate loses more than one of 8)."""
        cand, top = candidates[c], candidates[best]
        if not cand.steps:
            return 0 if cand.last_tried < 0 else self.MIN_GAP
        extra = (cand.seconds - cand.tokens / top.tokens_per_second) / top.seconds
        backoff = min(2 ** max(cand.misses - 1, 0), self.BACKOFF)  # 1, 2, 4, 4, ... after 1, 2, 3, 4, ... misses
        return max(self.MIN_GAP, backoff * extra * (len(self.candidates) - 1) / self.EXPLORE_BUDGET)

    def _nearest_best(self, key: tuple[int, str | None]) -> int:
        """A new batch size's first guess: the best of the nearest one measured on the same
        kind of text (else k)."""
        size, text = key
        known = [s for s, t in self.sizes if t == text and s != size and self._best(self.sizes[(s, t)]) is not None]
        if not known:
            return self.k
        nearest = min(known, key=lambda s: (abs(s.bit_length() - size.bit_length()), s))
        return self._best(self.sizes[(nearest, text)])

    def record(self, batch: int, k: int, tokens: int, seconds: float, text: str | None = None) -> None:
        """A pure decode step of ``batch`` sequences, run with ``k`` proposals each on ``text``
        (as ``choose`` was told), emitted ``tokens`` in ``seconds`` (proposing, the target's
        pass, verifying and appending)."""
        candidates = self.sizes.get((self.size_class(batch), text), {})
        candidate = candidates.get(k)
        if candidate is None or seconds <= 0 or tokens <= 0:  # a pure decode step emits a token per sequence
            return
        weight = max(self.SMOOTHING, 1 / (candidate.steps + 1))  # 1 for the first step: its own
        candidate.tokens += weight * (tokens - candidate.tokens)
        candidate.seconds += weight * (seconds - candidate.seconds)
        candidate.steps += 1
        best = candidates[self._best(candidates)]
        lost = (seconds - tokens / best.tokens_per_second) / best.seconds  # this step, in the best's step-times
        candidate.misses = candidate.misses + 1 if lost >= self.COSTLY_TRY and best is not candidate else 0

    def best(self, batch: int, text: str | None = None) -> int | None:
        """The candidate a step of ``batch`` sequences on ``text`` would use now (None: none measured)."""
        return self._best(self.sizes.get((self.size_class(batch), text), {}))

    @staticmethod
    def _best(candidates: dict[int, Candidate]) -> int | None:
        measured = {c: s.tokens_per_second for c, s in candidates.items() if s.tokens_per_second is not None}
        return max(measured, key=measured.get) if measured else None

    def describe(self) -> str:
        """What it decided, per batch size (and kind of text) measured, e.g. ``k=4 adaptive; 1
        running: k=4 (31.0 tok/s, plain 24.1); 8+ running: plain (118.0 tok/s, k=4 72.3)``, or
        ``…; 1 running, copying: k=8 (…); 1 running, free text: k=1 (…)``."""
        parts = [f"k={self.k} adaptive"]
        for size, text in sorted(self.sizes, key=lambda key: (key[0], key[1] or "")):
            candidates = self.sizes[(size, text)]
            best = self._best(candidates)
            if best is None:
                continue
            label = (f"{size} running" if size == 1 else f"{size}+ running") + (f", {text}" if text else "")
            rate = candidates[best].tokens_per_second
            other = self.k if best == 0 else 0
            alt = candidates[other].tokens_per_second
            alt_text = "" if alt is None else f", {'k=' + str(other) if other else 'plain'} {alt:.1f}"
            parts.append(f"{label}: {'k=' + str(best) if best else 'plain'} ({rate:.1f} tok/s{alt_text})")
        return "; ".join(parts)
