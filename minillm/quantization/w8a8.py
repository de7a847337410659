"""W8A8: int8 weights *and* int8 activations, with SmoothQuant-style smoothing.

Weight-only methods store int8/int4 but multiply in floating point. W8A8 also rounds the
activations to int8 — per token (row), with a scale computed on the fly from the row's
maximum, so no calibration of activation ranges is needed — and multiplies int8 × int8 into
int32 accumulators (``torch._int_mm``), the arithmetic integer units are fastest at:
``y = (a · qᵀ) · s_x · s_w`` with ``a = round(x / s_x)`` and ``q = round(W / s_w)``.

The catch is outliers. A few input channels of an LLM's activations are 10-100× larger than
the rest, for every token; one scale per token is then set by the outlier and the other
channels round to a handful of levels. SmoothQuant (Xiao et al., 2022, *SmoothQuant: Accurate
and Efficient Post-Training Quantization for Large Language Models*) moves that range into the
weights, which are easy to quantize: divide input channel ``j`` of the activations by ``s_j``
and multiply the weights' column ``j`` by it, which leaves ``x · Wᵀ`` unchanged, with
``s_j = max|x_j|^α / max|W_j|^(1-α)``. ``max|x_j|`` is measured on calibration text
(``calibration.py``); α is chosen per layer from a grid by the error of the quantized layer on
calibration rows (α = 0 is no smoothing). Like ``awq.py`` we multiply ``x`` by ``1/s`` inside
the layer rather than folding it into the previous norm.

Speed: ``torch._int_mm`` is PyTorch's int8 GEMM (on CPU through oneDNN, fast where the CPU has
int8 dot-product instructions: VNNI or AMX). Without them it is slow: on an AMD EPYC with AVX2
only it ran 46-50× slower than an fp32 GEMM of SmolLM2's shapes at 512 rows, 11-16× at 8 rows
(``benchmarks/bench_int8_gemm.py``). There the engine gets the same exact int32 result from
fp32 GEMMs over slices of K short enough that every partial sum is an integer fp32 holds
exactly (``exact_float_int8_matmul``): 35-50× faster than ``_int_mm`` at 512 rows, 3.5-5.6× at 8,
and from 2.8× faster to 1.5× slower at 1 row (converting the weights to fp32 then dominates).
The per-token quantization of the activations is extra work that weight-only methods do not
do, which ``benchmarks/bench_quant.py`` measures rather than assumes.
"""

from __future__ import annotations

import torch

from minillm.quantization.calibration import collect_activations
from minillm.quantization.int8 import quantize_int8
from minillm.quantization.saved import LoadsSavedTensors

ALPHAS = [i / 10 for i in range(0, 10)]  # α = 0: no smoothing; the paper's default is 0.5
CUDA_MIN_ROWS = 17  # torch._int_mm on CUDA wants more than 16 rows: fewer are padded
# 1024 · 128² = 2²⁴: a sum of 1024 products of int8 values is an integer fp32 holds exactly
EXACT_FP32_K = 1024


def cpu_has_int8_dot() -> bool:
    """Whether this CPU has the int8 dot-product instructions (AVX512-VNNI, AVX-VNNI, AMX-INT8)
    that PyTorch's CPU ``_int_mm`` is fast with; without them it is far slower (``bench_int8_gemm.py``)."""
    caps = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
    return any(caps.get(flag, False) for flag in ("avx512_vnni", "avx_vnni", "amx_int8"))


# Probed once, at import: a constant to ``torch.compile`` and ``torch.export``, which trace the layer
CPU_INT8_DOT = cpu_has_int8_dot()


def exact_float_int8_matmul(a: torch.Tensor, q_t: torch.Tensor) -> torch.Tensor:
    """``a int8 [M, K] · q_t int8 [K, N]`` → int32, exact, through fp32 GEMMs on slices of at
    most ``EXACT_FP32_K`` columns (each slice's sums are exact integers in fp32, whatever order
    the GEMM adds them in), added in int32."""
    out = None
    for k in range(0, a.shape[1], EXACT_FP32_K):
        part = (a[:, k : k + EXACT_FP32_K].float() @ q_t[k : k + EXACT_FP32_K].float()).to(torch.int32)
        out = part if out is None else out + part
    return out


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x[rows, in]`` → ``(a int8 [rows, in], scale fp32 [rows])``: one symmetric scale per token."""
    scale = x.float().abs().amax(dim=-1).clamp(min=1e-8) / 127.0
    a = torch.round(x.float() / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return a, scale


def int8_matmul(a: torch.Tensor, q_t: torch.Tensor) -> torch.Tensor:
    """``a int8 [M, K] · q_t int8 [K, N]`` → int32 ``[M, N]``, exact, on any device."""
    if a.device.type == "cpu":
        return torch._int_mm(a, q_t) if CPU_INT8_DOT else exact_float_int8_matmul(a, q_t)
    if a.device.type == "cuda" and a.shape[1] % 8 == 0 and q_t.shape[1] % 8 == 0:
        rows = a.shape[0]
        if rows < CUDA_MIN_ROWS:
            a = torch.cat([a, a.new_zeros(CUDA_MIN_ROWS - rows, a.shape[1])])
        return torch._int_mm(a, q_t)[:rows]
    return (a.double() @ q_t.double()).to(torch.int32)  # exact: every partial sum fits a double


def w8a8_linear(x: torch.Tensor, q_t: torch.Tensor, w_scale: torch.Tensor, inv_smooth: torch.Tensor | None):
    """The layer's matmul on ``x[rows, in]``: smooth, quantize per token, int8 GEMM, rescale."""
    if inv_smooth is not None:
        x = x * inv_smooth
    a, x_scale = quantize_activations(x)
    return int8_matmul(a, q_t).float() * x_scale[:, None] * w_scale[None, :]


