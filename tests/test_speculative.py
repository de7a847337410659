"""Speculative decoding in the paged engine: the acceptance rules against their definitions,
prompt lookup, and the engine's output identical to the target alone — greedy, with mixed
batches, chunked prefill, preemption, prefix hits, stops inside accepted runs, streaming — plus
the metrics and every bad option."""

from __future__ import annotations

import json

import pytest
import torch

from minillm import LLM, SamplingParams
from minillm.speculative import accept_greedy, accept_sampled, propose_ngram, residual_distribution
from minillm.speculative.ngram import TokenArrays, match_length, reach

TARGET, DRAFT = "tiny-shakespeare-8m", "tiny-shakespeare-1m"
# A fixed k (no governor, k guesses whenever anything matches): these tests check the verify
# mechanics and count what k proposals did; the default, adaptive engine is tested in
# test_governor.py and by the exactness test below, guesses by the match's length further down.
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "adaptive": False,
         "prompt_lookup_scaled": False}
DRAFT_CFG = {"method": "draft", "model": DRAFT, "num_speculative_tokens": 4, "adaptive": False}
PROMPTS = [
    "KING.\nNow is the winter",
    "ROMEO.\nBut soft, what light through yonder window breaks? It is the east",
    "HAMLET.\nTo be, or not to be, that is the question. To be, or not",
    "First Citizen:\nBefore we proceed any further, hear me speak.",
]


@pytest.fixture(scope="module")
def reference():
    llm = LLM(TARGET, dtype="fp32")
    return {n: [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=n, ignore_eos=True))]
            for n in (24, 40)}  # fmt: skip


# ---- the rules ------------------------------------------------------------------------------------


def test_greedy_acceptance_keeps_the_agreeing_prefix_then_the_targets_token():
    assert accept_greedy([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]  # all kept + the bonus token
    assert accept_greedy([5, 9, 7, 8], [5, 6, 7]) == [5, 9]  # the first disagreement ends the run
    assert accept_greedy([4, 6, 7, 8], [5, 6, 7]) == [4]  # nothing kept: still one token of progress
    assert accept_greedy([3], []) == [3]


def test_residual_is_where_the_target_wants_more_than_the_draft():
    p, q = torch.tensor([0.5, 0.3, 0.2]), torch.tensor([0.2, 0.6, 0.2])
    assert torch.allclose(residual_distribution(p, q), torch.tensor([1.0, 0.0, 0.0]))
    assert torch.allclose(residual_distribution(p, p), p)  # nothing rejected: never used, still a distribution


def _first_token_histogram(p, q, draft_sampler, accept, n=20000, seed=0):
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(len(p))
    for _ in range(n):
        d = draft_sampler(gen)
        emitted = accept(torch.stack([p, p]), None if q is None else q[None], [d], gen)
        counts[emitted[0]] += 1
    return counts


def _chi_square_ok(counts: torch.Tensor, p: torch.Tensor, threshold: float = 18.47) -> bool:
    """χ² with 4 degrees of freedom (5 tokens): 18.47 is the 0.1% critical value."""
    expected = p * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum()) < threshold


P = torch.tensor([0.05, 0.40, 0.25, 0.20, 0.10])
Q = torch.tensor([0.30, 0.10, 0.30, 0.05, 0.25])


def test_rejection_sampling_reproduces_the_targets_distribution():
    """Proposals from q, kept with min(1, p/q), else the residual: the emitted token is
    distributed as p (χ² over 20,000 draws at a fixed seed)."""
    counts = _first_token_histogram(P, Q, lambda g: int(torch.multinomial(Q, 1, generator=g)), accept_sampled)
    assert _chi_square_ok(counts, P), counts / counts.sum()
    # deterministic proposals (prompt lookup): q is one point
    fixed = _first_token_histogram(P, None, lambda g: 1, accept_sampled)
    assert _chi_square_ok(fixed, P), fixed / fixed.sum()


def test_the_distribution_test_catches_a_wrong_residual():
    """The same test fails an implementation that resamples from p instead of the residual
    (an off-by-one in the rule's second case): the test can fail."""

    def wrong(p, q, drafts, gen):
        token = drafts[0]
        if torch.rand((), generator=gen) * q[0][token] < p[0][token]:
            return [token]
        return [int(torch.multinomial(p[0], 1, generator=gen))]

    counts = _first_token_histogram(P, Q, lambda g: int(torch.multinomial(Q, 1, generator=g)), wrong)
    assert not _chi_square_ok(counts, P)


