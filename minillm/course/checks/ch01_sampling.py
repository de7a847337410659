"""Check for chapter 01's sampling exercise: ``filter_logits``, the filter every sampled token
goes through (hook ``filter_logits``, called by ``minillm.sampling.filtered_logits``).

Hand-made rows first. Each case is built so that one typical mistake changes which tokens stay
or how likely they are: a tie at the k-th logit, a k larger than the vocabulary, a nucleus that
depends on the temperature, on top-k having renormalised, or on a mass landing exactly on
``top_p``, a ``top_p`` so small only the top token may stay, a ``top_p`` of 1 with a token whose
probability rounds away, a temperature so tiny that forgetting to subtract the row maximum
overflows. A wrong answer is compared with the reference recomputed *as each mistake would*,
so the message names the mistake rather than a token index.

Then the engine: seeded sampled requests on the tiny model, with the learner's function plugged
into the hook, against the same requests through the package's filter. The engine samples by
the exponential race (``argmax p_i / E_i`` with noise from the request's own generator), so
equal filtered distributions give equal tokens: the comparison is exact, with no statistics.
"""

from __future__ import annotations

import functools
import math
import os
import traceback
from typing import NamedTuple

import torch

import minillm.hooks as hooks
from minillm.course.checks.common import DEFAULT_MODEL
from minillm.course.compare import compare_tokens
from minillm.course.results import CheckFailed, LearnerRaised, check

NEG = float("-inf")
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_TEMPERATURE = 1.2e-38  # just above float32's smallest normal number: the smallest the engine passes


def _shuffled(values: list[float], order: list[int]) -> list[float]:
    """``values`` (listed most likely first) placed at the vocabulary positions ``order``: the top
    token is never at index 0, so a mask left in sorted order shows."""
    row = [0.0] * len(values)
    for value, position in zip(values, order):
        row[position] = value
    return row


def _log(probs: list[float], order: list[int]) -> list[float]:
    return [math.log(p) for p in _shuffled(probs, order)]


class Case(NamedTuple):
    what: str  # what the case is about, for the messages
    logits: list[list[float]]
    temperature: float
    top_k: int
    top_p: float

    def call(self) -> str:
        rows = len(self.logits)
        return (
            f"filter_logits(logits [{rows}, {len(self.logits[0])}], temperature={self.temperature:g}, "
            f"top_k={self.top_k}, top_p={self.top_p:g}) ({self.what})"
        )


TIE_ROW = [1.0, 4.0, 2.0, 4.0, 3.0, 2.0, 0.0, -1.0]  # sorted: 4, 4, 3, 2, 2, 0, -1 (the 4th and 5th tie)
CASES = [
    Case(
        "temperature alone, two rows",
        [[2.0, 1.0, 0.0, -1.0, 0.5, -2.0, 1.5, -0.5], [-1.0, 3.0, 2.5, 0.5, 1.0, -3.0, 0.0, 2.0]],
        0.5,
        0,
        1.0,
    ),
    Case("top-k whose k-th logit ties with the next", [TIE_ROW, TIE_ROW[::-1]], 1.0, 4, 1.0),
    Case("top-k, two rows", [TIE_ROW, [0.5, -1.0, 2.5, 1.0, 3.0, -0.5, 2.0, 0.0]], 1.3, 3, 1.0),
    Case("top_k larger than the vocabulary", [TIE_ROW], 0.8, 50, 1.0),
    Case("top_k = 1", [[0.5, 2.0, 1.0, 1.5, -1.0]], 2.0, 1, 1.0),
    Case(
        "top-p, two rows",
        [_log([0.5, 0.2, 0.15, 0.1, 0.05], [2, 4, 3, 0, 1]), _log([0.6, 0.25, 0.1, 0.03, 0.02], [4, 1, 0, 3, 2])],
        1.0,
        0,
        0.75,
    ),
    Case(
        "top-p after the temperature",
        [_log([0.5, 0.3, 0.2], [1, 2, 0])],  # T = 0.5: 0.66, 0.24, 0.11
        0.5,
        0,
        0.6,
    ),
    Case(
        "top-p after top-k",
        [_log([0.4, 0.3, 0.2, 0.1], [3, 0, 2, 1])],  # top-k 2 leaves 0.57, 0.43: 0.57 reaches top_p
        1.0,
        2,
        0.42,
    ),
    Case(
        "a nucleus mass exactly equal to top_p",
        [_log([0.5, 0.25, 0.125, 0.125], [1, 3, 0, 2])],  # exact in float32: 0.5 reaches top_p = 0.5
        1.0,
        0,
        0.5,
    ),
    Case(
        "a top_p so small that float32 reads it as 0, two rows",
        [[0.5, 2.0, -1.0, 1.0, 0.0], [1.0, -2.0, 0.5, -1.0, 3.0]],
        1.0,
        0,
        1e-46,
    ),
    Case(
        "top_p = 1 with tokens whose probability rounds away next to the top one",
        [[-25.0, 0.0, -20.0, -22.0]],  # the top token's probability is exactly 1.0 in float32
        1.0,
        0,
        1.0,
    ),
    Case(
        "a tiny temperature, two rows with different maxima",
        [[6.0, 1.0, 2.0, 5.5], [-4.0, -2.0, -3.0, -2.5]],
        TINY_TEMPERATURE,
        0,
        1.0,
    ),
]


