"""Per-request latency timelines from real ``RequestOutput.metrics``.

Each request is a row: a grey bar while it waits, a wide bar for the prefill (scheduled →
first token: that is most of TTFT), then one thin bar per decode step (the gap between two
tokens: TPOT is their mean). Times are milliseconds from the first arrival.
"""

from __future__ import annotations


def timeline_segments(outputs) -> list[dict]:
    """The bars of the chart as plain dicts (request, kind, start_ms, duration_ms) — testable."""
    if not outputs:
        return []
    origin = min(o.metrics.arrival_time for o in outputs)
    segments = []
    for o in outputs:
        m = o.metrics
        row = f"request {o.request_id}"
        scheduled = m.first_scheduled_time if m.first_scheduled_time is not None else m.arrival_time
        if scheduled > m.arrival_time:
            segments.append(
                dict(
                    request=row,
                    kind="waiting",
                    start_ms=1000 * (m.arrival_time - origin),
                    duration_ms=1000 * (scheduled - m.arrival_time),
                )
            )
        if not m.token_times:
            continue
        segments.append(
            dict(
                request=row,
                kind="prefill",
                start_ms=1000 * (scheduled - origin),
                duration_ms=1000 * (m.token_times[0] - scheduled),
            )
        )
        for a, b in zip(m.token_times, m.token_times[1:]):
            segments.append(
                dict(request=row, kind="decode step", start_ms=1000 * (a - origin), duration_ms=1000 * (b - a))
            )
    return segments


COLORS = {"waiting": "#c7c7c7", "prefill": "#d62728", "decode step": "#1f77b4"}


def latency_timeline(outputs, title: str = "Per-request timeline"):
    import plotly.graph_objects as go

    segments = timeline_segments(outputs)
    fig = go.Figure()
    for kind, color in COLORS.items():
        rows = [s for s in segments if s["kind"] == kind]
        if not rows:
            continue
        fig.add_trace(
            go.Bar(
                y=[s["request"] for s in rows],
                x=[s["duration_ms"] for s in rows],
                base=[s["start_ms"] for s in rows],
                orientation="h",
                name=kind,
                marker=dict(color=color, line=dict(color="white", width=0.5)),
                hovertemplate="%{y}: %{base:.1f} → %{x:.1f} ms<extra>" + kind + "</extra>",
            )
        )
    for o in outputs:
        m = o.metrics
        if m.ttft is not None:
            tpot = f", TPOT {1000 * m.tpot:.1f} ms" if m.tpot else ""
            fig.add_annotation(
                y=f"request {o.request_id}",
                x=1000 * (m.token_times[-1] - min(p.metrics.arrival_time for p in outputs)),
                text=f"TTFT {1000 * m.ttft:.0f} ms{tpot}",
                showarrow=False,
                xanchor="left",
            )
    fig.update_layout(
        barmode="overlay",
        title=title,
        xaxis_title="time since first arrival (ms)",
        template="plotly_white",
        height=120 + 40 * len(outputs),
    )
    return fig
