"""The prefill's measured choice (``minillm/attention/prefill_tuning.py``): the SDPA candidate
computes what our FlashAttention computes, on the shapes a paged prefill has — chunks that
continue a cached prefix, GQA, sliding windows — and the engine's tokens do not depend on which
candidate wins."""

from __future__ import annotations

import pytest
import torch

from minillm import LLM, SamplingParams
from minillm.attention import triton_available

if not triton_available():
    pytest.skip("triton is not installed", allow_module_level=True)

from minillm.attention import prefill_tuning  # noqa: E402
from minillm.attention.decode_tuning import MeasuredChoice  # noqa: E402
from minillm.attention.prefill_tuning import (  # noqa: E402
    FLASH,
    GATHER_SDPA_PREFILL,
    gather_sdpa_prefill,
    prefill_bucket,
    prefill_mask,
)
from minillm.attention.triton_kernels import flash_attention  # noqa: E402
from tests.test_decode_tuning import FakeTimer  # noqa: E402
from tests.test_triton_kernels import CASES, DEVICE, FP32_TOL, reference, scatter_into_pool  # noqa: E402


@pytest.mark.parametrize(("heads", "kv_heads", "dim", "lengths"), CASES)
def test_the_sdpa_candidate_is_the_reference(heads, kv_heads, dim, lengths):
    """Chunks of 1-33 new tokens after prefixes of 0-37 cached ones, keys in scattered blocks."""
    gen = torch.Generator().manual_seed(4)
    qs = [torch.randn(t, heads, dim, generator=gen).to(DEVICE) for t, _ in lengths]
    ks = [torch.randn(s, kv_heads, dim, generator=gen).to(DEVICE) for _, s in lengths]
    vs = [torch.randn(s, kv_heads, dim, generator=gen).to(DEVICE) for _, s in lengths]
    k_pool, v_pool, tables = scatter_into_pool(ks, vs, 4, 40, gen)
    query_lens, context_lens = [t for t, _ in lengths], [s for _, s in lengths]
    out = gather_sdpa_prefill(torch.cat(qs), k_pool, v_pool, query_lens, context_lens, tables, dim**-0.5, 4)
    start = 0
    for i, n in enumerate(query_lens):
        expected = reference(qs[i], ks[i], vs[i], True)
        torch.testing.assert_close(out[start : start + n], expected, atol=FP32_TOL, rtol=FP32_TOL)
        start += n


@pytest.mark.parametrize("window", [1, 5, 64])
def test_the_sdpa_candidate_matches_our_kernel_with_a_window(window):
    """Sliding windows narrower than a chunk, than a block, and wider than every context."""
    gen = torch.Generator().manual_seed(5)
    lengths = [(9, 30), (12, 12), (1, 17)]
    ks = [torch.randn(s, 2, 64, generator=gen).to(DEVICE) for _, s in lengths]
    vs = [torch.randn(s, 2, 64, generator=gen).to(DEVICE) for _, s in lengths]
    q = torch.randn(sum(t for t, _ in lengths), 6, 64, generator=gen).to(DEVICE)
    k_pool, v_pool, tables = scatter_into_pool(ks, vs, 4, 30, gen)
    query_lens, context_lens = [t for t, _ in lengths], [s for _, s in lengths]
    cu = torch.tensor([0, 9, 21, 22], device=DEVICE)
    ours = flash_attention(q, k_pool, v_pool, cu, torch.tensor(context_lens, device=DEVICE), 12, 0.125,
                           block_tables=tables, block_size=4, window=window, block_m=16, block_n=16)  # fmt: skip
    sdpa = gather_sdpa_prefill(q, k_pool, v_pool, query_lens, context_lens, tables, 0.125, 4, window)
    torch.testing.assert_close(sdpa, ours, atol=FP32_TOL, rtol=FP32_TOL)


def test_the_mask_places_a_chunk_after_its_prefix():
    mask = prefill_mask(2, 5, None, "cpu")[0, 0]
    assert mask.tolist() == [[True, True, True, True, False], [True, True, True, True, True]]
    assert prefill_mask(2, 5, 2, "cpu")[0, 0].tolist() == [[False, False, True, True, False], [False] * 3 + [True] * 2]


def test_buckets_round_up_and_keep_what_changes_the_kernel():
    assert prefill_bucket([300, 5], [300, 700], "bf16") == (2, 1024, 512, "bf16")
    assert prefill_bucket([300], [300], "bf16") != prefill_bucket([300], [300], "fp32")


@pytest.mark.parametrize("winner", [FLASH, GATHER_SDPA_PREFILL])
def test_the_engine_runs_whichever_prefill_candidate_wins(tiny_model, monkeypatch, winner):
    """Chunked prefill (7 tokens a step) over scattered blocks: the greedy tokens are the torch
    backend's whichever kernel the prefill's choice names."""
    choice = MeasuredChoice(
        (FLASH, GATHER_SDPA_PREFILL), FakeTimer({c: 0.0 if c == winner else 1.0 for c in (FLASH, GATHER_SDPA_PREFILL)})
    )
    monkeypatch.setattr(prefill_tuning, "prefill_choice", lambda device: choice)
    prompts = [[5, 17, 42, 8, 99, 3, 250, 61, 7], [11, 12]]
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    args = dict(dtype="fp32", block_size=4, max_num_batched_tokens=7, device=DEVICE.type)
    ref = LLM(tiny_model, attention_backend="torch", **args).generate(prompts, params)
    out = LLM(tiny_model, attention_backend="triton", **args).generate(prompts, params)
    assert [o.token_ids for o in out] == [o.token_ids for o in ref]
    assert choice.decided and set(choice.decided.values()) == {winner}