def _variant(
    logits: torch.Tensor,
    temperature: float,
    top_k: int,
    top_p: float,
    *,
    scale: str = "divide",
    skip_k: bool = False,
    nucleus_first: bool = False,
    k_shift: int = 0,
    ties: bool = True,
    renormalise: bool = True,
    drop_when: str = "mass before >= p",
    keep_top: bool = True,
    scatter: bool = True,
    skip_p_at_1: bool = True,
) -> torch.Tensor:
    """The filter as written with one mistake (the defaults: the right one)."""
    x = logits - logits.max(dim=-1, keepdim=True).values
    tempered = {"divide": x / temperature, "none": x, "multiply": x * temperature}[scale]
    source = x if nucleus_first else tempered  # what top-p measures its mass on
    out = tempered
    vocab = x.shape[-1]
    if top_k > 0 and not skip_k:
        k = max(1, min(top_k + k_shift, vocab))
        if ties:
            drop = tempered < tempered.sort(dim=-1, descending=True).values[..., k - 1 : k]
        else:
            keep = torch.zeros_like(tempered, dtype=torch.bool).scatter(-1, tempered.topk(k, dim=-1).indices, True)
            drop = ~keep
        out = out.masked_fill(drop, NEG)
        if renormalise:
            source = source.masked_fill(drop, NEG)
    if top_p < 1.0 or not skip_p_at_1:
        probs, order = source.softmax(dim=-1).sort(dim=-1, descending=True)
        mass = probs.cumsum(dim=-1)
        drop = {
            "mass before >= p": mass - probs >= top_p,
            "mass before > p": mass - probs > top_p,
            "mass > p": mass > top_p,
        }[drop_when]
        if keep_top:
            drop[..., 0] = False
        if scatter:
            drop = torch.zeros_like(drop).scatter(-1, order, drop)
        out = out.masked_fill(drop, NEG)
    return out


