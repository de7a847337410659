"""Chapter 10's widgets: the /metrics dashboard and the one-change-at-a-time tuning log."""

from __future__ import annotations

import httpx
import pytest

from minillm.engine.virtual_clock import StepCost
from minillm.metrics import SLO
from minillm.tools.workloads import poisson_workload
from minillm.viz.dashboard import ServerDashboard, histogram_quantile, parse_metrics
from minillm.viz.tuning import TuningLog

MODEL = "tiny-shakespeare-8m"


def test_histogram_quantile_interpolates_inside_the_bucket_like_prometheus():
    buckets = [(0.1, 10), (0.5, 50), (1.0, 100), (float("inf"), 100)]
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.5)
    assert histogram_quantile(0.99, buckets) == pytest.approx(0.99)
    assert histogram_quantile(0.05, buckets) == pytest.approx(0.05)
    assert histogram_quantile(0.99, [(0.1, 0), (float("inf"), 0)]) is None
    assert histogram_quantile(0.99, [(0.1, 1), (float("inf"), 10)]) == 0.1  # past the last finite bound


def test_the_dashboard_follows_a_live_server():
    from minillm.server import ServerThread, build_app, build_engines

    engines = build_engines([MODEL], dtype="fp32", kv_cache_memory=4_000_000)
    with ServerThread(build_app(engines)) as server:
        dash = ServerDashboard(server.url, MODEL)
        first = dash.poll()
        assert first["kv_total"] == engines[MODEL].engine.block_manager.num_blocks and first["running"] == 0
        body = {"model": MODEL, "prompt": "KING.", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        assert httpx.post(server.url + "/v1/completions", json=body, timeout=60).status_code == 200
        second = dash.poll()
        assert second["tok_s"] > 0 and second["ttft_p99"] is not None and second["ttft_p99"] > 0
        third = dash.poll()  # nothing finished since: no latency in this window, no throughput
        assert third["tok_s"] == 0 and third["ttft_p99"] is None
        snap = parse_metrics(httpx.get(server.url + "/metrics").text, MODEL)
        assert snap.counters["minillm_generation_tokens"] == 12
        fig = dash.figure()
        assert len(fig.data) == 7


def test_the_tuning_log_keeps_what_wins_and_reverts_the_rest():
    load = poisson_workload(16, rate=20.0, prompt_lengths=(8, 32), output_lengths=(8, 16), vocab_size=400, seed=3)
    log = TuningLog(MODEL, dict(dtype="fp32", max_num_seqs=1, kv_cache_memory=4_000_000), load,
                    StepCost(0.005, 0.0001), SLO(ttft=0.3, tpot=0.05))  # fmt: skip
    base = log.measure("baseline")
    assert base.kept is None and base.breakdown["steps"] > 0 and base.breakdown["mean_waiting"] > 1
    more = log.measure("seats", {"max_num_seqs": 8})
    assert more.kept and log.current["max_num_seqs"] == 8
    static = log.measure("static", {"scheduling_policy": "static"})
    assert static.kept is False and "scheduling_policy" not in log.current
    again = log.measure("same again")  # an unchanged rerun on the virtual clock: identical, so no gain
    assert again.summary == more.summary and again.kept is False
    assert "KEEP" in log.table() and "revert" in log.table()
