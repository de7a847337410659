"""Checks for chapter 08 (speculative decoding).

Each check first tries the learner's function on hand-made cases built to expose the typical
mistakes (naming the mistake when it recognises one), then plugs it into the engine where the
package's own function runs — the speculator's acceptance rule (hooks ``accept_greedy`` and
``accept_sampled``) or the block manager's rollback (hook ``blocks_to_roll_back``) — and runs the 8M model with
the 1M model as its draft. Greedy output must be the 8M model's own, token for token; sampled
output must reproduce itself under the same seed; the pools must stay consistent after every
step and be empty at the end.

The rejection-sampling check is statistical: it draws a few thousand proposals at a fixed seed
and compares the histogram of emitted tokens with the target's distribution (a χ² test whose
threshold a correct rule fails with probability 1e-6, while the usual mistakes land hundreds
of units above it).
"""

from __future__ import annotations

import math

import torch

import minillm.hooks as hooks
from minillm.course.compare import compare_tokens
from minillm.course.results import CheckFailed, LearnerRaised, check, learner_frames_of

TARGET, DRAFT = "tiny-shakespeare-8m", "tiny-shakespeare-1m"
K = 4
PROMPTS = ["KING.\nNow is the winter of our discontent", "ROMEO.\nBut soft, what light", "HAMLET.\nTo be, or not"]
STEPS = 32


def _engine(spec: dict | None = None, **options):
    from minillm import LLM

    return LLM(TARGET, dtype="fp32", speculative_config=spec, **options)


def _draft_spec(k: int = K) -> dict:
    return {"method": "draft", "model": DRAFT, "num_speculative_tokens": k}


def _greedy(llm, prompts=PROMPTS, steps: int = STEPS):
    from minillm import SamplingParams

    return llm.generate(prompts, SamplingParams(max_tokens=steps, ignore_eos=True))


def _is_int_list(x) -> bool:
    return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def _spec_summary(outs) -> tuple[int, int, int, int]:
    tokens = sum(len(o.token_ids) for o in outs)
    passes = sum(o.metrics.num_forward_passes for o in outs)
    proposed = sum(o.metrics.spec_proposed for o in outs)
    accepted = sum(o.metrics.spec_accepted for o in outs)
    return tokens, passes, proposed, accepted


# ---------------------------------------------------------------------------------------------
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
    if not _is_int_list(got):
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

    reference = [o.token_ids for o in _greedy(_engine(None))]
    llm = _engine(_draft_spec())
    with hooks.override(accept_greedy=learner):
        outs = _greedy(llm)
    if not calls:
        raise RuntimeError("Speculator.verify no longer calls hook accept_greedy")
    for n, (out, ref) in enumerate(zip(outs, reference)):
        compare_tokens(
            out.token_ids, ref, f"prompt {n} with your acceptance rule", "the output must be the target's own"
        )
    tokens, passes, proposed, accepted = _spec_summary(outs)
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
    if not _is_int_list(got):
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
    for method, spec in (("draft", _draft_spec()), ("ngram", {"method": "ngram", "num_speculative_tokens": 3})):
        llm = _engine(spec)
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
    tokens, passes, proposed, accepted = _spec_summary(runs["draft"][0])
    return (
        f"over {SAMPLES:,} draws your rule emits exactly the target's distribution (χ² test, with and without the "
        f"draft's probabilities); in the engine, sampling at temperature 0.8 with a seed, the 8M model kept "
        f"{accepted} of the 1M draft's {proposed} proposals ({accepted / proposed:.0%}) — {passes / tokens:.2f} passes "
        "per token — and each request reproduced itself under its seed, with draft and with prompt-lookup proposals"
    )


# ---------------------------------------------------------------------------------------------
# Exercise 3: rolling back the KV of rejected tokens
# ---------------------------------------------------------------------------------------------


def _split_reference(table: list[int], num_tokens: int, block_size: int) -> tuple[list[int], list[int]]:
    from minillm.kvcache.addressing import RELEASED, blocks_for

    keep = blocks_for(num_tokens, block_size)
    return table[:keep], [b for b in reversed(table[keep:]) if b != RELEASED]


def _span(j: int, block_size: int, num_tokens: int) -> str:
    first, last = j * block_size, min((j + 1) * block_size, num_tokens) - 1
    return f"token {first}" if first == last else f"tokens {first}-{last}"


