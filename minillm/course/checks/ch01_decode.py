"""Chapter 01 (prefill and decode): the naive generation loop (with its greedy choice), causal attention."""

from __future__ import annotations

import math

import torch

import minillm.hooks as hooks
from minillm.course.checks.common import (
    DEFAULT_MODEL,
    STEPS,
    diagnose_return,
    diagnose_tokens,
    engine,
    is_token_list,
    prompt_ids,
    reference_tokens,
)
from minillm.course.compare import compare_tensors, compare_tokens
from minillm.course.helpers import forward_logits
from minillm.course.results import CheckFailed, check


def _diagnose_choice(generate_naive, model, prompt: list[int], got: list[int], expected: list[int]) -> None:
    """The tokens are not the reference's: name how token 0 was chosen from the last row of logits
    instead of its argmax (the smallest logit, the largest logit's value, an argmax over the
    positions), or show that the loop draws at random (another run, another continuation)."""
    if not is_token_list(got) or not got or got == expected:
        return
    if got[0] != expected[0]:
        logits = forward_logits(model, prompt)
        last = logits[-1]
        if got[0] == int(last.argmin()):
            raise CheckFailed(
                f"generate_naive: token 0 is {got[0]}, the *smallest* logit of the last position: take the argmax"
            )
        if got[0] == int(last.max()):
            raise CheckFailed(
                f"generate_naive: token 0 is {got[0]}, the largest logit's *value* ({float(last.max()):.2f}) turned "
                "into an int, not its index: argmax returns where the maximum is"
            )
        if got[0] == int(logits.argmax(dim=0)[-1]) and got[0] < len(prompt):
            raise CheckFailed(
                f"generate_naive: token 0 is {got[0]}, a position index rather than a token id: the argmax ran over "
                "the positions (dim 0). Take logits[-1].argmax(), over the vocabulary"
            )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        again = generate_naive(model, list(prompt), min(len(got), 8))
    if is_token_list(again) and again != got[: len(again)]:
        raise CheckFailed(
            "generate_naive gave another continuation when run again on the same prompt: greedy decoding always "
            "takes the most likely token, the argmax — no sampling (torch.multinomial) here"
        )


@check
def check_generate_naive(generate_naive, model: str = DEFAULT_MODEL) -> str:
    """``generate_naive(model, prompt_ids, max_new_tokens) -> list[int]``: the no-cache loop."""
    llm = engine(model, "naive")
    ids = prompt_ids(llm)
    given = list(ids)
    got = generate_naive(llm.model, given, STEPS)
    expected = reference_tokens(model)
    diagnose_return(got, ids, given, STEPS, "generate_naive")
    diagnose_tokens(got, llm.model, ids, expected, "generate_naive", rows_steps=4)
    _diagnose_choice(generate_naive, llm.model, ids, got, expected)
    compare_tokens(
        got,
        expected,
        "generate_naive",
        "each step runs the model on the prompt *plus every token generated so far*, picks the "
        "next token from the last position, and appends it",
    )
    return f"your loop generated {STEPS} tokens identical to the naive engine: {llm.tokenizer.decode(got)!r:.60}"


def _reference_attention(q, k, v):
    """Causal attention where the T queries are the *last* T of the S key positions."""
    t, s = q.shape[-2], k.shape[-2]
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    allowed = torch.ones(t, s, dtype=torch.bool).tril(diagonal=s - t)
    return torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1) @ v


def _attention_mistakes(q, k, v):
    """The wrong answers we have seen most, each with the hint that fixes it."""
    t = q.shape[-2]
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    raw = q @ k.transpose(-1, -2)
    scaled = raw / math.sqrt(q.shape[-1])
    masked = scaled.masked_fill(~causal, float("-inf"))
    yield (
        torch.softmax(raw.masked_fill(~causal, float("-inf")), -1) @ v,
        "the scores are not scaled: divide q·kᵀ by sqrt(head_dim) before the softmax",
    )
    yield (
        torch.softmax(scaled, -1) @ v,
        "no causal mask: position i must not attend to later positions (set those scores to -inf before the softmax)",
    )
    yield (
        torch.softmax(masked, -2) @ v,
        "the softmax runs over the wrong axis: normalise over the keys (dim=-1) so each query's weights sum to 1",
    )
    yield (
        torch.softmax(scaled.masked_fill(causal, float("-inf")), -1).nan_to_num() @ v,
        "the mask is inverted: keep positions j <= i (torch.tril), hide the ones above the diagonal",
    )
    yield (
        torch.softmax(scaled.masked_fill(causal.tril(-1), float("-inf")), -1) @ v,
        "the mask is inverted: keep positions j <= i (torch.tril), hide the ones above the diagonal",
    )
    yield (
        torch.softmax(scaled.masked_fill(~causal.tril(-1), float("-inf")), -1).nan_to_num() @ v,
        "the mask hides the diagonal: a position attends to itself too (keep j <= i, torch.tril() without an offset)",
    )
    yield (
        torch.softmax(scaled, -1).masked_fill(~causal, 0.0) @ v,
        "the mask is applied after the softmax: the weights it keeps no longer sum to 1. Set the hidden scores "
        "to -inf *before* the softmax",
    )
    yield (
        torch.softmax(scaled.masked_fill(~causal, 0.0), -1) @ v,
        "the hidden scores are set to 0, not -inf (what multiplying the scores by a 0/1 mask does): the softmax "
        "still gives each of them weight exp(0). Fill them with float('-inf')",
    )
    yield (
        torch.softmax(raw.masked_fill(~causal, float("-inf")), -1) / math.sqrt(q.shape[-1]) @ v,
        "the scale is applied after the softmax, so the weights sum to 1/sqrt(head_dim): scale the scores, "
        "q·kᵀ / sqrt(head_dim), before the softmax",
    )
    yield (
        torch.softmax(scaled.transpose(-1, -2).masked_fill(~causal, float("-inf")), -1) @ v,
        "the scores are transposed (k·qᵀ): row i must hold query i's scores against every key, q @ k.transpose(-2, -1)",
    )


