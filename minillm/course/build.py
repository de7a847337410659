"""``minillm course build``: generate the student notebooks from the solved ones.

``solutions/NN_topic.ipynb`` is the source of truth. A student notebook is exactly what
``nbgrader generate_assignment`` makes of the solved chapter, so the same file serves a learner
on their own and a class graded with nbgrader:

1. **source** (``source_notebook``; written for nbgrader by ``minillm course nbgrader-source``):
   the solved chapter with ``metadata.minillm.chapter`` and nbgrader cell metadata (schema 3).
   An *exercise* cell (one with a ``### BEGIN SOLUTION`` … ``### END SOLUTION`` region) is an
   nbgrader solution cell; the *check* cell of each exercise in ``EXERCISES`` (the cell whose
   code is exactly the exercise's check call) is a locked, graded test cell worth the
   exercise's points, with ``grade_id`` the check's name. Each graded check cell ends in a
   hidden-test region that calls ``require_pass``: a check that is not attempted does not
   raise (a student notebook runs top to bottom), and nbgrader gives full points to a test
   cell that does not raise.
2. **release** (``release_notebook``; what ``minillm course build`` writes to ``notebooks/``):
   nbgrader's default ``generate_assignment`` steps — solution and graded cells made
   undeletable (graded ones also uneditable), each solution region replaced by
   ``# YOUR CODE HERE`` + ``raise NotImplementedError()`` (indented like the markers), outputs
   and execution counts cleared, hidden-test regions removed, and checksums computed with
   nbgrader's algorithm (``nbgrader_checksum``).

Cells are also tagged ``exercise`` and ``check`` (any cell that calls a ``check_...``
function), and ``raises-exception`` when they run an exercise's function outside its check. Saved widget state (``metadata.widgets``) and execution timings are dropped.

Exercises are written as functions, so a student notebook still runs top to bottom: defining
an unfinished function raises nothing, its check reports "not attempted", and the chapter goes
on with the package's reference implementation.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
import warnings
from pathlib import Path

import nbformat

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
BEGIN_HIDDEN, END_HIDDEN = "### BEGIN HIDDEN TESTS", "### END HIDDEN TESTS"
# nbgrader's own delimiters: a line that contains one of these opens or closes a region.
_BEGIN, _END = "BEGIN SOLUTION", "END SOLUTION"
_BEGIN_HIDDEN, _END_HIDDEN = "BEGIN HIDDEN TESTS", "END HIDDEN TESTS"
STUB = ("# YOUR CODE HERE", "raise NotImplementedError()")
EXERCISE_TAG, CHECK_TAG = "exercise", "check"
#: A cell that runs the learner's functions outside their check (a test-sized example): before
#: the exercise is written it raises the stub's NotImplementedError, and this tag lets JupyterLab's
#: "Run All", nbclient and nbval go on past it, so the chapter still runs top to bottom.
RUNS_LEARNER_CODE = "raises-exception"
NBGRADER_SCHEMA = 3
_CHECK_CALL = re.compile(r"^\s*(?:\w+\s*=\s*)?check_\w+\(", re.MULTILINE)
_DEF = re.compile(r"^\s*(?:async\s+)?def\s+(\w+)", re.MULTILINE)


class ExerciseWarning(UserWarning):
    """A chapter's notebook and ``EXERCISES`` disagree; the notebook is built all the same."""


def _strip_regions(source: str, begin: str, end: str, stub: tuple[str, ...]) -> tuple[str, bool]:
    """Replace each region from a line containing ``begin`` to one containing ``end`` by
    ``stub`` (indented like the opening line), line by line as nbgrader does."""
    out: list[str] = []
    inside = found = False
    for number, line in enumerate(source.split("\n"), start=1):
        if begin in line:
            if inside:
                raise ValueError(f"line {number}: nested {begin!r}")
            inside = found = True
            indent = re.match(r"\s*", line).group(0)
            out += [indent + s for s in stub]
        elif end in line:
            if not inside:
                raise ValueError(f"line {number}: {end!r} without {begin!r}")
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise ValueError(f"{begin!r} is never closed")
    return "\n".join(out), found


def strip_solutions(source: str) -> tuple[str, bool]:
    """Replace each solution region by the stub; returns (new source, whether any was found)."""
    return _strip_regions(source, _BEGIN, _END, STUB)


def strip_hidden_tests(source: str) -> tuple[str, bool]:
    """Remove each hidden-test region; returns (new source, whether any was found)."""
    return _strip_regions(source, _BEGIN_HIDDEN, _END_HIDDEN, ())


def hidden_test(check: str) -> str:
    """The hidden-test region a graded check cell ends with in an nbgrader source notebook."""
    return (
        f"{BEGIN_HIDDEN}\n"
        "from minillm.course import require_pass\n\n"
        f"require_pass({check!r})  # no points unless the check above passed (not attempted does not raise)\n"
        f"{END_HIDDEN}"
    )


