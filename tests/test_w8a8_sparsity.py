"""W8A8 with SmoothQuant-style smoothing, and 2:4 sparsity by magnitude and Wanda scores: the
pieces against their definitions, the engine within a stated budget, and bad options named."""

from __future__ import annotations

import json

import pytest
import torch

from minillm import LLM, SamplingParams
from minillm.quantization.sparsity import is_two_four, magnitude_scores, two_four_mask, wanda_scores
from minillm.quantization.w8a8 import (
    EXACT_FP32_K,
    W8A8Method,
    exact_float_int8_matmul,
    int8_matmul,
    quantize_activations,
    search_smoothing,
    smoothing_scale,
    w8a8_linear,
)


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


# ---- W8A8 ----------------------------------------------------------------------------------------


def test_activations_are_quantized_per_token_within_half_a_step():
    x = torch.randn(6, 64, generator=_gen())
    x[2] *= 100  # a loud token must not cost the others precision
    a, scale = quantize_activations(x)
    assert a.dtype == torch.int8 and scale.shape == (6,)
    err = (a.float() * scale[:, None] - x).abs()
    assert (err <= scale[:, None] / 2 + 1e-6).all()
    assert torch.equal(a.abs().amax(1), torch.full((6,), 127, dtype=torch.int8))  # each row uses the full range


@pytest.mark.parametrize("shape", [(1, 64, 96), (5, 100, 33), (40, 128, 64)])
def test_int8_gemm_is_exact(shape):
    m, k, n = shape
    a = torch.randint(-127, 128, (m, k), dtype=torch.int8, generator=_gen())
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=_gen(1))
    assert torch.equal(int8_matmul(a, q.t()), (a.long() @ q.long().t()).int())


@pytest.mark.parametrize("k", [1, EXACT_FP32_K, EXACT_FP32_K + 1, 2 * EXACT_FP32_K + 300])
def test_the_fp32_int8_gemm_is_exact_at_the_extremes_and_across_slices(k):
    """The path CPUs without int8 dot products take: every product at its largest (-128 · -128,
    127 · -128) over one slice of K and over several, equal to the integer product and to
    ``torch._int_mm`` (which is exact on every CPU, only slow without VNNI/AMX)."""
    ends = torch.tensor([-128, 127, -128, -127], dtype=torch.int8)
    a = torch.stack(
        [ends[0].repeat(k), ends[1].repeat(k), torch.randint(-128, 128, (k,), dtype=torch.int8, generator=_gen())]
    )
    q_t = torch.stack(
        [ends[2].repeat(k), ends[3].repeat(k), torch.randint(-128, 128, (k,), dtype=torch.int8, generator=_gen(1))], 1
    )
    expected = (a.long() @ q_t.long()).int()
    assert expected[0, 0] == 128 * 128 * k  # 2^24 at one full slice: the bound the slicing keeps
    assert torch.equal(exact_float_int8_matmul(a, q_t), expected)
    assert torch.equal(torch._int_mm(a.repeat(6, 1), q_t.repeat(1, 3))[:3, :3], expected)


def test_w8a8_layer_is_its_dequantized_definition():
    """y = (a · s_x) (q · s_w)ᵀ computed in integers equals the same product in floats."""
    x, w = torch.randn(7, 64, generator=_gen()), torch.randn(48, 64, generator=_gen(1))
    from minillm.quantization.int8 import quantize_int8

    s = torch.rand(64, generator=_gen(2)) + 0.5
    q, w_scale = quantize_int8(w * s)
    got = w8a8_linear(x, q.t(), w_scale, 1 / s)
    a, x_scale = quantize_activations(x / s)
    expected = (a.double() * x_scale[:, None].double()) @ (q.double() * w_scale[:, None].double()).t()
    assert torch.allclose(got.double(), expected, rtol=1e-5, atol=1e-5)
    assert (got - x @ w.t()).abs().max() < 0.05 * (x @ w.t()).abs().max()  # and close to the float layer


