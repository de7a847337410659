"""Chapter 08's whole piece: the speculative decoding loop — propose, verify in one pass, accept,
roll back — as ``speculative_decode(model, prompt_ids, max_new_tokens, k) -> (tokens, passes)``.

It runs the real model against one KV cache (``forward_step``), so every pass it makes is
watched (a forward pre-hook records where each pass starts and how many tokens it feeds):

1. **the passes** — the prefill writes the whole prompt once; each later pass feeds the last
   emitted token and at most ``k`` proposals, starting exactly where the kept tokens end (the
   rollback: a rejected proposal's K/V is overwritten by the next pass), always into the same
   cache; the passes the learner reports are the passes that ran;
2. **the tokens** — equal to plain greedy decoding on an answer that repeats itself (where prompt
   lookup guesses well, so most passes must keep several tokens) and on one that does not, for
   several lengths and ``k``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from minillm.course.checks.common import engine
from minillm.course.results import CheckFailed, check

MODEL = "tiny-shakespeare-8m"
#: The 8M model's greedy answer to this repeats itself ("And, as the king, and the king..."): prompt
#: lookup finds most of it in the tokens so far (48 tokens in 23 passes at k=4).
REPEATING = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n\nFirst Citizen:\n"
PLAIN = "KING.\nNow is the winter"
#: (prompt, new tokens, k)
RUNS = [(REPEATING, 48, 4), (PLAIN, 17, 3), (REPEATING, 9, 8)]


def _greedy(llm, ids: list[int], n: int) -> list[int]:
    from minillm import SamplingParams

    return llm.generate([ids], SamplingParams(max_tokens=n, ignore_eos=True))[0].token_ids


def _result(got, prompt: list[int], n: int) -> tuple[list[int], int]:
    if not (isinstance(got, tuple) and len(got) == 2):
        raise CheckFailed(f"speculative_decode returned {type(got).__name__} {got!r:.60}; return a pair "
                          "(tokens, passes): the new tokens and how many forward passes made them")  # fmt: skip
    tokens, passes = got
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise CheckFailed(f"the tokens should be a list of ints, got {tokens!r:.60}")
    if len(tokens) == len(prompt) + n and tokens[: len(prompt)] == prompt:
        raise CheckFailed(f"speculative_decode returned the {len(prompt)} prompt tokens followed by the new ones: "
                          "return only the new tokens")  # fmt: skip
    if len(tokens) != n:
        raise CheckFailed(f"speculative_decode returned {len(tokens)} tokens for max_new_tokens={n}: a pass may "
                          f"accept more than are still wanted — keep exactly {n}")  # fmt: skip
    return tokens, passes


@dataclass
class _Pass:
    start: int
    ids: list[int]
    cache: object


@contextlib.contextmanager
def _passes(model, limit: int, n: int):
    """Every forward pass of ``model`` against a cache: where it starts and what it feeds (a
    forward pre-hook: nothing of the model is replaced). More than ``limit`` passes is a runaway."""
    passes: list[_Pass] = []

    def record(module, args):
        batch = args[0]
        if batch.cache is not None:
            passes.append(_Pass(int(batch.positions[0, 0]), batch.input_ids[0].tolist(), batch.cache))
        if len(passes) > limit:
            raise CheckFailed(f"your loop ran more than {limit} passes for {n} tokens: does every pass keep at least "
                              "one token (the target's own, at the first mismatch)?")  # fmt: skip

    handle = model.register_forward_pre_hook(record)
    try:
        yield passes
    finally:
        handle.remove()


def _check_passes(calls: list[_Pass], prompt: list[int], tokens: list[int], passes, k: int, what: str) -> None:
    if not calls:
        raise CheckFailed("your loop never ran the model against a cache: use forward_step(model, ids, start, cache)")
    first = calls[0]
    if (first.start, len(first.ids)) != (0, len(prompt)):
        raise CheckFailed(f"{what}: the first pass fed positions {first.start}..{first.start + len(first.ids) - 1}; "
                          f"the prefill feeds the whole prompt, positions 0..{len(prompt) - 1}, once")  # fmt: skip
    full, written = prompt + tokens, len(prompt)
    for i, call in enumerate(calls[1:], start=1):
        if call.start > written:
            raise CheckFailed(f"{what}: pass {i} started at position {call.start}, but no pass had written position "
                              f"{written}: a pass starts with the last kept token, at its own position len(ids) - 1 "
                              "(its K/V is not in the cache yet), then the proposals")  # fmt: skip
        written = max(written, call.start + len(call.ids))
        if call.cache is not first.cache:
            raise CheckFailed(f"{what}: pass {i} ran against a new cache: create the cache once, before the loop")
        if call.start == 0:
            raise CheckFailed(f"{what}: pass {i} started again at position 0, recomputing the whole sequence: feed only "
                              "the last token and the proposals, at the positions after the kept ones")  # fmt: skip
        if len(call.ids) > k + 1:
            raise CheckFailed(f"{what}: pass {i} fed {len(call.ids)} tokens with k={k}: the last token and at most k "
                              "proposals (propose_ngram(ids, k) gives at most k)")  # fmt: skip
        prev = calls[i - 1]
        if i >= 2 and call.start == prev.start + len(prev.ids) and full[prev.start : call.start] != prev.ids:
            raise CheckFailed(
                f"{what}: pass {i} started at position {call.start}, right after every token pass {i - 1} fed, though "
                f"you kept fewer of them: the next pass starts after the tokens *kept* (len(ids) - 1 once the "
                "accepted ones are appended), and so overwrites the rejected proposals' K/V — that is the rollback"
            )
        if call.start < len(full) and call.ids[0] != full[call.start]:
            raise CheckFailed(f"{what}: pass {i} fed token {call.ids[0]} at position {call.start}, where the sequence "
                              f"holds {full[call.start]}: a pass starts with the last kept token, at its own position "
                              "len(ids) - 1 (its K/V is not in the cache yet)")  # fmt: skip
    if len(calls) > 1 and calls[1].start < len(prompt):
        raise CheckFailed(f"{what}: pass 1 fed position {calls[1].start} again, which the prefill wrote: the prefill's "
                          "last row already gives the first new token — append it, then verify from there")  # fmt: skip
    if len(calls) > 1 and calls[-1].start >= len(prompt) + len(tokens) - 1:
        raise CheckFailed(f"{what}: the last pass ran after all {len(tokens)} tokens were made (it started at "
                          f"position {calls[-1].start}): stop as soon as max_new_tokens are kept")  # fmt: skip
    if passes != len(calls):
        raise CheckFailed(f"{what}: you reported {passes} passes, and {len(calls)} forward passes ran (the prefill "
                          "counts as one)")  # fmt: skip


@check
def check_speculative_decode(speculative_decode, model: str = MODEL) -> str:
    """``speculative_decode(model, prompt_ids, max_new_tokens, k) -> (tokens, passes)``."""
    llm = engine(model, "contiguous")
    summary = []
    for text, n, k in RUNS:
        prompt = llm.tokenizer.encode(text)
        expected = _greedy(llm, prompt, n)
        given = list(prompt)
        limit = 4 * (n + 2)

        with _passes(llm.model, limit, n) as calls:
            try:
                got = speculative_decode(llm.model, given, n, k)
            except Exception:
                if given != prompt:  # the likelier cause of what it raised
                    raise CheckFailed("speculative_decode changed the prompt_ids list it was given (appending to it?): "
                                      "copy it first, ids = list(prompt_ids)") from None  # fmt: skip
                raise
        what = f"{n} tokens with k={k} after {text[:18]!r}..."
        if given != prompt:
            raise CheckFailed(f"speculative_decode changed the prompt_ids list it was given ({what})")
        tokens, passes = _result(got, prompt, n)
        _check_passes(calls, prompt, tokens, passes, k, what)
        if tokens != expected:
            i = next(j for j, (a, b) in enumerate(zip(tokens, expected)) if a != b)
            raise CheckFailed(f"{what}: token {i} is {tokens[i]}, plain greedy decoding gives {expected[i]}: "
                              "keep a proposal only while it equals the target's argmax at its position (row i of the pass's logits "
                              "checks proposal i), then add the target's own token at the first mismatch (or after "
                              "the last proposal)")  # fmt: skip
        summary.append((text is REPEATING, n, k, passes))
    repeating = [(n, p) for rep, n, k, p in summary if rep]
    if all(p >= n for n, p in repeating):
        raise CheckFailed(
            f"on an answer that repeats itself your loop made {repeating[0][1]} passes for {repeating[0][0]} tokens: "
            "no proposal was ever accepted. Propose with propose_ngram(ids, k) — the prompt and the tokens so far — "
            "and keep the proposals the target agrees with"
        )
    n, p = repeating[0]
    return (
        f"greedy decoding's tokens exactly, {n} of them in {p} passes (prefill included) where the answer repeats "
        "itself; every pass fed the last token and at most k proposals right after the kept tokens, into one cache"
    )