def nbgrader_checksum(cell: nbformat.NotebookNode) -> str:
    """nbgrader's checksum of a cell (``nbgrader.utils.compute_checksum``), without nbgrader."""
    meta = cell.metadata["nbgrader"]
    grade, solution = meta.get("grade", False), meta.get("solution", False)
    locked = False if solution else True if grade else meta.get("locked", False)
    h = hashlib.md5()
    for part in (cell.source, cell.cell_type, str(grade), str(solution), str(locked), meta["grade_id"]):
        h.update(part.encode("utf-8"))
    if grade:
        h.update(str(float(meta["points"])).encode("utf-8"))
    return h.hexdigest()


def _nbgrader_meta(grade_id: str, *, solution: bool = False, points: int | None = None) -> dict:
    meta = {"schema_version": NBGRADER_SCHEMA, "grade": points is not None, "solution": solution}
    meta["locked"] = points is not None  # a graded test cell is locked; a solution cell is not
    meta["grade_id"] = grade_id
    if points is not None:
        meta["points"] = points
    return meta


def source_notebook(
    solution: nbformat.NotebookNode, chapter: str | None = None, strict: bool = True
) -> nbformat.NotebookNode:
    """The solved chapter with the course's metadata: nbgrader's *source* version.

    ``chapter`` (default: ``metadata.minillm.chapter``) names the chapter's exercises; without
    one, exercise cells are still solution cells but no cell is graded. An exercise of the
    chapter without its check cell is an error, or with ``strict=False`` a warning (the
    notebook is built without that graded cell)."""
    from minillm.course.exercises import EXERCISES

    nb = copy.deepcopy(solution)
    nb.metadata.pop("widgets", None)
    chapter = chapter or nb.metadata.get("minillm", {}).get("chapter")
    if chapter:
        nb.metadata["minillm"] = {**nb.metadata.get("minillm", {}), "chapter": chapter}
    exercises = {e.call: e for e in EXERCISES if e.chapter == chapter}
    written = sorted({name for e in exercises.values() for name in e.functions})
    # A cell runs the learner's code when it calls an exercise function, or hands one to another
    # call (``try_on_ranks(tp_attention)``): both raise the stub's NotImplementedError.
    names = "|".join(written)
    learner_calls = re.compile(rf"\b({names})\s*\(|[(,]\s*({names})\s*[,)]") if written else None
    graded: dict[str, int] = {}
    ids: set[str] = set()
    for index, cell in enumerate(nb.cells):
        cell.metadata.pop("execution", None)
        cell.metadata.pop("nbgrader", None)  # the course's metadata is the only nbgrader metadata
        tags = [t for t in cell.metadata.get("tags", []) if t not in (EXERCISE_TAG, CHECK_TAG)]
        try:
            visible, has_hidden = strip_hidden_tests(cell.source)
            _, is_exercise = strip_solutions(visible)
        except ValueError as err:
            raise ValueError(f"cell {index}: {err}") from None
        if cell.cell_type != "code":
            if is_exercise or has_hidden:
                raise ValueError(f"cell {index}: a solution or hidden-test region in a {cell.cell_type} cell")
        else:
            if is_exercise:
                tags.append(EXERCISE_TAG)
                names = _DEF.findall(visible)
                grade_id = f"answer_{names[0]}" if names else f"answer_cell_{index}"
                while grade_id in ids:
                    grade_id += "_"
                ids.add(grade_id)
                cell.metadata["nbgrader"] = _nbgrader_meta(grade_id, solution=True)
            if _CHECK_CALL.search(visible):
                tags.append(CHECK_TAG)
            elif not is_exercise and learner_calls and learner_calls.search(visible) and RUNS_LEARNER_CODE not in tags:
                tags.append(RUNS_LEARNER_CODE)
            exercise = exercises.get(visible.strip())
            if exercise is not None and exercise.check not in graded and not is_exercise:
                graded[exercise.check] = index
                cell.metadata["nbgrader"] = _nbgrader_meta(exercise.check, points=exercise.points)
                if "require_pass(" not in cell.source:
                    cell.source = cell.source.rstrip("\n") + "\n" + hidden_test(exercise.check)
            elif has_hidden:
                raise ValueError(f"cell {index}: a hidden-test region outside a graded check cell")
        if tags:
            cell.metadata["tags"] = tags
        else:
            cell.metadata.pop("tags", None)
    missing = [call for call, e in exercises.items() if e.check not in graded]
    if missing:
        message = (
            f"{chapter}: no check cell that is exactly {', '.join(map(repr, missing))} "
            "(the check call in EXERCISES and the notebook disagree)"
        )
        if strict:
            raise ValueError(message)
        warnings.warn(message + ": built without its graded cell", ExerciseWarning, stacklevel=2)
    return nb


