"""One request's own failure inside a step ends that request only (engine/isolation.py).

The attack: a request whose settings the sampler cannot apply, among innocent ones sharing its
steps. Before, the step raised and every request in it failed (a repeatable denial of
service through one field). The probe is exercised with a sampler that really fails — the
course's ``filter_logits`` hook overridden to raise on one request's top_k — since validation
now refuses every value known to break the stock sampler.
"""

from __future__ import annotations

import pytest
import torch

import minillm.hooks as hooks
from minillm import LLM, SamplingParams
from minillm.engine.client import EngineClient
from minillm.engine.isolation import probe
from minillm.errors import RequestFailed
from minillm.sampling import MAX_TOP_K, filter_logits

PROMPTS = [[5, 17, 42, 8, 99, 3], [11, 12], [300, 4, 77, 77, 150]]
INNOCENT = [
    SamplingParams(max_tokens=12, ignore_eos=True),
    SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.8, top_k=5, seed=3),
]
POISON = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.9, top_k=7, seed=1)


def fails_on_seven(logits, temperature, top_k, top_p):
    if top_k == 7:
        raise RuntimeError("value cannot be converted to type int64_t without overflow")
    return filter_logits(logits, temperature, top_k, top_p)


class Sink:
    def __init__(self):
        self.items = []

    def put(self, item):
        self.items.append(item)


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(tiny_model, dtype="fp32", block_size=4)


def innocent_alone(llm):
    return [llm.generate([p], q)[0].token_ids for p, q in zip(PROMPTS[:2], INNOCENT)]


def test_a_request_failing_in_a_step_ends_alone_and_the_others_are_untouched(llm):
    alone = innocent_alone(llm)
    client = EngineClient(llm.engine)
    sinks = [Sink() for _ in range(3)]
    with hooks.override(filter_logits=fails_on_seven):
        for prompt, params, sink in zip(PROMPTS, [*INNOCENT, POISON], sinks):
            client.add(prompt, params, sink)
        for _ in range(200):
            if not llm.engine.has_unfinished_requests():
                break
            for sink, delta in client.step():
                sink.put(delta)
    (error,) = sinks[2].items
    assert isinstance(error, RequestFailed) and error.param == "top_k"
    assert "top_k=7" in str(error) and "other requests were not affected" in str(error)
    finished = [[d for d in s.items if d.request_finished] for s in sinks[:2]]
    assert [f[0].output.token_ids for f in finished] == alone
    assert client.num_open == 0 and llm.engine.block_manager.num_used_blocks == 0
    llm.engine.block_manager.check_invariants()


def test_generate_raises_the_requests_own_error_and_the_engine_serves_on(llm):
    alone = innocent_alone(llm)
    with hooks.override(filter_logits=fails_on_seven), pytest.raises(RequestFailed, match="top_k=7"):
        llm.generate([PROMPTS[2]], POISON)
    assert not llm.engine.has_unfinished_requests()
    assert innocent_alone(llm) == alone


def test_a_failure_with_no_culprit_is_the_engines_and_is_raised(llm, monkeypatch):
    client = EngineClient(llm.engine)
    sink = Sink()
    client.add(PROMPTS[0], INNOCENT[0], sink)

    def broken(inputs):
        raise RuntimeError("the model itself failed")

    monkeypatch.setattr(llm.engine.runner, "execute", broken)
    with pytest.raises(RuntimeError, match="the model itself failed"):
        client.step()
    client.fail(RuntimeError("step failed"))
    assert isinstance(sink.items[0], RuntimeError) and not llm.engine.has_unfinished_requests()


def test_the_probe_names_the_setting_and_leaves_the_generator_alone():
    generator = torch.Generator().manual_seed(5)
    state = generator.get_state()
    assert probe(POISON, generator, [1, 2, 3], vocab_size=64) is None  # the stock sampler applies it
    with hooks.override(filter_logits=fails_on_seven):
        error = probe(POISON, generator, [1, 2, 3], vocab_size=64)
    assert error.param == "top_k" and torch.equal(generator.get_state(), state)


@pytest.mark.parametrize("top_k", [2**31, 2**63, 9223372036854775808])
def test_a_top_k_beyond_any_vocabulary_is_refused_by_name(top_k):
    with pytest.raises(ValueError, match=f"top_k={top_k} is larger than any vocabulary"):
        SamplingParams(top_k=top_k)


def test_a_top_k_at_or_over_the_vocabulary_keeps_every_token(llm):
    vocab = llm.engine.model_config.vocab_size
    outs = [
        llm.generate([PROMPTS[0]], SamplingParams(max_tokens=8, temperature=1.0, top_k=k, seed=9))[0].token_ids
        for k in (0, vocab, vocab + 1, MAX_TOP_K)
    ]
    assert outs[1:] == [outs[0]] * 3
