"""Paged attention (PyTorch reference) against plain causal attention on contiguous tensors.

Random K/V for several sequences are scattered over a pool in shuffled blocks; a mixed step
(decodes, a fresh prompt, a chunk continuing a cached prefix) must produce what ordinary
attention over each sequence's full history produces.
"""

from __future__ import annotations

import pytest
import torch

from minillm.attention import get_backend
from minillm.attention.layout import KVPool, StepLayout
from minillm.attention.paged import bucket_rows, gather_kv, write_kv
from minillm.attention.torch_ref import attention, causal_mask
from minillm.config import ModelConfig
from minillm.kvcache.addressing import padded_block_tables, slot_mapping
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


@pytest.mark.parametrize("backend", ["torch", "sdpa", "cpu"])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (6, 2), (4, 1)])
def test_mixed_step_matches_contiguous_attention(backend, heads, kv_heads):
    gen = torch.Generator().manual_seed(0)
    head_dim, block_size = 8, 4
    cache = PagedKVCache(tiny_config(heads, kv_heads, head_dim), 40, block_size, torch.float32, torch.device("cpu"))
    pool = KVPool(cache.k_slots, cache.v_slots, block_size, cache.null_block)
    free = torch.randperm(40, generator=gen).tolist()  # scattered blocks
    # (tokens already cached, new tokens this step) per sequence: two decodes (the shorter
    # first, as the runner sorts them), a fresh prompt, a prefix continuation
    plan = [(4, 1), (9, 1), (0, 7), (8, 5)]
    q_rows, k_rows, v_rows, slots, expected, tables = [], [], [], [], [], []
    for cached, new in plan:
        total = cached + new
        table = [free.pop() for _ in range(-(-total // block_size))]
        tables.append(table)
        k_all = torch.randn(total, kv_heads, head_dim, generator=gen)
        v_all = torch.randn(total, kv_heads, head_dim, generator=gen)
        q_new = torch.randn(new, heads, head_dim, generator=gen)
        old = torch.tensor(slot_mapping(table, 0, cached, block_size), dtype=torch.long)
        write_kv(pool, 0, old, k_all[:cached], v_all[:cached])  # the history, written in an earlier step
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
    context = [c + n for c, n in plan]
    width = max(len(t) for t in tables)
    layout = StepLayout(
        input_ids=torch.zeros(1, len(slots), dtype=torch.long),
        positions=torch.cat([torch.arange(c, c + n) for c, n in plan])[None],
        slot_mapping=torch.tensor(slots),
        query_lens=[n for _, n in plan],
        context_lens=context,
        block_tables=torch.tensor(padded_block_tables(tables, width, cache.null_block)),
        num_decodes=2,
        logit_index=torch.zeros(0, dtype=torch.long),
        pool=pool,
    )
    step = get_backend(backend).paged_step(layout)
    out = step.attend(0, torch.cat(q_rows)[None], torch.cat(k_rows)[None], torch.cat(v_rows)[None], head_dim**-0.5)
    torch.testing.assert_close(out[0], torch.cat(expected), atol=1e-5, rtol=1e-5)
    # The new K/V landed in the pool, readable through the block tables.
    k_back, _ = gather_kv(pool, 0, torch.tensor([tables[3]]))
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
