"""Activation-aware int4 (AWQ; Lin et al., 2023, *AWQ: Activation-aware Weight Quantization*).

Round-to-nearest int4 treats every input channel alike, but a few channels carry much larger
activations than the rest, and the error of *their* weights is multiplied by those large
values. AWQ protects them without mixed precision: scale input channel ``j`` of the weight up
by ``s_j`` before quantizing (its weights then use more of the 16 levels, so their relative
error shrinks) and divide the activation by ``s_j`` at run time, which leaves the exact product
unchanged: ``x · Wᵀ = (x / s) · (W · s)ᵀ``. With ``s = mean|x|^α`` per channel, measured on
calibration text, α is chosen per layer by trying a grid and keeping the one whose quantized
output is closest to the unquantized layer's on the calibration activations.

We divide ``x`` by ``s`` inside the layer (one elementwise multiply per step, a vector of a few
hundred numbers at decode) instead of folding ``1/s`` into the previous operation as the paper
does — simpler, the same numbers, and every layer handled the same way. The calibration text
and the activation statistics come from ``calibration.py``.
"""

from __future__ import annotations

import torch

from minillm.quantization.calibration import calibration_text, collect_activations  # noqa: F401 (re-exported)
from minillm.quantization.int4 import Int4Method, dequantize_int4, quantize_int4

ALPHAS = [i / 10 for i in range(11)]  # α = 0 is plain round-to-nearest


def search_scale(weight: torch.Tensor, mean_abs: torch.Tensor, sample: torch.Tensor, group_size: int):
    """The per-channel scale ``s`` (and its α) whose int4 version of ``W · s``, fed ``x / s``,
    is closest to ``x · Wᵀ`` on ``sample``."""
    w = weight.detach().float()
    reference = sample @ w.t()
    best = (float("inf"), None, None)
    for alpha in ALPHAS:
        s = mean_abs.clamp(min=1e-5).pow(alpha)
        s = s / (s.max() * s.min()).sqrt()  # centred, so neither W·s nor x/s drifts in magnitude
        q, scale, low = quantize_int4(w * s, group_size)
        error = ((sample / s) @ dequantize_int4(q, scale, low).t() - reference).pow(2).mean().item()
        if error < best[0]:
            best = (error, s, alpha)
    return best[1], best[2]


class AWQInt4Method(Int4Method):
    """Int4 of ``W · s`` with ``x / s`` at run time (``inv_scale`` = 1/s per input channel)."""

    name = "awq"

    def __init__(self, group_size: int, inv_scale: torch.Tensor | None = None, unpack=None):
        super().__init__(group_size, unpack)
        self.inv_scale = inv_scale

    def install(self, layer, q, scale, low, inv_scale=None) -> None:
        """``Int4Method.install`` (the weight quantized is already ``W · s``), plus ``1/s``."""
        dtype, device = layer.weight.dtype, layer.weight.device
        super().install(layer, q, scale, low)
        if inv_scale is not None:
            self.inv_scale = inv_scale
        layer.awq_inv_scale = self.inv_scale.to(device=device, dtype=dtype)

    def saved_shapes(self, layer) -> dict[str, tuple[int, ...]]:
        return {**super().saved_shapes(layer), "inv_scale": (layer.in_features,)}

    def install_saved(self, layer, saved: dict[str, torch.Tensor]) -> None:
        self.install(layer, self.saved_values(saved), saved["int4_scale"], saved["int4_min"], saved["inv_scale"])

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        return super().apply(layer, x * layer.awq_inv_scale)

    def held_tensors(self, layer) -> list[torch.Tensor]:
        return [*super().held_tensors(layer), layer.awq_inv_scale]


def awq_scales(model, layers: list, group_size: int, token_ids: list[int]) -> dict:
    """Calibrate on ``token_ids``: each layer's per-channel scale ``s`` and its α (nothing changed)."""
    stats = collect_activations(model, layers, token_ids)
    return {
        layer: search_scale(layer.weight, stats[layer].mean_abs, stats[layer].sample, group_size) for layer in layers
    }


def awq_quantize(model, layers: list, group_size: int, token_ids: list[int]) -> dict:
    """Calibrate on ``token_ids`` and convert ``layers`` to ``AWQInt4Method``; returns each
    layer's chosen α (for reports)."""
    chosen = {}
    for layer, (s, alpha) in awq_scales(model, layers, group_size, token_ids).items():
        with torch.no_grad():
            layer.weight.mul_(s.to(layer.weight.dtype))
        layer.set_method(AWQInt4Method(group_size, 1.0 / s))
        chosen[layer] = alpha
    return chosen