def _attention_weights(causal_attention, q, k, got):
    """The weights ``[B, H, T, S]`` the learner's function puts on each key, read by passing the
    identity as ``v`` (row j of v is one-hot at j); None unless its output is those weights @ v."""
    s, d = k.shape[-2], k.shape[-1]
    if d < s:
        return None
    eye = torch.zeros(*k.shape)
    eye[..., range(s), range(s)] = 1.0
    out = causal_attention(q.clone(), k.clone(), eye)
    if not isinstance(out, torch.Tensor) or out.shape != got.shape or not bool(torch.isfinite(out).all()):
        return None
    weights = out[..., :s].double()
    return weights if bool(out[..., s:].abs().max() < 1e-6) else None


def _scale_names(t: int, d: int) -> dict[float, str]:
    return {
        1.0 / d: f"divided by head_dim ({d}) instead of by sqrt(head_dim)",
        math.sqrt(d): "multiplied by sqrt(head_dim) instead of divided by it",
        1.0 / math.sqrt(t): f"divided by sqrt({t}), the sqrt of the number of positions (q.shape[-2]), "
        "instead of by sqrt(head_dim) (q.shape[-1])",
    }


def _diagnose_attention(causal_attention, q, k, v, got) -> None:
    """A wrong output that matches no listed mistake: read the weights it gives each key and say
    which rule they break (a later key, a sum other than 1, a scale other than 1/sqrt(head_dim))."""
    if bool(torch.isnan(got[..., -1, :]).all()):
        raise CheckFailed(
            "every output is NaN, even the last query's, which may attend to every key: a NaN got into the "
            "scores themselves. An additive mask built as (0/1 mask) × -inf does that, since 0 × -inf is NaN: "
            "use scores.masked_fill(mask, float('-inf')) or torch.where"
        )
    weights = _attention_weights(causal_attention, q, k, got)
    if weights is None or not torch.allclose(weights.float() @ v, got, atol=1e-4):
        return
    t, s, d = q.shape[-2], k.shape[-2], q.shape[-1]
    allowed = torch.ones(t, s, dtype=torch.bool).tril(diagonal=s - t)
    leak = weights.masked_fill(allowed, 0.0)
    if bool(leak.max() > 1e-6):
        *_, i, j = (int(x) for x in torch.nonzero(leak > 1e-6)[0])
        raise CheckFailed(
            f"query {i} gives weight {float(leak[..., i, j].max()):.2g} to key {j}, a later position: the mask must "
            "hide every key after the query and keep j <= i (torch.tril() without an offset, or hide "
            "torch.triu(diagonal=1))"
        )
    sums = weights.sum(-1)
    if bool((sums - 1).abs().max() > 1e-4):
        where = tuple(int(x) for x in torch.nonzero((sums - 1).abs() > 1e-4)[0])
        raise CheckFailed(
            f"query {where[-1]}'s attention weights sum to {float(sums[where]):.3g}, not 1: the softmax over "
            "the keys (dim=-1) of the masked, scaled scores must be the last step before @ v"
        )
    raw = (q @ k.transpose(-1, -2)).double()
    rows = [(i, j) for i in range(1, t) for j in range(1, i + 1)]
    x = torch.stack([raw[..., i, j] - raw[..., i, 0] for i, j in rows])
    y = torch.stack([weights[..., i, j].log() - weights[..., i, 0].log() for i, j in rows])
    scale = float((x * y).sum() / (x * x).sum())
    if float((y - scale * x).abs().max()) > 1e-3 or math.isclose(scale, 1 / math.sqrt(d), rel_tol=1e-3):
        return
    name = next((n for c, n in _scale_names(t, d).items() if math.isclose(scale, c, rel_tol=1e-3)), None)
    raise CheckFailed(
        f"the scores are scaled by {scale:.4g}"
        + (f": {name}" if name else "")
        + f". Divide q·kᵀ by sqrt(head_dim) = math.sqrt(q.shape[-1]), a factor of {1 / math.sqrt(d):.4g}"
    )


