"""Shared by the checks of chapters 01-02: the default model, reference runs and the diagnosis of a
generated token list (a prompt echoed, a wrong row, a list that is not a list)."""

from __future__ import annotations

import functools

from minillm.course.helpers import forward_logits
from minillm.course.results import CheckFailed

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


def is_token_list(got) -> bool:
    return isinstance(got, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in got)


def diagnose_return(got, prompt: list[int], given: list[int], steps: int, what: str) -> None:
    """What a generation loop returned or did to its prompt: nothing, the prompt too, a grown prompt list."""
    if got is None:
        raise CheckFailed(f"{what} returned None: did you forget to `return` the new tokens?")
    _refuse_prompt_echo(got, prompt, steps, what)
    if given != prompt:
        raise CheckFailed(
            f"{what} added tokens to the prompt_ids list it was given (ids = prompt_ids does not copy a list): "
            "copy it first, ids = list(prompt_ids), and leave the caller's prompt as it is"
        )


def diagnose_tokens(got, model, prompt: list[int], expected: list[int], what: str, rows_steps: int) -> None:
    """Name the slips of a generation loop that "token i differs" would hide: tokens shifted against
    the reference, in reverse, one pass read as generation, the next token read from another row
    (checked over the first ``rows_steps`` tokens)."""
    if not is_token_list(got) or got == expected or not got:
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
