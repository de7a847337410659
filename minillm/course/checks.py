"""One check per exercise. Each plugs the learner's function into the real engine where it
belongs, compares with the reference (shapes, dtypes, values, then end-to-end greedy tokens),
and explains a failure precisely.

Checks run on the tiny Shakespeare model by default so that they take a second or two; pass
``model=`` (a name or folder) to run them on another.
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import NamedTuple

import torch

import minillm.hooks as hooks
from minillm.course.compare import compare_tensors, compare_tokens
from minillm.course.helpers import forward_logits
from minillm.course.results import CheckFailed, check

DEFAULT_MODEL = "tiny-shakespeare-1m"
PROMPT = "ROMEO.\nBut soft, what light"
STEPS = 32


@functools.lru_cache(maxsize=4)
def engine(model: str, mode: str = "contiguous"):
    """The engine a check plugs learner code into: fp32, the torch attention, one per model and
    mode (cached: every check of a kernel shares it)."""
    from minillm import LLM

    return LLM(model, dtype="fp32", mode=mode, attention_backend="torch", seed=0)


def prompt_ids(llm) -> list[int]:
    """The checks' prompt, in ``llm``'s tokens."""
    return llm.tokenizer.encode(PROMPT)


def reference_tokens(model: str, steps: int = STEPS) -> list[int]:
    """The naive engine's greedy continuation of the checks' prompt: what every rung must reproduce."""
    from minillm import SamplingParams

    llm = engine(model, "naive")
    return llm.generate([prompt_ids(llm)], SamplingParams(max_tokens=steps, ignore_eos=True))[0].token_ids


def _refuse_prompt_echo(got, prompt: list[int], steps: int, what: str) -> None:
    """Returning prompt + new tokens is the commonest slip: say so instead of "token 0 differs"."""
    if isinstance(got, list) and len(got) == len(prompt) + steps and got[: len(prompt)] == prompt:
        raise CheckFailed(
            f"{what} returned {len(got)} tokens: the {len(prompt)} prompt tokens followed by the {steps} new "
            "ones. Return only the new tokens"
        )


def _is_token_list(got) -> bool:
    return isinstance(got, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in got)


def _diagnose_return(got, prompt: list[int], given: list[int], steps: int, what: str) -> None:
    """What a generation loop returned or did to its prompt: nothing, the prompt too, a grown prompt list."""
    if got is None:
        raise CheckFailed(f"{what} returned None: did you forget to `return` the new tokens?")
    _refuse_prompt_echo(got, prompt, steps, what)
    if given != prompt:
        raise CheckFailed(
            f"{what} added tokens to the prompt_ids list it was given (ids = prompt_ids does not copy a list): "
            "copy it first, ids = list(prompt_ids), and leave the caller's prompt as it is"
        )


def _diagnose_tokens(got, model, prompt: list[int], expected: list[int], what: str, rows_steps: int) -> None:
    """Name the slips of a generation loop that "token i differs" would hide: tokens shifted against
    the reference, in reverse, one pass read as generation, the next token read from another row
    (checked over the first ``rows_steps`` tokens)."""
    if not _is_token_list(got) or got == expected or not got:
        return  # right, or a wrong type that compare_tokens names
    steps = len(expected)
    for k in range(1, len(prompt)):
        if got[:k] == prompt[-k:] and len(got) in (steps, steps + k) and got[k:] == expected[: len(got) - k]:
            raise CheckFailed(
                f"{what} returned a list that starts with the last {k} prompt token{'s' if k > 1 else ''} "
                f"{prompt[-k:]} before the new ones: return only the tokens generated after the prompt, each "
                "recorded once it is generated (the new tokens are ids[len(prompt_ids):])"
            )
        if got == expected[k:]:
            raise CheckFailed(
                f"{what}'s list misses the first {k} new token{'s' if k > 1 else ''}: it holds the reference's "
                f"tokens {k}..{steps - 1}. The new tokens start right after the prompt, at ids[len(prompt_ids)]"
            )
    if len(got) > 1 and got == expected[::-1]:
        raise CheckFailed(
            f"{what} returned the right tokens in reverse order: append each new token at the end of the list"
        )
    rows = forward_logits(model, prompt).argmax(dim=-1).tolist()  # the argmax of every prompt row
    if got == rows:
        raise CheckFailed(
            f"{what} returned the argmax of every row of one forward pass over the prompt (the model's guess "
            "after each prompt position): generating needs one pass per new token, each over the prompt plus "
            "the tokens generated so far, reading the last row"
        )
    if got[0] != expected[0]:
        _diagnose_wrong_row(got, model, prompt, expected, what, min(len(got), rows_steps))


def _diagnose_wrong_row(got: list[int], model, prompt: list[int], expected: list[int], what: str, steps: int) -> None:
    """Token 0 differs: is each of the first ``steps`` tokens the argmax of another row than the last,
    the same row each step (counted from the start, as logits[0], or from the end, as logits[-2])?"""
    from_start, from_end = None, None
    for i in range(steps):
        rows = forward_logits(model, prompt + got[:i]).argmax(dim=-1).tolist()
        n = len(rows)
        hits = {r for r in range(n - 1) if rows[r] == got[i]}
        from_start = hits if from_start is None else from_start & hits
        from_end = {n - r for r in hits} if from_end is None else from_end & {n - r for r in hits}
    if steps == 1 and from_start:
        rows = sorted(from_start)
        where = f"row {rows[0]}" if len(rows) == 1 else f"rows {', '.join(map(str, rows))}"
        raise CheckFailed(
            f"{what}: token 0 is {got[0]}, the argmax of {where} of the prompt's logits. The next token follows "
            f"the last position, logits[-1] (row {len(prompt) - 1}, whose argmax is the reference's {expected[0]})"
        )
    if from_start:
        row = min(from_start)
        index = f"logits[{row}]"
    elif from_end:
        row = len(prompt) - min(from_end)
        index = f"logits[-{min(from_end)}]"
    else:
        return
    raise CheckFailed(
        f"{what}: token 0 is {got[0]}, the argmax of row {row} of the prompt's logits, and each of your first "
        f"{steps} tokens is the argmax of {index} over the tokens before it. The next token follows the last "
        f"position, logits[-1] (the reference's token 0 is {expected[0]})"
    )


# ---------------------------------------------------------------------------------------------
# Chapter 01: prefill and decode
# ---------------------------------------------------------------------------------------------


def _refuse_sampling(next_token) -> None:
    """Greedy decoding is deterministic: on nearly flat logits a sampler soon returns another token."""
    flat = torch.zeros(3, 10)
    flat[-1, 7] = 0.5
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        picks = [next_token(flat.clone()) for _ in range(8)]
    if all(isinstance(p, int) for p in picks) and len(set(picks)) > 1:
        raise CheckFailed(
            f"next_token returned different tokens for the same logits ({sorted(set(picks))}): greedy decoding "
            "always takes the most likely token, the argmax — no sampling (torch.multinomial) here"
        )


@check
def check_next_token(next_token, model: str = DEFAULT_MODEL) -> str:
    """``next_token(logits[T, V]) -> int``: the greedy choice after the last position."""
    logits = torch.full((3, 10), -1.0)  # 3 positions, a vocabulary of 10
    logits[0, 6] = 9.0  # the largest value overall, but at the first position
    logits[1, 5] = 5.0
    logits[2, 7] = 3.0  # the answer: the largest value at the last position (int(3.0) is no other answer)
    logits[2, 4] = -3.0  # the smallest value at the last position (what argmin would pick)
    logits[:, 8] = torch.tensor([4.5, 4.5, -1.0])  # the largest sum (or mean) over the positions
    logits[:, 9] = torch.tensor([-9.0, -9.0, 1.0])  # the largest softmax over the positions (dim 0)
    given = logits.clone()
    got = next_token(given)
    if got is None:
        raise CheckFailed("next_token returned None: did you forget the `return`?")
    if isinstance(got, torch.Tensor):
        raise CheckFailed(f"next_token returned a tensor ({got!r}); return a Python int, e.g. with int(...) or .item()")
    if not isinstance(got, int) or isinstance(got, bool):
        raise CheckFailed(f"next_token returned {got!r} ({type(got).__name__}); return one token id as a Python int")
    if not torch.equal(given, logits):
        raise CheckFailed(
            "next_token changed the logits it was given (an in-place operation such as -=, sub_ or x[...] = ...): "
            "leave its input as it is and compute on a new tensor"
        )
    _refuse_sampling(next_token)
    if got == 6:
        raise CheckFailed(
            "next_token returned 6, the argmax of position 0 (or of the whole tensor). The next token "
            "follows the *last* position: use logits[-1]."
        )
    if got == 5:
        raise CheckFailed(
            "next_token returned 5, the argmax of position 1, the second-to-last of 3: the next token "
            "follows the *last* position, logits[-1]"
        )
    if got in (0, 1, 2):
        raise CheckFailed(
            f"next_token returned {got}, a position index rather than a token id: the argmax ran over "
            "the wrong axis. Take logits[-1].argmax(), over the vocabulary."
        )
    if got == 4:
        raise CheckFailed("next_token returned 4, the *smallest* logit of the last position: use argmax, not argmin")
    if got == 3:
        raise CheckFailed(
            "next_token returned 3, the largest logit's *value* (3.0) in the last row, not its index: "
            "use argmax, which returns where the maximum is"
        )
    if got == 8:
        raise CheckFailed(
            "next_token returned 8, the token with the largest logits summed (or averaged) over every position: "
            "only the last position's row scores the next token, logits[-1]"
        )
    if got == 9:
        raise CheckFailed(
            "next_token returned 9: a softmax over the positions (dim=0) rescaled each token's column. "
            "The argmax of logits[-1] needs no softmax; if you take one, it runs over the vocabulary (dim=-1)"
        )
    if got != 7:
        raise CheckFailed(f"next_token returned {got} for constructed logits whose last row peaks at token 7")
    llm = engine(model)
    ids = prompt_ids(llm)
    expected = int(forward_logits(llm.model, ids)[-1].argmax())
    real = next_token(forward_logits(llm.model, ids))
    if real != expected:
        raise CheckFailed(f"on the real model's logits you chose token {real}, the reference chose {expected}")
    return f"you picked token {real} ({llm.tokenizer.decode([real])!r}) after {PROMPT!r}, as the engine does"


@check
def check_generate_naive(generate_naive, model: str = DEFAULT_MODEL) -> str:
    """``generate_naive(model, prompt_ids, max_new_tokens) -> list[int]``: the no-cache loop."""
    llm = engine(model, "naive")
    ids = prompt_ids(llm)
    given = list(ids)
    got = generate_naive(llm.model, given, STEPS)
    expected = reference_tokens(model)
    _diagnose_return(got, ids, given, STEPS, "generate_naive")
    _diagnose_tokens(got, llm.model, ids, expected, "generate_naive", rows_steps=4)
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


# ---------------------------------------------------------------------------------------------
# Chapter 02: the KV cache
# ---------------------------------------------------------------------------------------------


class _Pass(NamedTuple):
    """One forward pass against a KV cache: where it starts, how many tokens, which cache, the first token."""

    start: int
    count: int
    cache: object
    first_token: int


@contextlib.contextmanager
def _forward_passes(model):
    """Every forward pass of ``model`` that runs against a KV cache, in order, as ``_Pass`` records
    (a PyTorch forward pre-hook: nothing of the model is replaced)."""
    passes: list[_Pass] = []

    def record(module, args):
        batch = args[0]
        if batch.cache is not None:
            start, count = int(batch.positions[0, 0]), batch.positions.shape[1]
            passes.append(_Pass(start, count, batch.cache, int(batch.input_ids[0, 0])))

    handle = model.register_forward_pre_hook(record)
    try:
        yield passes
    finally:
        handle.remove()


def _cached_tokens(model: str, steps: int = STEPS) -> list[int]:
    from minillm import SamplingParams

    llm = engine(model, "contiguous")
    return llm.generate([prompt_ids(llm)], SamplingParams(max_tokens=steps, ignore_eos=True))[0].token_ids


@check
def check_kv_write(kv_write, model: str = DEFAULT_MODEL) -> str:
    """``kv_write(k_cache, v_cache, k_new, v_new, start)`` stores new K/V at ``start..start+T-1``."""
    k_cache, v_cache = torch.zeros(2, 3, 10, 4), torch.zeros(2, 3, 10, 4)
    k_new, v_new = torch.randn(2, 3, 2, 4), torch.randn(2, 3, 2, 4)
    k_given, v_given = k_new.clone(), v_new.clone()
    kv_write(k_cache, v_cache, k_given, v_given, 5)
    for name, cache, before, after in (("k_new", "k_cache", k_new, k_given), ("v_new", "v_cache", v_new, v_given)):
        if not torch.equal(before, after):
            raise CheckFailed(
                f"kv_write changed {name}, the new entries it should store: x.copy_(y) copies y *into* x, so "
                f"write into the cache, {cache}[...].copy_({name}) (or {cache}[...] = {name})"
            )
    written_k = [int(p) for p in range(10) if k_cache[:, :, p].abs().sum() > 0]
    written_v = [int(p) for p in range(10) if v_cache[:, :, p].abs().sum() > 0]
    if not written_k:
        raise CheckFailed(
            "after kv_write the key cache is still all zeros: did you store k_new into k_cache "
            "in place (k_cache[...] = k_new), rather than rebinding a local name? (k_cache = torch.cat(...) "
            "or any k_cache = ... makes a new tensor that the caller's cache never sees)"
        )
    if not written_v:
        raise CheckFailed("the keys were written but the value cache is still all zeros: store v_new too")
    if written_k != [5, 6]:
        raise CheckFailed(
            f"new keys landed at positions {written_k}, expected [5, 6] (start=5, two new tokens). "
            "Hint: positions start..start+T-1, along the sequence axis (dim 2)"
        )
    for row in range(k_cache.shape[0]):
        if not bool(k_cache[row].any()):
            raise CheckFailed(
                f"batch row {row} of the key cache was not written: kv_write stores every sequence of the "
                "batch, k_cache[:, :, start:start+T] = k_new (not only row 0)"
            )
    if torch.equal(k_cache[:, :, 5:7], v_new) and torch.equal(v_cache[:, :, 5:7], k_new):
        raise CheckFailed(
            "k_cache[:, :, 5:7] after kv_write differs from k_new: it holds v_new, and v_cache holds k_new. "
            "The two are swapped: keys go into k_cache, values into v_cache"
        )
    if torch.equal(v_cache[:, :, 5:7], k_new):
        raise CheckFailed("the value cache holds the new keys (k_new): store v_new into v_cache")
    compare_tensors(k_cache[:, :, 5:7], k_new, "k_cache[:, :, 5:7] after kv_write")
    compare_tensors(v_cache[:, :, 5:7], v_new, "v_cache[:, :, 5:7] after kv_write")
    stale_k, stale_v = torch.randn(2, 3, 10, 4), torch.randn(2, 3, 10, 4)  # slots that held an earlier sequence
    k_cache, v_cache = stale_k.clone(), stale_v.clone()
    kv_write(k_cache, v_cache, k_new.clone(), v_new.clone(), 3)
    if torch.allclose(k_cache[:, :, 3:5], stale_k[:, :, 3:5] + k_new):
        raise CheckFailed(
            "kv_write added k_new to what the cache held at positions 3..4 (+=): a slot may still hold an "
            "earlier sequence's keys and values. Assign (=) so that the new ones replace them"
        )
    compare_tensors(k_cache[:, :, 3:5], k_new, "k_cache[:, :, 3:5] after kv_write into a cache that held values")
    compare_tensors(v_cache[:, :, 3:5], v_new, "v_cache[:, :, 3:5] after kv_write into a cache that held values")
    with hooks.override(kv_write=kv_write):  # every cache write of a prefill or an equal-length decode
        got = _cached_tokens(model)
    compare_tokens(
        got,
        reference_tokens(model),
        "the engine writing through your kv_write",
        "the prefill writes the whole prompt at start=0, each decode step one token at its position",
    )
    return f"the engine's cache now stores K/V through your kv_write: {STEPS} tokens identical to the naive engine"


@check
def check_kv_read(kv_read, model: str = DEFAULT_MODEL) -> str:
    """``kv_read(k_cache, v_cache, length)`` returns the first ``length`` positions of each."""
    k_cache, v_cache = torch.randn(2, 3, 10, 4), torch.randn(2, 3, 10, 4)
    got = kv_read(k_cache, v_cache, 7)
    if not isinstance(got, (tuple, list)) or len(got) != 2:
        raise CheckFailed(f"kv_read should return a pair (keys, values), got {type(got).__name__}")
    k, v = got
    if isinstance(k, torch.Tensor) and k.dim() == 4 and k.shape[2] in (6, 8) and k.shape[:2] == k_cache.shape[:2]:
        fix = "not [:length-1]" if k.shape[2] == 6 else "not [:length+1]"
        raise CheckFailed(f"kv_read returned {k.shape[2]} positions for length=7: off by one (use [:length], {fix})")
    if isinstance(k, torch.Tensor) and k.shape == k_cache[:, :, 7].shape:
        raise CheckFailed(
            f"kv_read returned one position (shape {tuple(k.shape)}), as k_cache[:, :, length] does: slice the "
            "first length positions, k_cache[:, :, :length]"
        )
    if isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor) and k.shape == v.shape == k_cache[:, :, :7].shape:
        if torch.equal(k, v_cache[:, :, :7]) and torch.equal(v, k_cache[:, :, :7]):
            raise CheckFailed("kv_read returned (values, keys): the two are swapped, return the keys first")
        for first in range(1, 4):
            if torch.equal(k, k_cache[:, :, first : first + 7]):
                raise CheckFailed(
                    f"keys returned by kv_read(..., length=7) are positions {first}..{first + 6} of the cache: "
                    "read the first length positions, 0..length-1 ([:length])"
                )
    compare_tensors(k, k_cache[:, :, :7], "keys returned by kv_read(..., length=7)")
    compare_tensors(v, v_cache[:, :, :7], "values returned by kv_read(..., length=7)")
    if k.data_ptr() != k_cache.data_ptr():
        raise CheckFailed(
            "kv_read copied the cache: return a view (slicing), so a decode step does not copy "
            "the whole history every time (.clone(), .contiguous() and indexing with a list all copy)"
        )
    with hooks.override(kv_read=kv_read):  # every attention layer's read of the cache
        got_tokens = _cached_tokens(model)
    compare_tokens(
        got_tokens,
        reference_tokens(model),
        "the engine reading through your kv_read",
        "attention must see every cached position up to and including the new token",
    )
    return f"every attention layer now reads its history through your kv_read: {STEPS} tokens match the naive engine"


@check
def check_generate_cached(generate_cached, model: str = DEFAULT_MODEL) -> str:
    """``generate_cached(model, prompt_ids, max_new_tokens)``: prefill once, then one token per step."""
    llm = engine(model, "contiguous")
    ids = prompt_ids(llm)
    given = list(ids)
    with _forward_passes(llm.model) as calls:
        got = generate_cached(llm.model, given, STEPS)
    _diagnose_return(got, ids, given, STEPS, "generate_cached")
    if not calls:
        raise CheckFailed(
            "your loop never ran the model through the cache: call forward_step(model, ids, start, cache)"
        )
    if calls[0][:2] != (0, len(ids)):
        raise CheckFailed(
            f"the first forward pass wrote positions {calls[0].start}..{calls[0].start + calls[0].count - 1}; the "
            f"prefill should write the whole prompt at positions 0..{len(ids) - 1}"
        )
    long_steps = [c for c in calls[1:] if c.count != 1]
    if long_steps:
        raise CheckFailed(
            f"after the prefill, a step fed {long_steps[0].count} tokens at position {long_steps[0].start}: feed "
            "only the newest token (the cache already holds the others)"
        )
    fresh = next((step for step, c in enumerate(calls[1:], start=1) if c.cache is not calls[0].cache), None)
    if fresh is not None:
        raise CheckFailed(
            f"decode step {fresh} ran against a new cache, not the one the prefill filled: a new cache holds none "
            "of the earlier tokens' keys and values. Create the cache once, before the loop, and pass that same "
            "cache to every forward_step"
        )
    if len(calls) == STEPS + 1:
        raise CheckFailed(
            f"your loop ran {len(calls)} forward passes for {STEPS} new tokens, one too many: the prefill's "
            f"last row already gives the first new token, so {STEPS} tokens take 1 prefill + {STEPS - 1} decode steps"
        )
    if len(calls) != STEPS:
        raise CheckFailed(
            f"your loop ran {len(calls)} forward passes for {STEPS} new tokens; expected 1 prefill + "
            f"{STEPS - 1} one-token decode steps"
        )
    for step, call in enumerate(calls[1:], start=1):
        expected_pos = len(ids) + step - 1
        if call.start != expected_pos:
            raise CheckFailed(
                f"decode step {step} ran at position {call.start}, expected {expected_pos}. Hint: the token "
                "you feed sits at position len(prompt) + (tokens generated before it) - 1"
            )
    if _is_token_list(got) and len(got) >= len(calls) - 1:
        for step, call in enumerate(calls[1:], start=1):
            if call.first_token != got[step - 1]:
                raise CheckFailed(
                    f"decode step {step} fed token {call.first_token}, but the token generated before it is "
                    f"{got[step - 1]} (your token {step - 1}): each step feeds the newest token, [new[-1]]"
                )
    expected = reference_tokens(model)
    _diagnose_tokens(got, llm.model, ids, expected, "generate_cached", rows_steps=1)
    compare_tokens(
        got,
        expected,
        "generate_cached",
        "feed each new token at its own position and read logits from the last row",
    )
    return f"your decode step generated {STEPS} tokens identical to the naive engine, with one prefill and {len(calls) - 1} one-token steps"
