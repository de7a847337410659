"""The pipeline's schedule as a Gantt chart (chapter 09): which stage ran which micro-batch when.

The spans come from the ranks themselves (``llm.engine.runner.record_timings = True``, then
``runner.last_timings`` after a step): each rank's compute interval per micro-batch, in
``time.perf_counter`` seconds — one clock for every process on a machine, so the bars line up.
The chart is the schedule that really ran: GPipe's staircase, and the **bubble** — the idle
time of a stage before its first micro-batch arrives and after its last one leaves.
"""

from __future__ import annotations

import minillm.viz.style as style
from minillm.viz.serving import PALETTE

ROW_PX = 56  # height of one stage's row
MIN_HEIGHT = 240


def stage_spans(spans: list[dict]) -> dict[int, list[dict]]:
    """Each stage's spans in time order, from its lowest rank only: the tensor-parallel ranks of
    a stage run the same micro-batches in lock-step, and counting each of them would count the
    stage's busy time ``tp`` times."""
    first_rank: dict[int, int] = {}
    for s in spans:
        first_rank[s["stage"]] = min(first_rank.get(s["stage"], s["rank"]), s["rank"])
    out: dict[int, list[dict]] = {}
    for s in sorted(spans, key=lambda s: s["start"]):
        if s["rank"] == first_rank[s["stage"]]:
            out.setdefault(s["stage"], []).append(s)
    return dict(sorted(out.items()))


def bubble_fraction(spans: list[dict]) -> float:
    """The share of stage-time spent idle: ``1 - busy / (stages × (last end - first start))``,
    busy summed over every stage's spans — what more micro-batches (or fewer stages) shrink."""
    stages = stage_spans(spans)
    if not stages:
        raise ValueError("no spans: set runner.record_timings = True and run a step first")
    kept = [s for ss in stages.values() for s in ss]
    makespan = max(s["end"] for s in kept) - min(s["start"] for s in kept)
    if makespan <= 0:
        return 0.0
    busy = sum(s["end"] - s["start"] for s in kept)
    return 1 - busy / (len(stages) * makespan)


def pipeline_gantt(spans: list[dict], title: str = "Pipeline schedule"):
    """One row per stage (stage 0 on top), one bar per micro-batch coloured by its index; x in
    milliseconds from the earliest start; the bubble fraction in the title."""
    import plotly.graph_objects as go

    stages = stage_spans(spans)
    full_title = f"{title}: bubble {bubble_fraction(spans):.0%} of stage time idle"
    kept = [s for ss in stages.values() for s in ss]
    origin = min(s["start"] for s in kept)
    rows = [f"stage {k}" for k in stages]
    fig = go.Figure()
    for mb in sorted({s["microbatch"] for s in kept}):
        bars = [s for s in kept if s["microbatch"] == mb]
        fig.add_trace(
            go.Bar(
                y=[f"stage {s['stage']}" for s in bars],
                x=[1000 * (s["end"] - s["start"]) for s in bars],
                base=[1000 * (s["start"] - origin) for s in bars],
                customdata=[1000 * s.get("comm_s", 0.0) for s in bars],
                orientation="h",
                name=f"mb {mb}",
                text=[f"mb {mb}"] * len(bars),
                textposition="inside",
                insidetextanchor="middle",
                marker=dict(color=PALETTE[mb % len(PALETTE)], line=dict(color="white", width=1)),
                hovertemplate="%{y}: %{base:.2f} ms + %{x:.2f} ms (collectives %{customdata:.2f} ms)"
                f"<extra>mb {mb}</extra>",
            )
        )
    margin = dict(l=round(16 + style.text_width(max(rows, key=len))), r=24, b=style.X_AXIS)
    margin["t"] = style.top_margin(full_title, legend=True)
    height = max(MIN_HEIGHT, margin["t"] + margin["b"] + ROW_PX * len(rows))
    fig.update_layout(
        barmode="overlay",
        title=style.title(full_title),
        legend=style.legend_under_title(full_title, height),
        xaxis=dict(title="time since the step's first micro-batch began (ms)", rangemode="tozero"),
        yaxis=dict(categoryorder="array", categoryarray=rows, autorange="reversed"),
        template="plotly_white",
        height=height,
        margin=margin,
    )
    return fig
