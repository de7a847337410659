"""Spec-against-yours diagrams of chapters 07 and 08's checks: a wrong answer's ``CheckFailed``
carries a diagram of the spec against the learner's answer (shown under the one red line in a
notebook), and the message itself stays one line."""

from __future__ import annotations

import re

import pytest
import torch
from catalogue.ch07 import unpack_int4
from catalogue.ch08 import _rollback_variant, _sampled_variant

import minillm.course as course
from minillm.course import CheckFailed
from minillm.course.checks.ch08_acceptance import P


def _failure(check: str, *answer) -> CheckFailed:
    with pytest.raises(CheckFailed) as err:
        getattr(course, check)(*answer)
    failure = err.value
    assert "\n" not in str(failure), "the message must stay one line"
    assert failure.diagram, "the failure carries no diagram"
    lines = failure._render_traceback_()
    assert "\n" not in lines[0] and str(failure) in lines[0]
    assert lines[1:] == failure.diagram.splitlines(), "the diagram renders under the red line"
    return failure


def test_pack_int4_draws_the_first_wrong_byte_in_nibbles():
    def high_nibble_first(q):
        return ((q[:, 0::2] << 4) | q[:, 1::2]).to(torch.uint8)

    failure = _failure("check_pack_int4", high_nibble_first, unpack_int4)
    assert "puts the even column in the high nibble" in str(failure)
    values, spec, yours = failure.diagram.splitlines()
    assert values.startswith("values (q[0, 0], q[0, 1]) = (1, 2)") and "byte = high nibble | low nibble" in values
    assert spec.startswith("spec:  0010 | 0001  = 0x21")
    assert yours == "yours: 0001 | 0010  = 0x12"


def test_rollback_draws_the_table_before_and_both_tables_after():
    failure = _failure("check_rollback", lambda *a: _rollback_variant(*a, released="filter"))
    assert "placeholders must stay in the table, in place" in str(failure)
    header, before, spec, yours, legend = failure.diagram.splitlines()
    assert header.split() == ["tokens", "0-3", "4-7", "8-11", "12-15", "16-19"]
    assert before == "     before: [    -1 |    -1 |     4 |    11 |    12 ]"
    assert spec.startswith(" spec after: [    -1 |    -1 |     4 |    11 ]") and spec.endswith("freed [12]")
    assert yours.startswith("yours after: [     4 |    11 |    12 ]") and yours.endswith("freed []")
    # entry j of every row sits under the tokens it holds
    spans = [m.end() for m in re.finditer(r"\d+-\d+", header)]
    for row in (before, spec, yours):
        cells = [m.end() for m in re.finditer(r"-?\d+(?= [|\]])", row)]
        assert cells == spans[: len(cells)], row
    assert "keep the first ceil(13 / 4) = 4 entries" in legend and "RELEASED" in legend


def test_rollback_dropping_placeholders_from_kept_is_named():
    failure = _failure("check_rollback", lambda *a: _rollback_variant(*a, released="drop"))
    assert "placeholders must stay in the table, in place" in str(failure)
    assert "yours after: [     4 |    11 ]" in failure.diagram


def _bars(diagram: str) -> tuple[str, dict[int, tuple[float, float]]]:
    head, *rows = diagram.splitlines()
    values = {}
    for row in rows:
        tok, rest = row.split("  target ")
        target, yours = rest.split("  yours ")
        values[int(tok.split()[1])] = (float(target.split()[-1]), float(yours.split()[1]))
    return head, values


def test_accept_sampled_draws_the_position_where_the_histogram_is_furthest_off():
    failure = _failure("check_accept_sampled", lambda *a: _sampled_variant(*a, one_u=True))
    assert "one draw per position" in str(failure)
    head, values = _bars(failure.diagram)
    assert head.startswith("position 1 (reached when proposal 0 was kept)") and "target_probs[1]" in head
    assert sorted(values) == [0, 1, 2, 3, 4]
    assert [t for t, _ in values.values()] == [round(float(x), 2) for x in P[1]]
    assert abs(sum(y for _, y in values.values()) - 1) < 0.02
    assert "████" in failure.diagram and failure.diagram.count("◀") == 1


def test_accept_sampled_diagram_of_a_first_position_mistake():
    failure = _failure("check_accept_sampled", lambda *a: _sampled_variant(*a, replace="p"))
    head, values = _bars(failure.diagram)
    assert head.startswith("position 0 (the first proposal)")
    assert [t for t, _ in values.values()] == [round(float(x), 2) for x in P[0]]
