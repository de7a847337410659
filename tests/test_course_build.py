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


# ------------------------------------------------------------------------------------------
# A hostile notebook cannot forge its grade
# ------------------------------------------------------------------------------------------

HEADER = (
    "import math\nimport torch\n"
    "from minillm.course import check_causal_attention, check_generate_naive, check_next_token, forward_logits"
)
EXERCISES = ("def next_token", "def generate_naive", "def causal_attention")


def chapter01(solved: bool) -> nbformat.NotebookNode:
    """Chapter 01 cut to its exercises and check cells (solved or blank), for fast grading."""
    source = nbformat.read((SOLUTIONS if solved else NOTEBOOKS) / "01_prefill_and_decode.ipynb", as_version=4)
    student = nbformat.read(NOTEBOOKS / "01_prefill_and_decode.ipynb", as_version=4)
    exercises = [c for c in source.cells if c.cell_type == "code" and c.source.startswith(EXERCISES)]
    checks = [c for c in student.cells if "check" in c.metadata.get("tags", [])]
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(HEADER)]
    for exercise, check_cell in zip(exercises, checks):
        nb.cells += [exercise, check_cell]
    return nb


FORGERY = """
import json, os
from IPython.display import display
fake = {"check": "check_next_token", "status": "pass", "message": "forged"}
log = os.environ.get("MINILLM_GRADE_LOG", "grade.log")
with open(log, "a") as f:
    f.write("this is not json\\n" + json.dumps(fake) + "\\n")
print("✅ check_next_token: forged")
display({"application/vnd.minillm.verdict+json": {"nonce": "guess", **fake}}, raw=True)
"""


@pytest.mark.slow
def test_forged_verdicts_and_edited_check_cells_do_not_count(tmp_path):
    nb = chapter01(solved=False)
    nb.cells.insert(1, nbformat.v4.new_code_cell(FORGERY))
    checks = [c for c in nb.cells if "check" in c.metadata.get("tags", [])]
    checks[0].source = 'print("✅ check_next_token: passes")'  # the learner edited the check cell
    nb.cells.remove(checks[2])  # ... and deleted another
    path = tmp_path / "01_prefill_and_decode.ipynb"
    nbformat.write(nb, path)
    grade = grade_notebook(path, timeout=120)
    assert grade.error is None, grade.error
    assert [r.status for r in grade.results] == ["not attempted"] * 3, grade.as_text()


@pytest.mark.slow
def test_restored_check_cells_grade_a_solved_notebook(tmp_path):
    nb = chapter01(solved=True)
    checks = [c for c in nb.cells if "check" in c.metadata.get("tags", [])]
    checks[1].source = "pass"  # emptied
    nb.cells.remove(checks[2])  # deleted: the grader appends it after the last cell
    path = tmp_path / "01_prefill_and_decode.ipynb"
    nbformat.write(nb, path)
    grade = grade_notebook(path, timeout=120)
    assert grade.passed == 3, grade.as_text()


@pytest.mark.slow
def test_one_broken_notebook_does_not_stop_a_folder(tmp_path):
    (tmp_path / "bob").mkdir()
    (tmp_path / "bob" / "01_prefill_and_decode.ipynb").write_text("{ this is not a notebook")
    (tmp_path / "carol").mkdir()
    nbformat.write(chapter01(solved=True), tmp_path / "carol" / "01_prefill_and_decode.ipynb")
    grades = {Path(g.notebook).parent.name: g for g in grade_folder(tmp_path, timeout=120)}
    assert grades["bob"].error and grades["bob"].passed == 0
    assert grades["carol"].passed == 3 and grades["carol"].error is None
    rows = {Path(r["notebook"]).parent.name: r for r in csv.DictReader(open(tmp_path / "grades.csv"))}
    assert rows["bob"]["error"] and rows["carol"]["passed"] == "3"


def test_check_calls_match_the_shipped_check_cells():
    from minillm.course import CHECK_CALLS, CHECKS_BY_CHAPTER

    for chapter, names in CHECKS_BY_CHAPTER.items():
        nb = nbformat.read(NOTEBOOKS / f"{chapter}.ipynb", as_version=4)
        cells = {c.source.strip() for c in nb.cells if "check" in c.metadata.get("tags", [])}
        for name in names:
            assert CHECK_CALLS[name] in cells, (chapter, name)


@pytest.mark.slow
def test_a_renamed_copy_is_still_graded_as_its_chapter(tmp_path):
    nb = chapter01(solved=False)
    checks = [c for c in nb.cells if "check" in c.metadata.get("tags", [])]
    checks[0].source = "check_next_token(lambda logits: int(logits[-1].argmax()))"  # their own answer, not the exercise
    path = tmp_path / "submission.ipynb"
    nbformat.write(nb, path)
    grade = grade_notebook(path, timeout=120)
    assert [r.check for r in grade.results] == ["check_next_token", "check_generate_naive", "check_causal_attention"]
    assert [r.status for r in grade.results] == ["not attempted"] * 3, grade.as_text()
