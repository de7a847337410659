"""Where a step's time goes: the engine's own work beside the model's, per batch size.

Built from ``StepPhases`` (the engine's counters in every step record, ``metrics.median_phases``),
so the bars are what the engine measured on this machine, not a model of it.
"""

from __future__ import annotations

from minillm.metrics import PHASE_NAMES, StepPhases
from minillm.viz import style

PHASE_COLORS = {
    "schedule": "#1f77b4",
    "inputs": "#ff7f0e",
    "model": "#7f7f7f",  # grey: the model's work; every colour is the engine's own
    "sample": "#2ca02c",
    "output": "#d62728",
}


def step_phases_figure(rows: dict[str, StepPhases], title: str = "Where a decode step's time goes"):
    """One horizontal bar per row label (e.g. "64 sequences"), cut into the five phases, in
    microseconds per step."""
    import plotly.graph_objects as go

    labels = list(rows)
    fig = go.Figure()
    for name in PHASE_NAMES:
        fig.add_trace(
            go.Bar(
                y=labels,
                x=[1e6 * getattr(rows[label], name) for label in labels],
                name=name,
                orientation="h",
                marker_color=PHASE_COLORS[name],
                hovertemplate="%{y}: " + name + " %{x:.0f} µs<extra></extra>",
            )
        )
    height = 110 + 44 * max(1, len(labels))
    fig.update_layout(
        barmode="stack",
        template="plotly_white",
        title=style.title(title),
        height=height,
        xaxis_title="µs per step",
        yaxis=dict(autorange="reversed"),
        # room on the left for the longest label (plotly would not grow the margin for it)
        margin=dict(t=style.top_margin(title, legend=True), b=style.X_AXIS, l=int(max(map(style.text_width, labels)) + 30)),
        legend=style.legend_under_title(title, height),
    )
    return fig
