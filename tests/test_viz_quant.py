"""Chapter 07's arithmetic and figures: bytes of quantized weights, the error of each
granularity, the per-layer error heatmap and the trade-off chart of a committed benchmark."""

from __future__ import annotations

import json
import re

import pytest
import torch
from test_viz import layout_problems

from minillm.quantization import dequantize_int4, dequantize_int8, quantize_int4, quantize_int8
from minillm.viz.quant import (
    PROJECTIONS,
    bits_per_weight,
    committed_result,
    fake_quantize,
    layer_error_heatmap,
    layer_errors,
    load_quant_results,
    quant_tradeoff,
    quant_tradeoff_figure,
    quantized_weight_bytes,
    relative_error,
)


def test_the_7b_arithmetic_with_and_without_scales():
    assert quantized_weight_bytes(7e9, 16) == 14e9
    assert quantized_weight_bytes(7e9, 4) == 3.5e9  # the headline: no scales counted
    assert bits_per_weight(4, 64, scale_bits=16, zero_point=True) == 4.5  # what group-wise int4 really costs
    assert bits_per_weight(4, 128, zero_point=False) == 4.125
    assert quantized_weight_bytes(7e9, 4, 64, zero_point=True) == pytest.approx(3.9375e9)
    with pytest.raises(ValueError, match="group_size=0"):
        bits_per_weight(4, 0)
    with pytest.raises(ValueError, match="bits=0"):
        bits_per_weight(0)
    with pytest.raises(ValueError, match="num_params=-1"):
        quantized_weight_bytes(-1, 4)


def _weight():
    w = torch.randn(32, 128, generator=torch.Generator().manual_seed(0))
    w[3] *= 40  # one loud row
    return w


def test_fake_quantize_matches_the_package_and_stays_within_half_a_step():
    w = _weight()
    assert torch.allclose(fake_quantize(w, 8, "channel"), dequantize_int8(*quantize_int8(w)))
    assert torch.allclose(fake_quantize(w, 4, 32, symmetric=False), dequantize_int4(*quantize_int4(w, 32)), atol=1e-6)
    groups = w.reshape(32, 4, 32)
    step = (groups.amax(-1) - groups.amin(-1)) / 15
    err = (fake_quantize(w, 4, 32, symmetric=False) - w).abs().reshape(32, 4, 32)
    assert bool((err <= step[..., None] / 2 + 1e-5).all())


def test_finer_granularity_and_a_zero_point_lower_the_error():
    w = _weight() + 0.5  # off-centre: a zero point helps
    errors = [relative_error(w, fake_quantize(w, 4, g)) for g in ("tensor", "channel", 64, 32)]
    assert errors == sorted(errors, reverse=True)
    quiet = [r for r in range(32) if r != 3]  # with one scale per tensor, the loud row costs the others
    per_tensor, per_row = fake_quantize(w, 4, "tensor")[quiet], fake_quantize(w, 4, "channel")[quiet]
    assert relative_error(w[quiet], per_tensor) > 5 * relative_error(w[quiet], per_row)
    assert relative_error(w, fake_quantize(w, 4, 32, symmetric=False)) < errors[-1]
    with pytest.raises(ValueError, match="does not divide"):
        fake_quantize(w, 4, 48)
    with pytest.raises(ValueError, match="granularity"):
        fake_quantize(w, 4, "row")
    with pytest.raises(ValueError, match="2-D"):
        fake_quantize(w[0], 4)


def test_layer_errors_cover_every_projection_and_int8_beats_int4(tiny_model):
    from minillm.models import load_model

    model = load_model(tiny_model)
    int8, int4 = layer_errors(model, "int8"), layer_errors(model, "int4", group_size=32)
    assert len(int8) == len(model.layers) == 2 and all(len(row) == len(PROJECTIONS) for row in int8)
    assert all(0 < a < b for r8, r4 in zip(int8, int4) for a, b in zip(r8, r4))
    # the fused q/k/v rows are split: k_proj is exactly the k rows of the fused matrix
    attn = model.layers[1].attn
    q_rows = attn.qkv_proj.shards["q"]
    k = attn.qkv_proj.weight[q_rows : q_rows + attn.qkv_proj.shards["k"]]
    assert int8[1][PROJECTIONS.index("k")] == pytest.approx(relative_error(k, dequantize_int8(*quantize_int8(k))))
    fig = layer_error_heatmap(model, "int4", group_size=32, name="tiny")
    assert len(fig.data[0].z) == 2 and list(fig.data[0].x) == [f"{p}_proj" for p in PROJECTIONS]
    assert "tiny: int4, groups of 32" in fig.layout.title.text
    assert not layout_problems(fig)
    with pytest.raises(ValueError, match="method="):
        layer_errors(model, "int3")


def test_layer_errors_refuse_a_quantized_model(tiny_model):
    from minillm.models import load_model
    from minillm.quantization import quantize_model

    model = load_model(tiny_model)
    quantize_model(model, "int8")
    with pytest.raises(ValueError, match="plain weights"):
        layer_errors(model, "int8")


def test_tradeoff_figure_reads_the_committed_benchmark():
    path = committed_result("smollm2-135m")
    data = json.loads(path.read_text())
    fig = quant_tradeoff_figure(path)
    points = fig.data[1]
    assert list(points.hovertext) == [r["method"] for r in data["rows"]]
    assert list(points.x) == pytest.approx([r["weight_bytes"] / 1e6 for r in data["rows"]])
    assert list(points.marker.color) == [r["decode_tok_s_b1"] for r in data["rows"]]
    title = fig.layout.title.text
    machine = data["rows"][0]["machine"]
    assert "smollm2-135m" in title and machine["cpu"] in title
    assert re.search(r"\d{4}-\d{2}-\d{2}", path.name).group() in title  # the date the file name records
    assert fig.data[0].y[0] == data["rows"][0]["ppl_shakespeare"]  # bf16, the dashed reference
    assert not layout_problems(fig)
    prefill = quant_tradeoff_figure(data, "ppl_english", "prefill_tok_s_512")  # a dict: no file name to read
    assert list(prefill.data[1].y) == [r["ppl_english"] for r in data["rows"]]
    assert "prefill" in prefill.layout.title.text and not layout_problems(prefill)
    with pytest.raises(ValueError, match="quality must be"):
        quant_tradeoff_figure(data, "bleu")
    with pytest.raises(ValueError, match="rows"):
        load_quant_results({"rows": []})
    assert load_quant_results({"rows": data["rows"], "command": "x --model tiny-1m"})["model"] == "tiny-1m"


def test_tradeoff_widget_follows_its_dropdowns_and_keeps_a_static_copy():
    from IPython.core.interactiveshell import InteractiveShell

    from minillm.viz.display import PLOTLY_MIME

    data = load_quant_results(committed_result("smollm2-135m"))
    widget = quant_tradeoff(data)
    quality, speed = widget.children[0].children
    speed.value = "prefill_tok_s_512"
    assert list(widget.figure.data[1].marker.color) == [r["prefill_tok_s_512"] for r in data["rows"]]
    quality.value = "ppl_english"
    assert list(widget.figure.data[1].y) == [r["ppl_english"] for r in data["rows"]]
    assert "English" in widget.figure.layout.yaxis.title.text
    bundle, _ = InteractiveShell.instance().display_formatter.format(widget)
    assert "run the cell" in bundle["text/plain"] and len(json.dumps(bundle[PLOTLY_MIME])) < 50_000
