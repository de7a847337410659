"""The nbgrader route end to end: source notebooks → generate_assignment → a submission → autograde."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

pytest.importorskip("nbgrader")

from minillm.course.build import nbgrader_source  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CH01 = "01_prefill_and_decode"


def nbgrader(course: Path, *args: str) -> str:
    # nbgrader runs `alembic` (its database migrations) by name: the environment's bin/ goes first on PATH.
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "JUPYTER_CONFIG_DIR": str(course / ".jupyter"),  # no user-wide nbgrader settings
    }
    proc = subprocess.run(
        [sys.executable, "-m", "nbgrader", *args, f"--CourseDirectory.root={course}"],
        cwd=course,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout + proc.stderr


def answer(nb: nbformat.NotebookNode, grade_id: str, code: str) -> None:
    cell = next(c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade_id") == grade_id)
    stub = "    # YOUR CODE HERE\n    raise NotImplementedError()"
    assert stub in cell.source
    cell.source = cell.source.replace(stub, code)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_generate_assignment_then_autograde_scores_right_wrong_and_not_attempted(tmp_path):
    course = tmp_path / "course"
    nbgrader_source(ROOT / "solutions", course, [CH01])
    nbgrader(course, "generate_assignment", CH01, "--create")

    release = nbformat.read(course / "release" / CH01 / f"{CH01}.ipynb", as_version=4)
    assert release == nbformat.read(ROOT / "notebooks" / f"{CH01}.ipynb", as_version=4)  # the student notebook

    submission = release
    answer(  # right
        submission,
        "answer_generate_naive",
        "    ids = list(prompt_ids)\n"
        "    for _ in range(max_new_tokens):\n"
        "        ids.append(int(forward_logits(model, ids)[-1].argmax()))\n"
        "    return ids[len(prompt_ids):]",
    )
    answer(  # wrong: the scores are not scaled by 1/sqrt(d)
        submission,
        "answer_causal_attention",
        "    T = q.shape[-2]\n"
        "    mask = torch.ones(T, T, dtype=torch.bool).tril()\n"
        "    return torch.softmax((q @ k.transpose(-1, -2)).masked_fill(~mask, float('-inf')), dim=-1) @ v",
    )
    # the stopping exercise is not attempted. The cells after the last check (measurements, plots; not
    # graded, not locked) are deleted, as a student may: it keeps this test short.
    last_check = max(i for i, c in enumerate(submission.cells) if c.metadata.get("nbgrader", {}).get("grade"))
    submission.cells = submission.cells[: last_check + 1]
    folder = course / "submitted" / "alice" / CH01
    folder.mkdir(parents=True)
    nbformat.write(submission, folder / f"{CH01}.ipynb")

    nbgrader(course, "autograde", CH01, "--create")

    from nbgrader.api import Gradebook

    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gradebook:
        scores = {
            check: (grade.score, grade.max_score)
            for check in (
                "check_generate_naive",
                "check_stopping",
                "check_filter_logits",
                "check_causal_attention",
                "check_transformer",
            )
            for grade in [gradebook.find_grade(check, CH01, CH01, "alice")]
        }
        total = gradebook.find_submission(CH01, "alice")
        assert scores == {
            "check_generate_naive": (2, 2),
            "check_stopping": (0, 3),  # a check that is not attempted does not raise: the hidden test does
            "check_filter_logits": (0, 2),
            "check_causal_attention": (0, 2),
            "check_transformer": (0, 4),
        }
        assert (total.score, total.max_score) == (2, 16)
    graded = nbformat.read(course / "autograded" / "alice" / CH01 / f"{CH01}.ipynb", as_version=4)
    check = next(c for c in graded.cells if c.metadata.get("nbgrader", {}).get("grade_id") == "check_stopping")
    assert "require_pass('check_stopping')" in check.source  # the hidden test was put back
