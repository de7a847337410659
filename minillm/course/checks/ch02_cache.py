"""Chapter 02 (the KV cache): the cache's write, and the cached generation loop."""

from __future__ import annotations

import contextlib
from typing import NamedTuple

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
from minillm.course.results import CheckFailed, check


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
def check_generate_cached(generate_cached, model: str = DEFAULT_MODEL) -> str:
    """``generate_cached(model, prompt_ids, max_new_tokens)``: prefill once, then one token per step."""
    llm = engine(model, "contiguous")
    ids = prompt_ids(llm)
    given = list(ids)
    with _forward_passes(llm.model) as calls:
        got = generate_cached(llm.model, given, STEPS)
    diagnose_return(got, ids, given, STEPS, "generate_cached")
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
    if is_token_list(got) and len(got) >= len(calls) - 1:
        for step, call in enumerate(calls[1:], start=1):
            if call.first_token != got[step - 1]:
                raise CheckFailed(
                    f"decode step {step} fed token {call.first_token}, but the token generated before it is "
                    f"{got[step - 1]} (your token {step - 1}): each step feeds the newest token, [new[-1]]"
                )
    expected = reference_tokens(model)
    diagnose_tokens(got, llm.model, ids, expected, "generate_cached", rows_steps=1)
    compare_tokens(
        got,
        expected,
        "generate_cached",
        "feed each new token at its own position and read logits from the last row",
    )
    return f"your decode step generated {STEPS} tokens identical to the naive engine, with one prefill and {len(calls) - 1} one-token steps"
