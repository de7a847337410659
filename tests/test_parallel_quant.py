"""Quantization under tensor (and pipeline) parallelism: each rank quantizes its own slices to
exactly the values the one-process model holds — per-row int8 scales of a row slice come from
the whole rows (an all-reduce of the maxima), int4 groups of a row slice are whole groups — so
the parallel engine's greedy tokens are the one-process engine's; a group that cannot cut a
rank's slice is refused, naming the layer and the slice, before any worker starts.

The tiny model (``llama_gqa``: hidden 64, 4 query heads of 16, intermediate 128) at TP = 2 gives
its row-parallel layers input slices of 32 (o_proj: 2 heads × 16) and 64 (down_proj): int4
runs at ``quantization_group_size=32``; its default group, 64, cannot cut o_proj's slice."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import child_pids

from minillm import LLM, SamplingParams
from minillm.config import ModelConfig
from minillm.layers.tensor_parallel import ParallelContext
from minillm.models.llama import SwiGLU
from minillm.parallel.launch import run_ranks
from minillm.quantization import (
    Int4Method,
    Int8Method,
    dequantize_int4,
    dequantize_int8,
    quantize_int4,
    quantize_int8,
)

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 9, 14, 3, 22, 7], [8, 8, 31, 2, 17], list(range(3, 40)), [11]]
HIDDEN, INTERMEDIATE = 64, 128


def _tokens(folder, **engine) -> list[list[int]]:
    with LLM(folder, dtype="fp32", num_threads=1, max_num_seqs=4, **engine) as llm:
        return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize(
    "variant, quant, sizes",
    [
        ("llama_gqa", dict(quantization="int8"), dict(tensor_parallel_size=2)),  # tied: embeds from the int8 head
        ("llama_gqa", dict(quantization="int4", quantization_group_size=32), dict(tensor_parallel_size=2)),
        ("qwen2_bias", dict(quantization="int8"), dict(tensor_parallel_size=2)),  # q/k/v biases beside int8
        ("llama_gqa", dict(quantization="int8"), dict(pipeline_parallel_size=2)),  # embedding and head apart
    ],
)
def test_parallel_quantized_engine_gives_the_one_process_tokens(tiny_models, variant, quant, sizes):
    folder = tiny_models[variant]
    assert _tokens(folder, **quant, **sizes) == _tokens(folder, **quant)


def test_an_int4_group_that_cannot_cut_a_row_slice_is_refused_before_any_worker(tiny_model):
    before = child_pids()
    message = (
        r"layers\.0\.attn\.o_proj: int4 group_size=64 does not cut tensor-parallel rank 0's input slice 0:32 "
        r"\(of 64\) into whole groups"
    )
    with pytest.raises(ValueError, match=message):
        LLM(tiny_model, dtype="fp32", quantization="int4", quantization_group_size=64, tensor_parallel_size=2)
    assert child_pids() <= before


@pytest.mark.parametrize(
    "args, message",
    [
        (dict(quantization="awq"), "quantization='awq' cannot be combined"),
        (dict(quantization="w8a8"), "quantization='w8a8' cannot be combined"),
        (dict(sparsity="2:4"), "sparsity='2:4' cannot be combined"),
    ],
)
def test_weight_methods_that_cannot_run_in_parallel_are_refused(tiny_model, args, message):
    with pytest.raises(ValueError, match=message):
        LLM(tiny_model, dtype="fp32", tensor_parallel_size=2, **args)


def _tied_embedding(rank, world_size, folder, ids):
    from minillm.models import load_model
    from minillm.quantization import quantize_model

    model = load_model(folder, torch.float32, parallel=ParallelContext(tp_rank=rank, tp_size=world_size))
    quantize_model(model, "int8")
    embed = model.embed_tokens
    return embed.reads_from_head, embed.weight is None, embed(ids).numpy()  # by value: see _by_value


def test_a_tied_vocabulary_parallel_embedding_reads_its_int8_head_rows(tiny_model):
    """Each rank's embedding holds no float table: it reads its vocabulary rows through its
    int8 head shard (the same rows, per-row scales), and the all-reduced rows are the one-process
    model's, bit for bit."""
    from minillm.models import load_model
    from minillm.quantization import quantize_model

    ids = torch.tensor([[0, 5, 17, 399, 200]])  # ids on both ranks' halves of the 400-token vocabulary
    whole = load_model(tiny_model, torch.float32)
    quantize_model(whole, "int8")
    for reads, dropped, rows in run_ranks(_tied_embedding, 2, str(tiny_model), ids, timeout=120):
        assert reads and dropped
        assert torch.equal(torch.from_numpy(rows), whole.embed_tokens(ids))