LARGE_SCORE = 100.0  # exp(100) overflows float32 (its largest value is 3.4e38, about e^88.7)


def _check_large_scores(causal_attention, q, k, v) -> None:
    """The same inputs with q scaled until the largest scaled score is ``LARGE_SCORE``: scores
    that large come from real models (sharp heads, long contexts, a bf16 model's outliers). A
    softmax written as exp(x) / sum(exp(x)) overflows to inf / inf = NaN there; subtracting each
    row's max first (softmax(x) = softmax(x - max x)) keeps every exp at most 1."""
    t, s = q.shape[-2], k.shape[-2]
    allowed = torch.ones(t, s, dtype=torch.bool).tril(diagonal=s - t)
    scores = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(~allowed, float("-inf"))
    factor = LARGE_SCORE / float(scores.max())  # the largest score a query may see becomes LARGE_SCORE
    big_q = q * factor
    got = causal_attention(big_q.clone(), k.clone(), v.clone())
    expected = _reference_attention(big_q, k, v)
    if isinstance(got, torch.Tensor) and not bool(torch.isfinite(got).all()):
        bad = "NaN" if bool(torch.isnan(got).any()) else "inf"
        raise CheckFailed(
            f"with q × {factor:.1f} (the largest scaled score is {LARGE_SCORE:.0f}) your attention returned {bad}: "
            f"exp({LARGE_SCORE:.0f}) overflows float32, whose largest value is 3.4e38 ≈ e^88.7, and inf / inf is NaN. "
            "Subtract each row's max score before exp (softmax(x) = softmax(x − max x), so every exp is at most 1), "
            "or use torch.softmax, which does"
        )
    compare_tensors(got, expected, f"causal_attention with q × {factor:.1f} (scaled scores up to {LARGE_SCORE:.0f})")


_NAN_HINT = (
    "a query whose scores are all -inf softmaxes to NaN: every query must keep at least the keys at and "
    "before its own position (does your mask hide the diagonal?)"
)


def mha_adapter(causal_attention):
    """Fit a learner's MHA function ``f(q, k, v)`` into hook ``torch_attention``'s signature (GQA → MHA)."""

    def backend(q, k, v, mask, is_causal, scale):
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        return causal_attention(q, k, v)

    return backend


@check
def check_causal_attention(causal_attention, model: str = DEFAULT_MODEL) -> str:
    """``causal_attention(q, k, v)`` for ``[B, H, T, D]`` tensors (queries and keys at the same positions)."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 8, generator=gen) for _ in range(3))
    expected = _reference_attention(q, k, v)
    given = [x.clone() for x in (q, k, v)]
    got = causal_attention(*given)
    for name, before, after in zip("qkv", (q, k, v), given):
        if not torch.equal(before, after):
            raise CheckFailed(
                f"causal_attention changed its input {name} in place (an operation such as {name} /= ... or "
                f"{name}.mul_(...)): compute on new tensors and leave the caller's {name} as it was"
            )
    if isinstance(got, torch.Tensor) and got.dtype == expected.dtype and got.shape == expected.shape:
        for mistake, hint in _attention_mistakes(q, k, v):
            if torch.allclose(got, mistake, atol=1e-5):
                raise CheckFailed(hint)
        if not torch.allclose(got, expected, atol=1e-5):
            _diagnose_attention(causal_attention, q, k, v, got)
    elif isinstance(got, torch.Tensor) and tuple(got.shape) == (*q.shape[:-1], k.shape[-2]) != expected.shape:
        raise CheckFailed(
            f"causal_attention returned shape {tuple(got.shape)}, [B, H, T, T]: the attention weights (the softmax "
            "of the scores). Multiply them by v to get the output [B, H, T, head_dim]"
        )
    compare_tensors(got, expected, "causal_attention(q, k, v) with T = S = 5", nan_hint=_NAN_HINT)
    _check_large_scores(causal_attention, q, k, v)
    llm = engine(model, "naive")
    from minillm import SamplingParams

    with hooks.override(torch_attention=mha_adapter(causal_attention)):  # every layer's attention
        got_tokens = llm.generate([prompt_ids(llm)], SamplingParams(max_tokens=16, ignore_eos=True))[0].token_ids
    compare_tokens(
        got_tokens,
        reference_tokens(model, 16),
        "the model running your attention",
        "compare your function with the reference on small tensors first",
    )
    return "your attention runs inside every layer of the model and generated 16 tokens identical to the engine's"
