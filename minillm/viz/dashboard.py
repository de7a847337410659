"""A live dashboard of a running server, read from its Prometheus ``/metrics`` (chapter 10).

It polls the endpoint a monitoring system would scrape and draws what an operator watches:
output tokens/s, p99 TTFT and TPOT, requests running and waiting, and KV blocks in use.
Throughput is the change of a counter between two polls; the latency percentiles come from
the histograms the way Prometheus's ``histogram_quantile`` computes them — by linear
interpolation inside the bucket the rank falls in — over the requests finished since the
previous poll, so the chart follows the load rather than the whole history.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families


@dataclass
class Snapshot:
    """One scrape: counters, gauges and histogram buckets of one model."""

    time: float
    counters: dict[str, float] = field(default_factory=dict)
    gauges: dict[str, float] = field(default_factory=dict)
    buckets: dict[str, list[tuple[float, float]]] = field(default_factory=dict)  # name → [(le, cumulative count)]


def parse_metrics(text: str, model: str) -> Snapshot:
    """The samples of ``model`` in a Prometheus text exposition."""
    snap = Snapshot(time.perf_counter())
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.labels.get("model", model) != model:
                continue
            if family.type == "histogram" and s.name.endswith("_bucket"):
                snap.buckets.setdefault(family.name, []).append((float(s.labels["le"]), s.value))
            elif family.type == "counter" and s.name.endswith("_total"):
                snap.counters[family.name] = snap.counters.get(family.name, 0.0) + s.value
            elif family.type == "gauge":
                snap.gauges[family.name] = s.value
    for b in snap.buckets.values():
        b.sort()
    return snap


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """Prometheus's estimate of the ``q`` quantile from cumulative buckets ``[(le, count)]``."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if le == float("inf"):
                return lower_bound  # the rank is past the last finite bound: report that bound
            width = count - lower_count
            return lower_bound + (le - lower_bound) * ((rank - lower_count) / width if width else 1.0)
        lower_bound, lower_count = le, count
    return lower_bound


def _window(now: list[tuple[float, float]], before: list[tuple[float, float]] | None) -> list[tuple[float, float]]:
    """Buckets of the observations made between two scrapes."""
    if not before:
        return now
    old = dict(before)
    return [(le, count - old.get(le, 0.0)) for le, count in now]


class ServerDashboard:
    """Polls ``url``/metrics for ``model`` and keeps a time series; ``widget`` draws it live."""

    def __init__(self, url: str, model: str):
        self.url, self.model = url.rstrip("/"), model
        self.snapshots: list[Snapshot] = []
        self.series: dict[str, list[float | None]] = {k: [] for k in (
            "t", "tok_s", "ttft_p99", "tpot_p99", "running", "waiting", "kv_used", "kv_total")}  # fmt: skip
        self.widget = None
        self.shown = self.handle = None  # what ``display`` showed, and its display handle

    def poll(self) -> dict[str, float | None]:
        text = httpx.get(self.url + "/metrics", timeout=10).text
        return self.add(parse_metrics(text, self.model))

    def add(self, snap: Snapshot) -> dict[str, float | None]:
        prev = self.snapshots[-1] if self.snapshots else None
        self.snapshots.append(snap)
        start = self.snapshots[0].time
        row = {"t": snap.time - start}
        tokens = snap.counters.get("minillm_generation_tokens", 0.0)
        if prev is None or snap.time <= prev.time:
            row["tok_s"] = 0.0
        else:
            row["tok_s"] = (tokens - prev.counters.get("minillm_generation_tokens", 0.0)) / (snap.time - prev.time)
        for key, name in (("ttft_p99", "minillm_time_to_first_token_seconds"),
                          ("tpot_p99", "minillm_time_per_output_token_seconds")):  # fmt: skip
            window = _window(snap.buckets.get(name, []), prev.buckets.get(name) if prev else None)
            row[key] = histogram_quantile(0.99, window)
        row["running"] = snap.gauges.get("minillm_num_requests_running", 0.0)
        row["waiting"] = snap.gauges.get("minillm_num_requests_waiting", 0.0)
        row["kv_used"] = snap.gauges.get("minillm_kv_blocks_used", 0.0)
        row["kv_total"] = snap.gauges.get("minillm_kv_blocks_total", 0.0)
        for k, v in row.items():
            self.series[k].append(v)
        self._redraw()
        return row

    def figure(self):
        """A plotly figure of the series (a ``FigureWidget`` when ipywidgets is available)."""
        import plotly.graph_objects as go
        from plotly.subplots import make_subplots

        import minillm.viz.style as style

        fig = make_subplots(
            rows=2, cols=2, shared_xaxes=True, vertical_spacing=0.12,
            subplot_titles=("output tokens/s", "p99 latency since the last poll (s)", "requests", "KV blocks"),
        )  # fmt: skip
        t = self.series["t"]
        traces = [
            (1, 1, "tok/s", "tok_s"), (1, 2, "p99 TTFT", "ttft_p99"), (1, 2, "p99 TPOT", "tpot_p99"),
            (2, 1, "running", "running"), (2, 1, "waiting", "waiting"), (2, 2, "used", "kv_used"),
            (2, 2, "total", "kv_total"),
        ]  # fmt: skip
        for row, col, name, key in traces:
            fig.add_trace(go.Scatter(x=t, y=self.series[key], name=name, mode="lines+markers"), row=row, col=col)
        title = f"{self.model} at {self.url}"
        fig.update_layout(
            template="plotly_white",
            height=480,
            title=style.title(title),
            margin=dict(t=style.top_margin(title, extra=style.SUBPLOT_TITLE), b=style.X_AXIS + style.LEGEND_ROW, l=50,
                        r=10),  # fmt: skip
            legend=style.legend_at_bottom(480),
        )
        fig.update_xaxes(title_text="seconds", row=2)
        try:
            from minillm.viz.display import figure_widget

            return figure_widget(fig)
        except Exception:  # noqa: BLE001 (no ipywidgets: a static figure)
            return fig

    def _redraw(self) -> None:
        if self.widget is None or not hasattr(self.widget, "batch_update"):
            return
        keys = ["tok_s", "ttft_p99", "tpot_p99", "running", "waiting", "kv_used", "kv_total"]
        with self.widget.batch_update():
            for trace, key in zip(self.widget.data, keys):
                trace.x, trace.y = self.series["t"], self.series[key]

    def show(self):
        """The live figure, in a box that a saved notebook shows as a static copy of the chart
        as it was when the cell ran (``viz/display.py``), not as the widget's raw listing."""
        from minillm.viz.display import FigureBox

        self.widget = self.figure()
        if not hasattr(self.widget, "batch_update"):  # no ipywidgets: the plain figure
            return self.widget
        return FigureBox([self.widget], figure=self.widget, description=f"live dashboard of {self.url}")

    def display(self) -> None:
        """Show the dashboard in the notebook; when ``watch`` ends, the output is refreshed so
        that the saved notebook's static copy is the chart the load left, not an empty one."""
        from IPython.display import display

        self.shown = self.show()
        self.handle = display(self.shown, display_id=True)

    async def watch(self, stop: asyncio.Event, interval: float = 0.5) -> None:
        """Poll every ``interval`` seconds until ``stop`` is set (run it as an asyncio task)."""
        while not stop.is_set():
            await asyncio.to_thread(self.poll)
            try:
                await asyncio.wait_for(stop.wait(), interval)
            except asyncio.TimeoutError:
                pass
        await asyncio.to_thread(self.poll)
        if self.handle is not None:
            self.handle.update(self.shown)  # the saved notebook's static copy: the chart as the load left it
