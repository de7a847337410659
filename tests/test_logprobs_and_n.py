"""Two things an OpenAI-compatible server needs from the engine:

- ``SamplingParams.logprobs``: per output token, ``log_softmax`` of the model's raw logits at its
  position (the chosen token's and the top ``k``), also for the several tokens of a speculative
  verify step, and never for tokens cut off by a stop or ``max_tokens``;
- ``SamplingParams.n``: several samples of one prompt, prefilled once and forked copy-on-write.
  The reproducibility contract: sample ``i`` of a request seeded ``s`` is exactly the ``n=1``
  request seeded ``s + i`` (greedy: n copies of the greedy completion).
"""

from __future__ import annotations

import pytest
import torch

from minillm import LLM, SamplingParams
from minillm.engine.llm_engine import LLMEngine
from minillm.outputs import TokenLogprob

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]  # 10 tokens: with blocks of 4 the last block is shared half-full
SAMPLED = dict(temperature=1.0, max_tokens=12, ignore_eos=True)
TARGET = "tiny-shakespeare-8m"  # a trained model, so prompt lookup gets proposals accepted
# always k: the tests below count proposals and compare runs verify step for verify step (the governor,
# whose choices follow timing, is tested in test_governor.py)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "adaptive": False,
         "prompt_lookup_scaled": False}
DRAFT = {"method": "draft", "model": "tiny-shakespeare-1m", "num_speculative_tokens": 4, "adaptive": False}
HAMLET = "HAMLET.\nTo be, or not to be, that is the question. To be, or not"


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(tiny_model, dtype="fp32", block_size=4)


def reference_logprobs(folder, prompt: list[int], output: list[int]) -> torch.Tensor:
    """HF's log_softmax at the positions that predicted each output token: ``[len(output), V]``."""
    from conftest import hf_model

    with torch.no_grad():
        logits = hf_model(folder)(torch.tensor([prompt + output])).logits[0].float()
    return torch.log_softmax(logits, -1)[len(prompt) - 1 : -1]


def check_against(ref: torch.Tensor, token_ids: list[int], records: list[TokenLogprob], k: int) -> None:
    assert [r.token_id for r in records] == token_ids
    for row, r in zip(ref, records):
        assert r.logprob == pytest.approx(float(row[r.token_id]), abs=1e-4)
        values = [v for _, v in r.top]  # the top k by value (near ties may come in either order)
        assert values == pytest.approx(row.topk(k).values.tolist(), abs=1e-4)
        assert values == pytest.approx([float(row[t]) for t, _ in r.top], abs=1e-4)


# ---- logprobs ----------------------------------------------------------------------------------


def test_logprobs_are_the_models_log_softmax_not_the_samplers(llm, tiny_model):
    """Sampled with temperature, top-k and a repetition penalty: the logprobs still describe
    the raw model (HF's logits), chosen token and top 5 alike."""
    params = SamplingParams(
        temperature=0.7, top_k=5, repetition_penalty=1.3, seed=3, max_tokens=8, ignore_eos=True, logprobs=5
    )
    out = llm.generate([PROMPT], params)[0]
    assert len(out.logprobs) == len(out.token_ids) == 8
    check_against(reference_logprobs(tiny_model, PROMPT, out.token_ids), out.token_ids, out.logprobs, 5)


