"""Seeded fuzzing of the serving engine: random configurations × random workloads, with aborts,
forced preemption (small pools) and bad requests mixed in.

After every step: the block manager's invariants hold and every request is in exactly one
place (waiting, running, finished or aborted). At the end: the pool is clean and every
request that was not aborted produced exactly the tokens it produces alone (fp32: greedy and
seeded sampling alike).
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from minillm import LLM, LLMEngine, SamplingParams
from minillm.config import ModelConfig
from minillm.errors import PromptTooLongError
from minillm.kvcache.addressing import kv_bytes_per_token

STATS = {"preemptions": 0, "aborted": 0, "cached_tokens": 0}  # what the runs exercised, checked at the end
VOCAB = 300  # token ids used by the workloads (all inside the tiny models' vocabularies)


def random_config(rng: random.Random) -> dict:
    block_size = rng.choice([1, 2, 4, 16])
    config = dict(
        dtype="fp32",
        block_size=block_size,
        max_num_seqs=rng.choice([1, 2, 3, 8]),
        scheduling_policy=rng.choice(["continuous", "continuous", "static", "dynamic"]),
        enable_prefix_caching=rng.random() < 0.7,
        enable_chunked_prefill=rng.random() < 0.7,
        batch_timeout=0.0,
        max_model_len=64,
        # Small pools: room for one or two of the longest requests, so preemption happens.
        kv_cache_memory=None,
        attention_backend=rng.choice(["sdpa", "torch"]),
    )
    if config["enable_chunked_prefill"]:
        config["max_num_batched_tokens"] = rng.choice([None, 3, 8, 32])
    blocks = rng.randint(-(-48 // block_size), -(-80 // block_size))
    config["kv_cache_memory"] = ("blocks", blocks)
    return config


def random_params(rng: random.Random) -> SamplingParams:
    if rng.random() < 0.5:
        return SamplingParams(max_tokens=rng.randint(1, 16), ignore_eos=True)
    return SamplingParams(
        max_tokens=rng.randint(1, 16),
        temperature=rng.choice([0.5, 1.0]),
        top_k=rng.choice([0, 5]),
        top_p=rng.choice([1.0, 0.9]),
        seed=rng.randrange(2**32),
        ignore_eos=rng.random() < 0.8,
    )


def random_prompt(rng: random.Random, prefixes: list[list[int]]) -> list[int]:
    prompt = list(rng.choice(prefixes)[: rng.randint(0, 20)]) if rng.random() < 0.6 else []
    return prompt + [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 30 - len(prompt)))]


BAD_REQUESTS = [
    (lambda e, ok: ([], None, {}), ValueError, "empty list of token ids"),
    (lambda e, ok: ([1, 10**9], None, {}), ValueError, "outside the vocabulary"),
    (lambda e, ok: ([1, 2], "greedy", {}), TypeError, "must be SamplingParams"),
    (lambda e, ok: ([1] * 70, None, {}), PromptTooLongError, "max_model_len=64"),
    (lambda e, ok: ([1, 2], None, {"priority": "high"}), TypeError, "priority"),
    (lambda e, ok: ([1, 2], None, {"arrival_time": "now"}), TypeError, "arrival_time"),
    (lambda e, ok: ([1, 2], None, {"request_id": next(iter(e.requests))}), ValueError, "already in use"),
    (lambda e, ok: ([1, 2], None, {"request_id": {"a": 1}}), TypeError, "must be hashable"),
    (lambda e, ok: ([1, 2], _mutated(top_p=2.0), {}), ValueError, "top_p=2.0 must be in"),
    (lambda e, ok: ([1, 2], _mutated(temperature=math.nan), {}), ValueError, "temperature=nan must be a number"),
]


def _mutated(**fields) -> SamplingParams:
    """Parameters made valid, then changed: the engine must validate again at the door."""
    params = SamplingParams()
    for name, value in fields.items():
        setattr(params, name, value)
    return params


@pytest.fixture(scope="module")
def solo(tiny_model):
    """Each request alone through the contiguous-cache engine (the rung below paging)."""
    llm = LLM(tiny_model, dtype="fp32", mode="contiguous", max_model_len=64)
    cache: dict = {}

    def run(prompt: tuple[int, ...], params: SamplingParams) -> tuple[int, ...]:
        key = (prompt, repr(params))
        if key not in cache:
            cache[key] = tuple(llm.generate([list(prompt)], params)[0].token_ids)
        return cache[key]

    return run


def check_places(engine: LLMEngine, ids: set, finished: dict, aborted: set) -> None:
    waiting = {s.request_id for s in engine.scheduler.waiting}
    running = {s.request_id for s in engine.scheduler.running}
    places = [waiting, running, set(finished), aborted]
    assert sum(len(p) for p in places) == len(ids) and set().union(*places) == ids, "a request was lost or doubled"
    assert set(engine.requests) == waiting | running
    engine.block_manager.check_invariants()


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(40))
def test_random_engines_lose_nothing_and_match_solo_runs(tiny_model, solo, seed):
    rng = random.Random(seed)
    config = random_config(rng)
    _, blocks = config.pop("kv_cache_memory")
    per_token = kv_bytes_per_token(ModelConfig.from_folder(tiny_model), torch.float32)
    engine = LLMEngine(tiny_model, kv_cache_memory=blocks * config["block_size"] * per_token, **config)
    prefixes = [[rng.randrange(3, VOCAB) for _ in range(20)] for _ in range(3)]
    pending = [(random_prompt(rng, prefixes), random_params(rng)) for _ in range(14)]
    ids: set = set()
    submitted: dict = {}
    finished: dict = {}
    aborted: set = set()
    for _ in range(3000):
        if pending and rng.random() < 0.7:
            prompt, params = pending.pop()
            try:
                rid = engine.add_request(prompt, params)
            except ValueError as err:  # only "can never fit" may refuse a well-formed request
                assert "can never fit in the KV pool" in str(err)
            else:
                ids.add(rid)
                submitted[rid] = (tuple(prompt), params)
        if engine.requests and rng.random() < 0.15:  # a bad request: named, refused, harmless
            make, error, message = rng.choice(BAD_REQUESTS)
            prompt, params, kwargs = make(engine, next(iter(ids)))
            before = set(engine.requests)
            with pytest.raises(error, match=message):
                engine.add_request(prompt, params, **kwargs)
            assert set(engine.requests) == before
        live = list(engine.requests)
        if live and rng.random() < 0.02:
            rid = rng.choice(live)
            assert engine.abort(rid).finish_reason == "abort"
            aborted.add(rid)
        for delta in engine.step():
            if delta.output is not None:
                assert delta.request_id not in finished
                finished[delta.request_id] = delta.output
        check_places(engine, ids, finished, aborted)
        if not pending and not engine.has_unfinished_requests():
            break
    assert not pending and not engine.has_unfinished_requests(), "the workload did not drain"
    assert engine.block_manager.num_used_blocks == 0
    STATS["preemptions"] += sum(o.num_preemptions for o in finished.values())
    STATS["aborted"] += len(aborted)
    STATS["cached_tokens"] += sum(o.num_cached_tokens for o in finished.values())
    for rid, out in finished.items():
        prompt, params = submitted[rid]
        assert tuple(out.token_ids) == solo(prompt, params), (rid, config)


@pytest.mark.slow
def test_the_fuzz_runs_exercised_preemption_aborts_and_prefix_hits():
    """Runs after the seeds above (same module): the random runs must really have preempted,
    aborted and hit the prefix cache, or they tested less than they claim."""
    if STATS == {"preemptions": 0, "aborted": 0, "cached_tokens": 0}:
        pytest.skip("run together with the fuzz seeds")
    assert STATS["preemptions"] > 0 and STATS["aborted"] > 0 and STATS["cached_tokens"] > 0, STATS
