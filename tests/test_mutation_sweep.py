"""Each course check kills at least 90% of the non-equivalent mutants of its reference solution
(``mutation_sweep.py`` makes them: operators, comparisons, constants, indices ±1, dropped
statements). A survivor that is a real bug makes this fail, naming the mutant: teach the check to
catch it, or — if it computes the same thing on every input the exercise allows — list it in
``mutation_sweep.EQUIVALENT`` with the reason."""

from __future__ import annotations

import pytest
from mutation_sweep import EQUIVALENT, KILL_TARGET, mutants, report, sweep

from minillm.course import EXERCISES
from minillm.course.exercises import BY_CHECK


def _triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


SWEPT = [e for e in EXERCISES if e.check != "check_flash_kernel" or _triton()]


@pytest.mark.parametrize("exercise", SWEPT, ids=lambda e: e.check)
def test_the_check_kills_the_mutants_of_its_solution(exercise):
    result = sweep(exercise)
    print(report([result]))
    survivors = "\n".join(f"  {o.mutant.key}" for o in result.survivors())
    assert result.rate >= KILL_TARGET, f"{exercise.check}: kill rate {result.rate:.0%}; survivors:\n{survivors}"
    crashed = [o for o in result.outcomes if o.verdict == "check crashed"]
    assert not crashed, f"{exercise.check} crashed on a mutant (a bug in the check): {crashed[0].message}"


def test_every_listed_equivalent_mutant_still_exists():
    """A listed equivalent whose solution line changed would silently excuse nothing: refuse it."""
    for check, listed in EQUIVALENT.items():
        keys = {m.key for m in mutants(BY_CHECK[check])}
        stale = set(listed) - keys
        assert not stale, f"{check}: listed as equivalent but no longer generated: {sorted(stale)}"


def test_the_mutants_are_the_small_bugs_they_claim():
    exercise = BY_CHECK["check_block_table"]
    found = {m.key: m.source for m in mutants(exercise)}
    key = "line 1: index `[p // block_size]` + 1 in `return [block_table[p // block_size] * block_size + p % b...`"
    assert key in found and "block_table[p // block_size + 1]" in found[key]
    assert any("`%` → `//`" in k for k in found)
    # only the solution's lines are mutated: the signature and the markers stay as they are
    assert all("def slot_mapping(block_table: list[int], start: int" in s for s in found.values())
