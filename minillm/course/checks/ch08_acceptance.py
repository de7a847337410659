"""Chapter 08 (speculative decoding): greedy acceptance and rejection sampling."""

from __future__ import annotations

import math

import torch

import minillm.hooks as hooks
from minillm.course.checks.ch08_common import (
    PROMPTS,
    STEPS,
    TARGET,
    draft_spec,
    greedy_outputs,
    is_int_list,
    spec_engine,
    spec_summary,
)
from minillm.course.compare import compare_tokens
from minillm.course.results import CheckFailed, LearnerRaised, check, learner_frames_of

# Exercise 1: greedy acceptance
# ---------------------------------------------------------------------------------------------


def _greedy_reference(target: list[int], drafts: list[int]) -> list[int]:
    out = []
    for i, d in enumerate(drafts):
        if d != target[i]:
            return out + [target[i]]
        out.append(d)
    return out + [target[len(drafts)]]


def _greedy_shifted(target: list[int], drafts: list[int]) -> list[int]:
    """The rule with draft i compared to (and replaced by) the target's token one row later."""
    out = []
    for i, d in enumerate(drafts):
        if d != target[i + 1]:
            return out + [target[i + 1]]
        out.append(d)
    return out + [target[-1]]


def _diagnose_greedy(got, target: list[int], drafts: list[int]) -> None:
    call = f"accept_greedy({target}, {drafts})"
    if not is_int_list(got):
        raise CheckFailed(f"{call} should return a list of Python ints, got {type(got).__name__}: {got!r:.80}")
    expected = _greedy_reference(target, drafts)
    if got == expected:
        return
    accepted = len(expected) - 1
    k = len(drafts)
    head = f"{call} returned {got}, expected {expected}"
    if k == 0:
        raise CheckFailed(
            f"{head}: with no proposals (the draft proposed nothing this step) the step is a plain decode step — "
            f"return the target's own token, [target_tokens[0]]"
        )
    if accepted < k:  # a proposal was rejected
        agreeing = sum(d == t for d, t in zip(drafts, target))
        if agreeing != accepted and got == drafts[:agreeing] + [target[agreeing]]:
            raise CheckFailed(
                f"{head}: you counted every proposal that agrees with the target ({agreeing}), not the agreeing "
                f"*prefix*: proposal {accepted} disagrees, so it and every proposal after it are rejected, even one "
                "that happens to match — they were guessed after a token the target did not choose"
            )
        if accepted + 1 < len(target) and got == expected[:-1] + [target[accepted + 1]] != expected:
            raise CheckFailed(
                f"{head}: at the first disagreement (proposal {accepted}) you emitted target_tokens[{accepted + 1}] = "
                f"{target[accepted + 1]}; the replacement is the target's token at the same position, "
                f"target_tokens[{accepted}] = {target[accepted]} (row i of the verify pass is the target's choice for "
                "the position proposal i fills)"
            )
        if got == expected + [target[k]]:
            raise CheckFailed(
                f"{head}: after a rejected proposal you appended the bonus token target_tokens[k] = {target[k]} too. "
                "The target's rows after the rejection were computed following the wrong token: the bonus comes only "
                "when all k proposals are accepted — return right after the replacement"
            )
        if got == drafts[: accepted + 1]:
            raise CheckFailed(
                f"{head}: at the first disagreement (proposal {accepted}) you kept the draft's token {drafts[accepted]}. "
                f"The target's own token {target[accepted]} replaces it — that is the token the target alone would "
                "have produced there"
            )
        if got == drafts[:accepted]:
            raise CheckFailed(
                f"{head}: you returned only the accepted proposals. After them comes the target's own token at the "
                f"first disagreement ({target[accepted]}): every pass emits at least one token, so a step is never "
                "worse than plain decoding"
            )
        if len(got) > len(expected) and got[: len(expected)] == expected:
            raise CheckFailed(
                f"{head}: you went on after the first disagreement. Proposals after a rejected one were guessed "
                "following a token the target did not choose, and the target's rows after it were computed on that "
                "wrong token too: stop at the first mismatch"
            )
    elif got == drafts:
        raise CheckFailed(
            f"{head}: every proposal was accepted, and then the target's last row (position k) gives one more token "
            f"for free — the bonus token {target[k]}: return k + 1 tokens"
        )
    elif k and got == drafts + [target[k - 1]]:
        raise CheckFailed(
            f"{head}: the bonus token after all k accepted proposals is target_tokens[k] = {target[k]} (the last row: "
            f"what follows the last proposal), not target_tokens[k - 1] = {target[k - 1]}"
        )
    if got == _greedy_shifted(target, drafts):
        raise CheckFailed(
            f"{head}: you compared proposal i with target_tokens[i + 1]. Row i of the verify pass is the target's "
            "prediction *for the position proposal i fills* (it reads the tokens before it): compare drafts[i] "
            "with target_tokens[i]"
        )
    raise CheckFailed(
        f"{head}: keep proposals while they equal the target's token at the same position, then append the target's "
        "token where they first differ (or its last token when all k agree)"
    )


