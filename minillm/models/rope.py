"""Rotary position embeddings (RoPE).

RoPE encodes a token's position by rotating pairs of query/key dimensions by an angle
``position * inv_freq[i]``. Because a rotation by ``a`` followed by the inverse rotation by
``b`` is a rotation by ``a - b``, the dot product ``q · k`` depends only on the *distance*
between the two tokens — which is what lets us cache K once and reuse it at every later step.

We follow the Hugging Face layout ("rotate_half"): dimension ``i`` pairs with ``i + d/2``.
Checkpoints differ only in how ``inv_freq`` is computed; the variants below cover the models
we load (``default``; ``linear`` position interpolation; Llama 3.1's ``llama3`` scaling).
"""

from __future__ import annotations

import math

import torch

import minillm.hooks as hooks
from minillm.config import ModelConfig


def inv_frequencies(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """Return ``(inv_freq[head_dim/2], attention_scaling)`` for the config's RoPE variant."""
    dim = config.head_dim
    base = config.rope_theta
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
    kind = config.rope_type
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        # Position interpolation: positions are squeezed by `factor` to stretch the context.
        return inv_freq / float(scaling["factor"]), 1.0
    if kind == "llama3":
        # Llama 3.1: leave high frequencies alone, divide low frequencies by `factor`,
        # and blend smoothly in between (wavelength measured against the original context).
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_ctx = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(is_medium, blended, scaled), 1.0
    raise ValueError(f"rope_type={kind!r} is not supported")


@hooks.reference("rope_tables")
def rope_tables(inv_freq: torch.Tensor, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos[P, D], sin[P, D])`` in float32: row ``p`` holds position ``p``'s angles
    ``p * inv_freq[i]``, written twice along the row so that dimension ``i`` and ``i + D/2``
    (the pair ``rotate_half`` turns together) share one angle.

    Built once per model, outside the compiled step (chapter 02's exercise plugs in here): every
    step then only looks rows up by absolute position, which is why a decode step must be told
    where its token sits."""
    positions = torch.arange(max_positions, dtype=torch.float32)
    angles = torch.outer(positions, inv_freq.float())  # [P, D/2]
    angles = torch.cat([angles, angles], dim=-1)  # [P, D]: pairs (i, i + D/2) share an angle
    return angles.cos(), angles.sin()


class RotaryEmbedding:
    """A precomputed cos/sin table, indexed by absolute position at every step."""

    def __init__(self, config: ModelConfig, max_positions: int, device: torch.device):
        inv_freq, attention_scaling = inv_frequencies(config)
        cos, sin = hooks.rope_tables(inv_freq, max_positions)
        self.cos = (cos * attention_scaling).to(device)
        sin = sin * attention_scaling
        half = sin.shape[-1] // 2
        # rotate_half(x) * sin == roll(x, half) * signed_sin: fold the minus sign into the table
        self.signed_sin = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1).to(device)

    @property
    def max_positions(self) -> int:
        return self.cos.shape[0]

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for ``positions[B, T]`` shaped ``[B, T, 1, D]`` (broadcast over heads)."""
        return self.cos[positions].unsqueeze(2).to(dtype), self.signed_sin[positions].unsqueeze(2).to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [-x2, x1]``: the 90° turn of every (i, i + D/2) pair (the textbook form)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@hooks.reference("apply_rope")
def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x[B, T, heads, D]``: ``x·cos + rotate_half(x)·sin``.

    Computed as ``x·cos + roll(x, D/2)·signed_sin`` (the sign of ``rotate_half`` lives in the
    table), which is the same arithmetic in 3 tensor ops instead of 6 — it runs 30× per step.
    """
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin)
