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

import torch

import minillm.hooks as hooks
from minillm.course.compare import compare_tensors, compare_tokens
from minillm.course.helpers import forward_logits
from minillm.course.results import CheckFailed, check

DEFAULT_MODEL = "tiny-shakespeare-1m"
PROMPT = "ROMEO.\nBut soft, what light"
STEPS = 32


@functools.lru_cache(maxsize=4)
def _engine(model: str, mode: str = "contiguous"):
    from minillm import LLM

    return LLM(model, dtype="fp32", mode=mode, attention_backend="torch", seed=0)


def _prompt_ids(llm) -> list[int]:
    return llm.tokenizer.encode(PROMPT)


def _reference_tokens(model: str, steps: int = STEPS) -> list[int]:
    from minillm import SamplingParams

    llm = _engine(model, "naive")
    return llm.generate([_prompt_ids(llm)], SamplingParams(max_tokens=steps, ignore_eos=True))[0].token_ids


def _refuse_prompt_echo(got, prompt: list[int], steps: int, what: str) -> None:
    """Returning prompt + new tokens is the commonest slip: say so instead of "token 0 differs"."""
    if isinstance(got, list) and len(got) == len(prompt) + steps and got[: len(prompt)] == prompt:
        raise CheckFailed(
            f"{what} returned {len(got)} tokens: the {len(prompt)} prompt tokens followed by the {steps} new "
            "ones. Return only the new tokens"
        )


# ---------------------------------------------------------------------------------------------
# Chapter 01: prefill and decode
# ---------------------------------------------------------------------------------------------


@check
def check_next_token(next_token, model: str = DEFAULT_MODEL) -> str:
    """``next_token(logits[T, V]) -> int``: the greedy choice after the last position."""
    logits = torch.full((3, 8), -1.0)  # 3 positions, a vocabulary of 8
    logits[0, 6] = 9.0  # the largest value overall, but at the first position
    logits[1, 5] = 5.0
    logits[2, 7] = 2.0  # the answer: the largest value at the last position
    logits[2, 4] = -3.0  # the smallest value at the last position (what argmin would pick)
    got = next_token(logits)
    if isinstance(got, torch.Tensor):
        raise CheckFailed(f"next_token returned a tensor ({got!r}); return a Python int, e.g. with int(...) or .item()")
    if not isinstance(got, int) or isinstance(got, bool):
        raise CheckFailed(f"next_token returned {got!r} ({type(got).__name__}); return one token id as a Python int")
    if got == 6:
        raise CheckFailed(
            "next_token returned 6, the argmax of position 0 (or of the whole tensor). The next token "
            "follows the *last* position: use logits[-1]."
        )
    if got in (0, 1, 2):
        raise CheckFailed(
            f"next_token returned {got}, a position index rather than a token id: the argmax ran over "
            "the wrong axis. Take logits[-1].argmax(), over the vocabulary."
        )
    if got == 4:
        raise CheckFailed("next_token returned 4, the *smallest* logit of the last position: use argmax, not argmin")
    if got != 7:
        raise CheckFailed(f"next_token returned {got} for constructed logits whose last row peaks at token 7")
    llm = _engine(model)
    ids = _prompt_ids(llm)
    expected = int(forward_logits(llm.model, ids)[-1].argmax())
    real = next_token(forward_logits(llm.model, ids))
    if real != expected:
        raise CheckFailed(f"on the real model's logits you chose token {real}, the reference chose {expected}")
    return f"you picked token {real} ({llm.tokenizer.decode([real])!r}) after {PROMPT!r}, as the engine does"


@check
def check_generate_naive(generate_naive, model: str = DEFAULT_MODEL) -> str:
    """``generate_naive(model, prompt_ids, max_new_tokens) -> list[int]``: the no-cache loop."""
    llm = _engine(model, "naive")
    ids = _prompt_ids(llm)
    got = generate_naive(llm.model, list(ids), STEPS)
    expected = _reference_tokens(model)
    _refuse_prompt_echo(got, ids, STEPS, "generate_naive")
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


_NAN_HINT = (
    "a query whose scores are all -inf softmaxes to NaN: every query must keep at least the keys at and "
    "before its own position (does your mask hide the diagonal?)"
)


def _attention_adapter(causal_attention):
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
    got = causal_attention(q, k, v)
    if isinstance(got, torch.Tensor) and got.shape == expected.shape:
        for mistake, hint in _attention_mistakes(q, k, v):
            if torch.allclose(got, mistake, atol=1e-5):
                raise CheckFailed(hint)
    compare_tensors(got, expected, "causal_attention(q, k, v) with T = S = 5", nan_hint=_NAN_HINT)
    llm = _engine(model, "naive")
    from minillm import SamplingParams

    with hooks.override(torch_attention=_attention_adapter(causal_attention)):  # every layer's attention
        got_tokens = llm.generate([_prompt_ids(llm)], SamplingParams(max_tokens=16, ignore_eos=True))[0].token_ids
    compare_tokens(
        got_tokens,
        _reference_tokens(model, 16),
        "the model running your attention",
        "compare your function with the reference on small tensors first",
    )
    return "your attention runs inside every layer of the model and generated 16 tokens identical to the engine's"


