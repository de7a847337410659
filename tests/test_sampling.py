"""Sampling: exact masks on constructed logits, the sampled distribution, seeds, stops, streams."""

from __future__ import annotations

import math

import pytest
import torch

from minillm import LLM, SamplingParams
from minillm.sampling import apply_min_p, apply_repetition_penalty, apply_top_k, apply_top_p, sample

NEG = float("-inf")


def kept(logits: torch.Tensor) -> list[list[int]]:
    return [torch.nonzero(row != NEG).flatten().tolist() for row in logits]


def test_top_k_keeps_exactly_k_largest():
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0, 2.0], [1.0, 5.0, 3.0, 4.0, 2.0]])
    assert kept(apply_top_k(logits, torch.tensor([2, 0]))) == [[1, 3], [0, 1, 2, 3, 4]]


def test_top_k_larger_than_vocab_keeps_all():
    logits = torch.randn(1, 6)
    assert kept(apply_top_k(logits, torch.tensor([100]))) == [list(range(6))]


def test_top_p_keeps_smallest_nucleus():
    probs = torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]])
    logits = probs.log()
    assert kept(apply_top_p(logits, torch.tensor([0.5]))) == [[0]]
    assert kept(apply_top_p(logits, torch.tensor([0.51]))) == [[0, 1]]
    assert kept(apply_top_p(logits, torch.tensor([0.8]))) == [[0, 1, 2]]
    assert kept(apply_top_p(logits, torch.tensor([1.0]))) == [[0, 1, 2, 3, 4]]


def test_top_p_keeps_order_independent_of_position():
    probs = torch.tensor([[0.1, 0.05, 0.5, 0.15, 0.2]])
    assert kept(apply_top_p(probs.log(), torch.tensor([0.75]))) == [[2, 3, 4]]


def whole_sort_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The nucleus rule written out on a whole sorted row (what ``apply_top_p`` did before it
    looked in each row's head first)."""
    probs, order = logits.softmax(dim=-1).sort(dim=-1, descending=True)
    mass_before = probs.cumsum(dim=-1) - probs
    drop_sorted = (mass_before >= top_p.unsqueeze(-1)) & (top_p.unsqueeze(-1) < 1.0)
    drop_sorted[..., 0] = False
    return logits.masked_fill(torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted), NEG)


@pytest.mark.parametrize("vocab", [50, 49152])
def test_top_p_from_the_head_is_the_whole_sorts_nucleus(vocab):
    """Peaked rows (the nucleus inside the head), flat rows (it reaches past it: sorted whole),
    top_p of 1 and of almost 0, one batch: the same tokens as the rule on whole sorted rows."""
    generator = torch.Generator().manual_seed(vocab)
    scale = torch.tensor([8.0, 8.0, 3.0, 0.2, 0.01, 5.0, 8.0, 1.0])[:, None]
    logits = torch.randn(8, vocab, generator=generator) * scale
    top_p = torch.tensor([0.9, 0.5, 0.95, 0.9, 0.3, 1.0, 1e-9, 0.99])
    got, want = apply_top_p(logits, top_p), whole_sort_top_p(logits, top_p)
    assert kept(got) == kept(want)
    if vocab > 1024:  # both paths ran: some rows' nucleus fits the head, some does not
        sizes = [len(k) for k in kept(want)]
        assert min(sizes[:2]) < 1024 < max(sizes[3:5]), sizes


def test_top_k_from_topk_is_the_whole_sorts_kth():
    generator = torch.Generator().manual_seed(1)
    logits = torch.randint(-5, 5, (6, 300), generator=generator).float()  # many ties with the k-th
    top_k = torch.tensor([1, 7, 0, 300, 50, 2])
    vocab = logits.shape[-1]
    k = torch.where(top_k <= 0, vocab, top_k)
    kth = logits.sort(dim=-1, descending=True).values.gather(-1, (k - 1).unsqueeze(-1))
    assert kept(apply_top_k(logits, top_k)) == kept(logits.masked_fill(logits < kth, NEG))


def test_min_p_is_relative_to_the_top_token():
    probs = torch.tensor([[0.5, 0.3, 0.1, 0.06, 0.04]])
    assert kept(apply_min_p(probs.log(), torch.tensor([0.15]))) == [[0, 1, 2]]  # threshold 0.075
    assert kept(apply_min_p(probs.log(), torch.tensor([0.25]))) == [[0, 1]]  # threshold 0.125
    assert kept(apply_min_p(probs.log(), torch.tensor([0.0]))) == [[0, 1, 2, 3, 4]]


def test_repetition_penalty_divides_positive_multiplies_negative():
    logits = torch.tensor([[2.0, -2.0, 1.0]])
    out = apply_repetition_penalty(logits, [[0, 1]], torch.tensor([2.0]))
    assert out.tolist() == [[1.0, -4.0, 1.0]]


