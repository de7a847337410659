"""Shared by the checks of chapters 03-04: the paged engines they run, the prompts, the contiguous
cache's tokens to compare with, and the pool's bookkeeping after a run."""

from __future__ import annotations

import functools

import torch

import minillm.hooks as hooks
from minillm.course.results import CheckFailed

PROMPTS = [
    "ROMEO.\nBut soft, what light through yonder window breaks?",
    "JULIET.\nO Romeo, Romeo, wherefore art thou Romeo?",
    "HAMLET.\nTo be, or not to be, that is the question.",
    "KING.\nNow is the winter of our discontent",
    "FOOL.\nThe more",
]
SYSTEM = "You are a courtly poet of the Globe Theatre. Answer in blank verse, briefly, with wit and grace.\n"
MAX_TOKENS = 24


def greedy_params():
    from minillm import SamplingParams

    return SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)


@functools.lru_cache(maxsize=4)
def contiguous_reference(model: str, prompts: tuple[str, ...]) -> list[list[int]]:
    """Each prompt alone through the contiguous-cache engine (chapter 02's rung)."""
    from minillm import LLM

    llm = LLM(model, dtype="fp32", mode="contiguous", attention_backend="torch")
    return [llm.generate(p, greedy_params())[0].token_ids for p in prompts]


def paged_engine(model: str, **kwargs):
    from minillm import LLMEngine

    return LLMEngine(model, dtype="fp32", attention_backend="torch", **kwargs)


def pool_bytes(engine_model: str, blocks: int, block_size: int) -> int:
    from minillm.assets import resolve_model
    from minillm.config import ModelConfig
    from minillm.kvcache.addressing import kv_bytes_per_token

    config = ModelConfig.from_folder(resolve_model(engine_model))
    return blocks * block_size * kv_bytes_per_token(config, torch.float32)


def run_all(engine, prompts, max_steps: int = 2000) -> dict:
    """Add every prompt, step to completion; outputs by request id. Fails on a hang or loss."""
    ids = [engine.add_request(p, greedy_params()) for p in prompts]
    done: dict = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for d in engine.step():
            if d.output is not None:
                if d.request_id in done:
                    raise CheckFailed(f"request {d.request_id} finished twice")
                done[d.request_id] = d.output
    else:
        stuck = [i for i in ids if i not in done]
        raise CheckFailed(f"after {max_steps} steps requests {stuck} had still not finished: the engine is stuck")
    return {i: done[i] for i in ids}


def compare_request_tokens(outputs: dict, expected: list[list[int]], what: str, hint: str) -> None:
    for n, (out, ref) in enumerate(zip(outputs.values(), expected)):
        got = out.token_ids
        if got != ref:
            i = next((j for j, (a, b) in enumerate(zip(got, ref)) if a != b), min(len(got), len(ref)))
            raise CheckFailed(
                f"{what}: request {n} ({PROMPTS[n % len(PROMPTS)][:20]!r}...) differs from the reference at "
                f"token {i} (got {got[i : i + 3]}, expected {ref[i : i + 3]}). Hint: {hint}"
            )


def run_scattered(model: str, hook: dict, what: str, hint: str) -> None:
    """Every prompt through a paged engine whose free list is scattered (a sequence's blocks
    are not adjacent in the pool), with ``hook`` = {hook name: the learner's function} in
    place; each request must match the contiguous cache."""
    engine = paged_engine(model, block_size=4)
    engine.block_manager.free_ids.rotate(7)
    with hooks.override(**hook):
        outputs = run_all(engine, PROMPTS)
    compare_request_tokens(outputs, contiguous_reference(model, tuple(PROMPTS)), what, hint)


def assert_pool_clean(engine) -> None:
    try:
        engine.block_manager.check_invariants()
    except AssertionError as err:
        raise CheckFailed(f"the block manager's bookkeeping is broken: {err}") from None
    used = engine.stats().kv_blocks_used
    if used:
        raise CheckFailed(f"{used} blocks are still referenced after every request finished: a leak")


def run_arriving(engine, prompts, priorities=None, on_step=None, max_steps: int = 3000) -> dict:
    """Two requests now, the rest one per step while others run; outputs by request id."""
    priorities = priorities or [0] * len(prompts)
    pending = list(zip(prompts, priorities))
    ids, done = [], {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests() and not pending:
            break
        for _ in range(2 if not ids else 1):
            if pending:
                prompt, priority = pending.pop(0)
                ids.append(engine.add_request(prompt, greedy_params(), priority=priority))
        for d in engine.step():
            if d.output is not None:
                done[d.request_id] = d.output
    else:
        raise CheckFailed(
            f"after {max_steps} steps requests {[i for i in ids if i not in done]} were unfinished: the engine "
            "is stuck (does every step schedule the running sequences?)"
        )
    return {i: done[i] for i in ids}