# ---------------------------------------------------------------------------------------------
# Chapter 02: the KV cache
# ---------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _forward_passes(model):
    """The ``(first position, tokens)`` of every forward pass of ``model`` that runs against a KV
    cache, in order (a PyTorch forward pre-hook: nothing of the model is replaced)."""
    passes: list[tuple[int, int]] = []

    def record(module, args):
        batch = args[0]
        if batch.cache is not None:
            passes.append((int(batch.positions[0, 0]), batch.positions.shape[1]))

    handle = model.register_forward_pre_hook(record)
    try:
        yield passes
    finally:
        handle.remove()


def _cached_tokens(model: str, steps: int = STEPS) -> list[int]:
    from minillm import SamplingParams

    llm = _engine(model, "contiguous")
    return llm.generate([_prompt_ids(llm)], SamplingParams(max_tokens=steps, ignore_eos=True))[0].token_ids


@check
def check_kv_write(kv_write, model: str = DEFAULT_MODEL) -> str:
    """``kv_write(k_cache, v_cache, k_new, v_new, start)`` stores new K/V at ``start..start+T-1``."""
    k_cache, v_cache = torch.zeros(2, 3, 10, 4), torch.zeros(2, 3, 10, 4)
    k_new, v_new = torch.randn(2, 3, 2, 4), torch.randn(2, 3, 2, 4)
    kv_write(k_cache, v_cache, k_new, v_new, 5)
    written_k = [int(p) for p in range(10) if k_cache[:, :, p].abs().sum() > 0]
    written_v = [int(p) for p in range(10) if v_cache[:, :, p].abs().sum() > 0]
    if not written_k:
        raise CheckFailed(
            "after kv_write the key cache is still all zeros: did you store k_new into k_cache "
            "in place (k_cache[...] = k_new), rather than rebinding a local name?"
        )
    if not written_v:
        raise CheckFailed("the keys were written but the value cache is still all zeros: store v_new too")
    if written_k != [5, 6]:
        raise CheckFailed(
            f"new keys landed at positions {written_k}, expected [5, 6] (start=5, two new tokens). "
            "Hint: positions start..start+T-1, along the sequence axis (dim 2)"
        )
    compare_tensors(k_cache[:, :, 5:7], k_new, "k_cache[:, :, 5:7] after kv_write")
    compare_tensors(v_cache[:, :, 5:7], v_new, "v_cache[:, :, 5:7] after kv_write")
    with hooks.override(kv_write=kv_write):  # every cache write of a prefill or an equal-length decode
        got = _cached_tokens(model)
    compare_tokens(
        got,
        _reference_tokens(model),
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
    if isinstance(k, torch.Tensor) and k.shape[2] == 6:
        raise CheckFailed("kv_read returned 6 positions for length=7: off by one (use [:length], not [:length-1])")
    compare_tensors(k, k_cache[:, :, :7], "keys returned by kv_read(..., length=7)")
    compare_tensors(v, v_cache[:, :, :7], "values returned by kv_read(..., length=7)")
    if k.data_ptr() != k_cache.data_ptr():
        raise CheckFailed(
            "kv_read copied the cache: return a view (slicing), so a decode step does not copy "
            "the whole history every time"
        )
    with hooks.override(kv_read=kv_read):  # every attention layer's read of the cache
        got_tokens = _cached_tokens(model)
    compare_tokens(
        got_tokens,
        _reference_tokens(model),
        "the engine reading through your kv_read",
        "attention must see every cached position up to and including the new token",
    )
    return f"every attention layer now reads its history through your kv_read: {STEPS} tokens match the naive engine"


@check
def check_generate_cached(generate_cached, model: str = DEFAULT_MODEL) -> str:
    """``generate_cached(model, prompt_ids, max_new_tokens)``: prefill once, then one token per step."""
    llm = _engine(model, "contiguous")
    ids = _prompt_ids(llm)
    with _forward_passes(llm.model) as calls:
        got = generate_cached(llm.model, list(ids), STEPS)
    _refuse_prompt_echo(got, ids, STEPS, "generate_cached")
    if not calls:
        raise CheckFailed(
            "your loop never ran the model through the cache: call forward_step(model, ids, start, cache)"
        )
    if calls[0] != (0, len(ids)):
        raise CheckFailed(
            f"the first forward pass wrote positions {calls[0][0]}..{sum(calls[0]) - 1}; the prefill "
            f"should write the whole prompt at positions 0..{len(ids) - 1}"
        )
    long_steps = [c for c in calls[1:] if c[1] != 1]
    if long_steps:
        raise CheckFailed(
            f"after the prefill, a step fed {long_steps[0][1]} tokens at position {long_steps[0][0]}: feed only "
            "the newest token (the cache already holds the others)"
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
    for step, (start, _) in enumerate(calls[1:], start=1):
        expected_pos = len(ids) + step - 1
        if start != expected_pos:
            raise CheckFailed(
                f"decode step {step} ran at position {start}, expected {expected_pos}. Hint: the token "
                "you feed sits at position len(prompt) + (tokens generated before it) - 1"
            )
    compare_tokens(
        got,
        _reference_tokens(model),
        "generate_cached",
        "feed each new token at its own position and read logits from the last row",
    )
    return f"your decode step generated {STEPS} tokens identical to the naive engine, with one prefill and {len(calls) - 1} one-token steps"
