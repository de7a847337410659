"""``minillm course grade``: run learners' notebooks and report every check, with points.

The chapter of a notebook comes from its metadata (``minillm.chapter``, which every built
notebook carries), else its file name, else the chapter whose exercises its code works on most:
a renamed copy (``submission.ipynb``, ``…-Copy1.ipynb``) still expects all of its chapter's
checks. A notebook that is none of these (and has no check cell) is reported as *not a
course notebook* and not run.

A notebook is executed top to bottom in a fresh kernel (errors do not stop it: a failed check
must not hide the ones after it) by a client with no front end (``headless.py``: nbclient's
emulation of widgets once left a cell's reply unread until the notebook's time ran out). Each
code cell has a time limit and the whole notebook another: a run that passes either stops with
the code cell that was running and its last output, and is run once more in a fresh kernel;
the checks it never reached are *not run*.

Before running it, the grader **restores the check cells** of a chapter from the course's own
list (``CHECK_CALLS``): a check cell the learner edited, emptied or deleted is put back, and
each is wrapped so that it displays its verdict under a one-time nonce. Verdicts are read only
from those cells' outputs: text printed elsewhere, or lines written to a log file, do not
count. A pass (or a check the run never reached) is then **graded again in a fresh process**
from the learner's source (``isolated.py``), which a notebook cannot reach; a fail stands.
Checks that never report are "not attempted". A passed check earns its exercise's points
(``EXERCISES``); anything else earns none. What grading still cannot prevent is in
``isolated.py``'s docstring.
"""

from __future__ import annotations

import copy
import csv
import math
import re
import secrets
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from minillm.course.isolated import CHECK_TIMEOUT_S, TAMPERED, learner_cells, run_checks, tamper_findings
from minillm.course.reach import reach_findings, shipped_sources
from minillm.course.results import FAIL, NOT_ATTEMPTED, PASS, VERDICT_MIME, CheckResult

DEFAULT_TIMEOUT = 900  # seconds for a whole notebook
DEFAULT_CELL_TIMEOUT = 600  # seconds for one code cell: the slowest shipped cell takes about a minute
NOT_RUN = "not run"  # the notebook stopped (timed out, kernel died) before the check's cell
NOT_A_COURSE_NOTEBOOK = "not a course notebook"


def max_points(check: str) -> int:
    """What a check is worth (``EXERCISES``); 0 for a check the course does not list."""
    from minillm.course.exercises import BY_CHECK

    exercise = BY_CHECK.get(check)
    return exercise.points if exercise else 0


def _course_order(check: str) -> tuple[int, str]:
    from minillm.course.exercises import EXERCISES

    order = [e.check for e in EXERCISES]
    return (order.index(check), "") if check in order else (len(order), check)