def test_prompt_lookup_copies_what_followed_the_latest_match():
    tokens = [1, 2, 3, 4, 9, 9, 1, 2, 3, 5, 6, 1, 2, 3]
    assert propose_ngram(tokens, 2, max_n=3) == [5, 6]  # the most recent earlier "1 2 3"
    assert propose_ngram(tokens, 5, max_n=3) == [5, 6, 1, 2, 3]
    assert propose_ngram([7, 8, 9], 3) == []  # no earlier occurrence: nothing proposed
    assert propose_ngram([4, 1, 2, 8, 2], 2, max_n=3, min_n=1) == [8, 2]  # falls back to the 1-gram "2"
    assert propose_ngram([4, 1, 2, 8, 2], 2, max_n=3, min_n=2) == []


def test_match_length_finds_the_match_propose_ngram_copies_from():
    import random

    def brute(tokens, max_n, min_n):  # propose_ngram's own search, saying n
        for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
            if any(tokens[s : s + n] == tokens[-n:] for s in range(len(tokens) - n)):
                return n
        return 0

    rng = random.Random(0)
    for _ in range(3000):
        tokens = [rng.randrange(rng.randint(1, 5)) for _ in range(rng.randint(0, 24))]
        max_n = rng.randint(1, 6)
        min_n = rng.randint(1, max_n)
        n = match_length(tokens, max_n, min_n)
        assert n == brute(tokens, max_n, min_n), (tokens, max_n, min_n)
        assert bool(n) == bool(propose_ngram(tokens, 2, max_n, min_n))
    assert match_length([1, 2, 3, 4, 9, 1, 2, 3, 4], 4) == 4
    assert match_length([1, 2, 3, 4, 9, 1, 2, 3, 4], 3) == 3  # never past prompt_lookup_max
    assert match_length([1, 2, 3, 9, 7, 2, 3], 4) == 2
    assert match_length([1, 2, 3, 9, 7, 2, 3], 4, min_n=3) == 0
    assert match_length([5], 4) == match_length([], 4) == 0


def test_token_arrays_follow_each_requests_tokens_as_they_grow():
    from types import SimpleNamespace

    arrays = TokenArrays()
    seq = SimpleNamespace(request_id="a", prompt_token_ids=[5, 6, 7], output_token_ids=[])
    assert arrays.of(seq).tolist() == [5, 6, 7]
    for t in range(200):  # one token a step, past the first array's size: it grows
        seq.output_token_ids.append(t)
        assert arrays.of(seq).tolist() == [5, 6, 7, *range(t + 1)]
    seq.output_token_ids += [1, 2, 3]  # a verify step's several tokens at once
    assert arrays.of(seq).tolist()[-4:] == [199, 1, 2, 3]
    other = SimpleNamespace(request_id="a", prompt_token_ids=[9], output_token_ids=[4])  # a new object, same id
    assert arrays.of(other).tolist() == [9, 4] and arrays.of(seq).tolist()[:4] == [5, 6, 7, 0]
    assert len(arrays) == 1
    arrays.release("a")
    arrays.release("a")  # twice: harmless
    assert len(arrays) == 0


def test_prompt_lookup_keeps_no_array_for_a_finished_request():
    llm = LLM(TARGET, dtype="fp32", speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=24, ignore_eos=True))
    assert sum(o.metrics.spec_proposed for o in outs) > 0
    assert len(llm.engine.speculator._texts) == 0  # each released with its request


def test_the_guess_reaches_as_far_as_the_match_vouches_for():
    assert [reach(n, 8) for n in range(6)] == [0, 1, 2, 4, 8, 8]
    assert [reach(n, 3) for n in range(5)] == [0, 1, 2, 3, 3]  # never past k
    assert reach(5, 16) == 16