GREEDY_CASES = [
    ([5, 9, 7, 8], [5, 6, 7]),  # the second proposal is wrong (and the third happens to agree)
    ([5, 6, 7, 8], [5, 6, 7]),  # all accepted: the bonus token
    ([4, 6, 7, 8], [5, 6, 7]),  # the first is wrong: the target's token alone
    ([3], []),  # nothing proposed: a plain decode step
    ([1, 2, 3, 4, 9], [1, 2, 3, 5]),  # the last proposal is wrong
    ([2, 2, 2], [2, 2]),  # repeated tokens
]


@check
def check_accept_greedy(accept_greedy, model: str = TARGET) -> str:
    """``accept_greedy(target_tokens[k+1], draft_tokens[k]) -> list[int]``: the longest agreeing
    prefix of the proposals, then the target's own token."""
    for target, drafts in GREEDY_CASES:
        given_target, given_drafts = list(target), list(drafts)
        try:
            got = accept_greedy(given_target, given_drafts)
        except LearnerRaised as err:
            if drafts:
                raise
            failure = CheckFailed(
                f"accept_greedy({target}, []) raised {type(err.__cause__).__name__}: {err.__cause__} — with no "
                "proposals (the draft proposed nothing this step; a loop over them runs zero times) the step is a "
                "plain decode step: return [target_tokens[0]]"
            )
            failure.learner_frames = learner_frames_of(err.__cause__)
            raise failure from None
        _diagnose_greedy(got, target, drafts)
        if given_drafts != drafts:
            raise CheckFailed(
                f"accept_greedy({target}, {drafts}) changed its argument draft_tokens: {drafts} became {given_drafts}. "
                "The engine reads the proposals again after your function returns (it counts them): build a new "
                "list instead of appending to, or editing, the one you are given"
            )
    gen = torch.Generator().manual_seed(8)
    for _ in range(300):  # random cases over 3 tokens: agreements are frequent
        k = int(torch.randint(0, 6, (), generator=gen))
        target = torch.randint(0, 3, (k + 1,), generator=gen).tolist()
        drafts = torch.randint(0, 3, (k,), generator=gen).tolist()
        _diagnose_greedy(accept_greedy(list(target), list(drafts)), target, drafts)

    calls = []

    def learner(target_tokens, draft_tokens):  # what Speculator.verify calls for a greedy request
        calls.append(len(draft_tokens))
        got = accept_greedy(list(target_tokens), list(draft_tokens))
        _diagnose_greedy(got, list(target_tokens), list(draft_tokens))
        return got

    reference = [o.token_ids for o in greedy_outputs(spec_engine(None))]
    llm = spec_engine(draft_spec())
    with hooks.override(accept_greedy=learner):
        outs = greedy_outputs(llm)
    if not calls:
        raise RuntimeError("Speculator.verify no longer calls hook accept_greedy")
    for n, (out, ref) in enumerate(zip(outs, reference)):
        compare_tokens(
            out.token_ids, ref, f"prompt {n} with your acceptance rule", "the output must be the target's own"
        )
    tokens, passes, proposed, accepted = spec_summary(outs)
    return (
        f"with your rule the engine verified {proposed} proposals of the 1M draft in {passes} passes of the 8M "
        f"model and accepted {accepted} ({accepted / proposed:.0%}): {len(PROMPTS)}×{STEPS} tokens identical to "
        f"the 8M model alone, in {passes / tokens:.2f} target passes per token instead of 1"
    )


