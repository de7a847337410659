"""2:4 semi-structured sparsity: in every group of 4 consecutive input weights, 2 are zero.

Unstructured pruning (zero the smallest weights anywhere) saves nothing on dense hardware: a
zero costs what any weight costs. The 2:4 pattern is the structure NVIDIA's sparse tensor
cores (Ampere and later) exploit: the matrix is stored as its 2 kept values per group plus 2-bit
indices, so it streams ~44% fewer bytes (fp16) and the tensor core skips the zeros — up to 2×
on the matmul (Mishra et al., 2021, *Accelerating Sparse Deep Neural Networks*). In PyTorch:
``torch.sparse.to_sparse_semi_structured`` (CUDA only).

Which 2 of each 4 to drop:

- **magnitude**: the 2 smallest ``|W_ij|`` — the classic criterion, blind to the data;
- **Wanda** (Sun et al., 2023, *A Simple and Effective Pruning Approach for Large Language
  Models*): the 2 smallest ``|W_ij| · ‖X_j‖₂``, where ``‖X_j‖₂`` is the norm of input channel
  ``j``'s activations over calibration text — a small weight on a channel that carries large
  activations still matters. No retraining, no weight update: one pass of calibration.

Half of every decoder layer's weights become zero with no retraining, so quality drops;
``benchmarks/bench_quant.py`` measures how much. The LM head and embeddings are not pruned.

On CPU there is no speed-up, and we say so rather than hide it: PyTorch's CPU matmuls are dense
(the zeros are multiplied like any other weight) and ``to_sparse_semi_structured`` refuses CPU
tensors. What this module gives on CPU is the *quality* side of the trade. On a CUDA GPU of
compute capability ≥ 8.0 with fp16/bf16 weights, ``SemiStructuredMethod`` stores the pruned
matrix in the compressed format and multiplies with the sparse kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.sparse import to_sparse_semi_structured

from minillm.quantization.calibration import collect_activations

SPARSITY_METHODS = ("2:4", "2:4-wanda")  # magnitude and Wanda scores, both 2 of every 4 kept


def two_four_mask(scores: torch.Tensor) -> torch.Tensor:
    """``scores[out, in]`` (``in`` divisible by 4) → boolean mask keeping the 2 highest of every
    4 consecutive entries of each row."""
    out, cols = scores.shape
    if cols % 4:
        raise ValueError(f"2:4 sparsity needs input features divisible by 4, got {cols}")
    groups = scores.reshape(out, cols // 4, 4)
    keep = groups.topk(2, dim=-1).indices
    mask = torch.zeros_like(groups, dtype=torch.bool).scatter_(-1, keep, True)
    return mask.reshape(out, cols)


def magnitude_scores(weight: torch.Tensor) -> torch.Tensor:
    return weight.detach().float().abs()


def wanda_scores(weight: torch.Tensor, act_sq_sum: torch.Tensor) -> torch.Tensor:
    """``|W_ij| · ‖X_j‖₂`` with ``‖X_j‖₂² = act_sq_sum[j]``."""
    return weight.detach().float().abs() * act_sq_sum.float().sqrt()[None, :].to(weight.device)


def is_two_four(weight: torch.Tensor) -> bool:
    """At most 2 non-zeros in every group of 4 consecutive input weights."""
    out, cols = weight.shape
    return bool(((weight.reshape(out, cols // 4, 4) != 0).sum(-1) <= 2).all())


class SemiStructuredMethod:
    """A 2:4-pruned layer in PyTorch's compressed semi-structured format (CUDA, fp16/bf16)."""

    name = "2:4"

    @staticmethod
    def supported(layer) -> bool:
        w = layer.weight
        return (
            w is not None
            and w.device.type == "cuda"
            and w.dtype in (torch.float16, torch.bfloat16)
            and torch.cuda.get_device_capability(w.device) >= (8, 0)
        )

    def process_weights(self, layer) -> None:
        layer.sparse_weight = to_sparse_semi_structured(layer.weight.detach())
        layer.weight = None

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, layer.in_features)
        return F.linear(rows, layer.sparse_weight, layer.bias).view(*x.shape[:-1], layer.out_features)

    def held_tensors(self, layer) -> list[torch.Tensor]:
        packed = layer.sparse_weight
        parts = [getattr(packed, name, None) for name in ("packed", "meta", "packed_t", "meta_t")]
        return [t for t in (*parts, layer.bias) if t is not None]


@torch.no_grad()
def prune_model(model, method: str, layers: list, token_ids: list[int] | None = None) -> dict:
    """Zero 2 of every 4 input weights of each of ``layers`` (in place), chosen by ``method``'s
    scores; returns ``{layer: fraction of the layer's weight norm² removed}``. ``2:4-wanda``
    needs ``token_ids`` to calibrate on."""
    if method not in SPARSITY_METHODS:
        raise ValueError(f"sparsity={method!r}: expected one of {SPARSITY_METHODS} (or None)")
    for layer in layers:
        if layer.weight is None or layer.in_features % 4:
            raise ValueError(f"{layer!r}: 2:4 sparsity needs a loaded weight with input features divisible by 4")
    stats = collect_activations(model, layers, token_ids) if method == "2:4-wanda" else None
    removed = {}
    for layer in layers:
        w = layer.weight
        scores = wanda_scores(w, stats[layer].sq_sum) if stats else magnitude_scores(w)
        mask = two_four_mask(scores).to(w.device)
        removed[layer] = float(w.float()[~mask].pow(2).sum() / w.float().pow(2).sum().clamp(min=1e-30))
        w.mul_(mask.to(w.dtype))
    return removed
