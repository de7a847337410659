"""Offloading, the last resort: weights streamed per layer from host memory, or memory-mapped
from a file and paged in by the OS (even after being evicted) — the same logits and tokens as
resident weights."""

from __future__ import annotations

import pytest
import torch

from minillm import LLM, SamplingParams
from minillm.layers import PLAIN
from minillm.layers.offload import (
    OffloadMethod,
    evict_page_cache,
    is_memory_mapped,
    memory_map_weights,
    stream_layers,
)
from minillm.models import load_model

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _logits(model, ids):
    from minillm.models.llama import ForwardBatch

    return model(ForwardBatch(torch.tensor([ids]), torch.arange(len(ids))[None]))


def test_memory_mapped_weights_give_the_same_logits_even_when_evicted(tiny_model, tmp_path):
    model = load_model(tiny_model, torch.float32)
    ids = [5, 9, 14, 3, 22]
    want = _logits(model, ids)
    path = tmp_path / "w.pt"
    mapped = memory_map_weights(model, path)
    assert 0 < mapped <= path.stat().st_size
    assert all(is_memory_mapped(p, path) for p in model.parameters())
    assert model.lm_head.weight is model.embed_tokens.weight  # still tied
    torch.testing.assert_close(_logits(model, ids), want, atol=0, rtol=0)
    evict_page_cache(model, path)  # dropped from memory: the next pass reads the file again
    torch.testing.assert_close(_logits(model, ids), want, atol=0, rtol=0)


def test_streamed_layers_hold_weights_on_the_host_and_give_the_same_logits(tiny_model):
    model = load_model(tiny_model, torch.float32)
    ids = [5, 9, 14, 3, 22]
    want = _logits(model, ids)
    before = {id(layer.weight) for layer in model.linear_layers()}
    layers = stream_layers(model, "cpu")
    assert len(layers) == 4 * len(model.layers)  # qkv, o, gate_up, down: the head stays resident
    assert all(isinstance(layer.method, OffloadMethod) and layer.method.inner is PLAIN for layer in layers)
    assert {id(layer.weight) for layer in layers} <= before  # the same parameters, their data on the host
    assert all(layer.weight.data_ptr() == layer.host_tensors["weight"].data_ptr() for layer in layers)
    torch.testing.assert_close(_logits(model, ids), want, atol=0, rtol=0)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_offloading_wraps_a_quantized_method_too(tiny_model, tmp_path, method):
    """Offloading is a weight method around the layer's own: quantized storage streams from the
    host, or maps from a file, and computes exactly what it computes resident."""
    from minillm.quantization import quantize_model

    def quantized():
        model = load_model(tiny_model, torch.float32)
        quantize_model(model, method, 32 if method == "int4" else None)
        return model

    ids = [5, 9, 14, 3, 22]
    streamed, mapped = quantized(), quantized()
    want = _logits(streamed, ids)
    inner = type(streamed.layers[0].mlp.down_proj.method)
    layers = stream_layers(streamed, "cpu")
    assert all(isinstance(layer.method, OffloadMethod) and isinstance(layer.method.inner, inner) for layer in layers)
    assert layers[0].method.name == f"{method}, offloaded"
    torch.testing.assert_close(_logits(streamed, ids), want, atol=0, rtol=0)
    path = tmp_path / "q.pt"
    memory_map_weights(mapped, path)
    held = [t for layer in mapped.linear_layers() for t in layer.held_by_name().values()]
    assert held and all(is_memory_mapped(t, path) for t in held)  # int8/int4 tensors included
    torch.testing.assert_close(_logits(mapped, ids), want, atol=0, rtol=0)
    evict_page_cache(mapped, path)
    torch.testing.assert_close(_logits(mapped, ids), want, atol=0, rtol=0)


@pytest.mark.parametrize("offload", ["host", "disk"])
def test_engine_with_offloaded_weights(tiny_model, offload):
    with LLM(tiny_model, dtype="float32") as llm:
        want = [o.token_ids for o in llm.generate([[5, 6, 7], [8, 9]], GREEDY)]
    with LLM(tiny_model, dtype="float32", weight_offload=offload) as llm:
        assert [o.token_ids for o in llm.generate([[5, 6, 7], [8, 9]], GREEDY)] == want


def test_offload_refuses_packed_or_quantized_weights(tiny_model):
    model = load_model(tiny_model, torch.float32)
    from minillm.layers.cpu_prepack import CPUPrepackMethod, prepack_available

    if not prepack_available(torch.float32):
        pytest.skip("no oneDNN prepacking on this CPU")
    model.layers[0].mlp.down_proj.set_method(CPUPrepackMethod())
    with pytest.raises(ValueError, match=r"layers\.0\.mlp\.down_proj uses 'cpu_prepack' storage.*cpu_prepack=False"):
        stream_layers(model, "cpu")
    assert model.layers[0].attn.qkv_proj.method is PLAIN  # checked before any layer changed
    with pytest.raises(ValueError, match="cpu_prepack=False"):
        memory_map_weights(model, "/nonexistent/never-written.pt")
    with pytest.raises(ValueError, match="weight_offload='disk' cannot be combined with quantization"):
        LLM(tiny_model, weight_offload="disk", quantization="int8")
    with pytest.raises(ValueError, match="expected 'host', 'disk'"):
        LLM(tiny_model, weight_offload="gpu")