def test_greedy_chooses_the_top_alternative_and_lists_are_sorted(llm):
    for k in (0, 1, 20):
        out = llm.generate([PROMPT], SamplingParams(max_tokens=6, ignore_eos=True, logprobs=k))[0]
        for r in out.logprobs:
            assert len(r.top) == k
            assert [v for _, v in r.top] == sorted((v for _, v in r.top), reverse=True)
            if k:
                assert r.top[0] == (r.token_id, r.logprob)
            assert r.logprob <= 0
    plain = llm.generate([PROMPT], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    assert plain.logprobs is None and plain.token_ids == out.token_ids  # asking changes no token


def test_stream_deltas_carry_the_logprobs_of_their_tokens(llm):
    params = SamplingParams(max_tokens=9, logprobs=2, seed=1, temperature=1.0)
    deltas = list(llm.stream(PROMPT, params))
    final = deltas[-1].output
    assert [r for d in deltas for r in d.logprobs] == final.logprobs
    assert all([r.token_id for r in d.logprobs] == d.token_ids for d in deltas)
    assert all(d.logprobs is None for d in llm.stream(PROMPT, SamplingParams(max_tokens=3)))


def test_tokens_cut_by_a_stop_string_get_no_record(llm):
    full = llm.generate([PROMPT], SamplingParams(max_tokens=10, ignore_eos=True, logprobs=1))[0]
    stop = full.text[len(full.text) // 2 :][:2]
    assert stop
    out = llm.generate([PROMPT], SamplingParams(max_tokens=10, ignore_eos=True, logprobs=1, stop=[stop]))[0]
    assert out.finish_reason == "stop" and len(out.token_ids) < 10
    assert out.logprobs == full.logprobs[: len(out.token_ids)]


@pytest.fixture(scope="module")
def hamlet():
    """The target alone, greedy, with logprobs: what speculation must reproduce."""
    return LLM(TARGET, dtype="fp32").generate([HAMLET], SamplingParams(max_tokens=24, ignore_eos=True, logprobs=3))[0]


@pytest.fixture(scope="module", params=[NGRAM, DRAFT], ids=["ngram", "draft"])
def spec_llm(request):
    return LLM(TARGET, dtype="fp32", speculative_config=request.param)


def test_verify_steps_give_every_emitted_token_its_own_row(spec_llm, hamlet):
    """A verify chunk emits several tokens; row j of its logits is token j's. Same records as
    without speculation (fp32); and a stop inside an accepted run leaves the tokens after it
    (emitted by the step, not appended) without a record."""
    engine = spec_llm.engine
    emitted: list[list[int]] = []  # what each step emitted for the one request
    choose = engine._choose_tokens
    engine._choose_tokens = lambda chunks, logits: (lambda r: (emitted.append(r[0][0]), r)[1])(choose(chunks, logits))
    try:
        out = spec_llm.generate([HAMLET], SamplingParams(max_tokens=24, ignore_eos=True, logprobs=3))[0]
        assert out.token_ids == hamlet.token_ids and len(out.logprobs) == 24
        for a, b in zip(out.logprobs, hamlet.logprobs):
            assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [v for _, v in a.top] == pytest.approx([v for _, v in b.top], abs=1e-4)
        ends = [sum(len(e) for e in emitted[: i + 1]) for i in range(len(emitted))]
        inside = [end - len(e) + j for e, end in zip(emitted, ends) for j in range(len(e) - 1)]
        assert inside, emitted  # some step accepted proposals: a token that was not its step's last
        for p in inside[:3]:
            emitted.clear()
            stop = spec_llm.tokenizer.decode(hamlet.token_ids[: p + 1])  # first seen with token p
            cut = spec_llm.generate([HAMLET], SamplingParams(max_tokens=24, logprobs=3, stop=[stop]))[0]
            assert cut.finish_reason == "stop" and cut.token_ids == hamlet.token_ids[: p + 1]
            assert cut.logprobs == out.logprobs[: p + 1]
            assert sum(len(e) for e in emitted) > p + 1  # the last step emitted more than was kept
    finally:
        del engine._choose_tokens


@pytest.mark.parametrize("bad", [-1, 21, 1.5, True, "3"])
def test_bad_logprobs_are_refused_by_name(bad):
    with pytest.raises(ValueError, match="^logprobs="):
        SamplingParams(logprobs=bad)


# ---- n parallel samples --------------------------------------------------------------------------


def test_sample_i_of_a_seeded_request_is_the_request_seeded_seed_plus_i(llm):
    params = SamplingParams(n=3, seed=11, **SAMPLED)
    out = llm.generate([PROMPT], params)[0]
    again = llm.generate([PROMPT], params)[0]
    assert [s.index for s in out.samples] == [0, 1, 2]
    assert all(s.request_id == out.request_id for s in out.samples)
    assert (out.token_ids, out.text) == (out.samples[0].token_ids, out.samples[0].text)
    assert [s.token_ids for s in out.samples] == [s.token_ids for s in again.samples]  # reproducible
    assert len({tuple(s.token_ids) for s in out.samples}) == 3  # temperature 1: they differ
    for i, s in enumerate(out.samples):
        solo = llm.generate([PROMPT], SamplingParams(seed=11 + i, **SAMPLED))[0]
        assert s.token_ids == solo.token_ids and s.text == solo.text


def test_greedy_samples_are_all_the_greedy_completion(llm):
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    one = llm.generate([PROMPT, [20, 21, 22]], params)
    two = llm.generate([PROMPT, [20, 21, 22]], SamplingParams(n=2, max_tokens=8, ignore_eos=True))
    assert len(two) == 2  # one output per prompt, whatever n
    for a, b in zip(one, two):
        assert a.samples == [] and [s.token_ids for s in b.samples] == [a.token_ids] * 2


def test_the_prompt_is_prefilled_once_and_every_block_comes_back(tiny_model):
    engine = LLMEngine(tiny_model, dtype="fp32", block_size=4)
    copies = []
    execute = engine.runner.execute
    engine.runner.execute = lambda inputs: (copies.extend(inputs.block_copies), execute(inputs))[1]
    rid = engine.add_request(PROMPT, SamplingParams(n=3, seed=0, logprobs=1, **SAMPLED))
    deltas = []
    while engine.has_unfinished_requests():
        deltas += engine.step()
    prompt_tokens = sum(n for _, start, n, _ in (c for r in engine.step_records for c in r.chunks) if start < 10)
    assert prompt_tokens == len(PROMPT)  # one prefill, not three
    assert len(copies) == 2  # the half-full shared block: copied for two samples, the third writes in place
    bm = engine.block_manager
    bm.check_invariants()
    assert bm.num_used_blocks == 0 and not bm.tables
    assert not engine.scheduler.running and not engine.scheduler.waiting
    # deltas: every sample's tokens, its logprobs, its last delta; one request_finished, the last
    assert {d.request_id for d in deltas} == {rid}
    assert [d.request_finished for d in deltas].count(True) == 1 and deltas[-1].request_finished
    for i in range(3):
        mine = [d for d in deltas if d.index == i]
        assert sum(d.finish_reason is not None for d in mine) == 1 and mine[-1].output.index == i
        assert [t for d in mine for t in d.token_ids] == mine[-1].output.token_ids
        assert [r for d in mine for r in d.logprobs] == mine[-1].output.logprobs
    firsts = [next(d for d in deltas if d.index == i).logprobs[0] for i in range(3)]
    assert firsts[0].top == firsts[1].top == firsts[2].top  # all drawn from the prefill's one row


def test_samples_that_finish_at_their_first_token(llm):
    out = llm.generate([PROMPT], SamplingParams(n=4, seed=5, temperature=1.0, max_tokens=1, ignore_eos=True))[0]
    assert [len(s.token_ids) for s in out.samples] == [1] * 4
    assert all(s.finish_reason == "length" for s in out.samples)
    llm.engine.block_manager.check_invariants()
    assert llm.engine.block_manager.num_used_blocks == 0


def test_abort_of_the_request_ends_every_sample_and_frees_everything(tiny_model):
    engine = LLMEngine(tiny_model, dtype="fp32", block_size=4)
    for steps in (0, 1, 4):  # before the prefill, right after the fork, while decoding
        rid = engine.add_request(PROMPT, SamplingParams(n=3, seed=2, **SAMPLED))
        for _ in range(steps):
            engine.step()
        out = engine.abort(rid)
        assert out.finish_reason == "abort" and len(out.samples) == (3 if steps else 1)  # none forked yet
        assert all(s.finish_reason == "abort" for s in out.samples)
        assert not engine.requests and not engine.scheduler.running and not engine.scheduler.waiting
        engine.block_manager.check_invariants()
        assert engine.block_manager.num_used_blocks == 0
        with pytest.raises(ValueError, match="no unfinished request"):
            engine.abort(rid)


def test_n_under_memory_pressure_preempts_and_still_matches_solo_runs(tiny_model):
    from minillm.config import ModelConfig
    from minillm.kvcache.addressing import kv_bytes_per_token

    per_block = 4 * kv_bytes_per_token(ModelConfig.from_folder(tiny_model), torch.float32)
    small = LLM(tiny_model, dtype="fp32", block_size=4, kv_cache_memory=12 * per_block)
    assert small.engine.block_manager.num_blocks == 12  # 4 samples of 10 + 20 tokens need 8 each
    params = SamplingParams(n=4, seed=7, temperature=1.0, max_tokens=20, ignore_eos=True)
    out = small.generate([PROMPT], params)[0]
    assert sum(s.num_preemptions for s in out.samples) > 0
    roomy = LLM(tiny_model, dtype="fp32", block_size=4)
    for i, s in enumerate(out.samples):
        solo = roomy.generate([PROMPT], SamplingParams(seed=7 + i, temperature=1.0, max_tokens=20, ignore_eos=True))
        assert s.token_ids == solo[0].token_ids
    small.engine.block_manager.check_invariants()
    assert small.engine.block_manager.num_used_blocks == 0


def test_a_stream_of_n_samples_ends_after_the_last(llm):
    deltas = list(llm.stream(PROMPT, SamplingParams(n=2, seed=4, **SAMPLED)))
    assert {d.index for d in deltas} == {0, 1} and deltas[-1].request_finished
    assert sum(d.finish_reason is not None for d in deltas) == 2
    assert llm.client.num_open == 0 and not llm.engine.requests


def test_n_with_speculation(spec_llm, hamlet):
    """Prompt lookup needs nothing per sample; a draft model rebuilds a forked sample's draft
    state from its tokens (its own pool shares nothing), as after a preemption."""
    out = spec_llm.generate([HAMLET], SamplingParams(n=2, max_tokens=24, ignore_eos=True))[0]
    assert [s.token_ids for s in out.samples] == [hamlet.token_ids] * 2
    assert all(s.metrics.spec_accepted > 0 for s in out.samples)
    assert spec_llm.engine.block_manager.num_used_blocks == 0


def test_no_proposals_for_the_first_token_of_n_samples(hamlet):
    """A prompt chunked down to its last token "decodes" and could be verified with proposals;
    not when that token's row is the one all n samples draw their first token from."""
    budget = len(hamlet.prompt_token_ids) - 1  # the second step runs the prompt's last token
    llm = LLM(TARGET, dtype="fp32", speculative_config=NGRAM, max_num_batched_tokens=budget)
    out = llm.generate([HAMLET], SamplingParams(n=2, max_tokens=24, ignore_eos=True))[0]
    assert [s.token_ids for s in out.samples] == [hamlet.token_ids] * 2
    assert [r.chunks[0][1:3] for r in list(llm.engine.step_records)[:2]] == [(0, budget), (budget, 1)]


@pytest.mark.parametrize("mode", ["naive", "contiguous"])
def test_unpaged_engines_refuse_n(tiny_model, mode):
    llm = LLM(tiny_model, dtype="fp32", mode=mode)
    with pytest.raises(ValueError, match=r"n=2 for prompt 0: .* mode='paged'"):
        llm.generate([PROMPT], SamplingParams(n=2))


def test_n_beyond_max_num_seqs_is_refused(tiny_model):
    engine = LLMEngine(tiny_model, dtype="fp32", max_num_seqs=2)
    with pytest.raises(ValueError, match="n=3 .* exceeds max_num_seqs=2"):
        engine.add_request(PROMPT, SamplingParams(n=3))
    assert not engine.requests


@pytest.mark.parametrize("bad", [0, 17, 1.0, True, None])
def test_bad_n_is_refused_by_name(bad):
    with pytest.raises(ValueError, match="^n="):
        SamplingParams(n=bad)
