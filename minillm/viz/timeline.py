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


ROW_PX = 48  # height of one request's row
MIN_HEIGHT = 260
ANNOTATION_SIZE = 11


def latency_timeline(outputs, title: str = "Per-request timeline"):
    """One row per request (first request on top); TTFT and TPOT written after each row's last bar."""
    import plotly.graph_objects as go

    import minillm.viz.style as style

    segments = timeline_segments(outputs)
    rows = [f"request {o.request_id}" for o in outputs]
    fig = go.Figure()
    for kind, color in COLORS.items():
        bars = [s for s in segments if s["kind"] == kind]
        if not bars:
            continue
        fig.add_trace(
            go.Bar(
                y=[s["request"] for s in bars],
                x=[s["duration_ms"] for s in bars],
                base=[s["start_ms"] for s in bars],
                orientation="h",
                name=kind,
                marker=dict(color=color, line=dict(color="white", width=0.5)),
                hovertemplate="%{y}: %{base:.1f} → %{x:.1f} ms<extra>" + kind + "</extra>",
            )
        )
    margin = dict(l=round(16 + style.text_width(max(rows, key=len, default=""))), r=24, b=style.X_AXIS)
    margin["t"] = style.top_margin(title, legend=True)
    height = max(MIN_HEIGHT, margin["t"] + margin["b"] + ROW_PX * len(outputs))
    # Leave room right of the last bar for its label: an x range long enough at the narrowest
    # plot the notebook column gives (its width minus the margins).
    plot_px = style.NOTEBOOK_WIDTH - margin["l"] - margin["r"]
    origin = min((o.metrics.arrival_time for o in outputs), default=0.0)
    x_max = max((s["start_ms"] + s["duration_ms"] for s in segments), default=1.0) or 1.0
    for o in outputs:
        m = o.metrics
        if m.ttft is None:
            continue
        tpot = f", TPOT {1000 * m.tpot:.1f} ms" if m.tpot else ""
        text = f"TTFT {1000 * m.ttft:.0f} ms{tpot}"
        end = 1000 * (m.token_times[-1] - origin)
        label_px = 6 + style.text_width(text, ANNOTATION_SIZE)
        x_max = max(x_max, end / max(0.2, 1 - label_px / plot_px))
        fig.add_annotation(
            y=f"request {o.request_id}",
            x=end,
            text=text,
            showarrow=False,
            xanchor="left",
            xshift=4,
            font=dict(size=ANNOTATION_SIZE),
        )
    fig.update_layout(
        barmode="overlay",
        title=style.title(title),
        legend=style.legend_under_title(title, height),
        xaxis=dict(title="time since first arrival (ms)", range=[0, x_max]),
        yaxis=dict(categoryorder="array", categoryarray=rows, autorange="reversed"),
        template="plotly_white",
        height=height,
        margin=margin,
    )
    return fig