def _mistakes(case: Case):
    """Each mistake that may change this case's answer, as ``(variant options, message)``. The top-p
    mistakes come before the top-k ones: a case combining both is about top-p (the cases before it
    catch the top-k mistakes), and forgetting to renormalise after top-k can look like a k one off."""
    t, k, p = case.temperature, case.top_k, case.top_p
    yield (
        dict(scale="none"),
        f"the temperature was not applied: divide the logits by it (temperature={t:g} must "
        + ("sharpen" if t < 1 else "flatten")
        + " the distribution)",
    )
    yield (
        dict(scale="multiply"),
        f"the logits were multiplied by the temperature ({t:g}): divide by it — a temperature below 1 sharpens the "
        "distribution, above 1 flattens it",
    )
    yield (
        dict(nucleus_first=True),
        f"top-p chose its tokens from the probabilities before the temperature: divide by the temperature first — "
        f"the nucleus depends on it (at temperature {t:g} the top token alone holds "
        f"{float(_variant(torch.tensor(case.logits), t, k, 1.0).softmax(-1).max()):.0%} of the mass)",
    )
    if p < 1.0:
        yield (
            dict(renormalise=False),
            "top-p measured the probability mass before top-k: the tokens top-k dropped still counted. Apply top-p "
            "to the logits top-k left (their softmax is renormalised over the kept tokens)",
        )
        yield (
            dict(drop_when="mass before > p"),
            f"at exactly top_p the nucleus is complete: drop a token when the mass of the tokens ranked above it is "
            f">= top_p, not > (here the top token's probability is exactly {p:g})",
        )
        yield (
            dict(drop_when="mass > p"),
            "top-p dropped the token whose probability crosses top_p: the nucleus is the smallest set that *reaches* "
            "top_p, so a token stays while the mass ranked *above* it (cumsum - probs) is below top_p",
        )
        yield (
            dict(drop_when="mass > p", keep_top=False),
            "top-p dropped the token whose probability crosses top_p: the nucleus is the smallest set that *reaches* "
            "top_p, so a token stays while the mass ranked *above* it (cumsum - probs) is below top_p",
        )
        yield (
            dict(scatter=False),
            "the top-p mask is in sorted order but was applied to the vocabulary positions: map it back to them "
            "with torch.zeros_like(mask).scatter(-1, order, mask), order being the indices the sort returned",
        )
    else:
        yield (
            dict(skip_p_at_1=False),
            "top_p = 1 keeps every token (it turns top-p off): in float32 the mass above a token of probability "
            "~1e-9 already rounds to 1.0 and the comparison drops it. Skip top-p when top_p >= 1",
        )
    if k > 0:
        yield (
            dict(skip_k=True),
            f"top-k was not applied: top_k = {k} keeps only the {k} largest logit{'s' if k > 1 else ''} of each row "
            "(only top_k = 0 turns it off)",
        )
        yield (
            dict(k_shift=1),
            f"top-k kept one token too many: the k-th largest value is the sorted row's entry k - 1 = {k - 1} "
            "(counting from 0), and a token stays when its logit is >= it",
        )
        yield (
            dict(k_shift=-1),
            f"top-k kept one token too few: keep every token whose logit is >= the k-th largest, the sorted row's "
            f"entry k - 1 = {k - 1} (counting from 0)",
        )
        yield (
            dict(ties=False),
            "top-k kept exactly k tokens and dropped one that ties with the k-th largest logit: keep every token "
            "whose logit is >= the k-th largest value (ties included), e.g. compare with topk(k).values[..., -1:]",
        )


def _reference(logits: torch.Tensor, case: Case) -> torch.Tensor:
    return hooks.default("filter_logits")(logits.clone(), case.temperature, case.top_k, case.top_p)


def _kept(x: torch.Tensor) -> list[list[int]]:
    return [torch.nonzero(row > NEG).flatten().tolist() for row in x]


def _same(got: torch.Tensor, expected: torch.Tensor) -> bool:
    """The same tokens kept, with the same probabilities (what the sampler draws from)."""
    if _kept(got) != _kept(expected) or not bool(torch.isfinite(got.softmax(-1)).all()):
        return False
    return bool(torch.allclose(got.softmax(-1), expected.softmax(-1), atol=1e-5))