# ---------------------------------------------------------------------------------------------
# Exercise 2: rejection sampling
# ---------------------------------------------------------------------------------------------

# Three positions over a vocabulary of 5: the target's rows p0, p1, p2 (p2: the bonus row when
# two proposals are made) and the draft's q0, q1.
P = torch.tensor([[0.05, 0.40, 0.25, 0.20, 0.10], [0.30, 0.05, 0.15, 0.10, 0.40], [0.15, 0.15, 0.40, 0.20, 0.10]])
Q = torch.tensor([[0.30, 0.10, 0.30, 0.05, 0.25], [0.10, 0.40, 0.10, 0.30, 0.10]])
SAMPLES = 6000


def _chi2_limit(dof: int, p_value: float = 1e-6) -> float:
    """The χ² value a correct sampler exceeds with probability ``p_value``."""
    lo, hi = 0.0, 500.0
    a = torch.tensor(dof / 2, dtype=torch.float64)
    for _ in range(80):
        mid = (lo + hi) / 2
        if float(torch.special.gammaincc(a, torch.tensor(mid / 2, dtype=torch.float64))) > p_value:
            lo = mid
        else:
            hi = mid
    return hi


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs.double() * counts.sum()
    keep = expected > 0
    if bool((counts[~keep] > 0).any()):
        return math.inf
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def _fits(counts: torch.Tensor, probs: torch.Tensor) -> bool:
    dof = int((probs > 0).sum()) - 1
    return counts.sum() > 0 and _chi2(counts, probs) < _chi2_limit(max(dof, 1))


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    r = (p - q).clamp(min=0)
    return r / r.sum()


def _rule(
    p: torch.Tensor, q: torch.Tensor, keep: torch.Tensor, replacement: torch.Tensor
) -> tuple[torch.Tensor, float]:
    """The distribution of the first emitted token when proposal x ~ q is kept with probability
    ``keep[x]`` and otherwise replaced by a draw from ``replacement`` (``[V]``, or ``[V, V]``: row
    x when x was rejected), and how often a rejected proposal comes back as its own replacement."""
    rows = replacement.expand(len(p), len(p))
    rejected = q * (1 - keep)
    return q * keep + (rejected[:, None] * rows).sum(0), float((rejected * rows.diagonal()).sum())


def _without_proposal(p: torch.Tensor) -> torch.Tensor:
    """Row x: p with token x removed, renormalized (the residual when draft_probs is None)."""
    rows = p.expand(len(p), len(p)).clone()
    rows.fill_diagonal_(0)
    return rows / rows.sum(1, keepdim=True).clamp(min=1e-30)


