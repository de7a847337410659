"""Chapter 09's K/V-head check draws a wrong dealing: under its one-line message, a rank × head grid
of the failing layout, the spec's heads against the learner's (the grade records only the message)."""

from __future__ import annotations

import pytest
from catalogue.ch09 import heads_of_rank, heads_of_rank_extra_to_last, heads_of_rank_ignoring_groups

import minillm.course as course
from minillm.course import CheckFailed
from minillm.course.results import FAIL, _latest


def _failure(answer) -> CheckFailed:
    with pytest.raises(CheckFailed) as err:
        course.check_kv_heads(answer)
    assert _latest["check_kv_heads"].status == FAIL
    assert "\n" not in str(err.value), "the message must stay one line: the grid goes in the diagram"
    return err.value


def heads_of_rank_last_rank_short(num_heads, num_kv_heads, rank, tp_size):
    """Right, except that at TP=3 the last rank forgets its last query head."""
    q, kv = heads_of_rank(num_heads, num_kv_heads, rank, tp_size)
    if tp_size == 3 and rank == 2:
        q = range(q.start, q.stop - 1)
    return q, kv


def test_extra_groups_dealt_to_the_last_rank_are_drawn_against_the_spec():
    err = _failure(heads_of_rank_extra_to_last)
    assert "gives the 1 extra group to the first ranks: [2, 1]" in str(err)
    assert err.diagram.splitlines() == [
        "heads_of_rank(9, 3, rank, 2): ■ the rank holds the head, · it does not",
        "query heads 0..8",
        "  rank 0  spec: ■■■■■■···  yours: ■■■······  ✗",
        "  rank 1  spec: ······■■■  yours: ···■■■■■■  ✗",
        "K/V heads 0..2",
        "  rank 0  spec: ■■·  yours: ■··  ✗",
        "  rank 1  spec: ··■  yours: ·■■  ✗",
    ]


def test_query_heads_split_without_their_groups_are_drawn():
    err = _failure(heads_of_rank_ignoring_groups)
    assert "query head 3 reads K/V head 1, which rank 0 does not hold" in str(err)
    assert err.diagram.splitlines()[1:] == [
        "query heads 0..8",
        "  rank 0  spec: ■■■■■■···  yours: ■■■■·····  ✗",
        "  rank 1  spec: ······■■■  yours: ····■■■■·  ✗",
        "K/V heads 0..2",
        "  rank 0  spec: ■■·  yours: ■··  ✗",
        "  rank 1  spec: ··■  yours: ·■·  ✗",
    ]


def test_only_the_ranks_that_differ_are_marked():
    err = _failure(heads_of_rank_last_rank_short)
    assert "query head 8 is on no rank" in str(err)
    assert err.diagram.splitlines()[1:] == [
        "query heads 0..8",
        "  rank 0  spec: ■■■······  yours: ■■■······",
        "  rank 1  spec: ···■■■···  yours: ···■■■···",
        "  rank 2  spec: ······■■■  yours: ······■■·  ✗",
        "K/V heads 0..2",
        "  rank 0  spec: ■··  yours: ■··",
        "  rank 1  spec: ·■·  yours: ·■·",
        "  rank 2  spec: ··■  yours: ··■",
    ]


def test_in_a_notebook_the_grid_renders_under_the_one_red_line():
    err = _failure(heads_of_rank_extra_to_last)
    lines = err._render_traceback_()
    assert lines[0] == f"\x1b[31m❌ check_kv_heads: {err}\x1b[0m"
    assert lines[1:] == err.diagram.splitlines()
    assert _latest["check_kv_heads"].message == str(err)  # the grade records the message, not the grid
