"""Half-precision linears on CPUs without half-precision kernels (``layers/cpu_upcast.py``): the
engine picks the method exactly there, small batches stay on the native kernel bit for bit, big
ones are the fp32 product rounded once, and the engine's tokens do not change."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from minillm import LLM, SamplingParams
from minillm.layers import Linear, cpu_upcast
from minillm.layers.cpu_upcast import BIG_MATRIX, BIG_MATRIX_MIN_ROWS, UPCAST_MIN_ROWS, CPUUpcastMethod


def layer_of(out_features: int, in_features: int, dtype=torch.bfloat16, bias: bool = True) -> Linear:
    g = torch.Generator().manual_seed(0)
    layer = Linear(in_features, out_features, bias=bias).requires_grad_(False)
    layer.weight.copy_(torch.randn(out_features, in_features, generator=g) * 0.05)
    if bias:
        layer.bias.copy_(torch.randn(out_features, generator=g))
    layer.to(dtype)
    layer.set_method(CPUUpcastMethod())
    return layer


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_below_the_threshold_it_is_the_native_kernel_and_from_it_the_fp32_product_rounded_once(dtype):
    layer = layer_of(96, 64, dtype)
    x = torch.randn(2, UPCAST_MIN_ROWS, 64).to(dtype)  # 32 rows in a 3-D batch
    few = x[0, : UPCAST_MIN_ROWS - 1]
    assert torch.equal(layer(few), F.linear(few, layer.weight, layer.bias))
    exact = F.linear(x.float(), layer.weight.float(), layer.bias.float())
    got = layer(x)
    assert got.dtype == dtype and got.shape == (2, UPCAST_MIN_ROWS, 96)
    assert torch.equal(got, exact.to(dtype))
    # the native kernel rounds the same fp32 sums once too, summed in another order
    assert torch.allclose(got.float(), F.linear(x, layer.weight, layer.bias).float(), rtol=2e-2, atol=2e-2)


def test_a_head_sized_matrix_waits_for_more_rows():
    layer = layer_of(BIG_MATRIX // 64, 64, bias=False)
    x = torch.randn(BIG_MATRIX_MIN_ROWS - 1, 64).bfloat16()
    assert torch.equal(layer(x), F.linear(x, layer.weight))  # native: below the head's threshold
    x = torch.randn(BIG_MATRIX_MIN_ROWS, 64).bfloat16()
    assert torch.equal(layer(x), F.linear(x.float(), layer.weight.float()).bfloat16())


def no_half_kernels(monkeypatch, slow: bool = True) -> None:
    """Make this CPU look like one without bf16 kernels (``slow``) or with them, whatever it is:
    oneDNN's check answers both questions there — no native GEMM, and no prepacking either."""
    from minillm.layers import cpu_prepack

    native = cpu_prepack.prepack_available
    monkeypatch.setattr(cpu_upcast, "half_gemm_is_slow", lambda dtype: slow and dtype == torch.bfloat16)
    monkeypatch.setattr(cpu_prepack, "prepack_available", lambda dtype: native(dtype) and not (slow and dtype == torch.bfloat16))


def test_the_engine_upcasts_exactly_where_the_cpu_has_no_half_kernels(monkeypatch):
    for slow in (True, False):
        no_half_kernels(monkeypatch, slow)
        for dtype, wanted in (("bf16", "cpu_upcast" if slow else None), ("fp32", None)):
            llm = LLM("tiny-shakespeare-1m", dtype=dtype, enable_prefix_caching=False)
            names = {layer.method.name for layer in llm.model.linear_layers()}
            if wanted:
                assert names == {wanted}, names
            else:
                assert "cpu_upcast" not in names, names
        off = LLM("tiny-shakespeare-1m", dtype="bf16", cpu_prepack=False)  # the option turns it off too
        assert {layer.method.name for layer in off.model.linear_layers()} == {"plain"}


def test_greedy_tokens_and_perplexity_match_the_native_kernel(monkeypatch):
    """tiny-shakespeare-8m in bf16, a 200-token prompt (prefilled in fp32 from 16 rows): the same
    24 greedy tokens as plain bf16 storage, and the perplexity within 0.5%."""
    from minillm.assets import heldout_text
    from minillm.tools.evaluation import perplexity

    no_half_kernels(monkeypatch)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    results = {}
    for prepack in (True, False):
        llm = LLM("tiny-shakespeare-8m", dtype="bf16", cpu_prepack=prepack, enable_prefix_caching=False)
        ids = llm.tokenizer.encode(heldout_text())
        method = llm.model.layers[0].mlp.down_proj.method.name
        results[method] = (llm.generate([ids[:200]], params)[0].token_ids, perplexity(llm.model, ids[:257]))
    upcast, plain = results["cpu_upcast"], results["plain"]
    assert upcast[0] == plain[0]
    assert abs(upcast[1] / plain[1] - 1) < 0.005, (upcast[1], plain[1])
