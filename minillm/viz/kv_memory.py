"""The KV-cache memory calculator.

Per token, every layer stores one key and one value vector per KV head:

    bytes = 2 (K and V) × layers × kv_heads × head_dim × bytes_per_value × tokens × batch

GQA/MQA shrink ``kv_heads``; quantizing the cache shrinks ``bytes_per_value``; paging shrinks
the waste around ``tokens``. The presets are published architectures (and a GPT-3-sized
96-layer example), so the chapter can check commonly quoted figures with arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass

from minillm.kvcache.addressing import DTYPE_BYTES, dtype_bytes, kv_bytes_per_token_of


@dataclass(frozen=True)
class KVPreset:
    name: str
    layers: int
    kv_heads: int
    head_dim: int
    params: float  # parameter count, for the weights-vs-cache comparison
    note: str = ""


KV_PRESETS = {
    p.name: p
    for p in [
        KVPreset("SmolLM2-135M", 30, 3, 64, 134.5e6, "GQA: 9 query heads share 3 KV heads"),
        KVPreset("Llama-2-7B", 32, 32, 128, 6.74e9, "MHA"),
        KVPreset("Llama-3-8B", 32, 8, 128, 8.03e9, "GQA 32/8"),
        KVPreset("Llama-3-70B", 80, 8, 128, 70.6e9, "GQA 64/8"),
        KVPreset("96-layer example (GPT-3-sized)", 96, 96, 128, 175e9, "MHA, as in GPT-3 (Brown et al., 2020)"),
    ]
}


def kv_cache_bytes(
    layers: int, kv_heads: int, head_dim: int, dtype: str | float, seq_len: int, batch: int = 1
) -> float:
    """Bytes of K and V for ``batch`` sequences of ``seq_len`` tokens."""
    for name, value in (
        ("layers", layers),
        ("kv_heads", kv_heads),
        ("head_dim", head_dim),
        ("seq_len", seq_len),
        ("batch", batch),
    ):
        if value < 0:
            raise ValueError(f"{name}={value} must be >= 0")
    return kv_bytes_per_token_of(layers, kv_heads, head_dim, dtype) * seq_len * batch


def weight_bytes(params: float, dtype: str | float) -> float:
    return params * dtype_bytes(dtype)


def human_bytes(n: float) -> str:
    """Decimal units (GB = 1e9 bytes), as the articles and vendors quote them."""
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if abs(n) < 1000 or unit == "PB":
            return f"{n:.3g} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1000
    return f"{n:.3g} PB"


def kv_memory_figure(
    preset: KVPreset | str,
    dtype: str = "fp16",
    seq_lens=None,
    batches=(1, 8, 32, 128),
    seq_len: int | None = None,
    batch: int | None = None,
):
    """Memory against sequence length, one line per batch size, with the weights (in ``dtype``)
    for scale; ``seq_len`` and ``batch`` (both given) mark that point on the chart."""
    import math

    import plotly.graph_objects as go

    import minillm.viz.style as style

    p = KV_PRESETS[preset] if isinstance(preset, str) else preset
    seq_lens = list(seq_lens or [2**i for i in range(7, 18)])
    fig = go.Figure()
    for b in batches:
        ys = [kv_cache_bytes(p.layers, p.kv_heads, p.head_dim, dtype, s, b) / 1e9 for s in seq_lens]
        fig.add_trace(go.Scatter(x=seq_lens, y=ys, mode="lines+markers", name=f"batch {b}"))
    weights = weight_bytes(p.params, dtype) / 1e9
    fig.add_trace(
        go.Scatter(
            x=[seq_lens[0], seq_lens[-1]],
            y=[weights, weights],
            mode="lines",
            line=dict(dash="dash", color="black"),
            name=f"weights ({dtype})",
        )
    )
    if seq_len is not None and batch is not None:
        total = kv_cache_bytes(p.layers, p.kv_heads, p.head_dim, dtype, seq_len, batch)
        ys = [y for trace in fig.data for y in trace.y if y > 0] + [total / 1e9]
        ys = [y for y in ys if y > 0] or [1.0]
        lo, hi = math.log(min(ys)), math.log(max(ys))
        high = total > 0 and hi > lo and (math.log(total / 1e9) - lo) / (hi - lo) > 0.8
        right = seq_len > 0 and math.log(seq_len) > (math.log(seq_lens[0]) + math.log(seq_lens[-1])) / 2
        label = f"{human_bytes(total)}: {seq_len:,} tokens × batch {batch}"
        fig.add_trace(
            go.Scatter(
                x=[seq_len],
                y=[total / 1e9 if total > 0 else None],  # a log axis has no 0
                mode="markers",
                marker=dict(size=14, color="#d62728", symbol="circle-open", line=dict(width=3)),
                text=[label],
                name="selected",
                showlegend=False,
                hovertemplate="%{text}<extra></extra>",
            )
        )
        if total > 0:
            fig.add_annotation(  # on a log axis, an annotation's position is log10 of the value
                x=math.log10(seq_len),
                y=math.log10(total / 1e9),
                text=label,
                showarrow=True,
                arrowhead=0,
                arrowcolor="#d62728",
                ax=-40 if right else 40,
                ay=40 if high else -40,
                xanchor="right" if right else "left",
                font=dict(color="#d62728"),
                bgcolor="white",
                bordercolor="#d62728",
                borderpad=3,
            )
    title = (
        f"{p.name}: KV cache memory ({dtype})<br>"
        f"{p.layers} layers × {p.kv_heads} KV heads × {p.head_dim} dims = "
        f"{human_bytes(kv_cache_bytes(p.layers, p.kv_heads, p.head_dim, dtype, 1))} per token"
    )
    height = 460
    fig.update_layout(
        title=style.title(title),
        legend=style.legend_under_title(title, height),
        xaxis=dict(title="sequence length (tokens)", type="log"),
        yaxis=dict(title="memory (GB)", type="log"),
        template="plotly_white",
        height=height,
        margin=dict(l=80, r=30, t=style.top_margin(title, legend=True), b=style.X_AXIS),
    )
    return fig


def kv_memory_widget():
    """Sliders for the calculator: pick a preset (or edit its numbers) and see bytes and the plot.

    The chart's dashed line is the weights in the chosen dtype; the red circle is the chosen
    sequence length and batch. Displayed, the widget also carries a static copy of the chart,
    which a notebook shows when it is opened without the widget's state (not yet run)."""
    import ipywidgets as w

    from minillm.viz.display import FigureBox, figure_widget

    preset = w.Dropdown(options=list(KV_PRESETS), value="Llama-2-7B", description="model")
    layers = w.IntText(description="layers")
    kv_heads = w.IntText(description="KV heads")
    head_dim = w.IntText(description="head dim")
    dtype = w.Dropdown(options=list(DTYPE_BYTES), value="fp16", description="dtype")
    seq_len = w.IntSlider(value=4096, min=128, max=131072, step=128, description="seq len")
    batch = w.IntSlider(value=1, min=1, max=512, description="batch")
    readout = w.HTML()
    figure = figure_widget(kv_memory_figure(preset.value, dtype.value, seq_len=seq_len.value, batch=batch.value))

    def load_preset(*_):
        p = KV_PRESETS[preset.value]
        layers.value, kv_heads.value, head_dim.value = p.layers, p.kv_heads, p.head_dim

    def update(*_):
        if min(layers.value, kv_heads.value, head_dim.value) < 0:
            readout.value = "layers, KV heads and head dim must be >= 0"
            return
        total = kv_cache_bytes(layers.value, kv_heads.value, head_dim.value, dtype.value, seq_len.value, batch.value)
        per_token = kv_cache_bytes(layers.value, kv_heads.value, head_dim.value, dtype.value, 1, 1)
        readout.value = (
            f"<b>{human_bytes(total)}</b> of KV cache "
            f"({human_bytes(per_token)} per token × {seq_len.value:,} tokens × batch {batch.value})"
        )
        p = KV_PRESETS[preset.value]
        custom = KVPreset(p.name, layers.value, kv_heads.value, head_dim.value, p.params)
        fresh = kv_memory_figure(custom, dtype.value, seq_len=seq_len.value, batch=batch.value)
        with figure.batch_update():
            for trace, new in zip(figure.data, fresh.data):
                trace.update({k: v for k, v in new.to_plotly_json().items() if k not in ("type", "uid")})
            figure.layout.title = fresh.layout.title
            figure.layout.annotations = fresh.layout.annotations

    preset.observe(load_preset, "value")
    for control in (layers, kv_heads, head_dim, dtype, seq_len, batch):
        control.observe(update, "value")
    load_preset()
    update()
    return FigureBox(
        [w.HBox([preset, dtype]), w.HBox([layers, kv_heads, head_dim]), w.HBox([seq_len, batch]), readout, figure],
        figure=figure,
        description="KV-cache memory calculator",
    )
