"""The parallelism planner as a widget (chapter 09): pick a model, a device, TP and PP degrees
and dtypes; see what each device holds and how fast a bandwidth-bound decode could be."""

from __future__ import annotations

from minillm.parallel.planner import DEVICES, DTYPE_BYTES, MODELS, plan


def planner_figure(model: str, device: str, weight_dtype: str = "bf16", kv_dtype: str = "bf16", context: int = 4096,
                   degrees=((1, 1), (2, 1), (4, 1), (8, 1), (4, 2), (8, 2))):  # fmt: skip
    """Memory per device (weights, KV for the largest batch) and the batch-1 bound per layout."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    import minillm.viz.style as style

    plans = []
    for tp, pp in degrees:
        try:
            plans.append(plan(model, device, tp, pp, weight_dtype, kv_dtype, context))
        except ValueError:
            continue  # a layout this model cannot take (heads or layers do not divide)
    names = [f"TP{p.tp}×PP{p.pp}" for p in plans]
    fig = make_subplots(rows=1, cols=2, subplot_titles=("GB per device", "batch-1 decode bound, tok/s"))
    fig.add_trace(go.Bar(x=names, y=[p.weights_per_device_gb for p in plans], name="weights"), row=1, col=1)
    kv = [p.max_batch * p.kv_per_token_per_device_bytes * context / 1e9 for p in plans]
    fig.add_trace(go.Bar(x=names, y=kv, name=f"KV of the largest batch at {context} tokens",
                         text=[f"batch {p.max_batch}" if p.fits else "no fit" for p in plans]), row=1, col=1)  # fmt: skip
    fig.add_trace(go.Bar(x=names, y=[p.tok_s_batch1 if p.fits else 0 for p in plans], name="bound tok/s",
                         showlegend=False), row=1, col=2)  # fmt: skip
    memory = DEVICES[device].memory_gb
    fig.add_hline(y=memory, line_dash="dash", annotation_text=f"{device}: {memory:.0f} GB", row=1, col=1)
    title = f"{model} on {device}, weights {weight_dtype}, KV {kv_dtype}"
    height = 440
    fig.update_layout(
        template="plotly_white",
        barmode="stack",
        height=height,
        title=style.title(title),
        margin=dict(t=style.top_margin(title, extra=style.SUBPLOT_TITLE), b=style.X_AXIS + style.LEGEND_ROW, l=60, r=20),
        legend=style.legend_at_bottom(height),
    )
    return fig, plans


def planner_widget():
    """Dropdowns for model / device / dtypes / context; redraws the figure and a table."""
    import ipywidgets as w

    from minillm.parallel.planner import table

    controls = dict(
        model=w.Dropdown(options=list(MODELS), value="Llama-2-70B", description="model"),
        device=w.Dropdown(options=list(DEVICES), value="H100 SXM 80GB", description="device"),
        weight_dtype=w.Dropdown(options=list(DTYPE_BYTES), value="bf16", description="weights"),
        kv_dtype=w.Dropdown(options=list(DTYPE_BYTES), value="bf16", description="KV cache"),
        context=w.Dropdown(options=[2048, 4096, 8192, 32768, 131072], value=4096, description="context"),
    )
    from minillm.viz.display import FigureBox

    out = w.Output()
    box = FigureBox([w.HBox(list(controls.values())[:3]), w.HBox(list(controls.values())[3:]), out], figure=None,
                    description="the parallelism planner")  # fmt: skip

    def redraw(_=None):
        fig, plans = planner_figure(**{k: c.value for k, c in controls.items()})
        box.figure = fig  # the static copy a saved notebook shows is the chart last drawn
        _show_in(out, fig, table(plans) + "\n")

    for c in controls.values():
        c.observe(redraw, names="value")
    redraw()
    return box


def _show_in(out, fig, text: str) -> None:
    """Set what the Output widget ``out`` shows (the figure, then ``text``) in one assignment.

    Not by drawing inside ``with out:`` while the cell runs: that capture makes a notebook runner
    without a front end (nbclient, and so nbgrader and papermill) send the widget's new state to
    the kernel while it waits for the cell's reply, and that reply can then sit unread until the
    cell's time limit — chapter 09 lost a whole grading limit to it (``minillm/course/headless.py``)."""
    data = fig._repr_mimebundle_() or {}  # what display(fig) shows, as plotly's renderers say (none outside a kernel)
    out.outputs = (
        {"output_type": "display_data", "data": data, "metadata": {}},
        {"output_type": "stream", "name": "stdout", "text": text},
    )
