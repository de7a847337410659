"""The contiguous KV cache: one preallocated ``[batch, kv_heads, max_len, head_dim]`` slab per layer.

Without a cache, step ``n`` of generation recomputes keys and values for all ``n`` tokens;
with one, it computes them for the single new token and reads the rest back. We allocate the
whole slab up front because growing a tensor with ``torch.cat`` copies everything each step
(on CPU that copy cost a third of a decode step). The price is reserving ``max_len`` slots per
sequence whether or not it uses them — the waste the paged cache of chapter 03 removes.
"""

from __future__ import annotations

import torch

import minillm.hooks as hooks
from minillm.config import ModelConfig


class ContiguousKVCache:
    """K and V for ``batch_size`` sequences of up to ``max_len`` tokens, for every layer."""

    def __init__(
        self,
        config: ModelConfig,
        batch_size: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        shape = (config.num_layers, batch_size, config.num_kv_heads, max_len, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.batch_size = batch_size
        self.max_len = max_len
        # Per-layer views, made once: indexing the 5-D slab anew 60x per step costs real time.
        self.k_layers = list(self.k.unbind(0))
        self.v_layers = list(self.v.unbind(0))

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def write(
        self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor, same_start: int | None = None
    ) -> None:
        """Store ``k, v[B, kv_heads, T, D]`` of row ``b`` at ``positions[b, :]``.

        When every row writes the same span (``same_start`` given: prefill from 0, or a decode
        step of equal-length rows) a slice assignment does it; otherwise one scatter with
        per-row positions.
        """
        batch = positions.shape[0]
        k_cache, v_cache = self.k_layers[layer], self.v_layers[layer]
        if same_start is not None:
            if batch < self.batch_size:
                k_cache, v_cache = k_cache[:batch], v_cache[:batch]
            hooks.kv_write(k_cache, v_cache, k, v, same_start)  # chapter 02's exercise plugs in here
            return
        rows = torch.arange(batch, device=positions.device)[:, None]
        # Advanced indices (rows, positions) broadcast to [B, T]; the sliced head axis goes last.
        k_cache[rows, :, positions] = k.transpose(1, 2)
        v_cache[rows, :, positions] = v.transpose(1, 2)

    def read(self, layer: int, batch: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views (no copy) of the first ``length`` positions of rows ``0..batch-1``."""
        k, v = self.k_layers[layer], self.v_layers[layer]
        if batch < self.batch_size:
            k, v = k[:batch], v[:batch]
        return k.narrow(2, 0, length), v.narrow(2, 0, length)

    def move_row(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` positions of row ``src`` into row ``dst`` (batch compaction)."""
        self.k[:, dst, :, :length] = self.k[:, src, :, :length]
        self.v[:, dst, :, :length] = self.v[:, src, :, :length]


@hooks.reference("kv_write")
def kv_write(k_cache: torch.Tensor, v_cache: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, start: int) -> None:
    """Store ``k_new, v_new[B, KV, T, D]`` at positions ``start .. start+T-1`` of the caches, in place."""
    t = k_new.shape[2]
    k_cache.narrow(2, start, t).copy_(k_new)
    v_cache.narrow(2, start, t).copy_(v_new)


@hooks.reference("contiguous_cache")
def contiguous_cache(config: ModelConfig, batch_size: int, max_len: int, dtype: torch.dtype, device) -> ContiguousKVCache:
    """The package's cache for a static batch (hook ``contiguous_cache``: chapter 02's learner writes one)."""
    return ContiguousKVCache(config, batch_size, max_len, dtype, device)
