"""Offloading, the last resort: weights streamed per layer from host memory, or memory-mapped
from a file and paged in by the OS (even after being evicted) — the same logits and tokens as
resident weights."""

from __future__ import annotations

import pytest
import torch

from minillm import LLM, SamplingParams
from minillm.layers.offload import evict_page_cache, is_memory_mapped, memory_map_weights, stream_layers
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
    handles = stream_layers(model, "cpu")
    assert len(handles) == 2 * len(model.layers)
    torch.testing.assert_close(_logits(model, ids), want, atol=0, rtol=0)
    for h in handles:
        h.remove()


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
    with pytest.raises(ValueError, match="cpu_prepack=False"):
        stream_layers(model, "cpu")
    with pytest.raises(ValueError, match="weight_offload='disk' cannot be combined with quantization"):
        LLM(tiny_model, weight_offload="disk", quantization="int8")
    with pytest.raises(ValueError, match="expected 'host', 'disk'"):
        LLM(tiny_model, weight_offload="gpu")
