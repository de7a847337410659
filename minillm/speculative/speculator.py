"""Speculative decoding in the serving engine: propose, verify in one pass, roll back.

Each engine step, before scheduling, the speculator gives every running sequence that is
decoding up to ``k`` proposed tokens (``Sequence.draft_tokens``). The scheduler turns such a
sequence's decode into a verify chunk of ``1 + k`` positions — its last token and the proposals
— counted against the token budget and given pool slots like any chunk, and falls back to a
plain decode when the budget or the pool is short. All chunks of the step, plain decodes and
prefills included, run in the target's one forward pass. Then, per verify chunk,
``verify`` applies the acceptance rule to the ``k + 1`` rows of logits (``acceptance.py``);
the engine appends the emitted tokens (stopping at a stop token or ``max_tokens``), and the
K/V of rejected positions is rolled back in the target's pool (``BlockManager.truncate``, via
the scheduler) and in the draft's.

Why it pays at small batch: a decode step is bound by reading the weights, not by arithmetic
(chapter 01's roofline), so scoring ``k + 1`` positions costs about as much as scoring one;
every accepted proposal is a step saved. At large batch the step is compute-bound and the
rejected positions are wasted work, so the speed-up shrinks (``benchmarks/bench_spec.py``).

Requests with a ``repetition_penalty`` are decoded plainly: the penalty at a proposed position
depends on the proposals before it, which the one-pass verifier does not model.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

import minillm.hooks as hooks
from minillm.config import SpeculativeConfig
from minillm.sampling import argmax_rows, filtered_logits
from minillm.sequence import Sequence
from minillm.speculative import (
    acceptance,  # noqa: F401  (registers hooks accept_greedy and accept_sampled)
    ngram,  # registers hook propose_ngram; match_length, reach
)
from minillm.speculative.governor import SpeculationGovernor
from minillm.speculative.tree import accept_tree_sampled, graft_chain, verified_tree


class Speculator:
    def __init__(self, config: SpeculativeConfig, max_model_len: int, draft=None):
        """``draft``: a ``DraftModelProposer`` for ``method="draft"`` (built by the engine's builder)."""
        self.config = config
        self.k = config.num_speculative_tokens
        self.max_model_len = max_model_len
        self.draft = draft
        self._draft_dists: dict[Hashable, torch.Tensor | None] = {}
        self._texts = ngram.TokenArrays()  # prompt lookup's view of each request's tokens
        # A feature-level draft (EAGLE) reads the target's hidden states after every step.
        self.wants_hidden = bool(getattr(draft, "wants_hidden", False))
        # How many to propose, measured per batch size and kind of text (prompt lookup at batch 1, a tree
        # engine with `copies` at every size; governor.py); None: always k.
        self.governor = SpeculationGovernor(self.k) if config.adaptive else None
        # This step's decoding sequences (0: prompt lookup matched nothing — no decision, no evidence),
        # the k the governor chose, and the kind of text it was told (None: a proposer that cannot tell).
        self._step = (0, self.k, None)
        self._left: list[tuple[Sequence, int, int]] | None = None  # step_done's measure while draining
        self.resolved = None  # the engine's Resolved, whose `speculation` says what was decided
        # An EAGLE tree with prompt lookup's branch: a sequence copying its text (a match of
        # ngram.COPYING tokens or more) gets prompt lookup's chain instead of a tree (``propose``).
        self.copies = config.method == "eagle" and config.topk > 1 and bool(config.ngram_branch)
        # Whether the engine's runner can verify a tree this step (the engine sets it); trees are
        # proposed only then (``config.topk > 1``), chains otherwise.
        self.trees_verifiable = lambda: False

    def configure(self, k: int, adaptive: bool) -> None:
        """Propose up to ``k`` tokens from the next step on, measured afresh per batch size when
        ``adaptive`` (what ``num_speculative_tokens`` and ``adaptive`` set at start; for sweeps)."""
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 16:
            raise ValueError(f"k={k!r}: the tokens proposed per step must be an int from 1 to 16")
        self.k = k
        self.governor = SpeculationGovernor(k) if adaptive else None
        self._step = (0, k, None)
        if self.resolved is not None:
            self.resolved.speculation = self.describe()

    def forget_measurements(self) -> None:
        """Drop what the governor measured so far (the engine's warm-up: one-time costs, and
        steps on a clock a replay does not use)."""
        self.configure(self.k, adaptive=self.governor is not None)

    def describe(self) -> str:
        """The method and what decides ``k``, in words (``LLMEngine.resolved.speculation``)."""
        what = self.config.method + (f" {self.config.model}" if self.config.model else "")
        if self.config.method == "ngram" and self.config.prompt_lookup_scaled:
            what += " (up to 2^(n-1) guesses after an n-token match)"
        if self.config.topk > 1:
            what += f", trees of up to k nodes (top-{self.config.topk}, depth {self.config.depth})"
            if self.config.ngram_branch:
                what += f" with a prompt-lookup branch of up to {self.config.ngram_branch}"
            if self.copies:
                what += f"; copying text: prompt lookup's chain of up to k + {self.config.ngram_branch}"
        return f"{what}, " + (self.governor.describe() if self.governor else f"k={self.k} always")

    def observe(self, chunks, hidden: list[torch.Tensor], seqs: list[Sequence]) -> None:
        """The target's step ran ``chunks`` (``ChunkInput``s) and left each one's hidden states."""
        trees = [c.tree_parents is not None for c in chunks]
        self.draft.observe([c.request_id for c in chunks], [c.start for c in chunks], hidden, seqs, trees)

    def eligible(self, seq: Sequence, k: int | None = None) -> int:
        """How many tokens to propose for ``seq`` this step, at most ``k`` (default: the
        configured k; 0: decode it plainly).

        Not for the first token of a request with ``n > 1`` (a prompt chunked down to its last
        token also "decodes"): that token's row is where the engine draws all n samples' first
        tokens and forks them, which a verify step does not do."""
        if not seq.is_decoding or seq.params.repetition_penalty != 1.0 or seq.pending_generators:
            return 0
        left = seq.max_output - len(seq.output_token_ids)  # a step emits up to k + 1 tokens
        room = self.max_model_len - len(seq)  # positions len(seq)-1 .. +k must exist
        return max(0, min(self.k, self.k if k is None else k, left - 1, room))

    def propose(self, running: list[Sequence], waiting: int = 0) -> None:
        """Set ``draft_tokens`` of every running sequence (empty for those not speculating):
        as many as the governor finds pays at this batch size — and on this kind of text
        (``ngram.kind_of_text``), for prompt lookup at batch 1 and for an EAGLE tree with prompt
        lookup's branch (``copies``) at every batch size (a tree step in which nothing matches is
        free text; a prompt-lookup step in which nothing matches proposes nothing and asks the
        governor nothing) — the configured k for a seeded sampled request,
        whose random draws must not depend on timing (governor.py). ``waiting``: requests that a
        place freed this step would go to (``step_done`` says why it counts)."""
        decoding = [seq for seq in running if seq.is_decoding]
        batch = len(decoding)
        matches, text, cfg = {}, None, self.config
        prompt_lookup = cfg.method == "ngram" and (self.governor is not None or cfg.prompt_lookup_scaled)
        if prompt_lookup or (self.copies and self.trees_verifiable()):  # what prompt lookup can tell before proposing
            matches = {id(seq): ngram.match_length(self._texts.of(seq), cfg.prompt_lookup_max, cfg.prompt_lookup_min)
                       for seq in decoding if self.eligible(seq)}  # fmt: skip
            text = ngram.kind_of_text(list(matches.values()))
            if text is None and prompt_lookup:  # nothing matches: nothing to propose, and no evidence for any k
                batch = 0
            elif prompt_lookup and batch > 1:  # one proposer for both kinds, mixed texts: one measurement
                text = None
            elif text is None:  # the head proposes on any text
                text = "free text"
        step_k = self.governor.choose(batch, text) if self.governor is not None and batch else self.k
        self._step = (batch, step_k, text)
        self._left = None
        if self.governor is not None and batch > 1 and not waiting:
            self._left = [(seq, seq.max_output - len(seq.output_token_ids), len(seq.output_token_ids)) for seq in decoding]
        seqs, ks = [], []
        for seq in running:
            seq.draft_tokens, seq.draft_parents = [], None
            seeded = seq.params.seed is not None and not seq.params.greedy
            k = self.eligible(seq, self.k if seeded else step_k)
            if k:
                seqs.append(seq)
                ks.append(k)
        self._draft_dists.clear()
        if cfg.topk > 1 and seqs and self.trees_verifiable():
            if self.copies:  # copying: prompt lookup's chain, as deep as the tree's nodes and branch together
                chains = [(s, k) for s, k in zip(seqs, ks) if matches.get(id(s), 0) >= ngram.COPYING]
                for seq, k in chains:
                    seq.draft_tokens = self.look_up(seq, self.chain_room(seq, k + cfg.ngram_branch), matches[id(seq)])
                copying = {id(s) for s, _ in chains}
                seqs, ks = [s for s in seqs if id(s) not in copying], [k for s, k in zip(seqs, ks) if id(s) not in copying]
            by_id, k_of = {s.request_id: s for s in seqs}, {s.request_id: k for s, k in zip(seqs, ks)}
            for rid, (tokens, parents) in self.draft.propose_trees(seqs, ks, cfg.topk, cfg.depth).items():
                seq = by_id[rid]
                if cfg.ngram_branch:  # prompt lookup's guess as a branch of its own (as deep as k allows)
                    chain = hooks.propose_ngram(seq.token_ids, min(cfg.ngram_branch, k_of[rid]),
                                                cfg.prompt_lookup_max, cfg.prompt_lookup_min)  # fmt: skip
                    tokens, parents = graft_chain(tokens, parents, chain)
                seq.draft_tokens, seq.draft_parents = tokens, parents
            return
        if self.draft is not None:
            by_id = {s.request_id: s for s in seqs}
            for rid, (tokens, dists) in self.draft.propose(seqs, ks).items():
                by_id[rid].draft_tokens, self._draft_dists[rid] = tokens, dists
            return
        for seq, k in zip(seqs, ks):
            n = matches.get(id(seq))
            seq.draft_tokens = self.look_up(seq, k, n) if n != 0 else []

    def chain_room(self, seq: Sequence, k: int) -> int:
        """``k``, or fewer where ``seq`` ends sooner: a verified chain emits up to one token more
        than it guesses, within ``max_tokens`` and the model's length (``eligible``'s limits,
        without its cap at the configured k)."""
        return max(0, min(k, seq.max_output - len(seq.output_token_ids) - 1, self.max_model_len - len(seq)))

    def look_up(self, seq: Sequence, k: int, n: int | None = None) -> list[int]:
        """Prompt lookup's guess for ``seq``, up to ``k`` tokens — as many as the match's length
        ``n`` (found here when not given) vouches for (``ngram.reach``) unless
        ``prompt_lookup_scaled`` is off. Through hook ``propose_ngram`` (chapter 08), which finds
        the same match again; a step with no match never calls it."""
        cfg, tokens = self.config, seq.token_ids  # (a property that joins prompt and output: read once)
        if cfg.prompt_lookup_scaled:
            if n is None:
                n = ngram.match_length(tokens, cfg.prompt_lookup_max, cfg.prompt_lookup_min)
            k = ngram.reach(n, k)
            if not k:
                return []
        return hooks.propose_ngram(tokens, k, cfg.prompt_lookup_max, cfg.prompt_lookup_min)

    def step_done(self, chunks, tokens: int, seconds: float) -> None:
        """The step that ran ``chunks`` emitted ``tokens`` in ``seconds`` (from proposing on): a
        pure decode step — every chunk a decode or a verify — is the governor's evidence.

        While requests wait, a sequence that finishes sooner frees its place for one of them: the
        step is worth every token it made. When none waits (the end of a ``generate`` call, a
        static batch, a quiet server), the engine is busy until its furthest-behind sequence
        finishes, and a token for one that will finish first anyway frees a place nobody takes:
        the step is worth ``batch`` times what it brought the end of the last of them nearer —
        the most tokens any had left before ``max_tokens`` less the most any has left after,
        counting only the tokens each emitted (over the sequences the step ran: a preempted one,
        or one the token budget left out, moved for want of room, not of proposals; at batch 1,
        the tokens it made). Where requests stop at EOS, ``max_tokens`` is the best guess there
        is at which finishes last — and a sequence that stops there is credited with its
        tokens, not with the budget it left unused: that windfall is the stop's, not the
        proposals' (one such step weighed as hundreds of tokens would crown whichever k ran it).
        Counting every token, prompt lookup decoded static batches of 8 held-out chats at 0.98x
        the default engine — its lucky sequences finished early, and the batch's last steps ran
        half empty at nearly a full step's cost — and weighed by the mean progress of the
        sequences furthest behind, at 1.02x (medians of 10 rounds in one run,
        ``benchmarks/probe_governor_drain.py``, Intel Xeon, 2026-12-07). That mean still
        overrated a try: eight sequences that start together are all furthest behind, and the
        batch ends no sooner unless every one of them accepts a proposal — the least of their
        progress, which this measure takes. With the mean, prompt lookup decoded 16 chats 8 at a
        time at 0.974x the default engine (9 of 10 rounds slower; tries at 8 sequences were a
        fifth of those steps), ``bench_eagle_tree.py --batch 8 --runs 10``, Intel Xeon, 2026-12-07."""
        batch, step_k, text = self._step
        if self.governor is None or not batch or not all(c.draft_tokens or c.is_decode for c in chunks):
            return
        ran = {id(c.seq) for c in chunks} if self._left else set()
        before = [(seq, left, n) for seq, left, n in self._left or [] if id(seq) in ran]
        if before:  # how much nearer the last of them to finish is: the batch's remaining steps
            left_after = [left - (len(seq.output_token_ids) - n) for seq, left, n in before]  # by tokens emitted
            tokens = batch * (max(left for _, left, _ in before) - max(left_after))
        self.governor.record(batch, step_k, tokens, seconds, text)
        if self.resolved is not None:
            self.resolved.speculation = self.describe()

    def verify(self, seq: Sequence, drafts: list[int], logits: torch.Tensor) -> list[int]:
        """``logits[len(drafts) + 1, V]`` of the target at the verify chunk's positions → the
        tokens to emit (1 to ``len(drafts) + 1``), exactly as the target alone would choose:
        hook ``verify`` (the reference is ``verify`` below)."""
        return hooks.verify(self, seq, drafts, logits)

    def verify_tree(self, seq: Sequence, drafts: list[int], parents: list[int],
                    logits: torch.Tensor) -> tuple[list[int], list[int]]:  # fmt: skip
        """``logits[1 + N, V]``: the target's after the sequence's last token and after each of
        the tree's ``N`` nodes → the accepted branch (node indices) and the tokens to emit,
        exactly as the target alone would choose: greedy through hook ``accept_tree`` (chapter
        08's exercise, its verdict checked), sampled by ``tree.accept_tree_sampled``."""
        if seq.params.greedy:
            return verified_tree(parents, drafts, argmax_rows(logits))  # NumPy's argmax: torch's is slow on CPU
        target = filtered_logits(logits.float(), [seq.params] * len(logits)).softmax(-1)
        return accept_tree_sampled(target, parents, drafts, seq.generator)

    def draft_distributions(self, seq: Sequence) -> torch.Tensor | None:
        """The draft model's distributions ``[k, V]`` behind ``seq``'s proposals this step
        (None: deterministic proposals, as prompt lookup makes)."""
        return self._draft_dists.get(seq.request_id)

    def after_verify(self, seq: Sequence, path: list[int] | None = None) -> None:
        """The sequence has its new tokens (``path``: the branch a verified tree kept): roll the
        draft back to where it still agrees."""
        if self.draft is not None:
            if path is not None and hasattr(self.draft, "accept_branch"):
                self.draft.accept_branch(seq, len(seq) - len(path) - 2, path)
            if seq.is_finished:
                self.draft.release(seq.request_id)
            else:
                self.draft.rollback(seq)

    def release(self, request_id: Hashable) -> None:
        """A finished, aborted or preempted request: its draft state goes (rebuilt if it returns)."""
        self._texts.release(request_id)
        if self.draft is not None:
            self.draft.release(request_id)


class NoSpeculation:
    """The engine without ``speculative_config``: proposes nothing, so no chunk verifies."""

    wants_hidden = False

    def describe(self) -> str:
        return "off"

    def forget_measurements(self) -> None:
        pass

    def propose(self, running: list[Sequence], waiting: int = 0) -> None:
        pass

    def step_done(self, chunks, tokens: int, seconds: float) -> None:
        pass

    def verify(self, seq: Sequence, drafts: list[int], logits: torch.Tensor) -> list[int]:
        raise RuntimeError("a verify chunk without speculative decoding")

    def after_verify(self, seq: Sequence, path: list[int] | None = None) -> None:
        pass

    def release(self, request_id: Hashable) -> None:
        pass


@hooks.reference("verify")
def verify(speculator: Speculator, seq: Sequence, drafts: list[int], logits: torch.Tensor) -> list[int]:
    """The acceptance rule the request's sampling calls for: greedy requests keep the proposals
    the target's argmax agrees with (hook ``accept_greedy``); sampled ones run rejection
    sampling against the draft's distributions (hook ``accept_sampled``)."""
    if seq.params.greedy:
        return hooks.accept_greedy(argmax_rows(logits), drafts)
    target = filtered_logits(logits.float(), [seq.params] * len(logits)).softmax(-1)
    dists = speculator.draft_distributions(seq)
    if dists is not None:
        dists = dists[: len(drafts)]  # the scheduler may have kept fewer of them
    return hooks.accept_sampled(target, dists, drafts, seq.generator)