def test_smoothing_is_exact_before_rounding_and_helps_with_an_outlier_channel():
    w = torch.randn(32, 64, generator=_gen())
    x = torch.randn(200, 64, generator=_gen(1))
    x[:, 7] *= 60  # an outlier channel, in every token, as LLM activations have
    s = smoothing_scale(x.abs().amax(0), w, 0.5)
    assert torch.allclose((x / s) @ (w * s).t(), x @ w.t(), rtol=1e-4, atol=1e-3)
    s_best, alpha = search_smoothing(w, x.abs().amax(0), x)
    assert alpha > 0, "an outlier channel should be smoothed"
    from minillm.quantization.int8 import quantize_int8

    def error(scale):
        q, ws = quantize_int8(w * scale)
        return (w8a8_linear(x, q.t(), ws, 1 / scale) - x @ w.t()).pow(2).mean()

    assert error(s_best) < 0.5 * error(torch.ones(64))


def test_engine_w8a8_stays_within_budget_and_quantizes_every_decoder_layer():
    """fp32 tiny model, held-out Shakespeare: w8a8 perplexity within 1% of fp32 (measured
    +0.0%), the same first 16 greedy tokens; the head is int8 weight-only."""
    from minillm.assets import heldout_text
    from minillm.tools.evaluation import perplexity

    params = SamplingParams(max_tokens=16, ignore_eos=True)
    ppl, tokens = {}, {}
    for q in (None, "w8a8"):
        llm = LLM("tiny-shakespeare-8m", dtype="fp32", quantization=q)
        ppl[q] = perplexity(llm.model, llm.tokenizer.encode(heldout_text())[:1024])
        tokens[q] = llm.generate("KING.\nNow is the winter", params)[0].token_ids
    methods = {type(m.method).__name__ for m in llm.model.linear_layers() if m is not llm.model.lm_head}
    assert methods == {"W8A8Method"} and llm.model.lm_head.method.name == "int8"
    assert abs(ppl["w8a8"] / ppl[None] - 1) < 0.01, ppl
    assert tokens["w8a8"] == tokens[None]


def test_w8a8_in_bf16_runs_and_agrees_with_the_bf16_engine():
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    base = LLM("tiny-shakespeare-1m", dtype="bf16").generate("KING.", params)[0].token_ids
    got = LLM("tiny-shakespeare-1m", dtype="bf16", quantization="w8a8").generate("KING.", params)[0].token_ids
    assert len(got) == 8 and got[:4] == base[:4]


def test_w8a8_without_calibration_is_plain_per_token_int8():
    from minillm.layers.linear import Linear

    layer = Linear(64, 32)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(32, 64, generator=_gen()))
    w = layer.weight.detach().clone()
    layer.set_method(W8A8Method())
    x = torch.randn(3, 64, generator=_gen(1))
    assert layer.weight is None and torch.equal(layer.w8a8_inv_smooth, torch.ones(64))
    assert (layer(x) - x @ w.t()).abs().max() < 0.05 * (x @ w.t()).abs().max()


# ---- 2:4 sparsity ----------------------------------------------------------------------------------


def test_two_four_mask_keeps_the_two_largest_of_every_four():
    scores = torch.tensor([[1.0, 4.0, 3.0, 2.0, 0.1, 0.3, 0.2, 0.4]])
    assert two_four_mask(scores).tolist() == [[False, True, True, False, False, True, False, True]]
    w = torch.randn(16, 64, generator=_gen())
    pruned = w * two_four_mask(magnitude_scores(w))
    assert is_two_four(pruned) and not is_two_four(w)
    assert (pruned != 0).sum() == w.numel() // 2


def test_wanda_keeps_small_weights_on_loud_channels():
    w = torch.tensor([[1.0, 0.9, 0.2, 0.8]])
    loud = torch.tensor([1.0, 1.0, 400.0, 1.0])  # Σx² per channel: channel 2 carries 20× the activation norm
    assert two_four_mask(magnitude_scores(w)).tolist() == [[True, True, False, False]]
    assert two_four_mask(wanda_scores(w, loud)).tolist() == [[True, False, True, False]]


def test_input_features_not_divisible_by_four_are_named():
    with pytest.raises(ValueError, match="divisible by 4, got 6"):
        two_four_mask(torch.ones(2, 6))


@pytest.mark.parametrize("method", ["2:4", "2:4-wanda"])
def test_engine_prunes_every_decoder_layer_and_nothing_else(method):
    dense = LLM("tiny-shakespeare-1m", dtype="fp32", cpu_prepack=False)
    llm = LLM("tiny-shakespeare-1m", dtype="fp32", cpu_prepack=False, sparsity=method)
    for layer in llm.model.linear_layers():
        if layer is not llm.model.lm_head:
            assert is_two_four(layer.weight), layer
    assert torch.equal(llm.model.embed_tokens.weight, dense.model.embed_tokens.weight)  # the tied head is dense
    out = llm.generate("KING.", SamplingParams(max_tokens=8, ignore_eos=True))[0]
    assert len(out.token_ids) == 8