def _mistakes(p: torch.Tensor, q: torch.Tensor) -> list[tuple[tuple[torch.Tensor, float], str]]:
    """What the first emitted token would follow under the usual mistakes (p, q: one position),
    and how often a rejected proposal would be its own replacement."""
    ratio = torch.where(q > 0, p / q.clamp(min=1e-30), torch.ones_like(p)).clamp(max=1)
    inverse = torch.where(p > 0, q / p.clamp(min=1e-30), torch.ones_like(p)).clamp(max=1)
    most_likely = torch.zeros_like(p)
    most_likely[int(_residual(p, q).argmax())] = 1.0
    return [
        (
            _rule(p, q, ratio, p),
            "a rejected proposal is replaced by a draw from p, the target's distribution: draw it from the "
            "residual normalize(max(0, p − q)) instead. Tokens the draft already proposes often were partly "
            "emitted through acceptance; drawing from p adds them a second time",
        ),
        (
            _rule(p, q, inverse, _residual(p, q)),
            "proposals are kept with probability q(x) / p(x): the ratio is upside down. Keep proposal x with "
            "probability min(1, p(x) / q(x)) — tokens the target likes more than the draft are always kept",
        ),
        (
            _rule(p, q, (p >= q).float(), _residual(p, q)),
            "a proposal is kept exactly when p(x) >= q(x), with no random draw: keep it with probability "
            "min(1, p(x) / q(x)) — draw u uniform in [0, 1) and keep it if u < p(x) / q(x)",
        ),
        (
            _rule(p, q, p, _residual(p, q)),
            "a proposal is kept with probability p(x), forgetting the draft: the test is u < p(x) / q(x) (the "
            "draft proposed x with probability q(x), so acceptance must undo that)",
        ),
        (
            _rule(p, q, 1 - ratio, _residual(p, q)),
            "a proposal is kept with probability 1 − p(x) / q(x): the comparison is inverted — keep it when "
            "u < p(x) / q(x) (u uniform in [0, 1)), so that a token the target likes more than the draft is always kept",
        ),
        (
            _rule(p, q, ratio, most_likely),
            "a rejected proposal is always replaced by the residual's most likely token (an argmax): draw the "
            "replacement at random from normalize(max(0, p − q)) (torch.multinomial), or the other tokens the "
            "target wants there are never emitted",
        ),
        (
            _rule(p, q, ratio, _without_proposal(p)),
            "a rejected proposal is replaced by a draw from p with the rejected token removed: that is the residual "
            "only when draft_probs is None (q is 1 at the proposal). With the draft's distribution q the residual is "
            "normalize(max(0, p − q)) — it takes away what acceptance already emitted of every token",
        ),
    ]


def _validate_emitted(got, drafts: list[int], vocab: int, call: str) -> list[int]:
    if not is_int_list(got):
        raise CheckFailed(f"{call} should return a list of Python ints, got {type(got).__name__}: {got!r:.80}")
    k = len(drafts)
    if not 1 <= len(got) <= k + 1:
        raise CheckFailed(f"{call} returned {len(got)} tokens {got}: a step emits between 1 and k + 1 = {k + 1}")
    bad = [t for t in got if not 0 <= t < vocab]
    if bad:
        raise CheckFailed(
            f"{call} returned token {bad[0]}, outside the vocabulary 0..{vocab - 1}: if you sample with a cumulative "
            "sum, the residual max(0, p − q) sums to less than 1 — normalize it (divide by its sum) before sampling"
        )
    if got[:-1] != drafts[: len(got) - 1]:
        raise CheckFailed(
            f"{call} returned {got} for proposals {drafts}: every token before the last must be an accepted "
            "proposal, in order — after the first rejected proposal comes one replacement, and then nothing"
        )
    return got


def _call_sampled(fn, p: torch.Tensor, q: torch.Tensor | None, drafts: list[int], gen, what: str) -> list[int]:
    call = f"accept_sampled({what})"
    try:
        got = fn(p.clone(), None if q is None else q.clone(), list(drafts), gen)
    except LearnerRaised as err:
        if isinstance(err.__cause__, RuntimeError) and "probability tensor contains" in str(err.__cause__):
            if q is not None and torch.equal(q, p[: len(q)]):  # nothing to reject: the residual is all zeros
                failure = _RejectedAlthoughEqual(
                    "with draft_probs equal to target_probs a proposal must always be kept (min(1, p/q) = 1), but "
                    "your rule rejected one — and the residual max(0, p − q) is then all zeros, which "
                    f"torch.multinomial refused ({err.__cause__}). Keep proposal d when u < p(d) / q(d)"
                )
                failure.learner_frames = learner_frames_of(err.__cause__)
                raise failure from None
            failure = CheckFailed(
                f"{call}: torch.multinomial refused the weights it was given ({err.__cause__}): the residual p − q "
                "is negative wherever the draft likes a token more than the target — clamp it, max(0, p − q) "
                "(.clamp(min=0)), before normalizing and sampling"
            )
            failure.learner_frames = learner_frames_of(err.__cause__)
            raise failure from None
        if q is None and isinstance(err.__cause__, (TypeError, AttributeError, IndexError)):
            raise CheckFailed(
                f"with draft_probs=None your code raised {type(err.__cause__).__name__}: {err.__cause__}. None means "
                "deterministic proposals (prompt lookup has no distribution): q is 1 at the proposed token and 0 "
                "elsewhere — keep it with probability p(d), else draw from p without d"
            ) from None
        raise
    return _validate_emitted(got, drafts, p.shape[-1], call)