@dataclass
class NotebookGrade:
    notebook: str
    chapter: str | None = None
    results: list[CheckResult] = field(default_factory=list)
    error: str | None = None  # the notebook could not run, or not to the end
    retried: str | None = None  # the first run stopped early (why): the notebook was run again
    course: bool = True  # False: not a course notebook (it was not run)

    @property
    def sandbox(self) -> str:
        """How the fresh grading processes held the solved notebooks: "answers hidden", the first
        reason they were not, or "" (no check was graded in one)."""
        said = [r.sandbox for r in self.results if r.sandbox]
        return next((s for s in said if s != "answers hidden"), said[0] if said else "")

    @property
    def passed(self) -> int:
        return sum(r.status == PASS for r in self.results)

    @property
    def total(self) -> int:
        return len(self.results)

    @property
    def points(self) -> int:
        return sum(max_points(r.check) for r in self.results if r.status == PASS)

    @property
    def max_points(self) -> int:
        return sum(max_points(r.check) for r in self.results)

    def as_dict(self) -> dict:
        counts = {"passed": self.passed, "total": self.total, "points": self.points, "max_points": self.max_points}
        return {
            "notebook": self.notebook,
            "chapter": self.chapter,
            "course_notebook": self.course,
            **{k: (v if self.course else None) for k, v in counts.items()},
            "error": self.error,
            "retried": self.retried,
            "checks": [
                {
                    "check": r.check,
                    "status": r.status,
                    "message": r.message,
                    "points": max_points(r.check) if r.status == PASS else 0,
                    "max_points": max_points(r.check),
                    "sandbox": r.sandbox,
                }
                for r in self.results
            ],
        }

    def as_text(self) -> str:
        if not self.course:
            return f"{self.notebook}: {self.error}"
        chapter = f" ({self.chapter})" if self.chapter and self.chapter != Path(self.notebook).stem else ""
        lines = [
            f"{self.notebook}{chapter}: {self.passed}/{self.total} checks passed, "
            f"{self.points}/{self.max_points} points"
        ]
        if self.error:
            lines.append(f"  could not run to the end: {self.error}")
        elif self.retried:
            lines.append(f"  ran to the end on a retry in a fresh kernel (the first run: {self.retried})")
        for r in self.results:
            mark = {PASS: "PASS", FAIL: "FAIL"}.get(r.status, "----")
            earned = f"{max_points(r.check) if r.status == PASS else 0}/{max_points(r.check)}"
            detail = "" if r.status == PASS else f" — {r.status}: {r.message}"
            if r.sandbox and r.sandbox != "answers hidden":  # said wherever the guarantee did not hold
                detail += f" [{r.sandbox}]"
            lines.append(f"  [{mark}] {r.check} ({earned}){detail}")
        return "\n".join(lines)


def find_chapter(notebook: Path, nb=None) -> str | None:
    """The chapter ``notebook`` is: its metadata's ``minillm.chapter``, else its file name, else
    the chapter with the most exercises its code works on — the check called on the exercise's
    own function (``check_contiguous_cache(ContiguousKVCache)``), or that function defined; None for a notebook
    that is none. A check called on something else is no evidence: chapter 00 calls
    ``check_causal_attention`` on a lambda to show what a check looks like, and is not chapter 01."""
    from minillm.course import CHECK_CALLS, CHECKS_BY_CHAPTER
    from minillm.course.exercises import BY_CHECK

    meta = nb.metadata.get("minillm", {}) if nb is not None else {}
    for chapter in (meta.get("chapter") if isinstance(meta, dict) else None, Path(notebook).stem):
        if chapter in CHECKS_BY_CHAPTER:
            return chapter
    if nb is None:
        return None
    code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    defined = set(re.findall(r"^\s*def\s+(\w+)\s*\(", code, flags=re.MULTILINE))

    def worked_on(check: str) -> bool:
        return CHECK_CALLS[check] in code or all(f in defined for f in BY_CHECK[check].functions)

    counts = {name: sum(map(worked_on, checks)) for name, checks in CHECKS_BY_CHAPTER.items()}
    best = max(counts, key=counts.get)
    return best if counts[best] else None


def expected_checks(notebook: Path, nb=None) -> list[str] | None:
    """The checks of the chapter ``notebook`` is (``find_chapter``), or None for no chapter."""
    from minillm.course import CHECKS_BY_CHAPTER

    chapter = find_chapter(notebook, nb)
    return None if chapter is None else CHECKS_BY_CHAPTER[chapter]


def _graded_cell(name: str, call: str, nonce: str) -> str:
    return f"with __import__('minillm.course.results', fromlist=['graded']).graded({name!r}, {nonce!r}):\n    {call}\n"


def _check_cells(nb) -> list[int]:
    return [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and "check" in c.metadata.get("tags", [])]


