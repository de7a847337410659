"""Calibration: what the activations entering each linear layer look like on real text.

The calibrated methods all start from the same measurement. AWQ scales the weights of input
channels whose activations are large on average (``mean_abs``); SmoothQuant moves the range of
outlier channels (``max_abs``) from the activations into the weights; Wanda prunes the weights
whose magnitude times their channel's activation norm (``sq_sum``) is smallest. Each needs a
few hundred rows of real activations too (``sample``), to score a candidate on.

The text ships with Python (its reference manual, ``pydoc_data.topics``), so calibration runs
offline on every machine; ``benchmarks/bench_quant.py`` evaluates on a different slice of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pydoc_data.topics import topics

import torch

from minillm.attention.contiguous import ForwardBatch


def calibration_text(start: int = 60_000, length: int = 12_000) -> str:
    """English prose every Python installation carries, away from the slice evaluated on."""
    return "\n\n".join(topics[k] for k in sorted(topics))[start : start + length]


@dataclass
class ActivationStats:
    """Per input channel of one layer, over every calibration token."""

    mean_abs: torch.Tensor  # mean |x_j|
    max_abs: torch.Tensor  # max |x_j|
    sq_sum: torch.Tensor  # Σ x_j² (Wanda's ‖X_j‖₂ is its square root)
    sample: torch.Tensor  # [rows, in]: input rows spread over the text


@torch.inference_mode()
def collect_activations(model, layers, token_ids: list[int], window: int = 256, rows: int = 512) -> dict:
    """Run ``model`` over ``token_ids`` (in windows of ``window`` tokens) and return each of
    ``layers``' ``ActivationStats``, measured by a forward pre-hook on the layer."""
    if len(token_ids) < 2:
        raise ValueError(f"calibration needs at least 2 tokens, got {len(token_ids)}")
    acc = {layer: {"abs": 0.0, "max": 0.0, "sq": 0.0, "n": 0, "rows": []} for layer in layers}

    def hook(layer, args):
        x = args[0].detach().reshape(-1, layer.in_features).float().cpu()
        entry = acc[layer]
        entry["abs"] = entry["abs"] + x.abs().sum(0)
        entry["max"] = torch.maximum(torch.as_tensor(entry["max"]), x.abs().amax(0))
        entry["sq"] = entry["sq"] + x.pow(2).sum(0)
        entry["n"] += x.shape[0]
        entry["rows"].append(x[:: max(1, x.shape[0] // 64)])

    handles = [layer.register_forward_pre_hook(hook) for layer in layers]
    device = model.device
    window = min(window, len(token_ids))
    try:
        n = len(token_ids) // window
        ids = torch.tensor(token_ids[: n * window], device=device).view(n, window)
        positions = torch.arange(window, device=device)[None]
        for i in range(n):
            model(ForwardBatch(ids[i : i + 1], positions))
    finally:
        for h in handles:
            h.remove()
    return {
        layer: ActivationStats(e["abs"] / e["n"], e["max"], e["sq"], torch.cat(e["rows"])[:rows])
        for layer, e in acc.items()
    }


def calibration_ids(tokenizer, calibration_ids: list[int] | None = None) -> list[int]:
    """The token ids to calibrate on: the caller's, else the shipped text tokenized."""
    if calibration_ids is not None:
        return list(calibration_ids)
    if tokenizer is None:
        raise ValueError("calibration needs calibration_ids or a tokenizer to tokenize its calibration text")
    return tokenizer.encode(calibration_text())