class _RejectedAlthoughEqual(CheckFailed):
    """A proposal was rejected with q = p: reported after the histograms, which may say why."""


def _all_accepted_gives_a_bonus(fn) -> None:
    """With q = p every proposal is kept (u · q < p for every u < 1): k + 1 tokens."""
    gen = torch.Generator().manual_seed(3)
    p = torch.stack([P[0], P[1], P[2]])
    for _ in range(20):
        drafts = [int(torch.multinomial(P[i], 1, generator=gen)) for i in range(2)]
        got = _call_sampled(fn, p, p[:2], drafts, gen, "target_probs, draft_probs = target_probs[:2], 2 proposals")
        if len(got) < 3:
            if got == drafts:
                raise CheckFailed(
                    "when the draft's distribution equals the target's every proposal is kept — and then the target's "
                    "last row gives one more token: sample the bonus from target_probs[k] and return k + 1 tokens"
                )
            raise _RejectedAlthoughEqual(
                f"with draft_probs equal to target_probs a proposal must always be kept (min(1, p/q) = 1), but "
                f"accept_sampled returned {got} for proposals {drafts}"
            )


def _sampled_histograms(fn, q: torch.Tensor | None, fixed: list[int] | None, n: int, seed: int):
    """Counts of the emitted tokens by position, each position counted where it was reached by
    accepting every earlier proposal, how often the first proposal was kept, and how many times it
    was rejected and replaced by itself (never, under the right rule: the residual is 0 there)."""
    vocab = P.shape[1]
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(3, vocab, dtype=torch.float64)
    first_kept = itself = 0
    k = 2 if fixed is None else len(fixed)
    what = "2 proposals drawn from draft_probs" if q is not None else f"draft_probs=None, proposals {fixed}"
    for _ in range(n):
        drafts = fixed if fixed is not None else [int(torch.multinomial(q[i], 1, generator=gen)) for i in range(k)]
        got = _call_sampled(fn, P[: k + 1], q, drafts, gen, what)
        for i, token in enumerate(got):
            counts[i, token] += 1
        first_kept += len(got) > 1
        itself += len(got) == 1 and got[0] == drafts[0]
    return counts, first_kept / n, itself


# Where each position of _sampled_histograms is counted (the rows of P it must follow).
POSITIONS = [
    "position 0 (the first proposal)",
    "position 1 (reached when proposal 0 was kept)",
    "position 2, the bonus token (reached when both proposals were kept)",
]


def _histogram_diagram(counts: torch.Tensor, rows: torch.Tensor = P) -> str:
    """The target's distribution against the learner's frequencies, a text bar per token, at the
    position where they differ most (the largest χ²); ◀ marks the token furthest off."""
    scores = [_chi2(c, r) if c.sum() > 0 else -1.0 for c, r in zip(counts, rows)]
    i = max(range(len(scores)), key=lambda j: scores[j])
    freq = (counts[i] / counts[i].sum().clamp(min=1)).tolist()
    target = [float(x) for x in rows[i]]
    top = max(max(freq), max(target), 1e-9)
    width = 24

    def bar(v: float) -> str:
        return ("█" * round(v / top * width)).ljust(width)

    worst = max(range(len(target)), key=lambda t: abs(freq[t] - target[t]))
    lines = [f"{POSITIONS[i]}, {int(counts[i].sum()):,} draws — target_probs[{i}] against your frequencies:"]
    for t, (a, b) in enumerate(zip(target, freq)):
        mark = "  ◀" if t == worst else ""
        lines.append(f"tok {t}  target {bar(a)} {a:.2f}  yours {bar(b)} {b:.2f}{mark}")
    return "\n".join(lines)


