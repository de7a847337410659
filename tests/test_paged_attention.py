"""Paged attention (PyTorch reference) against plain causal attention on contiguous tensors.

Random K/V for several sequences are scattered over a pool in shuffled blocks; a mixed step
(decodes, a fresh prompt, a chunk continuing a cached prefix) must produce what ordinary
attention over each sequence's full history produces.
"""

from __future__ import annotations

import pytest
import torch

from minillm.attention import get_backend
from minillm.attention.paged import (
    DecodeBucket,
    PagedAttentionMetadata,
    PrefillSpan,
    bucket_rows,
    decode_mask,
    paged_attention,
    prefix_mask,
)
from minillm.attention.torch_ref import attention, causal_mask
from minillm.config import ModelConfig
from minillm.engine.paged_runner import slot_mapping
from minillm.kvcache.paged import PagedKVCache


def tiny_config(heads: int, kv_heads: int, head_dim: int, layers: int = 1) -> ModelConfig:
    return ModelConfig.from_dict(
        dict(
            model_type="llama",
            vocab_size=16,
            hidden_size=heads * head_dim,
            intermediate_size=8,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            max_position_embeddings=256,
        )
    )


@pytest.mark.parametrize("backend", ["torch", "sdpa"])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (6, 2), (4, 1)])
def test_mixed_step_matches_contiguous_attention(backend, heads, kv_heads):
    gen = torch.Generator().manual_seed(0)
    head_dim, block_size = 8, 4
    cache = PagedKVCache(tiny_config(heads, kv_heads, head_dim), 40, block_size, torch.float32, torch.device("cpu"))
    free = torch.randperm(40, generator=gen).tolist()  # scattered blocks
    # (tokens already cached, new tokens this step) per sequence: two decodes, a fresh prompt, a prefix continuation
    plan = [(9, 1), (4, 1), (0, 7), (8, 5)]
    q_rows, k_rows, v_rows, slots, expected = [], [], [], [], []
    tables, spans = [], []
    row = 0
    for cached, new in plan:
        total = cached + new
        table = [free.pop() for _ in range(-(-total // block_size))]
        tables.append(table)
        k_all = torch.randn(total, kv_heads, head_dim, generator=gen)
        v_all = torch.randn(total, kv_heads, head_dim, generator=gen)
        q_new = torch.randn(new, heads, head_dim, generator=gen)
        old = torch.tensor(slot_mapping(table, 0, cached, block_size), dtype=torch.long)
        cache.write(0, old, k_all[:cached], v_all[:cached])  # the history, written in an earlier step
        slots += slot_mapping(table, cached, new, block_size)
        q_rows.append(q_new)
        k_rows.append(k_all[cached:])
        v_rows.append(v_all[cached:])
        positions = torch.arange(cached, total)[None]
        ref = attention(
            q_new.transpose(0, 1)[None],
            k_all.transpose(0, 1)[None],
            v_all.transpose(0, 1)[None],
            causal_mask(positions, total),
            head_dim**-0.5,
        )
        expected.append(ref[0].transpose(0, 1))
        if new > 1:
            span = PrefillSpan(row, row + new, total)
            if cached:
                span.block_table = torch.tensor([table])
                span.mask = prefix_mask(total, new, torch.device("cpu"))
            spans.append(span)
        row += new
    decodes = [i for i, (_, new) in enumerate(plan) if new == 1]
    width = max(len(tables[i]) for i in decodes)
    meta = PagedAttentionMetadata(
        cache,
        torch.tensor(slots),
        num_decodes=len(decodes),
        decode_buckets=[
            DecodeBucket(
                0,
                len(decodes),
                torch.tensor([tables[i] + [0] * (width - len(tables[i])) for i in decodes]),
                mask=decode_mask(torch.tensor([sum(plan[i]) for i in decodes]), width * block_size),
            )
        ],
        prefills=spans,
    )
    out = paged_attention(
        torch.cat(q_rows), torch.cat(k_rows), torch.cat(v_rows), 0, meta, head_dim**-0.5, get_backend(backend)
    )
    torch.testing.assert_close(out, torch.cat(expected), atol=1e-5, rtol=1e-5)
    # The new K/V landed in the pool, readable through the block tables.
    k_back, _ = cache.gather(0, torch.tensor([tables[3]]))
    torch.testing.assert_close(k_back[0, :, 8:13].transpose(0, 1), k_rows[3])


def test_copy_blocks_copies_every_layer():
    config = tiny_config(2, 2, 4, layers=3)
    cache = PagedKVCache(config, 6, 2, torch.float32, torch.device("cpu"))
    cache.k[:, 1] = torch.randn(3, 2, 2, 4)
    cache.copy_blocks([(1, 4)])
    assert torch.equal(cache.k[:, 4], cache.k[:, 1]) and torch.equal(cache.v[:, 4], cache.v[:, 1])


def test_decode_buckets_minimise_padding():
    assert bucket_rows([5, 6, 7, 8], overhead=100) == [(0, 4)]  # similar lengths: one bucket
    assert bucket_rows([10, 10, 10, 4000], overhead=100) == [(0, 3), (3, 4)]  # an outlier alone
    assert bucket_rows([], overhead=100) == []
    lengths = sorted([16, 40, 41, 300, 310, 320, 900, 2000])
    buckets = bucket_rows(lengths, overhead=200)
    assert buckets[0][0] == 0 and buckets[-1][1] == len(lengths)
    assert all(a[1] == b[0] for a, b in zip(buckets, buckets[1:]))  # consecutive, covering every row
