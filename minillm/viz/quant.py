"""Chapter 07's arithmetic and figures: what a quantized weight costs, how much error it leaves.

- ``bits_per_weight`` / ``quantized_weight_bytes``: the storage of a quantized model, *with*
  the scales (and zero points) that group-wise formats keep next to the values — why "4-bit"
  models are really 4.25-5 bits per weight;
- ``fake_quantize``: quantize and dequantize a matrix at a chosen bit width and granularity
  (one scale per tensor, per output channel, or per group of input weights), symmetric or with
  a zero point, to measure the error each choice leaves in a real weight matrix;
- ``layer_errors`` / ``layer_error_heatmap``: the package's own int8 or int4 quantizer applied
  to every decoder projection of a model, the relative error of each as a layers × projections
  heatmap;
- ``quant_tradeoff_figure`` / ``quant_tradeoff``: a committed ``benchmarks/bench_quant.py``
  result as perplexity against weight bytes, coloured and sized by speed.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

#: The columns of ``layer_errors``: the seven projections of a Llama decoder layer.
PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down")


def bits_per_weight(
    bits: float, group_size: int | None = None, scale_bits: int = 16, zero_point: bool = False
) -> float:
    """Stored bits per weight: ``bits`` for the value, plus its share of the group's scale (and
    zero point, for an asymmetric format) of ``scale_bits`` each. ``group_size=None`` counts no
    scales at all — the ideal the headline figures quote."""
    if bits <= 0:
        raise ValueError(f"bits={bits} must be positive")
    if group_size is None:
        return float(bits)
    if group_size < 1:
        raise ValueError(f"group_size={group_size} must be >= 1 (or None for no scales)")
    return bits + scale_bits * (2 if zero_point else 1) / group_size


def quantized_weight_bytes(
    num_params: float, bits: float, group_size: int | None = None, scale_bits: int = 16, zero_point: bool = False
) -> float:
    """Bytes of ``num_params`` weights stored at ``bits_per_weight(bits, group_size, ...)``."""
    if num_params < 0:
        raise ValueError(f"num_params={num_params} must be >= 0")
    return num_params * bits_per_weight(bits, group_size, scale_bits, zero_point) / 8


def fake_quantize(
    weight: torch.Tensor, bits: int, granularity: str | int = "channel", symmetric: bool = True
) -> torch.Tensor:
    """``weight[out, in]`` quantized to ``bits`` and back (fp32), so the error can be measured.

    ``granularity``: ``"tensor"`` (one scale), ``"channel"`` (one per output row) or an int
    (one per group of that many consecutive input weights of a row). Symmetric: ``q`` in
    ``[-(2^(b-1) - 1), 2^(b-1) - 1]`` with ``scale = max|w| / (2^(b-1) - 1)``. Asymmetric:
    ``q`` in ``[0, 2^b - 1]`` with ``scale = (max - min) / (2^b - 1)`` and the minimum as zero
    point."""
    w = weight.detach().float()
    if w.dim() != 2:
        raise ValueError(f"fake_quantize needs a 2-D weight [out, in], got shape {tuple(w.shape)}")
    out, cols = w.shape
    if granularity == "tensor":
        groups = w.reshape(1, 1, -1)
    elif granularity == "channel":
        groups = w.reshape(out, 1, cols)
    elif isinstance(granularity, int) and not isinstance(granularity, bool) and granularity > 0:
        if cols % granularity:
            raise ValueError(f"group size {granularity} does not divide the {cols} input features")
        groups = w.reshape(out, cols // granularity, granularity)
    else:
        raise ValueError(f"granularity={granularity!r}: expected 'tensor', 'channel' or a group size")
    if symmetric:
        top = 2 ** (bits - 1) - 1
        scale = (groups.abs().amax(-1, keepdim=True) / top).clamp(min=1e-12)
        back = torch.round(groups / scale).clamp(-top, top) * scale
    else:
        levels = 2**bits - 1
        low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
        scale = ((high - low) / levels).clamp(min=1e-12)
        back = torch.round((groups - low) / scale).clamp(0, levels) * scale + low
    return back.reshape(out, cols)


def relative_error(weight: torch.Tensor, approx: torch.Tensor) -> float:
    """``‖W - Ŵ‖ / ‖W‖`` (Frobenius norms): 0.01 means the error is 1% of the matrix."""
    w = weight.detach().float()
    return float((w - approx.detach().float()).norm() / w.norm().clamp(min=1e-30))


def _load(model):
    """A model with plain weights: ``model`` itself, or loaded (fp32) from a name or folder."""
    if isinstance(model, (str, Path)):
        from minillm.assets import resolve_model
        from minillm.models import load_model

        return load_model(resolve_model(str(model)), torch.float32)
    return model


def _projections(layer) -> dict[str, torch.Tensor]:
    """The seven weight matrices of one decoder layer, split out of the fused q/k/v and gate/up."""
    out = {}
    for fused in (layer.attn.qkv_proj, layer.attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        if fused.weight is None or fused.weight.dim() != 2:
            raise ValueError(
                f"layer_errors needs plain weights; this layer holds {fused.method.name!r} storage "
                "(pass the model before quantizing it, or its name)"
            )
        start = 0
        for shard, rows in fused.shards.items():
            name = shard if shard is not None else ("o" if fused is layer.attn.o_proj else "down")
            out[name] = fused.weight[start : start + rows]
            start += rows
    return out


def _quantize_rows(weight: torch.Tensor, method: str, group_size: int) -> torch.Tensor:
    from minillm.quantization import dequantize_int4, dequantize_int8, quantize_int4, quantize_int8

    if method == "int8":
        return dequantize_int8(*quantize_int8(weight))
    if method == "int4":
        return dequantize_int4(*quantize_int4(weight, group_size))
    raise ValueError(f"method={method!r}: expected 'int8' or 'int4'")


@torch.inference_mode()
def layer_errors(model, method: str = "int4", group_size: int | None = None) -> list[list[float]]:
    """``[layer][projection]``: the relative error of the package's ``method`` quantizer (int8
    per output channel; int4 in groups of ``group_size``, by default the package's choice for
    this model) on every projection of every decoder layer (columns: ``PROJECTIONS``).

    Quantization works row by row (int8) or on groups within a row (int4), so quantizing a
    fused matrix and splitting it gives exactly the error of quantizing each part alone."""
    model = _load(model)
    if method == "int4" and group_size is None:
        from minillm.quantization import default_group_size

        group_size = default_group_size(model)
    rows = []
    for layer in model.layers:
        weights = _projections(layer)
        rows.append([relative_error(weights[p], _quantize_rows(weights[p], method, group_size)) for p in PROJECTIONS])
    return rows


def layer_error_heatmap(model, method: str = "int4", group_size: int | None = None, name: str | None = None):
    """A heatmap of ``layer_errors``: rows are decoder layers, columns the seven projections,
    each cell the relative error in percent. ``model``: a name, a folder or a loaded model
    with plain weights (``name`` labels the title; a name passed as ``model`` is used)."""
    import plotly.graph_objects as go

    import minillm.viz.style as style

    if name is None and isinstance(model, (str, Path)):
        name = Path(str(model)).name
    model = _load(model)
    if method == "int4" and group_size is None:
        from minillm.quantization import default_group_size

        group_size = default_group_size(model)
    errors = layer_errors(model, method, group_size)
    percent = [[float(f"{100 * e:.4g}") for e in row] for row in errors]  # 4 digits: stable output
    labels = [f"layer {i}" for i in range(len(errors))]
    what = "int8, one scale per output channel" if method == "int8" else f"int4, groups of {group_size}"
    title = f"{name or 'model'}: {what}<br>relative error ‖W − Ŵ‖ / ‖W‖ of every projection (%)"
    row_px = 28
    top, bottom = style.top_margin(title), style.X_AXIS
    height = max(300, top + bottom + row_px * len(errors))
    fig = go.Figure(
        go.Heatmap(
            z=percent,
            x=[f"{p}_proj" for p in PROJECTIONS],
            y=labels,
            text=[[f"{v:.2f}" for v in row] for row in percent],
            texttemplate="%{text}",
            colorscale="Reds",
            zmin=0,
            colorbar=dict(title=dict(text="%"), thickness=14),
            hovertemplate="%{y}, %{x}: %{z:.3f}% error<extra></extra>",
            xgap=1,
            ygap=1,
        )
    )
    fig.update_layout(
        template="plotly_white",
        height=height,
        title=style.title(title),
        yaxis=dict(autorange="reversed"),
        margin=dict(l=70, r=70, t=top, b=bottom),
    )
    return fig


# ---- the committed benchmark: quality, size and speed of every method ---------------------------

SPEEDS = {
    "decode_tok_s_b1": "decode tok/s, batch 1",
    "decode_tok_s_b8": "decode tok/s, batch 8",
    "prefill_tok_s_512": "prefill tok/s, 512-token prompt",
}
QUALITIES = {"ppl_shakespeare": "perplexity, held-out Shakespeare", "ppl_english": "perplexity, English prose"}


RESULTS_DIR = Path(__file__).resolve().parents[2] / "benchmarks" / "results"  # in a checkout of the repository


def committed_result(model: str = "smollm2-135m", folder: str | Path = RESULTS_DIR) -> Path:
    """The latest committed ``bench_quant.py`` result for ``model`` (``quant-<model>-<date>-*.json``)."""
    found = sorted(Path(folder).glob(f"quant-{model}-[0-9]*.json"))
    if not found:
        raise FileNotFoundError(f"no quant-{model}-*.json in {folder}: run benchmarks/bench_quant.py --model {model}")
    return found[-1]


def load_quant_results(results) -> dict:
    """A ``bench_quant.py`` result — a path to its JSON, or the loaded dict — with what its
    file name says (``quant-<model>-<date>-<machine tag>.json``) as ``model`` and ``date``."""
    source = None
    if isinstance(results, (str, Path)):
        source = Path(results)
        results = json.loads(source.read_text())
    if not isinstance(results, dict) or not results.get("rows"):
        raise ValueError("expected a bench_quant.py result: a JSON object with a non-empty 'rows' list")
    out = dict(results)
    match = re.fullmatch(r"quant-(.+)-(\d{4}-\d{2}-\d{2})-(.+)\.json", source.name) if source else None
    out.setdefault("model", match.group(1) if match else _model_from_command(results.get("command", "")))
    out.setdefault("date", match.group(2) if match else None)
    out.setdefault("machine", results["rows"][0].get("machine", {}))
    return out


def _model_from_command(command: str) -> str:
    found = re.search(r"--model\s+(\S+)", command)
    return found.group(1) if found else "smollm2-135m"  # bench_quant.py's default


def _machine_words(machine: dict) -> str:
    parts = [machine.get("cpu") or machine.get("device") or "unknown machine"]
    if machine.get("torch_threads"):
        parts.append(f"{machine['torch_threads']} threads")
    if machine.get("torch"):
        parts.append(f"torch {machine['torch']}")
    return ", ".join(parts)


COLORBAR_PX = 60  # the colour bar and its tick labels, right of the plot


def quant_tradeoff_figure(results, quality: str = "ppl_shakespeare", speed: str = "decode_tok_s_b1"):
    """Every method of a ``bench_quant.py`` result as one point: weight MB (x) against
    ``quality`` (y, lower is better), marker colour and size by ``speed``; bf16 (the
    reference) as a dashed line. The title names the model, machine and date it was measured on."""
    import plotly.graph_objects as go

    import minillm.viz.style as style

    data = load_quant_results(results)
    if quality not in QUALITIES or speed not in SPEEDS:
        raise ValueError(f"quality must be one of {list(QUALITIES)} and speed one of {list(SPEEDS)}")
    rows = [r for r in data["rows"] if all(r.get(k) is not None for k in (quality, speed, "weight_bytes"))]
    if not rows:
        raise ValueError(f"no row of this result has {quality!r}, {speed!r} and 'weight_bytes'")
    ref = next((r for r in rows if r["method"] in ("bf16", "fp16", "fp32")), rows[0])
    speeds = [r[speed] for r in rows]
    top_speed = max(speeds)
    when = f", {data['date']}" if data.get("date") else ""
    title = (
        f"{data['model']}: perplexity against weight memory ({ref['method']} dashed)<br>"
        f"measured on {_machine_words(data['machine'])}{when}<br>"
        f"colour and size: {SPEEDS[speed]}"
    )
    height, top = 440, style.top_margin(title, size=14)
    ys = [r[quality] for r in rows]
    pad = (max(ys) - min(ys)) * 0.15 or 1.0
    x_range, y_range = (0, max(r["weight_bytes"] for r in rows) / 1e6 * 1.08), (min(ys) - pad, max(ys) + 2 * pad)
    # Labels placed in pixels (plot area: the notebook column less the margins and the colour bar),
    # so methods that land on one spot share a label and close ones take different sides.
    width_px, height_px = style.NOTEBOOK_WIDTH - 70 - 70 - COLORBAR_PX, height - top - style.X_AXIS
    points = [
        ((r["weight_bytes"] / 1e6 - x_range[0]) / (x_range[1] - x_range[0]) * width_px,
         (y_range[1] - r[quality]) / (y_range[1] - y_range[0]) * height_px,
         (14 + 26 * r[speed] / top_speed) / 2)
        for r in rows
    ]  # fmt: skip
    labels, spots = style.place_labels(points, [r["method"] for r in rows])
    fig = go.Figure()
    fig.add_trace(
        go.Scatter(
            x=[0, max(r["weight_bytes"] for r in rows) / 1e6 * 1.08],
            y=[ref[quality]] * 2,
            mode="lines",
            line=dict(dash="dash", color="#888"),
            hoverinfo="skip",
            showlegend=False,
        )
    )
    fig.add_trace(
        go.Scatter(
            x=[r["weight_bytes"] / 1e6 for r in rows],
            y=[r[quality] for r in rows],
            mode="markers+text",
            text=labels,
            textposition=spots,
            hovertext=[r["method"] for r in rows],
            customdata=[
                [r["weight_bytes"] / ref["weight_bytes"], r[quality] / ref[quality] - 1, r[speed] / ref[speed]]
                for r in rows
            ],
            marker=dict(
                size=[14 + 26 * s / top_speed for s in speeds],
                color=speeds,
                colorscale="Viridis",
                cmin=0,
                showscale=True,
                colorbar=dict(title=dict(text="tok/s"), thickness=14),
                line=dict(width=1, color="#333"),
            ),
            hovertemplate=(
                "%{hovertext}: %{x:.0f} MB (%{customdata[0]:.2f}× bf16), perplexity %{y:.2f} "
                "(%{customdata[1]:+.1%}), %{marker.color:.0f} tok/s (%{customdata[2]:.2f}× bf16)<extra></extra>"
            ),
            showlegend=False,
        )
    )
    fig.update_layout(
        template="plotly_white",
        height=height,
        title=style.title(title, size=14),
        xaxis=dict(title="weights held (MB)", range=list(x_range)),
        yaxis=dict(title=QUALITIES[quality], range=list(y_range)),
        margin=dict(l=70, r=70, t=top, b=style.X_AXIS),
    )
    return fig


def quant_tradeoff(results):
    """``quant_tradeoff_figure`` with two dropdowns: the quality measure (which held-out text)
    and the speed that colours the points (decode at batch 1 or 8, or prefill). Displayed, it
    also carries a static copy of its chart for a notebook opened without the widget's state."""
    import ipywidgets as w

    from minillm.viz.display import FigureBox, figure_widget

    data = load_quant_results(results)
    quality = w.Dropdown(options=[(v, k) for k, v in QUALITIES.items()], value="ppl_shakespeare", description="y")
    speed = w.Dropdown(options=[(v, k) for k, v in SPEEDS.items()], value="decode_tok_s_b1", description="colour")
    figure = figure_widget(quant_tradeoff_figure(data, quality.value, speed.value))

    def update(*_):
        fresh = quant_tradeoff_figure(data, quality.value, speed.value)
        with figure.batch_update():
            for trace, new in zip(figure.data, fresh.data):
                trace.update({k: v for k, v in new.to_plotly_json().items() if k not in ("type", "uid")})
            figure.layout.title = fresh.layout.title
            figure.layout.yaxis = fresh.layout.yaxis

    quality.observe(update, "value")
    speed.observe(update, "value")
    return FigureBox(
        [w.HBox([quality, speed]), figure], figure=figure, description=f"quantization trade-off ({data['model']})"
    )