def _shared_uniform(fn) -> str | None:
    """Does the learner compare every proposal of a pass with one uniform u? With p(d)/q(d) = 0.5 at
    both proposals the second is kept in half of the passes that kept the first — and in all of
    them when u is reused (the u < 0.5 that kept the first keeps the second too). Every row and
    proposal is the same, so a position read from the wrong row changes nothing."""
    p = torch.tensor([0.1, 0.2, 0.3, 0.2, 0.2]).repeat(3, 1)
    q = torch.tensor([0.15, 0.4, 0.15, 0.15, 0.15]).repeat(2, 1)
    drafts, n = [1, 1], 400
    gen = torch.Generator().manual_seed(5)
    first = both = 0
    for _ in range(n):
        got = _call_sampled(fn, p, q, drafts, gen, "p(d) / q(d) = 0.5 at both proposals [1, 1]")
        first += len(got) > 1
        both += len(got) == 3
    if not (0.35 < first / n < 0.65 and both > 0.85 * first):
        return None
    return (
        f"with p(d) / q(d) = 0.5 at both proposals your rule kept the second in {both / first:.0%} of the {first} "
        "passes that kept the first (expected 50%): you draw one uniform u and compare every proposal of the pass "
        "with it, so the u < p/q that kept the first keeps the next ones too and the later positions follow the "
        "wrong distribution. Draw a fresh u for each proposal (torch.rand((), generator=generator) inside the "
        "loop): one draw per position, each acceptance its own coin flip"
    )