@pytest.mark.parametrize("scaled", [True, False])
def test_prompt_lookup_guesses_by_the_match_unless_told_not_to(scaled, reference):
    import minillm.hooks as hooks

    calls = []
    inner = hooks.current("propose_ngram")

    def record(tokens, k, max_n, min_n):
        calls.append((list(tokens), k))
        return inner(tokens, k, max_n, min_n)

    llm = LLM(TARGET, dtype="fp32", speculative_config={**NGRAM, "prompt_lookup_scaled": scaled})
    with hooks.override(propose_ngram=record):
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=24, ignore_eos=True))
    assert [o.token_ids for o in outs] == reference[24]  # exact either way
    lengths = [match_length(tokens, 3) for tokens, _ in calls]
    if scaled:  # called only with a match, asking no further than it vouches for (k is 3; fewer near the end)
        assert all(n > 0 and 1 <= k <= reach(n, 3) for n, (_, k) in zip(lengths, calls))
        assert {k for n, (_, k) in zip(lengths, calls) if n == 1} == {1}
        assert 3 in {k for _, k in calls}  # long matches still get all k
    else:  # always k, with or without a match (vLLM's ngram)
        assert 0 in lengths and 3 in {k for n, (_, k) in zip(lengths, calls) if n == 1}


# ---- the engine: identical greedy output ------------------------------------------------------------


@pytest.mark.parametrize("spec", [NGRAM, DRAFT_CFG], ids=["ngram", "draft"])
def test_greedy_speculation_reproduces_the_target_alone(spec, reference):
    llm = LLM(TARGET, dtype="fp32", speculative_config=spec)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=40, ignore_eos=True))
    assert [o.token_ids for o in outs] == reference[40]
    proposed = sum(o.metrics.spec_proposed for o in outs)
    assert proposed > 0 and sum(o.metrics.spec_accepted for o in outs) > 0
    assert all(o.metrics.forward_passes_per_token <= 1 for o in outs)
    assert min(o.metrics.forward_passes_per_token for o in outs) < 1  # some step emitted several tokens
    assert llm.engine.block_manager.num_used_blocks == 0
    if spec is DRAFT_CFG:
        assert llm.engine.speculator.draft.blocks.num_used_blocks == 0 and not llm.engine.speculator.draft.states


def test_a_quantized_draft_changes_proposals_not_the_output(reference):
    spec = {**DRAFT_CFG, "quantization": "int8"}
    llm = LLM(TARGET, dtype="fp32", speculative_config=spec)
    assert llm.engine.speculator.draft.model.lm_head.method.name == "int8"
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=40, ignore_eos=True))
    assert [o.token_ids for o in outs] == reference[40]


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_the_default_adaptive_engine_reproduces_the_target_alone(reference, method):
    """As shipped (``adaptive`` on: as many proposals as pay, per batch size; test_governor.py),
    whatever the governor chooses step by step, greedy tokens are the target's alone."""
    spec = {k: v for k, v in (NGRAM if method == "ngram" else DRAFT_CFG).items() if k != "adaptive"}
    llm = LLM(TARGET, dtype="fp32", speculative_config=spec)
    assert llm.engine.speculator.governor is not None
    for _ in range(2):  # the second run starts from what the first measured
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=40, ignore_eos=True))
        assert [o.token_ids for o in outs] == reference[40]


def test_one_request_at_a_time_matches_too(reference):
    llm = LLM(TARGET, dtype="fp32", speculative_config=DRAFT_CFG)
    for prompt, expected in zip(PROMPTS, reference[24]):
        assert llm.generate(prompt, SamplingParams(max_tokens=24, ignore_eos=True))[0].token_ids == expected


@pytest.mark.parametrize("spec", [NGRAM, DRAFT_CFG], ids=["ngram", "draft"])
def test_speculation_under_chunked_prefill_preemption_and_prefix_hits(spec, reference):
    """A 6-token budget mixes verify chunks with prompt chunks and trims proposals; a pool of
    12 blocks of 4 preempts; the second round hits the prefix cache. Tokens never change."""
    from minillm.assets import resolve_model
    from minillm.config import ModelConfig
    from minillm.kvcache.addressing import kv_bytes_per_token

    per_block = 4 * kv_bytes_per_token(ModelConfig.from_folder(resolve_model(TARGET)), torch.float32)
    llm = LLM(TARGET, dtype="fp32", speculative_config=spec, max_num_batched_tokens=6, block_size=4,
              kv_cache_memory=14 * per_block, max_model_len=64)  # fmt: skip
    assert llm.engine.block_manager.num_blocks == 14  # 4 prompts of ~15-20 + 24 tokens need ~40
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    outs = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == reference[24]
    assert sum(o.num_preemptions for o in outs) > 0
    roomy = LLM(TARGET, dtype="fp32", speculative_config=spec, max_num_batched_tokens=6, block_size=4)
    for _ in range(2):
        outs = roomy.generate(PROMPTS, params)
        assert [o.token_ids for o in outs] == reference[24]
    assert sum(o.num_cached_tokens for o in outs) > 0  # the second round's prompts were cached
    llm.engine.block_manager.check_invariants()
    assert llm.engine.block_manager.num_used_blocks == 0