def restore_check_cells(nb, expected: list[str] | None, nonce: str) -> dict[int, str]:
    """Put the course's check cells back into ``nb`` and wrap them; returns cell index → check.

    For a chapter, each expected check goes into the cell tagged ``check`` that calls it, else
    into a new cell at the end (the learner deleted or rewrote it; at the end, every exercise
    function is defined). Any other notebook keeps its own ``check`` cells, wrapped as they are."""
    import nbformat

    from minillm.course import CHECK_CALLS

    check_cells = _check_cells(nb)
    graded: dict[int, str] = {}
    if expected is None:
        for i in check_cells:
            name = next((n for n in CHECK_CALLS if n in nb.cells[i].source), f"cell {i + 1}")
            graded[i] = name
            nb.cells[i].source = _graded_cell(name, nb.cells[i].source.replace("\n", "\n    "), nonce)
        return graded
    free = list(check_cells)
    for name in expected:
        cell = next((i for i in free if name in nb.cells[i].source), None)
        if cell is None:
            nb.cells.append(nbformat.v4.new_code_cell(metadata={"tags": ["check"]}))
            cell = len(nb.cells) - 1
        else:
            free.remove(cell)
        nb.cells[cell].source = _graded_cell(name, CHECK_CALLS[name], nonce)
        graded[cell] = name
    return graded


def _now() -> float:
    """The grader's clock (one place, so a test can move it)."""
    return time.monotonic()


class _OutOfTime(Exception):
    """The notebook's time ran out before a code cell could start."""


def _where(index: int, first_lines: list[str], graded: dict[int, str]) -> str:
    """'cell N of M' in the learner's numbering (1-based, markdown included), with its first line."""
    if index >= len(first_lines):
        return f"the restored check cell of {graded.get(index, '?')} (after the last cell)"
    first = first_lines[index] if len(first_lines[index]) <= 60 else first_lines[index][:57] + "..."
    return f"cell {index + 1} of {len(first_lines)}" + (f" (`{first}`)" if first else "")


def _last_output(cell, chars: int = 240) -> str:
    """The end of what a cell had shown when it stopped: text streams, text results, errors."""
    text = ""
    for out in cell.get("outputs", []):
        if out.get("output_type") == "stream":
            text += out.get("text", "")
        elif out.get("output_type") == "error":
            text += f"{out.get('ename')}: {out.get('evalue')}\n"
        elif "text/plain" in out.get("data", {}):
            text += str(out["data"]["text/plain"]) + "\n"
    text = text.strip()
    return f"; its last output: {text[-chars:]!r}" if text else "; it had shown no output"


@dataclass
class _Run:
    """One execution of a notebook: why it stopped early (None: it ran to the end), in which
    cell (-1: before the first), and where its time went."""

    error: str | None = None
    stopped: int | None = None
    cells_s: float = 0.0
    wall_s: float = 0.0


