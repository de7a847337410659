"""The neutral layout of one paged step: plain tensors the runner builds and every backend reads.

A continuous-batching step mixes sequences in different states, so there is no padding: the
step's new tokens lie **flat**, sequence after sequence — decodes first (one query token
each, sorted by context length), then prefill chunks. Per sequence the layout says how many
new tokens it has (``query_lens``), how many tokens it attends to (``context_lens``: cached
plus new) and where its blocks are (``block_tables``); per token, where its K/V go
(``slot_mapping``). Each attention backend turns this into what its kernels need, once per
step (``backend.paged_step(layout)``), and nothing more.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minillm.config import KVCacheDtype


@dataclass
class KVPool:
    """The paged pool as plain tensors: per layer, K and V as one row per slot
    ``[num_slots, kv_heads, head_dim]`` (slot = block * block_size + offset)."""

    k_slots: list[torch.Tensor]
    v_slots: list[torch.Tensor]
    block_size: int
    null_block: int  # a block nothing owns: padding rows and padded table entries point here
    # An int8 pool (kv_cache_dtype="int8"): per layer, one scale per slot and head
    # [num_slots, kv_heads]; attention dequantizes to ``dtype`` as it reads.
    k_scales: list[torch.Tensor] | None = None
    v_scales: list[torch.Tensor] | None = None
    dtype: torch.dtype | None = None
    kv_cache_dtype: KVCacheDtype = KVCacheDtype("auto")  # the pool's: how its slots' 8 bits are read

    @classmethod
    def of(cls, cache) -> KVPool:
        """The plain-tensor view of a ``PagedKVCache``."""
        return cls(
            cache.k_slots,
            cache.v_slots,
            cache.block_size,
            cache.null_block,
            cache.k_scale_slots,
            cache.v_scale_slots,
            cache.dtype,
            cache.kv_cache_dtype,
        )


@dataclass
class StepLayout:
    input_ids: torch.Tensor  # [1, N]: the step's new tokens, flat
    positions: torch.Tensor  # [1, N]: their positions in their sequences
    slot_mapping: torch.Tensor  # [N]: the pool slot each new token's K/V is written to
    query_lens: list[int]  # [S]: new tokens per sequence (1 for the first num_decodes)
    context_lens: list[int]  # [S]: keys each sequence attends to (cached + new)
    block_tables: torch.Tensor  # [S, W]: blocks per sequence, padded with the null block
    num_decodes: int  # sequences 0..num_decodes-1 have one query token each
    logit_index: torch.Tensor  # rows of the flat batch whose logits are returned, in order
    pool: KVPool
    window: int | None = None  # sliding-window attention: each query sees its last `window` keys
    max_context: int | None = None  # a fixed bound on context_lens (CUDA graphs); None: their max
    context_lens_tensor: torch.Tensor | None = None  # [S] on the device, for backends that want it
    # A pure decode step over a fixed window of blocks (block_tables[S, W]), context_lens_tensor
    # masking each row: the compiled CPU decode step's shape (runtime/compiled_decode.py).
    static_decode: bool = False
    # A static decode step whose rows attend through the C++ kernel (an operator in the graph),
    # each over exactly its own keys, instead of over the whole window (attention/cpu_paged.py).
    in_place_decode: bool = False
    # Keep every token's last hidden state on the model (``model.last_hidden``): a feature-level
    # draft (EAGLE, speculative/eagle.py) drafts from the target's own features.
    keep_hidden: bool = False
    chunk_ends: list[int] | None = None  # where each chunk's rows end in the flat batch (the runner's order)
    # Per decode row (every row of a static step), which keys just before its own it sees: the
    # C++ kernel's ancestor bits (``cpu_paged.paged_decode_attention``), for the nodes of a
    # speculative tree verified as rows. None: every row plainly causal.
    visible: torch.Tensor | None = None

    @property
    def logit_rows(self) -> torch.Tensor:
        return self.logit_index

    def bind(self, model):
        """The per-step attention object of ``model``'s backend for this layout."""
        return model.attention_backend.paged_step(self)
