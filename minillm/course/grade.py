"""``minillm course grade``: run learners' notebooks and report every check.

A notebook is executed top to bottom in a fresh kernel (errors do not stop it: a failed check
must not hide the ones after it). Each check appends its verdict to a log file whose path we
pass in ``MINILLM_GRADE_LOG``; checks that never ran — a deleted cell, a crash before it — are
reported "not attempted". Instructors get text, JSON, or a CSV for a folder of submissions.
"""

from __future__ import annotations

import csv
import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from minillm.course.results import GRADE_LOG_ENV, NOT_ATTEMPTED, PASS, CheckResult


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


def expected_checks(notebook: Path) -> list[str] | None:
    """The checks a chapter's exercises have, or None for a notebook that is not a chapter."""
    from minillm.course import CHECKS_BY_CHAPTER

    return CHECKS_BY_CHAPTER.get(notebook.stem)


def grade_notebook(path: str | Path, timeout: int = 600) -> NotebookGrade:
    import nbformat
    from nbclient import NotebookClient

    path = Path(path)
    grade = NotebookGrade(notebook=str(path))
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "checks.jsonl"
        previous = os.environ.get(GRADE_LOG_ENV)
        os.environ[GRADE_LOG_ENV] = str(log)  # inherited by the kernel
        try:
            nb = nbformat.read(path, as_version=4)
            NotebookClient(
                nb,
                timeout=timeout,
                allow_errors=True,
                kernel_name="python3",
                resources={"metadata": {"path": str(path.parent)}},
            ).execute()
        except Exception as err:  # a broken notebook is a grade, not a crash of the grader
            grade.error = f"{type(err).__name__}: {err}"
        finally:
            if previous is None:
                os.environ.pop(GRADE_LOG_ENV, None)
            else:
                os.environ[GRADE_LOG_ENV] = previous
        seen: dict[str, CheckResult] = {}
        if log.is_file():
            for line in log.read_text().splitlines():
                r = CheckResult(**json.loads(line))
                seen[r.check] = r  # the last verdict counts if a check ran twice
    expected = expected_checks(path)
    if expected is None:  # not a known chapter: report whatever checks ran
        grade.results.extend(seen.values())
        return grade
    for name in expected:  # a chapter: exactly its exercises (demo checks in the text do not count)
        grade.results.append(seen.pop(name, CheckResult(name, NOT_ATTEMPTED, "the check never ran")))
    return grade


def grade_folder(folder: str | Path, csv_path: str | Path | None = None) -> list[NotebookGrade]:
    folder = Path(folder)
    grades = [grade_notebook(p) for p in sorted(folder.rglob("*.ipynb")) if ".ipynb_checkpoints" not in p.parts]
    csv_path = Path(csv_path) if csv_path else folder / "grades.csv"
    names = sorted({r.check for g in grades for r in g.results})
    with open(csv_path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["notebook", "passed", "total", *names, "error"])
        for g in grades:
            status = {r.check: r.status for r in g.results}
            writer.writerow([g.notebook, g.passed, g.total, *[status.get(n, "") for n in names], g.error or ""])
    return grades
