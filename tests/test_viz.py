"""Widgets and plots: the numbers they show, and that they build outside a notebook."""

from __future__ import annotations

import pytest

from minillm import LLM, SamplingParams
from minillm.viz import (
    KV_PRESETS,
    RooflinePoint,
    kv_cache_bytes,
    kv_memory_figure,
    kv_memory_widget,
    latency_timeline,
    measure_machine,
    roofline_figure,
)
from minillm.viz.kv_memory import human_bytes, weight_bytes
from minillm.viz.roofline import MachinePeaks, measure_step_points
from minillm.viz.timeline import timeline_segments


def test_kv_bytes_formula_and_presets():
    smol = KV_PRESETS["SmolLM2-135M"]
    assert kv_cache_bytes(smol.layers, smol.kv_heads, smol.head_dim, "bf16", 1) == 2 * 30 * 3 * 64 * 2
    llama = KV_PRESETS["Llama-2-7B"]
    assert kv_cache_bytes(llama.layers, llama.kv_heads, llama.head_dim, "fp16", 4096) == 2**31  # 2 GiB
    big = KV_PRESETS["96-layer example (GPT-3-sized)"]
    assert kv_cache_bytes(big.layers, big.kv_heads, big.head_dim, "fp16", 2048, 512) == pytest.approx(4.95e12, rel=1e-2)
    assert weight_bytes(7e9, "fp16") == 14e9 and weight_bytes(7e9, "int4") == 3.5e9
    assert human_bytes(14e9) == "14 GB"
    with pytest.raises(ValueError, match="seq_len=-1"):
        kv_cache_bytes(1, 1, 1, "fp16", -1)


def test_kv_memory_figure_and_widget():
    fig = kv_memory_figure("Llama-3-8B", "fp16", seq_lens=[128, 1024], batches=(1, 8))
    assert len(fig.data) == 3  # two batch sizes + the weights line
    assert fig.data[1].y[1] == pytest.approx(8 * 1024 * 2 * 32 * 8 * 128 * 2 / 1e9)
    widget = kv_memory_widget()
    assert "KV cache" in widget.children[3].value


def test_latency_timeline_from_real_metrics(tiny_model):
    outs = LLM(tiny_model, dtype="fp32").generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=4, ignore_eos=True))
    segments = timeline_segments(outs)
    kinds = [s["kind"] for s in segments]
    assert kinds.count("prefill") == 2 and kinds.count("decode step") == 6
    assert all(s["duration_ms"] >= 0 for s in segments)
    fig = latency_timeline(outs)
    assert {t.name for t in fig.data} >= {"prefill", "decode step"}


def test_roofline_measurement_and_figure(tiny_model):
    peaks = measure_machine("cpu", copy_mb=16, matmul_n=256, repeats=2)
    assert peaks.bandwidth_gbs > 0.1 and peaks.flops_tflops > 1e-4
    llm = LLM(tiny_model, dtype="fp32")
    points = measure_step_points(llm, prompt_lens=(8, 64), decode_batches=(1, 4), context=16, repeats=1)
    prefill, decode = points[1], points[2]
    assert prefill.intensity > decode.intensity  # prefill reuses each weight for many tokens
    fig = roofline_figure(peaks, points)
    assert len(fig.data) == 1 + len(points)


def test_roofline_point_arithmetic():
    p = RooflinePoint("x", flops=2e9, bytes=1e9, seconds=0.5)
    assert p.intensity == 2 and p.achieved_tflops == pytest.approx(4e-3)
    assert MachinePeaks("cpu", "bf16", bandwidth_gbs=30, flops_tflops=0.3).ridge_intensity == pytest.approx(10)


def _recorded_run(tiny_model, **engine_args):
    from minillm import LLMEngine

    engine = LLMEngine(tiny_model, dtype="fp32", block_size=4, **engine_args)
    engine.record_block_tables = True
    system = list(range(30, 46))
    ids = [engine.add_request(system + [i, i + 1], SamplingParams(max_tokens=6, ignore_eos=True)) for i in range(3)]
    done = {}
    while engine.has_unfinished_requests():
        done |= {d.request_id: d.output for d in engine.step() if d.output}
    return engine, [done[i] for i in ids]


def test_block_table_explorer_shows_owners_and_shared_blocks(tiny_model):
    from minillm.viz import block_table_explorer
    from minillm.viz.serving import CACHED, FREE, _block_grid

    engine, outputs = _recorded_run(tiny_model, max_num_batched_tokens=18)  # one prompt per step
    records = engine.step_records
    fig = block_table_explorer(records, engine.block_manager.num_blocks, columns=8, max_blocks=64)
    assert len(fig.frames) == len(records) and len(fig.layout.sliders[0].steps) == len(records)
    # Find a step where two requests share the cached system-prompt blocks: marked "×2".
    owners = {o.request_id: i for i, o in enumerate(outputs)}
    labels = [_block_grid(r, 64, 8, owners)[2] for r in records]
    assert any("×2" in row for grid in labels for row in grid) or any("×3" in row for grid in labels for row in grid)
    values, hover, _ = _block_grid(records[-1], 64, 8, owners)
    flat = [v for row in values for v in row]
    assert FREE in flat and CACHED in flat  # after the last step: finished prefixes kept as cache
    with pytest.raises(ValueError, match="record_block_tables"):
        block_table_explorer([], 8)


def test_batching_timeline_segments(tiny_model):
    from minillm.metrics import run_report
    from minillm.viz import batching_segments, batching_timeline, compare_timelines, latency_percentiles

    engine, outputs = _recorded_run(tiny_model)
    segments = batching_segments(engine.step_records, outputs)
    kinds = {s["kind"] for s in segments}
    assert {"prefill", "decode"} <= kinds
    for s in segments:
        assert s["end_s"] >= s["start_s"] >= 0
    # Consecutive decode steps merge into one bar per request.
    assert sum(s["kind"] == "decode" for s in segments) == len(outputs)
    fig = batching_timeline(engine.step_records, outputs)
    assert {t.name for t in fig.data} == kinds
    both = compare_timelines({"a": (engine.step_records, outputs), "b": (engine.step_records, outputs)})
    assert len(both.data) == 2 * len(fig.data)
    report = run_report(outputs, engine.step_records)
    assert len(latency_percentiles({"a": report, "b": report}).data) == 4


def test_batching_timeline_shows_preemption(tiny_model):
    import torch

    from minillm.config import ModelConfig
    from minillm.kvcache.addressing import kv_bytes_per_token
    from minillm.viz import batching_segments

    per_block = 4 * kv_bytes_per_token(ModelConfig.from_folder(tiny_model), torch.float32)
    engine, outputs = _recorded_run(tiny_model, kv_cache_memory=7 * per_block)  # room for ~1.2 requests
    assert sum(o.num_preemptions for o in outputs) > 0
    kinds = [s["kind"] for s in batching_segments(engine.step_records, outputs)]
    assert "preempted" in kinds and "waiting" in kinds