def _by_value(held: dict) -> dict:
    """A rank's tensors as numpy arrays: pickled by value, not shared through a file descriptor
    that dies with the rank's process when the parent reads the queue late (a loaded machine)."""
    return {name: {k: t.numpy() for k, t in parts.items()} for name, parts in held.items()}


def _as_tensors(held: dict) -> dict:
    return {name: {k: torch.from_numpy(a) for k, a in parts.items()} for name, parts in held.items()}


def _weights():
    gen = torch.Generator().manual_seed(3)
    gate, up = (torch.randn(INTERMEDIATE, HIDDEN, generator=gen) for _ in range(2))
    down = torch.randn(HIDDEN, INTERMEDIATE, generator=gen)
    down[:, 70] *= 30  # one row's largest weight sits in rank 1's columns: rank 0 alone would pick a smaller scale
    return gate, up, down, torch.randn(5, HIDDEN, generator=gen)


def _quantized_shard(rank, world_size, method):
    gate, up, down, x = _weights()
    config = ModelConfig("llama", 10, HIDDEN, INTERMEDIATE, 1, 2, 2, 32, 1e-6, 8, True, False, 1e4)
    mlp = SwiGLU(config, ParallelContext(tp_rank=rank, tp_size=world_size))
    mlp.gate_up_proj.weight_loader("weight", gate, "gate")
    mlp.gate_up_proj.weight_loader("weight", up, "up")
    mlp.down_proj.weight_loader("weight", down)
    for layer in (mlp.gate_up_proj, mlp.down_proj):
        layer.set_method(Int8Method() if method == "int8" else Int4Method(32))
    held = {
        name: {
            k: getattr(layer, k).clone() for k in ("qweight", "scales", "int4_scale", "int4_min") if hasattr(layer, k)
        }
        for name, layer in (("gate_up", mlp.gate_up_proj), ("down", mlp.down_proj))
    }
    with torch.no_grad():
        return _by_value(held), mlp(x).numpy()


def _round_trip(w: torch.Tensor, method: str) -> torch.Tensor:
    """``w`` as the one-process layer holds it: quantized whole, dequantized."""
    return dequantize_int8(*quantize_int8(w)) if method == "int8" else dequantize_int4(*quantize_int4(w, 32))


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_each_rank_holds_exactly_its_slice_of_the_one_process_quantization(method):
    """Column slices (gate/up rows) and row slices (down's input columns) hold the very values,
    scales and group tables of the whole matrix quantized in one process; the all-reduced
    output is the quantized MLP's."""
    gate, up, down, x = _weights()
    ranks = [(_as_tensors(held), torch.from_numpy(out)) for held, out in run_ranks(_quantized_shard, 2, method)]
    for (held, _), r in zip(ranks, [slice(0, 64), slice(64, 128)]):
        if method == "int8":
            q, scale = quantize_int8(torch.cat([gate[r], up[r]]))  # column slices: their rows' own scales
            assert torch.equal(held["gate_up"]["qweight"], q) and torch.equal(held["gate_up"]["scales"], scale)
            q, scale = quantize_int8(down)  # row slices: the whole rows' scales
            assert torch.equal(held["down"]["qweight"], q[:, r]) and torch.equal(held["down"]["scales"], scale)
        else:
            _, scale, low = quantize_int4(down, 32)  # row slices of whole groups: the same groups
            groups = slice(r.start // 32, r.stop // 32)
            assert torch.equal(held["down"]["int4_scale"], scale[:, groups])
            assert torch.equal(held["down"]["int4_min"], low[:, groups])
    w_gate, w_up, w_down = (_round_trip(w, method) for w in (gate, up, down))
    want = F.linear(F.silu(F.linear(x, w_gate)) * F.linear(x, w_up), w_down)
    for _, out in ranks:
        torch.testing.assert_close(out, want, atol=1e-3, rtol=1e-4)
