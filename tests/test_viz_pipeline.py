"""Chapter 09's pipeline Gantt chart and its bubble, on hand-made spans (no processes needed)."""

from __future__ import annotations

import pytest
from test_viz import layout_problems

from minillm.viz.pipeline import bubble_fraction, pipeline_gantt, stage_spans

T0 = 1234.5  # perf_counter seconds: an arbitrary origin


def _span(rank, stage, mb, start, end, comm_s=0.0):
    return {"rank": rank, "stage": stage, "microbatch": mb, "start": T0 + start, "end": T0 + end, "comm_s": comm_s}


# GPipe, 2 stages × 2 micro-batches of 1 s each: stage 1 waits for mb 0, stage 0 idles after mb 1.
GPIPE = [_span(0, 0, 0, 0, 1), _span(0, 0, 1, 1, 2), _span(1, 1, 0, 1, 2, 0.25), _span(1, 1, 1, 2, 3, 0.25)]


def test_bubble_of_a_hand_made_schedule():
    assert bubble_fraction(GPIPE) == pytest.approx(1 - 4 / (2 * 3))  # busy 4 s of 2 stages × 3 s
    assert bubble_fraction(GPIPE[:2]) == pytest.approx(0)  # one stage, back to back: no bubble
    # (p - 1) / (m + p - 1) for p stages and m equal micro-batches: 8 micro-batches on 2 stages
    many = [_span(s, s, m, m + s, m + s + 1) for s in range(2) for m in range(8)]
    assert bubble_fraction(many) == pytest.approx(1 / 9)
    with pytest.raises(ValueError, match="record_timings"):
        bubble_fraction([])


def test_tensor_parallel_ranks_of_a_stage_count_once():
    twins = GPIPE + [dict(s, rank=s["rank"] + 2) for s in GPIPE]  # TP = 2: ranks 0, 2 in stage 0
    assert bubble_fraction(twins) == pytest.approx(bubble_fraction(GPIPE))
    assert {k: [s["rank"] for s in v] for k, v in stage_spans(twins).items()} == {0: [0, 0], 1: [1, 1]}


def test_gantt_has_a_row_per_stage_and_a_bar_per_span():
    fig = pipeline_gantt(list(reversed(GPIPE)))
    assert sum(len(trace.x) for trace in fig.data) == len(GPIPE)
    assert [trace.name for trace in fig.data] == ["mb 0", "mb 1"]
    assert list(fig.layout.yaxis.categoryarray) == ["stage 0", "stage 1"]
    mb0 = fig.data[0]
    assert list(mb0.y) == ["stage 0", "stage 1"]
    assert list(mb0.base) == pytest.approx([0, 1000]) and list(mb0.x) == pytest.approx([1000, 1000])
    assert list(mb0.customdata) == pytest.approx([0, 250])  # collective time in the hover
    assert fig.data[0].marker.color != fig.data[1].marker.color
    assert "bubble 33%" in fig.layout.title.text
    assert not layout_problems(fig)
