"""Rung 1 of the correctness ladder: minillm reproduces HF transformers on tiny random models.

For every architecture variant: prefill logits and every decode step's logits within 1e-4
(fp32), and identical greedy tokens for 32 steps, on a batch whose prompts differ in length.
"""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_VARIANTS, hf_model

from minillm import LLM, SamplingParams
from minillm.kvcache import ContiguousKVCache
from minillm.models import load_model
from minillm.models.llama import ForwardBatch

ATOL = 1e-4
PROMPTS = [[5, 17, 42, 8, 99, 3, 250, 61, 7], [11, 12], [300, 4, 77, 77, 150]]
STEPS = 32


def hf_greedy(hf, prompt: list[int], steps: int) -> tuple[list[int], list[torch.Tensor]]:
    """HF reference, one sequence at a time (no padding): greedy tokens and each step's logits."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=steps,
            min_new_tokens=steps,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    return out.sequences[0, len(prompt) :].tolist(), [step[0].float() for step in out.logits]


@pytest.mark.parametrize("variant", sorted(TINY_VARIANTS))
def test_prefill_logits_match_hf(tiny_models, variant):
    folder = tiny_models[variant]
    ours, ref = load_model(folder, torch.float32), hf_model(folder)
    width = max(len(p) for p in PROMPTS)
    ids = torch.tensor([p + [0] * (width - len(p)) for p in PROMPTS])
    positions = torch.arange(width).expand(len(PROMPTS), -1)
    logits = ours(ForwardBatch(ids, positions))  # [B, T, V], right-padded batch
    for row, prompt in enumerate(PROMPTS):
        with torch.no_grad():
            expected = ref(torch.tensor([prompt])).logits[0]
        diff = (logits[row, : len(prompt)] - expected).abs().max().item()
        assert diff <= ATOL, f"{variant} prompt {row}: prefill logits differ by {diff:.2e}"


@pytest.mark.parametrize("variant", sorted(TINY_VARIANTS))
def test_decode_logits_and_greedy_tokens_match_hf(tiny_models, variant):
    """Drive the cached model by hand on a ragged batch and compare every step with HF."""
    folder = tiny_models[variant]
    ours, ref = load_model(folder, torch.float32), hf_model(folder)
    references = [hf_greedy(ref, p, STEPS) for p in PROMPTS]

    batch = len(PROMPTS)
    lengths = [len(p) for p in PROMPTS]
    width = max(lengths)
    cache = ContiguousKVCache(ours.config, batch, width + STEPS, torch.float32, torch.device("cpu"))
    ids = torch.tensor([p + [0] * (width - len(p)) for p in PROMPTS])
    positions = torch.arange(width).expand(batch, -1)
    last = torch.tensor([n - 1 for n in lengths])
    logits = ours(ForwardBatch(ids, positions, cache, kv_len=width, logit_index=last, same_start=0))
    tokens: list[list[int]] = [[] for _ in PROMPTS]
    for step in range(STEPS):
        for row, (_, ref_logits) in enumerate(references):
            diff = (logits[row] - ref_logits[step]).abs().max().item()
            assert diff <= ATOL, f"{variant} row {row} step {step}: logits differ by {diff:.2e}"
            # HF's min_new_tokens suppresses EOS (id 2) while choosing; so do we.
            tokens[row].append(int(logits[row].index_fill(0, torch.tensor([2]), float("-inf")).argmax()))
        step_ids = torch.tensor([[t[-1]] for t in tokens])
        pos = torch.tensor([[n + step] for n in lengths])  # rows at different positions
        logits = ours(ForwardBatch(step_ids, pos, cache, kv_len=max(lengths) + step + 1))[:, -1]
    for row, (ref_tokens, _) in enumerate(references):
        assert tokens[row] == ref_tokens, f"{variant} row {row}: greedy tokens differ from HF"


@pytest.mark.parametrize("variant", ["llama_gqa", "llama_mqa", "qwen2_bias", "llama_untied"])
@pytest.mark.parametrize("mode,backend", [("contiguous", "sdpa"), ("contiguous", "torch"), ("naive", "sdpa")])
def test_engine_greedy_tokens_match_hf(tiny_models, variant, mode, backend):
    folder = tiny_models[variant]
    ref = hf_model(folder)
    llm = LLM(folder, dtype="fp32", mode=mode, attention_backend=backend)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=STEPS, ignore_eos=True))
    for row, (prompt, out) in enumerate(zip(PROMPTS, outs)):
        expected, _ = hf_greedy(ref, prompt, STEPS)
        assert out.token_ids == expected, f"{variant}/{mode}/{backend} prompt {row}"
        assert out.finish_reason == "length"


def test_naive_and_kv_cache_modes_agree(tiny_model):
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    cached = LLM(tiny_model, dtype="fp32").generate(PROMPTS, params)
    naive = LLM(tiny_model, dtype="fp32", mode="naive").generate(PROMPTS, params)
    assert [o.token_ids for o in cached] == [o.token_ids for o in naive]


def test_batch_equals_alone(tiny_model):
    """A sequence's tokens do not depend on its batch-mates (or on when they finish)."""
    llm = LLM(tiny_model, dtype="fp32")
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (20, 5, 12)]
    together = llm.generate(PROMPTS, params)
    for prompt, p, out in zip(PROMPTS, params, together):
        alone = llm.generate([prompt], p)[0]
        assert alone.token_ids == out.token_ids


def test_prepacked_linears_match_plain(tiny_model):
    plain = LLM(tiny_model, dtype="fp32", cpu_prepack=False)
    packed = LLM(tiny_model, dtype="fp32", cpu_prepack=True)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    assert [o.token_ids for o in plain.generate(PROMPTS, params)] == [
        o.token_ids for o in packed.generate(PROMPTS, params)
    ]


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_half_precision_runs_close_to_fp32(tiny_model, dtype):
    """Half precision is a quality trade, not a different model: same first tokens, close logits."""
    full = load_model(tiny_model, torch.float32)
    half = load_model(tiny_model, {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype])
    ids = torch.tensor([PROMPTS[0]])
    pos = torch.arange(ids.shape[1])[None]
    a, b = full(ForwardBatch(ids, pos)), half(ForwardBatch(ids, pos))
    assert b.dtype == torch.float32  # logits are always handed to the sampler in fp32
    assert (a - b).abs().max().item() < 0.15 * a.abs().max().item()


@pytest.mark.slow
@pytest.mark.parametrize("prepack", [True, False])
def test_compiled_decode_matches_eager(tiny_model, prepack):
    """torch.compile'd decode steps reproduce the eager engine: one sequence, aligned and
    ragged batches, with (fp32: compiled single-row steps, packed batched steps) and without
    prepacked weights."""
    compiled = LLM(tiny_model, dtype="fp32", mode="contiguous", compile=True, cpu_prepack=prepack)
    eager = LLM(tiny_model, dtype="fp32", mode="contiguous", cpu_prepack=False)
    for prompts in ([[5, 6, 7]], [[5, 6, 7], [8, 9, 10]], PROMPTS):
        params = SamplingParams(max_tokens=12, ignore_eos=True)
        assert [o.token_ids for o in compiled.generate(prompts, params)] == [
            o.token_ids for o in eager.generate(prompts, params)
        ]
