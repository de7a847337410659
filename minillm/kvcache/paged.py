"""The paged KV pool: every layer's K and V as ``[num_blocks, block_size, kv_heads, head_dim]``.

The ``BlockManager`` decides which block each token goes to; this class only moves tensors:

- ``write`` stores new K/V through a **slot mapping** — for each new token, the flat slot
  ``block * block_size + offset`` it belongs in. One ``index_copy_`` per layer, whatever the
  mix of sequences and positions in the batch.
- ``gather`` reads sequences back through their **block tables** into a padded
  ``[B, kv_heads, S, head_dim]`` that any attention function can use. (A real paged-attention
  kernel — chapter 06 — reads the blocks in place instead of copying them.)
"""

from __future__ import annotations

import torch

from minillm.config import ModelConfig


def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    """K and V of one token across all layers."""
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * torch.empty((), dtype=dtype).element_size()


class PagedKVCache:
    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device):
        # One block more than the block manager hands out: the null block, which padded rows of
        # a batch (a CUDA graph's spare seats, a short block table's tail) write to and read from.
        self.null_block = num_blocks
        shape = (config.num_layers, num_blocks + 1, block_size, config.num_kv_heads, config.head_dim)
        # Zeroed, not empty: attention multiplies unused slots by a probability of exactly 0,
        # and 0 * NaN (uninitialised memory) would still be NaN.
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.k_layers = list(self.k.unbind(0))
        self.v_layers = list(self.v.unbind(0))
        # The same memory seen as one row per slot: [num_blocks * block_size, kv_heads, head_dim].
        self.k_slots = [k.flatten(0, 1) for k in self.k_layers]
        self.v_slots = [v.flatten(0, 1) for v in self.v_layers]

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def write(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k, v[N, kv_heads, D]`` (one row per new token) at ``slot_mapping[N]``."""
        self.k_slots[layer].index_copy_(0, slot_mapping, k)
        self.v_slots[layer].index_copy_(0, slot_mapping, v)

    def gather(self, layer: int, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``block_tables[B, max_blocks]`` as ``[B, kv_heads, max_blocks*block_size, D]``.

        Rows shorter than ``max_blocks`` are padded with any valid block id; the caller masks
        key positions at or beyond each row's context length.
        """
        b, n = block_tables.shape
        flat = block_tables.flatten()  # index_select: ~4x faster than advanced indexing on CPU
        k = self.k_layers[layer].index_select(0, flat).view(b, n * self.block_size, *self.k.shape[-2:])
        v = self.v_layers[layer].index_select(0, flat).view(b, n * self.block_size, *self.v.shape[-2:])
        return k.transpose(1, 2), v.transpose(1, 2)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: block ``dst`` becomes a copy of ``src`` in every layer."""
        for src, dst in copies:
            self.k[:, dst] = self.k[:, src]
            self.v[:, dst] = self.v[:, src]