def release_notebook(source: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """What ``nbgrader generate_assignment`` (default settings) makes of a source notebook."""
    nb = copy.deepcopy(source)
    nb.metadata.pop("celltoolbar", None)
    for index, cell in enumerate(nb.cells):
        meta = cell.metadata.get("nbgrader")
        if meta and meta.get("solution"):  # LockCells
            cell.metadata["deletable"] = False
        elif meta and (meta.get("grade") or meta.get("locked")):
            cell.metadata["deletable"] = cell.metadata["editable"] = False
        try:
            if cell.cell_type == "code":  # ClearSolutions
                cell.source, _ = strip_solutions(cell.source)
            cell.source, _ = strip_hidden_tests(cell.source)  # ClearHiddenTests
        except ValueError as err:
            raise ValueError(f"cell {index}: {err}") from None
        if cell.cell_type == "code":  # ClearOutput
            cell.outputs = []
            cell.execution_count = None
            cell.metadata.pop("collapsed", None)
            cell.metadata.pop("scrolled", None)
        if meta and (meta.get("grade") or meta.get("solution") or meta.get("locked")):  # ComputeChecksums
            meta["checksum"] = nbgrader_checksum(cell)
            meta["cell_type"] = cell.cell_type
    return nb


def student_notebook(
    solution: nbformat.NotebookNode, chapter: str | None = None, strict: bool = False
) -> nbformat.NotebookNode:
    """The student notebook of a solved chapter: the release version of its source version."""
    return release_notebook(source_notebook(solution, chapter, strict=strict))


def read_notebook(path: Path) -> nbformat.NotebookNode:
    """Read a notebook; a cell without an id (written by hand or by a tool) gets one derived from
    its position and content, so that building twice gives the same file (nbformat's own repair
    would draw a random id on every read)."""
    raw = json.loads(Path(path).read_text(encoding="utf-8"))
    if (raw.get("nbformat"), raw.get("nbformat_minor", 0)) >= (4, 5):
        for index, cell in enumerate(raw.get("cells", [])):
            if "id" not in cell:
                source = cell.get("source", "")
                content = f"{index}\n{cell.get('cell_type')}\n{''.join(source) if isinstance(source, list) else source}"
                cell["id"] = hashlib.sha1(content.encode("utf-8")).hexdigest()[:8]
    return nbformat.reads(json.dumps(raw), as_version=4)


def render(nb: nbformat.NotebookNode) -> str:
    return nbformat.writes(nb) + "\n"


def build(solutions: Path, notebooks: Path, check_only: bool = False) -> list[Path]:
    """Write (or, with ``check_only``, compare) every student notebook; returns those that differ."""
    notebooks.mkdir(parents=True, exist_ok=True)
    differing = []
    for src in sorted(solutions.glob("*.ipynb")):
        try:
            expected = render(student_notebook(read_notebook(src), chapter=src.stem))
        except ValueError as err:
            raise ValueError(f"{src}: {err}") from None
        dst = notebooks / src.name
        if not dst.is_file() or dst.read_text() != expected:
            differing.append(dst)
            if not check_only:
                dst.write_text(expected)
    return differing


NBGRADER_CONFIG = """\
# nbgrader settings for the minillm course (written by `minillm course nbgrader-source`).
c = get_config()  # noqa: F821

# A chapter's cells load models and time the engine: nbgrader's default of 30 s per cell is too short.
c.Execute.timeout = 600
"""


def nbgrader_source(
    solutions: Path, course: Path, chapters: list[str] | None = None, overwrite: bool = False
) -> list[Path]:
    """Write each chapter's source notebook to ``course/source/<chapter>/<chapter>.ipynb`` (an
    nbgrader course: the chapter is the assignment) and, if there is none, ``nbgrader_config.py``.

    Returns the files written. An existing source notebook is left alone unless ``overwrite``."""
    paths = sorted(solutions.glob("*.ipynb"))
    if chapters:
        unknown = sorted(set(chapters) - {p.stem for p in paths})
        if unknown:
            raise ValueError(f"no chapter {', '.join(unknown)} in {solutions}")
        paths = [p for p in paths if p.stem in chapters]
    written = []
    for src in paths:
        try:
            nb = source_notebook(read_notebook(src), chapter=src.stem)
        except ValueError as err:
            raise ValueError(f"{src}: {err}") from None
        dst = course / "source" / src.stem / src.name
        if dst.exists() and not overwrite:
            raise FileExistsError(f"{dst} exists (use --overwrite to replace it)")
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_text(render(nb))
        written.append(dst)
    config = course / "nbgrader_config.py"
    if not config.exists():
        config.write_text(NBGRADER_CONFIG)
        written.append(config)
    return written