def test_pruning_costs_quality_and_wanda_keeps_layer_outputs_closer():
    """Half the weights gone without retraining: perplexity rises for both criteria. Wanda's
    criterion is about outputs: summed over the layers, its pruned layers' outputs on the
    calibration rows are closer to the dense ones than magnitude pruning's. (Which one wins
    on perplexity depends on the text: on held-out Shakespeare the tiny model calibrated on
    English prose loses slightly more with Wanda — ``bench_quant.py`` reports SmolLM2.)"""
    from minillm.assets import heldout_text
    from minillm.quantization.calibration import calibration_ids, collect_activations
    from minillm.tools.evaluation import perplexity

    ppl = {}
    for method in (None, "2:4", "2:4-wanda"):
        llm = LLM("tiny-shakespeare-8m", dtype="fp32", cpu_prepack=False, sparsity=method)
        ppl[method] = perplexity(llm.model, llm.tokenizer.encode(heldout_text())[:1024])
    assert ppl[None] < min(ppl["2:4"], ppl["2:4-wanda"]), ppl

    dense = LLM("tiny-shakespeare-8m", dtype="fp32", cpu_prepack=False)
    layers = [m for m in dense.model.linear_layers() if m is not dense.model.lm_head]
    stats = collect_activations(dense.model, layers, calibration_ids(dense.tokenizer)[:1024])
    error = {"2:4": 0.0, "2:4-wanda": 0.0}
    for layer in layers:
        w, x = layer.weight.detach(), stats[layer].sample
        for method, scores in (("2:4", magnitude_scores(w)), ("2:4-wanda", wanda_scores(w, stats[layer].sq_sum))):
            error[method] += (x @ (w * ~two_four_mask(scores)).t()).pow(2).sum().item() / (x @ w.t()).pow(
                2
            ).sum().item()
    assert error["2:4-wanda"] < error["2:4"], error


def test_pruning_then_int8_keeps_the_zeros():
    llm = LLM("tiny-shakespeare-1m", dtype="fp32", cpu_prepack=False, sparsity="2:4", quantization="int8")
    layer = llm.model.layers[0].mlp.down_proj
    assert layer.method.name == "int8" and is_two_four(layer.qweight)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"sparsity": "50%"}, "sparsity='50%': expected one of"),
        ({"sparsity": "2:4", "mode": "contiguous", "compile": True}, "cannot be combined with compile"),
        ({"quantization": "w8a4"}, "quantization='w8a4': expected one of"),
    ],
)
def test_bad_sparsity_and_w8a8_options_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM("tiny-shakespeare-1m", **kwargs)


def test_cli_takes_w8a8_and_sparsity(capsys):
    from minillm.cli import main

    args = ["generate", "--model", "tiny-shakespeare-1m", "--dtype", "fp32", "--prompt", "KING.", "--max-tokens", "4"]
    for extra in (["--quantization", "w8a8"], ["--sparsity", "2:4-wanda"]):
        assert main([*args, "--ignore-eos", "--json", *extra]) == 0
        assert len(json.loads(capsys.readouterr().out.strip().splitlines()[-1])["token_ids"]) == 4
    with pytest.raises(SystemExit):
        main([*args, "--sparsity", "1:4"])
    assert "invalid choice: '1:4'" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_semi_structured_layers_on_gpu_match_the_dense_pruned_matmul():
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("2:4 sparse kernels need compute capability 8.0+")
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    sparse = LLM("tiny-shakespeare-8m", device="cuda", dtype="fp16", sparsity="2:4")
    names = {m.method.name for m in sparse.model.linear_layers() if m is not sparse.model.lm_head}
    assert names == {"2:4"}
    got = sparse.generate("KING.", params)[0].token_ids
    dense_pruned = LLM("tiny-shakespeare-8m", device="cuda", dtype="fp16", sparsity="2:4", quantization="int8")
    assert len(got) == 16 and len(dense_pruned.generate("KING.", params)[0].token_ids) == 16