def smoothing_scale(act_max: torch.Tensor, weight: torch.Tensor, alpha: float) -> torch.Tensor:
    """SmoothQuant's ``s_j = max|x_j|^α / max|W_j|^(1-α)`` per input channel ``j``."""
    w_max = weight.detach().float().abs().amax(dim=0).clamp(min=1e-5)
    return (act_max.clamp(min=1e-5).pow(alpha) / w_max.pow(1 - alpha)).clamp(min=1e-5)


def search_smoothing(weight: torch.Tensor, act_max: torch.Tensor, sample: torch.Tensor):
    """The α (and its ``s``) whose W8A8 layer is closest to the float layer on ``sample``."""
    w = weight.detach().float()
    reference = sample @ w.t()
    best = (float("inf"), None, None)
    for alpha in ALPHAS:
        s = smoothing_scale(act_max, w, alpha) if alpha else torch.ones(w.shape[1])
        q, w_scale = quantize_int8(w * s)
        error = (w8a8_linear(sample, q.t(), w_scale, 1.0 / s) - reference).pow(2).mean().item()
        if error < best[0]:
            best = (error, s, alpha)
    return best[1], best[2]


class W8A8Method(LoadsSavedTensors):
    """A linear layer with int8 weights (per output channel), int8 activations (per token) and
    a per-input-channel smoothing vector ``1/s``. ``smoothing``: the calibrated ``s``
    (``w8a8_scales``); None is α = 0, no smoothing."""

    name = "w8a8"

    def __init__(self, smoothing: torch.Tensor | None = None):
        self.smoothing = smoothing

    def validate(self, layer, name: str) -> None:
        if layer.weight is None or layer.weight.dim() != 2:
            raise ValueError(f"{name}: w8a8 needs the loaded 2-D weight (was the layer already converted?)")

    def process_weights(self, layer) -> None:
        """Quantize ``W · s`` (just ``W`` without smoothing) and keep ``1/s`` for the input."""
        self.validate(layer, repr(layer))
        s = self.smoothing
        if s is None:
            q, scale = quantize_int8(layer.weight)
            self.install(layer, q, scale, torch.ones(layer.in_features))
        else:
            q, scale = quantize_int8(layer.weight.detach().float() * s)
            self.install(layer, q, scale, 1.0 / s)

    def install(self, layer, q: torch.Tensor, scale: torch.Tensor, inv_smooth: torch.Tensor) -> None:
        """Hold ``q`` (int8 ``[out, in]`` of ``W · s``), its per-row scale and ``1/s``."""
        device, layer.dtype = layer.weight.device, layer.weight.dtype
        layer.w8a8_qt = q.to(device=device, dtype=torch.int8).t().contiguous()  # [in, out]: the GEMM's layout
        layer.w8a8_scale = scale.float().to(device)
        layer.w8a8_inv_smooth = inv_smooth.float().to(device)
        layer.weight = None

    def saved_shapes(self, layer) -> dict[str, tuple[int, ...]]:
        out, cols = layer.out_features, layer.in_features
        return {"qweight": (out, cols), "scales": (out,), "inv_scale": (cols,)}

    def install_saved(self, layer, saved: dict[str, torch.Tensor]) -> None:
        self.install(layer, saved["qweight"], saved["scales"], saved["inv_scale"])

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, layer.in_features)
        y = w8a8_linear(rows, layer.w8a8_qt, layer.w8a8_scale, layer.w8a8_inv_smooth).to(x.dtype)
        if layer.bias is not None:
            y = y + layer.bias
        return y.view(*x.shape[:-1], layer.out_features)

    def held_tensors(self, layer) -> list[torch.Tensor]:
        return [t for t in (layer.w8a8_qt, layer.w8a8_scale, layer.w8a8_inv_smooth, layer.bias) if t is not None]


def w8a8_scales(model, layers: list, token_ids: list[int]) -> dict:
    """Calibrate on ``token_ids``: each layer's smoothing vector ``s`` and its α (nothing changed)."""
    stats = collect_activations(model, layers, token_ids)
    return {layer: search_smoothing(layer.weight, stats[layer].max_abs, stats[layer].sample) for layer in layers}


def w8a8_quantize(model, layers: list, token_ids: list[int]) -> dict:
    """Calibrate on ``token_ids`` and convert ``layers`` to ``W8A8Method``; returns each layer's α."""
    chosen = {}
    for layer, (s, alpha) in w8a8_scales(model, layers, token_ids).items():
        layer.set_method(W8A8Method(s))
        chosen[layer] = alpha
    return chosen
