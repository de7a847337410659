"""Serving widgets: the KV pool's block tables step by step, and who ran when under each policy.

- ``block_table_explorer``: the pool as a grid, one cell per block, coloured by the request
  that owns it; shared blocks (reference count > 1: a cached prefix) carry their count, blocks
  kept only for the prefix cache are grey. A slider steps through the scheduler steps of a
  real run (``engine.record_block_tables = True`` before running).
- ``batching_timeline``: a Gantt chart, one row per request — waiting, prefill chunks,
  decode, preempted — built from the engine's step records.
- ``latency_percentiles``: TTFT / TPOT percentiles of several runs side by side.
"""

from __future__ import annotations

from collections.abc import Hashable

import minillm.viz.style as style
from minillm.metrics import RunReport, StepRecord

PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"]
FREE, CACHED = 0, 1  # grid values below the owners' colours


FREE_COLOR, CACHED_COLOR = "#e6e6e6", "#a6a6a6"  # light grey cells on white; mid grey
OWNER_PALETTE = [c for c in PALETTE if c != "#7f7f7f"]  # no grey owner: grey means free or cached
BLOCK_ROW_PX = 32
RUNNING_SHOWN = 10  # request ids listed in the caption, then "+ n more"


def _block_grid(record: StepRecord, num_blocks: int, columns: int, owners: dict[Hashable, int]):
    """Values, hover text and labels of one step's grid (values: 0 free, 1 cached, 2+ owner colour)."""
    values = [FREE] * num_blocks
    hover = [f"block {b}: free" for b in range(num_blocks)]
    labels = [""] * num_blocks
    for b in range(num_blocks):
        if record.block_hashes and record.block_hashes[b]:
            values[b] = CACHED
            hover[b] = f"block {b}: cached prefix, unreferenced (evictable)"
    holders: dict[int, list[Hashable]] = {}
    for rid, table in (record.block_tables or {}).items():
        for b in table:
            holders.setdefault(b, []).append(rid)
    for b, rids in holders.items():
        if b >= num_blocks:
            continue
        values[b] = 2 + owners[rids[0]] % len(OWNER_PALETTE)
        shared = len(rids) > 1
        hover[b] = f"block {b}: {', '.join(map(str, rids))}" + (" (shared prefix)" if shared else "")
        labels[b] = f"×{len(rids)}" if shared else ""
    rows = -(-num_blocks // columns)
    pad = rows * columns - num_blocks

    def grid(items, fill):
        items = items + [fill] * pad
        return [items[r * columns : (r + 1) * columns] for r in range(rows)]

    return grid(values, None), grid(hover, ""), grid(labels, "")


def _colorscale() -> list:
    """A discrete scale: light grey = free, mid grey = cached, then one colour per owner slot."""
    colors = [FREE_COLOR, CACHED_COLOR, *OWNER_PALETTE]
    n = len(colors)
    scale = []
    for i, c in enumerate(colors):
        scale += [[i / n, c], [(i + 1) / n, c]]
    return scale


def _block_key():
    """Legend entries for the grid's colours (a heatmap has none of its own)."""
    import plotly.graph_objects as go

    def entry(name, color, symbol="square"):
        return go.Scatter(
            x=[None], y=[None], mode="markers", name=name, hoverinfo="skip",
            marker=dict(symbol=symbol, size=14, color=color, line=dict(color="white", width=1)),
        )  # fmt: skip

    return [
        entry("in use (colour: request)", OWNER_PALETTE[0]),
        entry("×n: shared by n requests", "#444444", "square-x-open"),
        entry("cached, unreferenced", CACHED_COLOR),
        entry("free", FREE_COLOR),
    ]


def block_table_explorer(step_records: list[StepRecord], num_blocks: int, columns: int = 16, max_blocks: int = 256):
    """A plotly figure with one frame per recorded step and a slider to move between them.

    One cell per block (row ``block // columns``, column ``block % columns``), 32 px a row; a
    colour key above the grid; the title says what the step holds."""
    import plotly.graph_objects as go

    records = [r for r in step_records if r.block_tables is not None]
    if not records:
        raise ValueError("no block tables recorded: set engine.record_block_tables = True before running")
    shown = min(num_blocks, max_blocks)
    owners: dict[Hashable, int] = {}
    for r in records:
        for rid in r.block_tables:
            owners.setdefault(rid, len(owners))
    n_colors = 2 + len(OWNER_PALETTE)

    def heatmap(record):
        z, hover, text = _block_grid(record, shown, columns, owners)
        return go.Heatmap(
            z=z,
            text=text,
            customdata=hover,
            texttemplate="%{text}",
            hovertemplate="%{customdata}<extra></extra>",
            colorscale=_colorscale(),
            zmin=0,
            zmax=n_colors,
            showscale=False,
            xgap=2,
            ygap=2,
        )

    def caption(record):
        running = [str(rid) for rid in record.block_tables]
        if len(running) > RUNNING_SHOWN:
            running = running[:RUNNING_SHOWN] + [f"+ {len(running) - RUNNING_SHOWN} more"]
        return (
            f"step {record.index}: {record.blocks_used} blocks in use, {record.blocks_cached} cached, "
            f"{record.blocks_free} free<br>running requests: {', '.join(running) or 'none'}"
        )

    rows = -(-shown // columns)
    title = caption(records[0])
    top = style.top_margin(title, legend=True)
    slider_pad = style.X_AXIS + 4  # the slider starts under the x axis' labels
    bottom = slider_pad + style.SLIDER + 6
    height = top + bottom + max(2, rows) * BLOCK_ROW_PX
    every = max(1, -(-len(records) * 28 // 700))  # a step label every ~28 px of a 700 px rail
    frames = [
        go.Frame(data=[heatmap(r)], name=str(r.index), layout=dict(title=style.title(caption(r)))) for r in records
    ]
    fig = go.Figure(data=[heatmap(records[0]), *_block_key()], frames=frames)
    fig.update_layout(
        title=style.title(title),
        legend=style.legend_under_title(title, height),
        template="plotly_white",
        height=height,
        margin=dict(l=80, r=30, t=top, b=bottom),
        xaxis=dict(title=f"block id mod {columns}", showgrid=False, zeroline=False),
        yaxis=dict(title=f"block id // {columns}", autorange="reversed", showgrid=False, zeroline=False),
        sliders=[
            dict(
                active=0,
                currentvalue=dict(visible=False),  # the title names the step
                pad=dict(t=slider_pad, b=0),
                steps=[
                    dict(
                        method="animate",
                        label=str(r.index) if i % every == 0 else "",
                        value=str(r.index),
                        args=[[str(r.index)], dict(mode="immediate", frame=dict(duration=0, redraw=True))],
                    )
                    for i, r in enumerate(records)
                ],
            )
        ],
    )
    return fig


# ------------------------------------------------------------------------------------------------
# Batching timeline
# ------------------------------------------------------------------------------------------------

TIMELINE_COLORS = {"waiting": "#c7c7c7", "prefill": "#d62728", "decode": "#1f77b4", "preempted": "#ff7f0e"}


def batching_segments(step_records: list[StepRecord], outputs) -> list[dict]:
    """Gantt bars (request, kind, start_s, end_s, step), merging consecutive steps of the same kind."""
    if not outputs:
        return []
    origin = min(o.metrics.arrival_time for o in outputs)
    arrivals = {o.request_id: o.metrics.arrival_time for o in outputs}
    segments: list[dict] = []
    open_bar: dict[Hashable, dict] = {}
    last_seen: dict[Hashable, float] = {}
    preempted_at: dict[Hashable, float] = {}

    def add(rid, kind, start, end, step=None):
        bar = open_bar.get(rid)
        if bar is not None and bar["kind"] == kind and step is not None and bar["step"] == step - 1:
            bar["end_s"], bar["step"] = end - origin, step  # the same activity in the very next step
            return
        bar = dict(request=str(rid), kind=kind, start_s=start - origin, end_s=end - origin, step=step)
        segments.append(bar)
        open_bar[rid] = bar

    for r in step_records:
        for rid, _start, _n, is_decode in r.chunks:
            if rid not in arrivals:
                continue
            if rid not in last_seen:
                if r.start > arrivals[rid]:
                    add(rid, "waiting", arrivals[rid], r.start)
            elif rid in preempted_at:
                add(rid, "preempted", preempted_at.pop(rid), r.start)
            add(rid, "decode" if is_decode else "prefill", r.start, r.end, r.index)
            last_seen[rid] = r.end
        for rid in r.preempted:
            if rid in arrivals:
                preempted_at[rid] = r.end
    return segments


def batching_timeline(
    step_records: list[StepRecord], outputs, title: str = "Batching timeline", max_requests: int = 40
):
    """One row per request (the first ``max_requests`` by arrival): what it was doing over time."""
    import plotly.graph_objects as go

    outputs = sorted(outputs, key=lambda o: o.metrics.arrival_time)[:max_requests]
    segments = batching_segments(step_records, outputs)
    fig = go.Figure()
    for kind, color in TIMELINE_COLORS.items():
        rows = [s for s in segments if s["kind"] == kind]
        if rows:
            fig.add_trace(
                go.Bar(
                    y=[s["request"] for s in rows],
                    x=[s["end_s"] - s["start_s"] for s in rows],
                    base=[s["start_s"] for s in rows],
                    orientation="h",
                    name=kind,
                    marker=dict(color=color),
                    hovertemplate="%{y}: %{base:.2f} s + %{x:.2f} s<extra>" + kind + "</extra>",
                )
            )
    fig.update_layout(
        barmode="overlay",
        title=title,
        template="plotly_white",
        xaxis_title="seconds since the first arrival",
        yaxis=dict(autorange="reversed", title="request"),
        height=140 + 16 * len(outputs),
    )
    return fig


def compare_timelines(runs: dict[str, tuple[list[StepRecord], list]], max_requests: int = 24):
    """Batching timelines of several runs (policy name → (step records, outputs)), stacked, one x axis."""
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=len(runs), cols=1, shared_xaxes=True, subplot_titles=list(runs), vertical_spacing=0.06)
    for i, (_, (records, outputs)) in enumerate(runs.items(), start=1):
        single = batching_timeline(records, outputs, max_requests=max_requests)
        for trace in single.data:
            trace.showlegend = i == 1
            trace.legendgroup = trace.name
            fig.add_trace(trace, row=i, col=1)
        fig.update_yaxes(autorange="reversed", showticklabels=False, title="requests", row=i, col=1)
    height = 160 + len(runs) * (60 + 10 * max_requests)
    top = style.top_margin("", legend=True, extra=24)
    fig.update_layout(
        barmode="overlay",
        template="plotly_white",
        height=height,
        margin=dict(t=top),
        legend=dict(orientation="h", x=0, xanchor="left", y=1 + (top - 24) / height * 0.9, yanchor="bottom"),
    )
    fig.update_xaxes(title="seconds since the first arrival", row=len(runs), col=1)
    return fig


def latency_percentiles(reports: dict[str, RunReport]):
    """TTFT and TPOT p50 / p95 / p99 of several runs, grouped by percentile."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=2, subplot_titles=("TTFT (s)", "TPOT (ms)"))
    qs = ["p50", "p95", "p99"]
    for i, (name, report) in enumerate(reports.items()):
        color = PALETTE[i % len(PALETTE)]
        fig.add_trace(go.Bar(x=qs, y=[report.ttft[q] for q in qs], name=name, marker_color=color), row=1, col=1)
        fig.add_trace(
            go.Bar(x=qs, y=[1000 * report.tpot[q] for q in qs], name=name, marker_color=color, showlegend=False),
            row=1,
            col=2,
        )
    title = "Latency percentiles"
    fig.update_layout(
        barmode="group",
        template="plotly_white",
        title=style.title(title),
        height=380,
        margin=dict(t=style.top_margin(title, legend=True, extra=24)),
        legend=style.legend_under_title(title, 380),
    )
    return fig