def _run(nb, path: Path, timeout: float, cell_timeout: float, graded: dict[int, str], first_lines: list[str]) -> _Run:
    """Execute ``nb``: each code cell within ``cell_timeout`` seconds and all of them within
    ``timeout``. A stop names the *code* cell that was running and shows its last output; time
    the notebook lost outside its cells (a kernel that idled between them) is said as such."""
    from nbclient.exceptions import CellTimeoutError, DeadKernelError

    from minillm.course.headless import HeadlessNotebookClient

    start = _now()
    deadline = start + timeout
    state: dict = {"index": None, "began": None, "cells_s": 0.0}

    def on_cell_start(cell, cell_index):
        if cell.cell_type != "code" or not cell.source.strip():
            return  # a markdown cell never runs: it cannot be where the time went
        if _now() >= deadline:
            raise _OutOfTime
        state["index"], state["began"] = cell_index, _now()

    def on_cell_executed(cell, cell_index, execute_reply):
        state["cells_s"] += _now() - state["began"]

    def cell_limit(cell) -> int:
        return max(1, math.ceil(min(cell_timeout, deadline - _now())))

    client = HeadlessNotebookClient(  # nbclient's widget emulation can leave a reply unread: see headless.py
        nb,
        timeout_func=cell_limit,
        allow_errors=True,
        kernel_name="python3",
        shutdown_kernel="immediate",
        resources={"metadata": {"path": str(path.parent)}},
        on_cell_start=on_cell_start,
        on_cell_executed=on_cell_executed,
    )
    run = _Run()
    try:
        client.execute(stderr=subprocess.DEVNULL)  # the kernel's own warnings are not the learner's output
    except (CellTimeoutError, _OutOfTime, DeadKernelError) as err:
        index = state["index"]
        where = "its start" if index is None else _where(index, first_lines, graded)
        elapsed = _now() - start
        outside = elapsed - state["cells_s"]
        if isinstance(err, DeadKernelError):
            run.error = f"the kernel died in {where} (out of memory, or a crash in native code)"
        elif isinstance(err, _OutOfTime):
            run.error = (f"the notebook's limit of {timeout:g} s ran out after {where} finished: its code cells "
                         f"took {state['cells_s']:.0f} s and {outside:.0f} s went outside them (the kernel "
                         "starting, or idle between cells)")  # fmt: skip
        elif _now() >= deadline - 1:
            run.error = f"timed out in {where}: the notebook ran past its limit of {timeout:g} s"
        else:
            run.error = f"timed out in {where}: the cell ran past its limit of {cell_timeout:g} s"
        if index is not None and not isinstance(err, _OutOfTime):
            run.error += _last_output(nb.cells[index])
        run.stopped = -1 if index is None else index
    except Exception as err:  # a broken notebook is a grade, not a crash of the grader
        index = state["index"]
        run.error, run.stopped = f"{type(err).__name__}: {err}", (-1 if index is None else index)
    run.cells_s, run.wall_s = state["cells_s"], _now() - start
    return run


def _in_notebook_verdict(nb, index: int, name: str, nonce: str) -> CheckResult | None:
    """The verdict the restored check cell displayed in the notebook's own run, if one."""
    verdicts = []
    for out in nb.cells[index].get("outputs", []):
        data = out.get("data", {}).get(VERDICT_MIME) if out.get("output_type") == "display_data" else None
        if isinstance(data, dict) and data.get("nonce") == nonce and data.get("check") == name:
            verdicts.append(CheckResult(name, str(data.get("status")), str(data.get("message"))))
    if len(verdicts) > 1:  # the wrapper displays exactly one: anything more was added by other code
        return CheckResult(name, FAIL, f"{TAMPERED}: the check cell showed more than one verdict")
    return verdicts[0] if verdicts else None