def test_pool_invariants_hold_after_every_verify_step():
    llm = LLM(TARGET, dtype="fp32", speculative_config=DRAFT_CFG, block_size=4)
    for prompt in PROMPTS:
        llm.engine.add_request(prompt, SamplingParams(max_tokens=30, ignore_eos=True))
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
        llm.engine.block_manager.check_invariants()
        llm.engine.speculator.draft.blocks.check_invariants()


def test_stops_and_max_tokens_inside_an_accepted_run(reference):
    """Nothing after a stop token, a stop string or max_tokens is emitted, even when the
    verifier accepted proposals beyond it."""
    expected = reference[40][2]  # HAMLET's continuation
    stop_id = expected[9]
    llm = LLM(TARGET, dtype="fp32", speculative_config=DRAFT_CFG)
    out = llm.generate(PROMPTS[2], SamplingParams(max_tokens=40, ignore_eos=True, stop_token_ids=[stop_id]))[0]
    assert out.token_ids == expected[: expected.index(stop_id) + 1] and out.finish_reason == "stop"
    for n in (1, 2, 7):
        out = llm.generate(PROMPTS[2], SamplingParams(max_tokens=n, ignore_eos=True))[0]
        assert out.token_ids == expected[:n] and out.finish_reason == "length"
    full = llm.generate(PROMPTS[2], SamplingParams(max_tokens=40, ignore_eos=True))[0].text
    stop = full[10:14]
    out = llm.generate(PROMPTS[2], SamplingParams(max_tokens=40, ignore_eos=True, stop=[stop]))[0]
    assert out.text == full[: full.index(stop)]
    assert llm.engine.block_manager.num_used_blocks == 0


def test_streaming_delivers_several_tokens_per_step(reference):
    llm = LLM(TARGET, dtype="fp32", speculative_config=NGRAM)
    deltas = list(llm.stream(PROMPTS[2], SamplingParams(max_tokens=40, ignore_eos=True)))
    tokens = [t for d in deltas for t in d.token_ids]
    assert tokens == reference[40][2]
    assert max(len(d.token_ids) for d in deltas) > 1
    assert all(d.token_id == d.token_ids[-1] for d in deltas if d.token_ids)
    assert "".join(d.text for d in deltas) == deltas[-1].output.text


def test_sampled_speculation_honours_the_seed_and_reports_metrics():
    spec = LLM(TARGET, dtype="fp32", speculative_config=DRAFT_CFG)
    params = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.95, seed=7, ignore_eos=True)
    first = spec.generate(PROMPTS[:2], params)
    again = spec.generate(PROMPTS[:2], params)
    assert [o.token_ids for o in first] == [o.token_ids for o in again]
    m = first[0].metrics
    assert m.spec_proposed > 0 and 0 <= m.acceptance_rate <= 1
    assert m.mean_accepted_length == m.spec_accepted / m.num_verify_steps
    assert m.as_dict()["forward_passes_per_token"] == m.forward_passes_per_token


def test_repetition_penalty_requests_decode_plainly_and_correctly():
    params = SamplingParams(max_tokens=16, repetition_penalty=1.3, ignore_eos=True)
    plain = LLM(TARGET, dtype="fp32").generate(PROMPTS[0], params)[0]
    out = LLM(TARGET, dtype="fp32", speculative_config=NGRAM).generate(PROMPTS[0], params)[0]
    assert out.token_ids == plain.token_ids and out.metrics.spec_proposed == 0


def test_abort_frees_both_pools():
    llm = LLM(TARGET, dtype="fp32", speculative_config=DRAFT_CFG)
    rid = llm.engine.add_request(PROMPTS[1], SamplingParams(max_tokens=30, ignore_eos=True))
    for _ in range(4):
        llm.engine.step()
    llm.engine.abort(rid)
    assert llm.engine.block_manager.num_used_blocks == 0
    assert llm.engine.speculator.draft.blocks.num_used_blocks == 0