def _alike(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same answer, right or wrong (a row with no token left is alike another such row)."""
    return _kept(a) == _kept(b) and bool(torch.allclose(a.softmax(-1), b.softmax(-1), atol=1e-5, equal_nan=True))


def _their_frames(err: BaseException) -> list[str]:
    """The learner's own frames of what they raised (not this package's, not a library's)."""
    frames = [
        f
        for f in traceback.extract_tb(err.__traceback__)
        if not os.path.abspath(f.filename).startswith(_PACKAGE_DIR + os.sep) and "site-packages" not in f.filename
    ]
    return traceback.format_list(frames[-5:])


@functools.lru_cache(maxsize=2)
def _engine(model: str):
    """The tiny model's contiguous engine in fp32 (the sampler is the same in every mode)."""
    from minillm import LLM

    return LLM(model, dtype="fp32", mode="contiguous", attention_backend="torch", seed=0)


def _call(filter_logits, case: Case, logits: torch.Tensor):
    """The learner's function on one case; what it raised, explained when the case tells why."""
    try:
        return filter_logits(logits, case.temperature, case.top_k, case.top_p)
    except LearnerRaised as err:
        cause = err.__cause__
        if isinstance(cause, NotImplementedError):
            raise  # the exercise is not attempted yet: the check says so quietly
        why = ""
        if case.top_k == 0:
            why = ": top_k = 0 means no top-k filter (every token stays), so skip that step"
        elif case.top_k > logits.shape[-1]:
            why = (
                f": a top_k larger than the vocabulary ({case.top_k} > {logits.shape[-1]}) keeps every token — "
                "take min(top_k, vocabulary size) or skip top-k then"
            )
        failure = CheckFailed(f"{case.call()} raised {type(cause).__name__}: {cause}{why}")
        failure.learner_frames = _their_frames(cause)
        raise failure from None


def _diagnose(filter_logits, case: Case, given: torch.Tensor, got, expected: torch.Tensor) -> None:
    """Raise a message naming what is wrong with ``got`` (nothing when it is right)."""
    call = case.call()
    if got is None:
        raise CheckFailed(f"{call} returned None: did you forget the `return`?")
    if not isinstance(got, torch.Tensor):
        raise CheckFailed(f"{call} returned a {type(got).__name__}; return the filtered logits, a torch.Tensor")
    if tuple(got.shape) != tuple(expected.shape):
        raise CheckFailed(
            f"{call} returned shape {tuple(got.shape)}, expected {tuple(expected.shape)}: return every token's logit, "
            "the excluded ones set to float('-inf') (not only the kept tokens)"
        )
    if got.dtype != torch.float32:
        raise CheckFailed(f"{call} returned dtype {got.dtype}: the engine hands you float32 logits; return float32")
    if not torch.equal(given, torch.tensor(case.logits)):
        raise CheckFailed(
            f"{call} changed the logits it was given (an in-place operation such as -=, /=, masked_fill_ or "
            "x[...] = ...): the engine reads them again after your function returns. Compute on new tensors"
        )
    if _same(got, expected):
        return
    if bool(torch.isnan(got).any() | (got == float("inf")).any()):
        (r, j) = (int(i) for i in torch.nonzero(torch.isnan(got) | (got == float("inf")))[0])
        tiny = case.temperature < 1e-30
        raise CheckFailed(
            f"{call} returned {float(got[r, j])} for token {j} of row {r}"
            + (
                ": dividing a logit by a tiny temperature overflows to inf. Subtract each row's maximum *before* "
                "dividing, so that every value is <= 0 and the top one stays exactly 0"
                if tiny
                else ": the sampler cannot draw from NaN or +inf"
            )
        )
    rows = len(case.logits)
    mixed = (
        "the rows were mixed. Each row is filtered on its own: take maxima, sorts, softmaxes and cumsums along the "
        "last dim (dim=-1, keepdim=True where you broadcast back)"
    )
    for r in range(rows if rows > 1 else 0):  # does row r's answer change when only the other rows do?
        others = given.clone()
        others[torch.arange(rows) != r] = others[torch.arange(rows) != r] * 2.0 - 1.0
        again = _call(filter_logits, case, others)
        if (
            isinstance(again, torch.Tensor)
            and again.shape == got.shape
            and not _alike(again[r : r + 1], got[r : r + 1])
        ):
            raise CheckFailed(f"{call}: row {r}'s answer changes when only the other rows do — {mixed}")
    if rows > 1:
        alone = [_call(filter_logits, case, given[r : r + 1].clone()) for r in range(rows)]
        if all(isinstance(a, torch.Tensor) and a.shape == expected[r : r + 1].shape for r, a in enumerate(alone)):
            if all(_same(a.float(), expected[r : r + 1]) for r, a in enumerate(alone)):
                r = next(r for r in range(rows) if not _same(got[r : r + 1], expected[r : r + 1]))
                raise CheckFailed(
                    f"{call}: row {r} is right when passed alone but wrong in the call with {rows} rows — {mixed}"
                )
    for r, row in enumerate(got):
        if not bool((row > NEG).any()):
            raise CheckFailed(
                f"{call} left no token in row {r} (every logit is -inf): the most likely token always stays — "
                "top-p keeps it even when its probability alone exceeds top_p"
                + (
                    f", and even when top_p is so small ({case.top_p:g}) that float32 reads it as 0, which the mass "
                    "before the top token (0) equals. Keep the top token explicitly (drop[..., 0] = False)"
                    if float(torch.tensor(case.top_p)) == 0.0
                    else ""
                )
            )
    if torch.allclose(got, expected.softmax(-1), atol=1e-5):
        raise CheckFailed(
            f"{call} returned probabilities (a softmax): return the filtered *logits*, excluded tokens at -inf — "
            "the engine takes the softmax itself"
        )
    excluded = (expected == NEG) & (got > NEG)
    if bool(excluded.any()):
        values = got[excluded]
        if bool((values == 0).all()):
            raise CheckFailed(
                f"{call} set the excluded tokens to 0, not -inf: after subtracting the maximum, 0 is the top token's "
                "own logit, so they stay as likely as it. Use float('-inf')"
            )
        if bool((values < -1e3).all()):
            raise CheckFailed(
                f"{call} set the excluded tokens to {float(values[0]):g}, not -inf: a finite logit leaves a token "
                "merely unlikely, while an excluded one is marked float('-inf'), which no later shift or change of "
                "precision can bring back"
            )
    x = torch.tensor(case.logits)
    for options, message in _mistakes(case):
        mistake = _variant(x, case.temperature, case.top_k, case.top_p, **options)
        if not _same(mistake, expected) and _kept(mistake) == _kept(got) and _same(got, mistake):
            raise CheckFailed(f"{call}: {message}")
    for r in range(rows):
        kept, want = _kept(got[r : r + 1])[0], _kept(expected[r : r + 1])[0]
        if kept != want:
            raise CheckFailed(f"{call} keeps tokens {kept} of row {r}; the reference keeps {want}")
    probs, want = got.softmax(-1), expected.softmax(-1)
    r, j = (int(i) for i in torch.nonzero((probs - want).abs() == (probs - want).abs().max())[0])
    raise CheckFailed(
        f"{call} gives token {j} of row {r} probability {float(probs[r, j]):.4f}, the reference "
        f"{float(want[r, j]):.4f}: the temperature divides the logits (after subtracting each row's maximum)"
    )


def _requests():
    """Seeded requests whose settings exercise each filter; two share their settings, so the engine
    hands the learner's function a group of two rows."""
    from minillm import SamplingParams

    def params(seed: int, **settings) -> SamplingParams:
        return SamplingParams(max_tokens=24, ignore_eos=True, seed=seed, **settings)

    return [
        ("ROMEO.\nBut soft, what light", params(11, temperature=0.8, top_k=12)),
        ("KING.\nNow is the winter of our discontent", params(12, temperature=1.3, top_p=0.85)),
        ("HAMLET.\nTo be, or not", params(13, temperature=0.6, top_k=30, top_p=0.7)),
        ("JULIET.\nO Romeo, Romeo", params(14, temperature=0.8, top_k=12)),  # shares request 0's group
    ]


@check
def check_filter_logits(filter_logits, model: str = DEFAULT_MODEL) -> str:
    """``filter_logits(logits[R, V], temperature, top_k, top_p) -> [R, V]``: temperature, then
    top-k, then top-p, excluded tokens at -inf."""
    for case in CASES:
        given = torch.tensor(case.logits)
        expected = _reference(given, case)
        got = _call(filter_logits, case, given)
        _diagnose(filter_logits, case, given, got, expected)

    llm = _engine(model)
    prompts = [llm.tokenizer.encode(text) for text, _ in _requests()]
    settings = [p for _, p in _requests()]
    expected = [o.token_ids for o in llm.generate(prompts, settings)]
    calls = []

    def plugged(logits, temperature, top_k, top_p):
        calls.append((temperature, top_k, top_p))
        return filter_logits(logits, temperature, top_k, top_p)

    with hooks.override(filter_logits=plugged):
        got = [o.token_ids for o in llm.generate(prompts, settings)]
    if not calls:
        raise RuntimeError("the engine sampled without calling hook filter_logits")
    for i, (tokens, want, p) in enumerate(zip(got, expected, settings)):
        compare_tokens(
            tokens,
            want,
            f"request {i} (temperature={p.temperature:g}, top_k={p.top_k}, top_p={p.top_p:g}, seed={p.seed})",
            "with the same seed, the same filtered logits give the same token: compare your function with the "
            "reference on rows of the real model's logits",
        )
    total = sum(len(t) for t in got)
    return (
        f"the engine sampled {total} tokens of {len(got)} seeded requests through your filter ({len(calls)} calls), "
        f"identical to its own: {llm.tokenizer.decode(got[0])!r:.60}"
    )