@check
def check_accept_sampled(accept_sampled, model: str = TARGET) -> str:
    """``accept_sampled(target_probs[k+1, V], draft_probs[k, V] | None, draft_tokens, generator)``:
    the emitted tokens follow the target's distribution exactly."""
    from minillm import SamplingParams

    try:
        _all_accepted_gives_a_bonus(accept_sampled)
        rejected = None
    except _RejectedAlthoughEqual as err:  # the histograms below may name the acceptance test's mistake
        rejected = err
    counts, kept, itself = _sampled_histograms(accept_sampled, Q, None, SAMPLES, seed=0)
    expected_kept = float(torch.minimum(P[0], Q[0]).sum())
    if not _fits(counts[0], P[0]):
        # The mistake whose distribution the histogram fits best, among those under which a rejected proposal
        # comes back as its own replacement as often as it did (two of them differ mostly in that).
        fitting = [
            (_chi2(counts[0], dist), why)
            for (dist, self_rate), why in _mistakes(P[0], Q[0])
            if _fits(counts[0], dist) and (self_rate * SAMPLES > 20 if itself else self_rate * SAMPLES < 5)
        ]
        if fitting:
            raise CheckFailed(min(fitting)[1], diagram=_histogram_diagram(counts))
    if rejected is not None:
        raise rejected
    if not _fits(counts[0], P[0]):
        shared = _shared_uniform(accept_sampled)
        if shared:
            raise CheckFailed(shared, diagram=_histogram_diagram(counts))
        freq = (counts[0] / counts[0].sum()).tolist()
        extra = ""
        if abs(kept - expected_kept) > 0.03:
            extra = (
                f"; and the first proposal was kept {kept:.1%} of the time, expected Σ min(p, q) = {expected_kept:.0%}"
            )
        raise CheckFailed(
            f"over {SAMPLES:,} draws the first emitted token had frequencies {[round(f, 3) for f in freq]}, but it must "
            f"follow the target's p = {[round(float(x), 2) for x in P[0]]}{extra}: keep a proposal x with probability "
            "min(1, p(x)/q(x)), else draw from normalize(max(0, p − q))",
            diagram=_histogram_diagram(counts),
        )
    if abs(kept - expected_kept) > 0.03:
        raise CheckFailed(
            f"the first proposal was kept {kept:.1%} of the time, expected Σ min(p, q) = {expected_kept:.0%}; keep "
            "proposal x with probability min(1, p(x) / q(x))",
            diagram=_histogram_diagram(counts),
        )
    for i, (row, name) in enumerate(((P[1], "the second position"), (P[2], "the bonus token"))):
        if not _fits(counts[i + 1], row):
            shared = _shared_uniform(accept_sampled)
            if shared:
                raise CheckFailed(shared, diagram=_histogram_diagram(counts))
            freq = (counts[i + 1] / counts[i + 1].sum()).tolist()
            raise CheckFailed(
                f"{name} (position {i + 1}, reached when every earlier proposal was kept) had frequencies "
                f"{[round(f, 3) for f in freq]} over {int(counts[i + 1].sum()):,} draws, but must follow "
                f"target_probs[{i + 1}] = {[round(float(x), 2) for x in row]}: position i uses target_probs[i] and "
                "draft_probs[i], and the bonus comes from target_probs[k]",
                diagram=_histogram_diagram(counts),
            )
    counts, kept, _ = _sampled_histograms(accept_sampled, None, [1, 0], SAMPLES // 2, seed=1)
    if not _fits(counts[0], P[0]) or abs(kept - float(P[0, 1])) > 0.04:
        freq = (counts[0] / counts[0].sum()).tolist()
        raise CheckFailed(
            f"with draft_probs=None (deterministic proposals, as prompt lookup makes) the proposal was kept "
            f"{kept:.1%} of the time (expected p(d) = {float(P[0, 1]):.0%}) and the first token had frequencies "
            f"{[round(f, 3) for f in freq]} instead of p: q is then 1 at the proposed token d and 0 elsewhere — keep "
            "d with probability p(d), else draw from p with d removed (the residual of that q)",
            diagram=_histogram_diagram(counts),
        )

    calls = []

    def learner(target_probs, draft_probs, draft_tokens, generator=None):  # what Speculator.verify calls
        calls.append(draft_probs is None)
        got = accept_sampled(target_probs, draft_probs, list(draft_tokens), generator)
        return _validate_emitted(got, list(draft_tokens), target_probs.shape[-1], "accept_sampled in the engine")

    params = SamplingParams(max_tokens=STEPS, temperature=0.8, top_p=0.95, seed=7, ignore_eos=True)
    runs = {}
    for method, spec in (("draft", draft_spec()), ("ngram", {"method": "ngram", "num_speculative_tokens": 3,
                                                                 "adaptive": False, "prompt_lookup_scaled": False})):
        llm = spec_engine(spec)
        with hooks.override(accept_sampled=learner):
            runs[method] = [llm.generate(PROMPTS, params) for _ in range(2)]
    if not calls or all(calls):
        raise RuntimeError("Speculator.verify no longer calls hook accept_sampled")
    for method, (first, again) in runs.items():
        for n, (a, b) in enumerate(zip(first, again)):
            if a.token_ids != b.token_ids:
                raise CheckFailed(
                    f"two runs of prompt {n} with seed=7 ({method} proposals) gave different tokens: draw every random "
                    "number from the generator you are given (torch.rand(..., generator=generator), "
                    "torch.multinomial(..., generator=generator)) — a request's seed must reproduce its output"
                )
    tokens, passes, proposed, accepted = spec_summary(runs["draft"][0])
    return (
        f"over {SAMPLES:,} draws your rule emits exactly the target's distribution (χ² test, with and without the "
        f"draft's probabilities); in the engine, sampling at temperature 0.8 with a seed, the 8M model kept "
        f"{accepted} of the 1M draft's {proposed} proposals ({accepted / proposed:.0%}) — {passes / tokens:.2f} passes "
        "per token — and each request reproduced itself under its seed, with draft and with prompt-lookup proposals"
    )