# ---- options ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec,message",
    [
        ({"method": "medusa", "num_speculative_tokens": 2}, "method='medusa': expected one of"),
        ({"method": "ngram"}, "needs num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens=0 must be >= 1"),
        ({"method": "ngram", "num_speculative_tokens": 2, "model": DRAFT}, r"unknown key\(s\) \['model'\]"),
        ({"method": "draft", "num_speculative_tokens": 2}, "needs model=NAME_OR_PATH"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2}, "above"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_scaled": "yes"},
         "prompt_lookup_scaled='yes' must be true or false"),
        ({"method": "draft", "model": DRAFT, "num_speculative_tokens": 2, "prompt_lookup_scaled": True},
         r"unknown key\(s\) \['prompt_lookup_scaled'\]"),
        ({"method": "draft", "model": "no-such-model", "num_speculative_tokens": 2}, "no-such-model"),
        ("ngram", "must be a dict"),
        (
            {"method": "draft", "model": DRAFT, "num_speculative_tokens": 2, "quantization": "int3"},
            "quantization='int3'",
        ),
    ],
)
def test_bad_speculative_configs_are_named(spec, message):
    with pytest.raises(Exception, match=message):
        LLM(DRAFT, speculative_config=spec)


def test_a_draft_with_another_tokenizer_is_refused(tiny_model):
    with pytest.raises(ValueError, match="does not share the target's tokenizer"):
        LLM(TARGET, speculative_config={"method": "draft", "model": str(tiny_model), "num_speculative_tokens": 2})


def test_speculation_needs_the_paged_engine():
    with pytest.raises(ValueError, match="speculative_config needs mode='paged'"):
        LLM(DRAFT, mode="contiguous", speculative_config=NGRAM)


def test_cli_speculative_config(capsys, reference):
    from minillm.cli import main

    args = ["generate", "--model", TARGET, "--dtype", "fp32", "--prompt", PROMPTS[0], "--max-tokens", "24"]
    assert main([*args, "--ignore-eos", "--json", "--speculative-config", json.dumps(DRAFT_CFG)]) == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert record["token_ids"] == reference[24][0]
    assert record["metrics"]["acceptance_rate"] is not None
    assert main([*args, "--ignore-eos", "--speculative-config", json.dumps(NGRAM)]) == 0
    assert "target forward passes per output token" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*args, "--speculative-config", "{not json"])
    assert "--speculative-config: not JSON" in capsys.readouterr().err


def test_run_report_sums_the_speculation_metrics():
    from minillm.metrics import run_report

    llm = LLM(TARGET, dtype="fp32", speculative_config=NGRAM)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=24, ignore_eos=True))
    report = run_report(outs)
    assert report.spec_proposed == sum(o.metrics.spec_proposed for o in outs) > 0
    assert report.acceptance_rate == report.spec_accepted / report.spec_proposed
    assert report.forward_passes_per_token < 1
    plain = run_report(LLM(TARGET, dtype="fp32").generate(PROMPTS, SamplingParams(max_tokens=8, ignore_eos=True)))
    assert plain.summary()["spec_acceptance_rate"] is None and plain.forward_passes_per_token == 1


@pytest.mark.slow
def test_smollm2_prompt_lookup_in_fp32_reproduces_the_target_alone():
    """On the real model in fp32 the verify pass gives the plain engine's tokens exactly. (In
    bf16 a position computed in a chunk of k + 1 rows rounds differently from the same position
    computed alone, so near-ties can flip; bench_spec.py reports the agreement.)"""
    passage = "The quick brown fox jumps over the lazy dog. " * 3 + "Caches keep recently used data close."
    chat = [{"role": "user", "content": f"Repeat this text exactly:\n\n{passage}"}]
    params = SamplingParams(max_tokens=40)
    plain = LLM("smollm2-135m", dtype="fp32").generate([chat], params)[0]
    spec = LLM("smollm2-135m", dtype="fp32", speculative_config=NGRAM).generate([chat], params)[0]
    assert spec.token_ids == plain.token_ids
    assert spec.metrics.acceptance_rate > 0.3 and spec.metrics.forward_passes_per_token < 0.8