def _rollback_diagram(table, num_tokens: int, block_size: int, spec: tuple, yours: tuple) -> str:
    """The block table before the rollback, the spec's after and the learner's after, one row
    each, entry j of every row under the tokens it holds."""
    from minillm.kvcache.addressing import RELEASED

    rows = [("before", list(table), None), ("spec after", *spec), ("yours after", *yours)]
    width = max(len(r) for r, _, _ in rows)
    n = max(len(cells) for _, cells, _ in rows)
    spans = [f"{j * block_size}-{(j + 1) * block_size - 1}" for j in range(n)]
    cell = max(len(x) for x in spans + [str(b) for _, cells, _ in rows for b in cells])
    lines = [f"{'tokens':>{width}}    " + "   ".join(f"{x:>{cell}}" for x in spans)]
    for label, cells, freed in rows:
        body = " | ".join(f"{b:>{cell}}" for b in cells)
        line = f"{label:>{width}}: [ {body}{' ' if cells else ''}]"
        if freed is not None:
            line = f"{line:<{width + 5 + n * (cell + 3)}}  freed {freed}"
        lines.append(line.rstrip())
    keep = -(-num_tokens // block_size)
    legend = (
        f"; {RELEASED} = RELEASED, the placeholder of a block a sliding window gave back" if RELEASED in table else ""
    )
    lines.append(f"num_tokens={num_tokens}: keep the first ceil({num_tokens} / {block_size}) = {keep} entries{legend}")
    return "\n".join(lines)


def _diagnose_rollback(got, table: list[int], num_tokens: int, block_size: int) -> None:
    from minillm.kvcache.addressing import RELEASED

    call = f"blocks_to_roll_back({table}, num_tokens={num_tokens}, block_size={block_size})"
    shape = f"{call} should return a tuple (kept, freed) of two lists of ints, got {got!r:.80}"
    if isinstance(got, (tuple, list)) and len(got) == 2:
        for name, part in zip(("kept", "freed"), got):
            if hasattr(part, "__next__"):
                raise CheckFailed(
                    f"{call} returned {name} as a {type(part).__name__}, an iterator, not a list: what reversed(...), "
                    "filter(...) or a generator expression give is used up after one pass — make it a list: list(...)"
                )
    if not (isinstance(got, (tuple, list)) and len(got) == 2 and all(isinstance(x, (list, tuple)) for x in got)):
        raise CheckFailed(shape)
    kept, freed = list(got[0]), list(got[1])
    if not (_is_int_list(kept) and _is_int_list(freed)):
        raise CheckFailed(shape)
    exp_kept, exp_freed = _split_reference(table, num_tokens, block_size)
    if kept == exp_kept and freed == exp_freed:
        return
    head = f"{call} returned kept={kept}, freed={freed}; expected kept={exp_kept}, freed={exp_freed}"
    diagram = _rollback_diagram(table, num_tokens, block_size, (exp_kept, exp_freed), (kept, freed))
    real = [b for b in table if b != RELEASED]
    if RELEASED in exp_kept and kept and RELEASED not in kept and all(b in real for b in kept):
        # Dropped the placeholders: whether from kept alone or from the whole table before splitting it,
        # every later block now sits at the wrong entry (and a block of kept tokens may look "not kept").
        raise CheckFailed(
            f"{head}: you dropped the {RELEASED} (RELEASED) entries from kept — placeholders that keep the positions "
            "of blocks a sliding window already gave back. The placeholders must stay in the table, in place: "
            "entry j of a block table holds tokens j × block_size onwards, so removing one shifts every "
            "later block onto the wrong tokens. Keep the first ceil(num_tokens / block_size) entries as they are, "
            "placeholders included, and skip RELEASED only in freed",
            diagram=diagram,
        )
    both = [b for b in freed if b in kept and b != RELEASED]
    if both:
        j = kept.index(both[0])
        raise CheckFailed(
            f"{head}: block {both[0]} is both kept and given back. It holds {_span(j, block_size, num_tokens)}, which "
            "stay: a block partly filled by kept tokens is kept whole (the next tokens are written after them)",
            diagram=diagram,
        )
    if RELEASED in freed:
        raise CheckFailed(
            f"{head}: you gave back the table entry {RELEASED} (RELEASED): that block was already returned behind a "
            "sliding window — there is no block to free. Skip those entries",
            diagram=diagram,
        )
    if len(kept) < len(exp_kept):
        lost = exp_kept[len(kept)]
        j = len(kept)
        partial = num_tokens % block_size and j == len(exp_kept) - 1
        why = (
            f"the last kept block is only partly filled ({_span(j, block_size, num_tokens)} of a block of "
            f"{block_size}), and those tokens stay"
            if partial
            else f"it holds {_span(j, block_size, num_tokens)}, which stay"
        )
        raise CheckFailed(
            f"{head}: block {lost} must be kept — {why}. Keep blocks_for(num_tokens) = ceil(num_tokens / block_size) "
            f"= {len(exp_kept)} blocks",
            diagram=diagram,
        )
    if len(kept) > len(exp_kept):
        extra = kept[len(exp_kept)]
        raise CheckFailed(
            f"{head}: {len(kept)} blocks kept for {num_tokens} tokens of {block_size} per block — block {extra} holds "
            f"only rejected positions: keep ceil(num_tokens / block_size) = {len(exp_kept)} blocks and give the rest back",
            diagram=diagram,
        )
    if kept != exp_kept:
        raise CheckFailed(f"{head}: kept must be the table's first {len(exp_kept)} entries, in order", diagram=diagram)
    zero = " — block 0 is a real block (only RELEASED, -1, marks a missing one): test `b != RELEASED`, not `b > 0`"
    if not freed and exp_freed:
        raise CheckFailed(
            f"{head}: blocks {exp_freed} hold only rejected tokens and are neither kept nor given back — they would "
            "leak from the pool: return them as freed" + (zero if 0 in exp_freed else ""),
            diagram=diagram,
        )
    missing = [b for b in exp_freed if b not in freed]
    if missing and set(freed) <= set(exp_freed):
        raise CheckFailed(
            f"{head}: block{'s' if len(missing) > 1 else ''} {missing} hold{'' if len(missing) > 1 else 's'} only "
            f"rejected tokens but {'are' if len(missing) > 1 else 'is'} not given back: it would leak from the pool"
            + (zero if 0 in missing else ""),
            diagram=diagram,
        )
    if sorted(freed) == sorted(exp_freed) and freed == sorted(freed, reverse=True) != exp_freed[::-1]:
        raise CheckFailed(
            f"{head}: you sorted the blocks by their number. Tail first means by their place in the table — the "
            "last entry first (reversed(table[keep:])), as BlockManager.free gives them back: a block's number "
            "says nothing about where it sits in the sequence",
            diagram=diagram,
        )
    if sorted(freed) == sorted(exp_freed):
        raise CheckFailed(
            f"{head}: give the blocks back tail first (the last block of the table first), as BlockManager.free does: "
            "with prefix caching an unreferenced block stays cached and is evicted in the order it was given back, "
            "and the end of a sequence should go before its beginning, which other requests may share",
            diagram=diagram,
        )
    raise CheckFailed(f"{head}: freed must be the table's entries after the kept ones, last first", diagram=diagram)


ROLLBACK_CASES = [
    # table, num_tokens, block_size: what each case is about
    ([3, 8, 5, 9], 6, 4),  # the last kept block (8) is partly filled: tokens 4-5
    ([3, 8, 5], 8, 4),  # exactly two full blocks stay
    ([3, 8], 7, 4),  # nothing to give back
    ([7, 2, 6], 0, 4),  # back to nothing: everything goes, tail first
    ([10, 20, 30, 40], 17, 16),  # larger blocks: tokens 16-16 keep block 20
    ([-1, -1, 4, 11, 12], 13, 4),  # a sliding window released the first two blocks
    ([-1, -1, 4, 11], 0, 4),  # ... and a rollback past them frees only real blocks
    ([6, 2, 0], 5, 4),  # block 0 is a block like any other: it is given back
    ([0, 9, 1], 3, 4),  # ... or kept
]


def _pool_tables(llm) -> tuple[dict, dict]:
    draft = llm.engine.speculator.draft
    return (
        {rid: list(t) for rid, t in llm.engine.block_manager.tables.items()},
        {rid: list(t) for rid, t in draft.blocks.tables.items()},
    )


@check
def check_rollback(blocks_to_roll_back, model: str = TARGET) -> str:
    """``blocks_to_roll_back(table, num_tokens, block_size) -> (kept, freed)``: the blocks a
    rollback keeps and those it gives back, tail first."""
    from minillm import SamplingParams

    for table, num_tokens, block_size in ROLLBACK_CASES:
        _diagnose_rollback(blocks_to_roll_back(list(table), num_tokens, block_size), table, num_tokens, block_size)

    calls = []

    def learner(table, num_tokens, block_size):  # what BlockManager.truncate calls
        got = blocks_to_roll_back(list(table), num_tokens, block_size)
        _diagnose_rollback(got, list(table), num_tokens, block_size)
        kept, freed = (list(x) for x in got)
        calls.append(len(freed))
        return kept, freed

    options = dict(block_size=4, max_num_batched_tokens=64)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    plain = [o.token_ids for o in _greedy(_engine(None, **options), steps=40)]
    mine, ref = _engine(_draft_spec(), **options), _engine(_draft_spec(), **options)
    for n, prompt in enumerate(PROMPTS):
        mine.engine.add_request(prompt, params, request_id=n)
        ref.engine.add_request(prompt, params, request_id=n)
    outputs, step = {}, 0
    while mine.engine.has_unfinished_requests():
        with hooks.override(blocks_to_roll_back=learner):
            deltas = mine.engine.step()
        ref.engine.step()
        step += 1
        for delta in deltas:
            if delta.output is not None:
                outputs[delta.request_id] = delta.output
        for name, pool in (
            ("the 8M model's", mine.engine.block_manager),
            ("the draft's", mine.engine.speculator.draft.blocks),
        ):
            try:
                pool.check_invariants()
            except AssertionError as err:
                raise CheckFailed(f"after step {step}, {name} KV pool is inconsistent: {err}") from None
        for name, got, expected in zip(("the 8M model's", "the draft's"), _pool_tables(mine), _pool_tables(ref)):
            if got != expected:
                rid = next(r for r in expected.keys() | got.keys() if got.get(r) != expected.get(r))
                raise CheckFailed(
                    f"after step {step}, request {rid}'s block table in {name} pool is {got.get(rid)}, "
                    f"the package's rollback gives {expected.get(rid)}"
                )
    if not calls:
        raise RuntimeError("BlockManager.truncate no longer calls hook blocks_to_roll_back")
    for n in range(len(PROMPTS)):
        compare_tokens(
            outputs[n].token_ids, plain[n], f"prompt {n} with your rollback", "roll back only rejected tokens"
        )
    stats = mine.engine.stats()
    if stats.kv_blocks_used or stats.draft_kv_blocks_used:
        raise CheckFailed(
            f"every request finished, but {stats.kv_blocks_used} blocks of the 8M model's pool and "
            f"{stats.draft_kv_blocks_used} of the draft's are still in use: blocks leaked"
        )
    freed = sum(calls)
    return (
        f"your rollback ran {len(calls)} times over {step} steps ({freed} blocks of 4 tokens given back, in the 8M "
        f"model's pool and the draft's): both pools consistent after every step and empty at the end, block tables "
        f"identical to the package's, {len(PROMPTS)}×40 tokens identical to the 8M model alone"
    )


# ---------------------------------------------------------------------------------------------
# Exercise 4: the tree attention mask
# ---------------------------------------------------------------------------------------------

# Trees as parent lists (-1: a child of the sequence's last token), parents before children.
TREE_CASES = [
    [-1, 0, 1, 2],  # a chain: the mask is the causal triangle
    [-1, 0, -1, 2],  # two branches of two
    [-1, -1, -1],  # three alternatives for the same position
    [-1, 0, 0, 1, 2, -1, 5, 6],  # branching below the root, and a second chain
    [-1, 0, 1, 0, 3, 1],  # depth 3 with a fork at each level
    [-1],
    [],
]


def _reference_tree_mask(parents: list[int]) -> torch.Tensor:
    from minillm.speculative.tree import tree_attention_mask

    return tree_attention_mask(parents)


def _ancestors(parents: list[int], i: int) -> list[int]:
    out = []
    while parents[i] >= 0:
        i = parents[i]
        out.append(i)
    return out


def _diagnose_tree_mask(got, parents: list[int]) -> torch.Tensor:
    n = len(parents)
    if not isinstance(got, torch.Tensor):
        raise CheckFailed(f"tree_attention_mask({parents}) returned a {type(got).__name__}: return a torch.Tensor")
    if tuple(got.shape) != (n, n):
        raise CheckFailed(
            f"tree_attention_mask({parents}) has shape {tuple(got.shape)}: one row and one column per node, ({n}, {n})"
        )
    if got.dtype != torch.bool:
        raise CheckFailed(
            f"tree_attention_mask({parents}) is {got.dtype}: return a bool mask (True = may attend), which "
            "scaled_dot_product_attention reads as allowed/blocked — not 0/1 numbers or an additive -inf mask"
        )
    expected = _reference_tree_mask(parents)
    if torch.equal(got, expected):
        return got
    for i in range(n):
        if not got[i, i]:
            raise CheckFailed(f"in tree {parents}, node {i} does not see itself: a token attends to its own key too")
    if n > 1 and torch.equal(got, expected.T):
        raise CheckFailed(
            f"in tree {parents}, your mask is transposed: row i is node i's query, so it must mark i's ancestors "
            "(the nodes it continues), not its descendants"
        )
    for i in range(n):
        for j in range(n):
            if got[i, j] and not expected[i, j]:
                if j > i:
                    why = f"node {j} comes after it (a child or another branch)"
                elif torch.equal(got, torch.ones(n, n, dtype=torch.bool).tril()):
                    why = (
                        f"node {j} is on another branch: a causal triangle is right for a chain only — "
                        "in a tree, earlier in the list is not the same as earlier in the branch"
                    )
                else:
                    why = f"node {j} is not on its branch (its ancestors are {_ancestors(parents, i) or 'none'})"
                raise CheckFailed(f"in tree {parents}, node {i} may attend to node {j}, but {why}")
            if expected[i, j] and not got[i, j]:
                hint = (
                    " — every ancestor, not only the parent: the grandparent's token is part of the text before it"
                    if parents[i] != j
                    else ""
                )
                raise CheckFailed(f"in tree {parents}, node {i} cannot see node {j}, its ancestor{hint}")
    raise CheckFailed(f"in tree {parents}, your mask differs from the expected one")  # not reached


@check
def check_tree_attention_mask(tree_attention_mask, model: str = TARGET) -> str:
    """``tree_attention_mask(parents[N]) -> bool [N, N]``: node ``i`` sees itself and its ancestors."""
    from minillm.assets import resolve_model
    from minillm.models import load_model
    from minillm.speculative.tree import tree_pass

    for parents in TREE_CASES:
        given = list(parents)
        _diagnose_tree_mask(tree_attention_mask(given), parents)
        if given != parents:
            raise CheckFailed(f"tree_attention_mask changed its argument: {parents} became {given}")
    gen = torch.Generator().manual_seed(4)
    trees = []
    for _ in range(40):  # random trees: each node's parent drawn among the root and the earlier nodes
        n = int(torch.randint(1, 9, (), generator=gen))
        parents = [int(torch.randint(-1, i, (), generator=gen)) if i else -1 for i in range(n)]
        _diagnose_tree_mask(tree_attention_mask(list(parents)), parents)
        trees.append(parents)

    # Into the verify pass: one pass of the 8M model over a prompt and a tree, each node's logits
    # against its branch run as plain text.
    target = load_model(resolve_model(model), torch.float32)
    calls = []

    def learner(parents):
        got = tree_attention_mask(list(parents))
        _diagnose_tree_mask(got, list(parents))
        calls.append(len(parents))
        return got

    from minillm.tokenizer import Tokenizer

    prompt = Tokenizer(resolve_model(model)).encode(PROMPTS[2])
    vocab = target.config.vocab_size
    nodes = 0
    for parents in trees[:6] + [TREE_CASES[3]]:
        drafts = torch.randint(0, vocab, (len(parents),), generator=gen).tolist()
        with hooks.override(tree_attention_mask=learner):
            logits, _ = tree_pass(target, prompt, drafts, parents)
        for i in range(len(parents)):
            branch = [drafts[j] for j in reversed([i, *_ancestors(parents, i)])]
            alone, _ = tree_pass(target, prompt + branch, [], [])
            diff = float((logits[1 + i] - alone[0]).abs().max())
            nodes += 1
            if diff > 1e-3:
                raise CheckFailed(
                    f"in the verify pass over tree {parents}, node {i}'s logits differ from its branch run alone by "
                    f"{diff:.3g}: it saw tokens that are not its branch's"
                )
    if not calls:
        raise RuntimeError("tree_pass no longer calls hook tree_attention_mask")
    return (
        f"your mask is right on {len(TREE_CASES) + len(trees)} trees; in {len(calls)} verify passes of the 8M model "
        f"every one of {nodes} draft nodes got the logits of its own branch run alone (to within 1e-3: the same "
        "sums in another order)"
    )
