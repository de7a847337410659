"""Student notebooks are generated from the solutions, and graded."""

from __future__ import annotations

import csv
import shutil
from pathlib import Path

import nbformat
import pytest

from minillm.course.build import build, strip_solutions, student_notebook
from minillm.course.grade import grade_folder, grade_notebook

ROOT = Path(__file__).resolve().parent.parent
SOLUTIONS, NOTEBOOKS = ROOT / "solutions", ROOT / "notebooks"


def test_notebooks_are_exactly_what_the_build_produces():
    differing = build(SOLUTIONS, NOTEBOOKS, check_only=True)
    assert not differing, f"run `minillm course build`: {[str(p) for p in differing]} are out of date"
    assert sorted(p.name for p in SOLUTIONS.glob("*.ipynb")) == sorted(p.name for p in NOTEBOOKS.glob("*.ipynb"))


def test_strip_solutions_keeps_indentation_and_code_around():
    source = "def f(x):\n    y = 1\n    ### BEGIN SOLUTION\n    return x + y\n    ### END SOLUTION\nprint(f)"
    stripped, found = strip_solutions(source)
    assert found
    assert stripped == "def f(x):\n    y = 1\n    # YOUR CODE HERE\n    raise NotImplementedError()\nprint(f)"


@pytest.mark.parametrize(
    "source,message",
    [
        ("### BEGIN SOLUTION\nx\n### BEGIN SOLUTION\n### END SOLUTION", "nested"),
        ("x\n### END SOLUTION", "without"),
        ("### BEGIN SOLUTION\nx", "never closed"),
    ],
)
def test_malformed_regions_are_reported(source, message):
    with pytest.raises(ValueError, match=message):
        strip_solutions(source)


def test_student_notebooks_have_no_solutions_no_outputs_and_tags():
    for path in SOLUTIONS.glob("*.ipynb"):
        student = student_notebook(nbformat.read(path, as_version=4))
        assert "widgets" not in student.metadata  # no megabytes of saved widget JavaScript
        for cell in student.cells:
            assert "### BEGIN SOLUTION" not in cell.source
            if cell.cell_type == "code":
                assert cell.outputs == [] and cell.execution_count is None
                tags = cell.metadata.get("tags", [])
                assert ("exercise" in tags) == ("YOUR CODE HERE" in cell.source)
                if "check_" in cell.source and "(" in cell.source and "import" not in cell.source:
                    assert "check" in tags


@pytest.mark.slow
@pytest.mark.parametrize("chapter", ["01_prefill_and_decode", "02_kv_cache"])
def test_grading_solutions_pass_and_students_do_not(chapter):
    solved = grade_notebook(SOLUTIONS / f"{chapter}.ipynb")
    assert solved.error is None
    assert solved.total == 3 and solved.passed == 3, solved.as_text()
    blank = grade_notebook(NOTEBOOKS / f"{chapter}.ipynb")
    assert blank.passed == 0, blank.as_text()
    assert all(r.status == "not attempted" for r in blank.results)


@pytest.mark.slow
def test_grading_a_folder_writes_a_csv(tmp_path):
    submissions = tmp_path / "submissions"
    submissions.mkdir()
    shutil.copy(SOLUTIONS / "01_prefill_and_decode.ipynb", submissions / "01_prefill_and_decode.ipynb")
    nb = nbformat.read(SOLUTIONS / "01_prefill_and_decode.ipynb", as_version=4)
    for cell in nb.cells:  # a learner who got the attention scale wrong
        cell.source = cell.source.replace("/ math.sqrt(q.shape[-1])", "")
    (submissions / "alice").mkdir()
    nbformat.write(nb, submissions / "alice" / "01_prefill_and_decode.ipynb")
    grades = grade_folder(submissions)
    by_name = {Path(g.notebook).parent.name: g for g in grades}
    assert by_name["alice"].passed == 2
    failed = [r for r in by_name["alice"].results if r.status == "fail"]
    assert failed[0].check == "check_causal_attention" and "not scaled" in failed[0].message
    rows = list(csv.DictReader(open(submissions / "grades.csv")))
    assert len(rows) == 2 and {r["check_causal_attention"] for r in rows} == {"pass", "fail"}
