"""``minillm course grade``: run learners' notebooks and report every check.

A notebook is executed top to bottom in a fresh kernel (errors do not stop it: a failed check
must not hide the ones after it). Before running it, the grader **restores the check cells**
of a chapter from the course's own list (``CHECK_CALLS``): a check cell the learner edited,
emptied or deleted is put back, and each is wrapped so that it displays its verdict under a
one-time nonce. Verdicts are read only from those cells' outputs: text printed elsewhere, or
lines written to a log file, do not count. Checks that never report are "not attempted".

What grading cannot prevent: the notebook runs the learner's code in the same Python process
as the checks, so code written to defeat the grader (replacing the check functions themselves
before the check cell runs, for instance) can still fake a verdict. Treat grades as a strong
signal for honest work, and read the code of a submission whose grades surprise you.
"""

from __future__ import annotations

import csv
import secrets
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path

from minillm.course.results import FAIL, NOT_ATTEMPTED, PASS, VERDICT_MIME, CheckResult

DEFAULT_TIMEOUT = 600  # seconds per cell


@dataclass
class NotebookGrade:
    notebook: str
    results: list[CheckResult] = field(default_factory=list)
    error: str | None = None  # the notebook could not be executed at all

    @property
    def passed(self) -> int:
        return sum(r.status == PASS for r in self.results)

    @property
    def total(self) -> int:
        return len(self.results)

    def as_dict(self) -> dict:
        return {
            "notebook": self.notebook,
            "passed": self.passed,
            "total": self.total,
            "error": self.error,
            "checks": [asdict(r) for r in self.results],
        }

    def as_text(self) -> str:
        lines = [f"{self.notebook}: {self.passed}/{self.total} checks passed"]
        if self.error:
            lines.append(f"  could not run: {self.error}")
        for r in self.results:
            mark = {"pass": "PASS", "fail": "FAIL"}.get(r.status, "----")
            detail = "" if r.status == PASS else f" — {r.message}"
            lines.append(f"  [{mark}] {r.check}{detail}")
        return "\n".join(lines)


def expected_checks(notebook: Path, nb=None) -> list[str] | None:
    """The checks of the chapter ``notebook`` is, or None for a notebook that is not a chapter.

    The chapter comes from the notebook's metadata (``minillm.chapter``), else its file name,
    else the chapter whose check names its code mentions most: a renamed copy
    (``submission.ipynb``, ``…-Copy1.ipynb``) still expects all of its chapter's checks."""
    from minillm.course import CHECKS_BY_CHAPTER

    chapter = (nb.metadata.get("minillm", {}).get("chapter") if nb is not None else None) or notebook.stem
    if chapter in CHECKS_BY_CHAPTER:
        return CHECKS_BY_CHAPTER[chapter]
    if nb is None:
        return None
    code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    counts = {name: sum(check in code for check in checks) for name, checks in CHECKS_BY_CHAPTER.items()}
    best = max(counts, key=counts.get)
    return CHECKS_BY_CHAPTER[best] if counts[best] else None


def _graded_cell(name: str, call: str, nonce: str) -> str:
    return f"with __import__('minillm.course.results', fromlist=['graded']).graded({name!r}, {nonce!r}):\n    {call}\n"


def restore_check_cells(nb, expected: list[str] | None, nonce: str) -> dict[int, str]:
    """Put the course's check cells back into ``nb`` and wrap them; returns cell index → check.

    For a chapter, each expected check goes into the cell tagged ``check`` that calls it, else
    into a new cell at the end (the learner deleted or rewrote it; at the end, every exercise
    function is defined). Any other notebook keeps its own ``check`` cells, wrapped as they are."""
    import nbformat

    from minillm.course import CHECK_CALLS

    check_cells = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and "check" in c.metadata.get("tags", [])]
    graded: dict[int, str] = {}
    if expected is None:
        for i in check_cells:
            name = next((n for n in CHECK_CALLS if n in nb.cells[i].source), f"cell {i}")
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


def grade_notebook(path: str | Path, timeout: int = DEFAULT_TIMEOUT) -> NotebookGrade:
    import nbformat
    from nbclient import NotebookClient

    path = Path(path)
    grade = NotebookGrade(notebook=str(path))
    nonce = secrets.token_hex(16)
    graded: dict[int, str] = {}
    try:
        nb = nbformat.read(path, as_version=4)
        graded = restore_check_cells(nb, expected_checks(path, nb), nonce)
        client = NotebookClient(
            nb,
            timeout=timeout,
            allow_errors=True,
            kernel_name="python3",
            resources={"metadata": {"path": str(path.parent)}},
        )
        client.execute(stderr=subprocess.DEVNULL)  # the kernel's own warnings are not the learner's output
    except Exception as err:  # a broken notebook is a grade, not a crash of the grader
        grade.error = f"{type(err).__name__}: {err}"
    for index, name in graded.items():
        verdicts = []
        for out in nb.cells[index].get("outputs", []):
            data = out.get("data", {}).get(VERDICT_MIME) if out.get("output_type") == "display_data" else None
            if isinstance(data, dict) and data.get("nonce") == nonce and data.get("check") == name:
                verdicts.append(CheckResult(name, str(data.get("status")), str(data.get("message"))))
        if len(verdicts) > 1:  # the wrapper displays exactly one: anything more was added by other code
            verdicts = [CheckResult(name, FAIL, "the check cell showed more than one verdict: graded as tampered")]
        grade.results.append(verdicts[0] if verdicts else CheckResult(name, NOT_ATTEMPTED, "the check never ran"))
    return grade


def grade_folder(
    folder: str | Path, csv_path: str | Path | None = None, timeout: int = DEFAULT_TIMEOUT
) -> list[NotebookGrade]:
    """Grade every notebook below ``folder`` (one that cannot run is flagged with its error; the
    others are graded all the same) and write ``grades.csv``."""
    folder = Path(folder)
    paths = sorted(p for p in folder.rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts)
    grades = [grade_notebook(p, timeout) for p in paths]
    csv_path = Path(csv_path) if csv_path else folder / "grades.csv"
    names = sorted({r.check for g in grades for r in g.results})
    with open(csv_path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["notebook", "passed", "total", *names, "error"])
        for g in grades:
            status = {r.check: r.status for r in g.results}
            writer.writerow([g.notebook, g.passed, g.total, *[status.get(n, "") for n in names], g.error or ""])
    return grades
