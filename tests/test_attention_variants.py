"""Attention variants: K/V head pooling, perplexity, the measurement helpers and the FlashAttention
tiling visualiser's arithmetic."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from minillm.kv_head_pooling import pool_kv_heads
from minillm.models import load_model
from minillm.models.llama import ForwardBatch
from minillm.tools.evaluation import perplexity


def duplicate_kv_heads(src, dst):
    """A copy of a GQA model whose K/V heads come in identical pairs: pooling them loses nothing."""
    import shutil

    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    tensors = load_file(str(dst / "model.safetensors"))
    for name, t in tensors.items():
        if name.endswith(("k_proj.weight", "v_proj.weight")):
            heads = t.view(-1, 2, head_dim, t.shape[-1])
            tensors[name] = heads[:, :1].expand_as(heads).reshape(t.shape).contiguous()
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_pooling_identical_heads_changes_nothing(tiny_models, tmp_path):
    # llama_mha: 4 query heads, 4 K/V heads; make heads (0,1) and (2,3) identical, then pool to 2.
    source = duplicate_kv_heads(tiny_models["llama_mha"], tmp_path / "dup")
    pooled = pool_kv_heads(source, tmp_path / "pooled", 2)
    assert json.loads((pooled / "config.json").read_text())["num_key_value_heads"] == 2
    assert (pooled / "tokenizer.json").is_file()
    ids = torch.tensor([[5, 17, 42, 8, 99, 3, 250, 61, 7]])
    pos = torch.arange(ids.shape[1])[None]
    a = load_model(source, torch.float32)(ForwardBatch(ids, pos))
    b = load_model(pooled, torch.float32)(ForwardBatch(ids, pos))
    assert load_model(pooled, torch.float32).config.num_kv_heads == 2
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_pooling_averages_each_group(tiny_models, tmp_path):
    pooled = pool_kv_heads(tiny_models["llama_mha"], tmp_path / "mqa", 1)
    before = load_file(str(tiny_models["llama_mha"] / "model.safetensors"))
    after = load_file(str(pooled / "model.safetensors"))
    name = "model.layers.0.self_attn.k_proj.weight"
    head_dim = before[name].shape[0] // 4
    expected = before[name].view(4, head_dim, -1).mean(0)
    torch.testing.assert_close(after[name], expected)
    with pytest.raises(ValueError, match="num_kv_heads=3 must divide"):
        pool_kv_heads(tiny_models["llama_mha"], tmp_path / "bad", 3)


def test_perplexity_matches_hf_loss(tiny_model):
    from conftest import hf_model

    ids = [(i * 37) % 300 + 3 for i in range(129)]
    ours = perplexity(load_model(tiny_model, torch.float32), ids, window=64)
    hf = hf_model(tiny_model)
    windows = torch.tensor(ids[:128]).view(2, 64)
    targets = torch.tensor(ids[1:129]).view(2, 64)
    with torch.no_grad():
        logits = hf(windows).logits
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
    assert ours == pytest.approx(math.exp(loss.item()), rel=1e-4)
    with pytest.raises(ValueError, match="more than window=64"):
        perplexity(load_model(tiny_model, torch.float32), ids[:10], window=64)


def test_variant_measurement_and_figure():
    from minillm.viz.attention_variants import measure_variants, variant_name, variants_figure

    rows = measure_variants(kv_heads=(4, 1), contexts=(16, 64), batch=2, hidden=64, heads=4, layers=1, repeats=1)
    assert [(r.kv_heads, r.context) for r in rows] == [(4, 16), (4, 64), (1, 16), (1, 64)]
    assert rows[0].kv_bytes_per_token == 4 * rows[2].kv_bytes_per_token == 2 * 1 * 4 * 16 * 4
    assert all(r.step_ms > 0 for r in rows)
    assert [variant_name(k, 8) for k in (8, 2, 1)] == ["MHA (8 KV heads)", "GQA (2 KV heads)", "MQA (1 KV head)"]
    assert len(variants_figure(rows, heads=4).data) == 4


def test_flash_tiling_arithmetic():
    from minillm.viz.flash_tiles import flash_tiling_figure, hbm_bytes, online_softmax_trace, visible_key_tiles

    # Causal, T = S = 256, 64x64 tiles: query tile i loads key tiles 0..i.
    assert [len(visible_key_tiles(i, 256, 256, 64, 64, True)) for i in range(4)] == [1, 2, 3, 4]
    assert visible_key_tiles(0, 256, 256, 64, 64, False) == [0, 1, 2, 3]
    # A prefill of 16 queries continuing a 240-token prefix sees every key tile.
    assert visible_key_tiles(0, 16, 256, 16, 64, True) == [0, 1, 2, 3]
    b = hbm_bytes(1024, 1024, 64, 64, causal=False, bytes_per_element=1)
    assert b["naive"] == 2 * 1024 * 64 + 2 * 1024 * 64 + 4 * 1024 * 1024
    assert b["flash"] == 2 * 1024 * 64 + 2 * 16 * 1024 * 64
    steps = online_softmax_trace(128, 128, 32, 32, query_tile=3, row=5)
    assert [s.key_tile for s in steps] == [0, 1, 2, 3]
    assert all(a.running_max <= b.running_max for a, b in zip(steps, steps[1:]))
    assert steps[-1].partially_masked and not steps[0].partially_masked
    fig = flash_tiling_figure(128, 128, 32, 32)
    assert len(fig.data) == 3
