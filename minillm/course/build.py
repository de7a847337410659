"""``minillm course build``: generate the student notebooks from the solved ones.

``solutions/NN_topic.ipynb`` is the source of truth. In every code cell, the lines between
``### BEGIN SOLUTION`` and ``### END SOLUTION`` are replaced by ``# YOUR CODE HERE`` and
``raise NotImplementedError()`` (indented like the markers), outputs and execution counts are
cleared, and cells are tagged:

- ``exercise``: a cell the learner completes (it had a solution region);
- ``check``: a cell that calls a ``check_...`` function from ``minillm.course``.

Saved widget state (``metadata.widgets``, megabytes of JavaScript for a plotly widget) is
dropped: a student notebook has no outputs for it to restore.

Exercises are written as functions, so a student notebook still runs top to bottom: defining
an unfinished function raises nothing, its check reports "not attempted", and the chapter goes
on with the package's reference implementation.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import nbformat

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
EXERCISE_TAG, CHECK_TAG = "exercise", "check"
_CHECK_CALL = re.compile(r"^\s*(?:\w+\s*=\s*)?check_\w+\(", re.MULTILINE)


def strip_solutions(source: str) -> tuple[str, bool]:
    """Replace each solution region by a stub; returns (new source, whether any was found)."""
    out: list[str] = []
    inside = False
    found = False
    for number, line in enumerate(source.splitlines(), start=1):
        stripped = line.strip()
        if stripped == BEGIN:
            if inside:
                raise ValueError(f"line {number}: nested {BEGIN!r}")
            inside = found = True
            indent = line[: len(line) - len(line.lstrip())]
            out += [f"{indent}# YOUR CODE HERE", f"{indent}raise NotImplementedError()"]
        elif stripped == END:
            if not inside:
                raise ValueError(f"line {number}: {END!r} without {BEGIN!r}")
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise ValueError(f"{BEGIN!r} is never closed")
    return "\n".join(out), found


def student_notebook(solution: nbformat.NotebookNode) -> nbformat.NotebookNode:
    nb = copy.deepcopy(solution)
    nb.metadata.pop("widgets", None)
    for index, cell in enumerate(nb.cells):
        tags = [t for t in cell.metadata.get("tags", []) if t not in (EXERCISE_TAG, CHECK_TAG)]
        if cell.cell_type == "code":
            try:
                cell.source, is_exercise = strip_solutions(cell.source)
            except ValueError as err:
                raise ValueError(f"cell {index}: {err}") from None
            if is_exercise:
                tags.append(EXERCISE_TAG)
            if _CHECK_CALL.search(cell.source):
                tags.append(CHECK_TAG)
            cell.outputs = []
            cell.execution_count = None
        cell.metadata.pop("execution", None)
        if tags:
            cell.metadata["tags"] = tags
        else:
            cell.metadata.pop("tags", None)
    return nb


def render(nb: nbformat.NotebookNode) -> str:
    return nbformat.writes(nb) + "\n"


def build(solutions: Path, notebooks: Path, check_only: bool = False) -> list[Path]:
    """Write (or, with ``check_only``, compare) every student notebook; returns those that differ."""
    notebooks.mkdir(parents=True, exist_ok=True)
    differing = []
    for src in sorted(solutions.glob("*.ipynb")):
        expected = render(student_notebook(nbformat.read(src, as_version=4)))
        dst = notebooks / src.name
        if not dst.is_file() or dst.read_text() != expected:
            differing.append(dst)
            if not check_only:
                dst.write_text(expected)
    return differing