def test_greedy_is_argmax():
    logits = torch.tensor([[0.1, 3.0, 0.2], [5.0, 0.0, 1.0]])
    gens = [torch.Generator().manual_seed(0) for _ in range(2)]
    assert sample(logits, [SamplingParams(), SamplingParams()], gens) == [1, 0]


def test_sampled_frequencies_follow_the_filtered_distribution():
    """Top-k 3 then temperature 1: empirical frequencies match the renormalised probabilities."""
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    params = SamplingParams(temperature=1.0, top_k=3)
    gen = torch.Generator().manual_seed(1234)
    n = 6000
    counts = torch.zeros(4)
    for _ in range(n):
        counts[sample(probs.log()[None], [params], [gen])[0]] += 1
    assert counts[3] == 0  # masked by top-k
    expected = torch.tensor([0.4, 0.3, 0.2]) / 0.9
    observed = counts[:3] / n
    assert (observed - expected).abs().max() < 4 * math.sqrt(0.25 / n) + 0.01


@pytest.mark.parametrize("temperature", [0.2, 1.0, 5.0])
def test_temperature_rescales_the_distribution(temperature):
    """p_i ∝ p_i^(1/T): T < 1 sharpens, T > 1 flattens."""
    probs = torch.tensor([0.6, 0.4])
    gen = torch.Generator().manual_seed(0)
    n = 2000
    hits = sum(sample(probs.log()[None], [SamplingParams(temperature=temperature)], [gen])[0] == 0 for _ in range(n))
    scaled = probs ** (1 / temperature)
    expected = float(scaled[0] / scaled.sum())
    assert abs(hits / n - expected) < 4 * math.sqrt(expected * (1 - expected) / n)


def test_same_seed_same_tokens_alone_or_in_a_batch(tiny_model):
    llm = LLM(tiny_model, dtype="fp32")
    seeded = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=20, seed=7, ignore_eos=True)
    other = SamplingParams(temperature=1.3, max_tokens=12, seed=99, ignore_eos=True)
    alone = llm.generate([[5, 6, 7]], seeded)[0].token_ids
    batched = llm.generate([[9, 9], [5, 6, 7], [1, 2, 3, 4, 5]], [other, seeded, other])[1].token_ids
    assert alone == batched
    assert llm.generate([[5, 6, 7]], seeded)[0].token_ids == alone  # and again, same engine


def test_unseeded_requests_are_reproducible_from_the_engine_seed(tiny_model):
    params = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)
    a = LLM(tiny_model, dtype="fp32", seed=3).generate([[5, 6, 7]] * 2, params)
    b = LLM(tiny_model, dtype="fp32", seed=3).generate([[5, 6, 7]] * 2, params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert a[0].token_ids != a[1].token_ids  # different requests draw different streams


def test_stop_string_cuts_text_exactly(tiny_model):
    llm = LLM(tiny_model, dtype="fp32")
    free = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=40, ignore_eos=True))[0]
    text = free.text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), "constructed stop string is whitespace; pick another prompt"
    cut = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=40, ignore_eos=True, stop=[stop]))[0]
    assert cut.finish_reason == "stop"
    assert cut.text == text[: text.index(stop)]
    assert free.token_ids[: len(cut.token_ids)] == cut.token_ids


def test_stop_token_ids_and_eos(tiny_model):
    llm = LLM(tiny_model, dtype="fp32")
    free = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=20, ignore_eos=True))[0]
    stop_id = free.token_ids[4]
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=20, stop_token_ids=[stop_id], ignore_eos=True))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == free.token_ids[: free.token_ids.index(stop_id) + 1]


@pytest.mark.parametrize("stop", [[], ["e"], ["the q", "xyz"]])
def test_stream_deltas_add_up_to_the_final_text(tiny_model, stop):
    llm = LLM(tiny_model, dtype="fp32")
    params = SamplingParams(max_tokens=30, ignore_eos=True, stop=stop)
    deltas = list(llm.stream([5, 6, 7], params))
    final = llm.generate([[5, 6, 7]], params)[0]
    assert "".join(d.text for d in deltas) == final.text
    assert [d.token_id for d in deltas] == final.token_ids
    assert deltas[-1].finish_reason == final.finish_reason
    assert all(d.finish_reason is None for d in deltas[:-1])


def test_metrics_are_recorded(tiny_model):
    out = LLM(tiny_model, dtype="fp32").generate([[5, 6, 7]], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    m = out.metrics
    assert len(m.token_times) == 8
    assert 0 < m.ttft <= m.e2e_latency
    assert m.tpot > 0 and len(m.inter_token_latencies) == 7
    assert m.queueing_time >= 0
