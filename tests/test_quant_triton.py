"""The Triton int8 / int4 dequantize-and-multiply kernels (``quantization/triton_matmul.py``)
against the dequantized reference ``F.linear(x, dequantize(...))``: on CPU under Triton's
interpreter (small shapes, slow), on CUDA for real; and a quantized model on CUDA whose greedy
tokens must match the dequantize + ``F.linear`` path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from minillm import LLM, SamplingParams
from minillm.layers.linear import Linear
from minillm.quantization import (
    Int4Method,
    Int8Method,
    dequantize_int4,
    dequantize_int8,
    pack_int4,
    quantize_int4,
    quantize_int8,
    triton_matmul,
)
from minillm.quantization import int8 as int8_module
from minillm.quantization.triton_matmul import INTERPRETED, int4_matmul, int8_matmul

DEVICE = "cpu" if INTERPRETED else "cuda"
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 1e-2}  # relative to the output's largest value


def _weight(out: int, cols: int, seed: int = 0) -> torch.Tensor:
    w = torch.randn(out, cols, generator=torch.Generator().manual_seed(seed))
    w[3] *= 40  # one loud row, as in test_quantization
    return w


def _x(rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)


def _assert_close(got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == dtype and got.shape == expected.shape
    scale = expected.abs().max().item()
    error = (got.float() - expected).abs().max().item()
    assert error <= TOLERANCE[dtype] * scale, f"max error {error:.3g} = {error / scale:.2e} of max |y| {scale:.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows", [1, 5, 40])  # decode config (≤ 16 rows), prefill config; none a block multiple
@pytest.mark.parametrize("out,cols", [(96, 128), (80, 200)])  # N not a multiple of the tiles; K=200 masked
def test_int8_kernel_matches_the_dequantized_reference(out, cols, rows, dtype):
    q, scale = quantize_int8(_weight(out, cols))
    x = _x(rows, cols, dtype)
    got = int8_matmul(x, q.to(DEVICE), scale.to(DEVICE))
    expected = F.linear(x.float(), dequantize_int8(q, scale).to(DEVICE))
    _assert_close(got, expected, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows", [1, 5, 40])
@pytest.mark.parametrize("group,out,cols", [(32, 96, 128), (64, 80, 256), (128, 48, 256)])
def test_int4_kernel_matches_the_dequantized_reference(group, out, cols, rows, dtype):
    q, scale, low = quantize_int4(_weight(out, cols), group)
    x = _x(rows, cols, dtype)
    got = int4_matmul(x, pack_int4(q).to(DEVICE), scale.to(DEVICE), low.to(DEVICE), group)
    expected = F.linear(x.float(), dequantize_int4(q, scale, low).to(DEVICE))
    _assert_close(got, expected, dtype)


def test_kernels_take_strided_rows_and_empty_batches():
    q, scale = quantize_int8(_weight(48, 64))
    q, scale = q.to(DEVICE), scale.to(DEVICE)
    wide = _x(6, 128, torch.float32)
    rows = wide[:, ::2]  # a non-contiguous view: the kernels take strides
    torch.testing.assert_close(int8_matmul(rows, q, scale), int8_matmul(rows.contiguous(), q, scale))
    assert int8_matmul(wide[:0, :64], q, scale).shape == (0, 48)
    q4, s4, low = quantize_int4(_weight(48, 64), 32)
    packed = pack_int4(q4).to(DEVICE)
    assert int4_matmul(wide[:0, :64], packed, s4.to(DEVICE), low.to(DEVICE), 32).shape == (0, 48)
    with pytest.raises(ValueError, match="power-of-two group size"):
        int4_matmul(rows, packed, s4.to(DEVICE), low.to(DEVICE), 8)
    with pytest.raises(ValueError, match=r"x must be \[M, 64\]"):
        int8_matmul(wide, q, scale)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_methods_triton_path_matches_their_reference_with_bias_and_batch_dims(method):
    """``apply_triton`` (what ``apply`` runs on CUDA) on a layer's held tensors: bias added,
    leading dimensions kept. On CPU the int4 layer holds the CPU kernel's tiled layout, so the
    test gives it the packed form a CUDA layer holds."""
    layer = Linear(128, 64, bias=True)
    with torch.no_grad():
        layer.weight.copy_(_weight(64, 128))
        layer.bias.copy_(torch.randn(64, generator=torch.Generator().manual_seed(2)))
    bias = layer.bias.detach().clone()
    if method == "int8":
        q, scale = quantize_int8(layer.weight)
        reference_w = dequantize_int8(q, scale)
        layer.set_method(Int8Method())
    else:
        q, scale, low = quantize_int4(layer.weight, 32)
        reference_w = dequantize_int4(q, scale, low)
        layer.set_method(Int4Method(32))
        layer.int4 = pack_int4(q)
    layer.to(DEVICE)
    for name in ("qweight", "scales", "int4", "int4_scale", "int4_min"):
        if getattr(layer, name, None) is not None:
            setattr(layer, name, getattr(layer, name).to(DEVICE))
    x = torch.randn(2, 3, 128, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    got = layer.method.apply_triton(layer, x)
    expected = F.linear(x, reference_w.to(DEVICE), bias.to(DEVICE))
    assert got.shape == (2, 3, 64)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())


def test_the_cpu_engine_never_routes_through_the_interpreter(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the CPU path called the Triton kernel")

    monkeypatch.setattr(triton_matmul, "int8_matmul", refuse)
    monkeypatch.setattr(triton_matmul, "int4_matmul", refuse)
    assert not int8_module.use_triton(torch.zeros(1))
    for method in (Int8Method(), Int4Method(32)):
        layer = Linear(64, 32)
        layer.set_method(method)
        assert layer(torch.randn(2, 64)).shape == (2, 32)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("quantization", ["int8", "int4"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_quantized_model_on_cuda_matches_the_dequantize_reference_gpu(quantization, dtype, monkeypatch):
    """Greedy tokens of a quantized model on CUDA: Triton kernels (with CUDA graphs, the default)
    against dequantize + ``F.linear``; the layers hold only the low-bit tensors."""
    prompt, params = "KING.\nNow is the winter", SamplingParams(max_tokens=24, ignore_eos=True)
    calls = {"int8": 0, "int4": 0}
    for name in calls:
        kernel = getattr(triton_matmul, f"{name}_matmul")

        def counted(*args, _kernel=kernel, _name=name, **kwargs):
            calls[_name] += 1
            return _kernel(*args, **kwargs)

        monkeypatch.setattr(triton_matmul, f"{name}_matmul", counted)
    llm = LLM("tiny-shakespeare-8m", dtype=dtype, quantization=quantization)
    assert llm.device.type == "cuda"
    fast = llm.generate(prompt, params)[0].token_ids
    assert calls["int8"] > 0 and (quantization != "int4" or calls["int4"] > 0), calls
    for layer in llm.model.linear_layers():
        assert layer.weight is None
        held = layer.method.held_tensors(layer)
        assert all(t.is_cuda for t in held)
        if quantization == "int4" and layer is not llm.model.lm_head:
            assert held[0].dtype == torch.uint8 and held[0].shape == (layer.out_features, layer.in_features // 2)

    monkeypatch.setattr(int8_module, "_triton_installed", lambda: False)  # the dequantize + F.linear path
    reference = LLM("tiny-shakespeare-8m", dtype=dtype, quantization=quantization, cuda_graphs=False)
    slow = reference.generate(prompt, params)[0].token_ids
    same = 24 if dtype == "fp32" else 8  # bf16: the two paths round differently; a near tie may flip late
    assert fast[:same] == slow[:same], (fast, slow)

    layer = llm.model.lm_head  # and the kernel's numbers on a real layer, prefill-sized
    x = torch.randn(300, layer.in_features, device="cuda", dtype=llm.dtype)
    expected = F.linear(x.float(), dequantize_int8(layer.qweight, layer.scales.float()))
    _assert_close(int8_matmul(x, layer.qweight, layer.scales), expected, x.dtype)