def grade_notebook(
    path: str | Path,
    timeout: float = DEFAULT_TIMEOUT,
    cell_timeout: float = DEFAULT_CELL_TIMEOUT,
    check_timeout: float = CHECK_TIMEOUT_S,
) -> NotebookGrade:
    """Run one notebook (each code cell within ``cell_timeout`` seconds, all within ``timeout``;
    a run that stops early is retried once) and grade its checks, each in a fresh process
    (``isolated.py``) within ``check_timeout`` seconds."""
    import nbformat

    from minillm.course import CHECKS_BY_CHAPTER

    path = Path(path)
    grade = NotebookGrade(notebook=str(path))
    try:
        submitted = nbformat.read(path, as_version=4)
    except Exception as err:
        grade.error = f"could not read the notebook: {type(err).__name__}: {err}"
        grade.chapter = find_chapter(path)
        expected = CHECKS_BY_CHAPTER.get(grade.chapter, [])
        grade.results = [CheckResult(name, NOT_RUN, "the notebook could not be read") for name in expected]
        return grade
    grade.chapter = find_chapter(path, submitted)
    expected = None if grade.chapter is None else CHECKS_BY_CHAPTER[grade.chapter]
    if expected is None and not _check_cells(submitted):
        grade.course = False
        grade.error = (
            f"{NOT_A_COURSE_NOTEBOOK}: no minillm chapter in its metadata or file name, no chapter's exercise "
            "in its code and no check cell (not run)"
        )
        return grade
    cells = learner_cells(submitted, len(submitted.cells), ())
    findings = tamper_findings(cells) + reach_findings(cells, shipped_sources(grade.chapter))
    first_lines = [next((line.strip() for line in c.source.splitlines() if line.strip()), "") for c in submitted.cells]
    for attempt in (1, 2):  # a run that stops early is tried once more, in a fresh kernel
        nb, nonce = copy.deepcopy(submitted), secrets.token_hex(16)
        graded = restore_check_cells(nb, expected, nonce)
        run = _run(nb, path, timeout, cell_timeout, graded, first_lines)
        if run.error is None or attempt == 2:
            break
        first_error = run.error
    grade.error = run.error
    if attempt == 2:
        grade.retried = first_error
        if run.error:
            grade.error = f"{run.error} (the first run stopped too: {first_error})"
    verdicts = {index: _in_notebook_verdict(nb, index, name, nonce) for index, name in graded.items()}
    # A pass, or no verdict (the notebook stopped first), is graded again on its own, from the
    # source; a fail or "not attempted" in the notebook stands: nothing a forger gains by it.
    again = [(name, learner_cells(nb, index, graded)) for index, name in graded.items()
             if expected is not None and not findings and (verdicts[index] is None or verdicts[index].status == PASS)]  # fmt: skip
    fresh = run_checks(again, cwd=str(path.parent), timeout=check_timeout) if again else {}
    for index, name in graded.items():
        in_notebook = verdicts[index]
        if findings:
            result = CheckResult(name, FAIL, f"{TAMPERED}: " + "; ".join(findings[:8]))
        elif expected is None:  # not a course chapter: its own check cells, as the notebook ran them
            result = in_notebook or _unreported(name, index, run)
        elif name in fresh:
            result = fresh[name]
            if in_notebook is not None and result.status != PASS:
                result.message += " (the notebook's own run showed a pass; the grade is the check run on its own)"
        else:
            result = in_notebook
        grade.results.append(result)
    return grade


def _unreported(name: str, index: int, run: _Run) -> CheckResult:
    """Why a check cell of a notebook outside the course showed no verdict."""
    if run.stopped is not None and index == run.stopped:
        return CheckResult(name, FAIL, f"the notebook stopped in this check's cell — {run.error}")
    if run.stopped is not None and index > run.stopped:
        where = "before its first cell" if run.stopped < 0 else f"in cell {run.stopped + 1}"
        return CheckResult(name, NOT_RUN, f"the notebook stopped {where}, before this check")
    return CheckResult(name, NOT_ATTEMPTED, "the check never ran")


def notebooks_below(folder: str | Path) -> list[Path]:
    folder = Path(folder)
    return sorted(p for p in folder.rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts)


def write_csv(grades: list[NotebookGrade], csv_path: str | Path) -> None:
    """One row per notebook: chapter, points, checks passed, each check's status, error."""
    names = sorted({r.check for g in grades for r in g.results}, key=_course_order)
    with open(csv_path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["notebook", "chapter", "points", "max_points", "passed", "total", *names, "error", "sandbox"])
        for g in grades:
            status = {r.check: r.status for r in g.results}
            counts = [g.points, g.max_points, g.passed, g.total] if g.course else ["", "", "", ""]
            writer.writerow([g.notebook, g.chapter or "", *counts, *[status.get(n, "") for n in names], g.error or "",
                             g.sandbox])  # fmt: skip


def grade_folder(
    folder: str | Path,
    csv_path: str | Path | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    cell_timeout: float = DEFAULT_CELL_TIMEOUT,
) -> list[NotebookGrade]:
    """Grade every notebook below ``folder`` (one that cannot run is flagged with its error; the
    others are graded all the same) and write ``grades.csv`` (or ``csv_path``)."""
    folder = Path(folder)
    csv_path = Path(csv_path) if csv_path else folder / "grades.csv"
    grades = [grade_notebook(p, timeout, cell_timeout) for p in notebooks_below(folder)]
    write_csv(grades, csv_path)
    return grades
