"""Student notebooks are generated from the solutions, and graded."""

from __future__ import annotations

import csv
from pathlib import Path

import nbformat
import pytest

from minillm.course.build import build, read_notebook, strip_solutions, student_notebook
from minillm.course.exercises import EXERCISES as ALL_EXERCISES
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
        student = student_notebook(nbformat.read(path, as_version=4), chapter=path.stem)
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
@pytest.mark.parametrize("chapter", ["01_prefill_and_decode"])  # every chapter's solved cells run under nbval
def test_grading_a_solved_chapter_passes_every_check(chapter):
    from minillm.course import CHECKS_BY_CHAPTER

    solved = grade_notebook(SOLUTIONS / f"{chapter}.ipynb")
    assert solved.error is None
    expected = len(CHECKS_BY_CHAPTER[chapter])
    assert solved.total == expected and solved.passed == expected, solved.as_text()


@pytest.mark.slow
@pytest.mark.parametrize("chapter", ["01_prefill_and_decode"])
def test_grading_a_blank_chapter_passes_none(chapter):
    """(One test with the solved grade above once; split so the two grades run on two workers.)"""
    from minillm.course import CHECKS_BY_CHAPTER

    blank = grade_notebook(NOTEBOOKS / f"{chapter}.ipynb")
    assert blank.total == len(CHECKS_BY_CHAPTER[chapter]) and blank.passed == 0, blank.as_text()
    assert all(r.status == "not attempted" for r in blank.results)


@pytest.mark.slow
def test_grading_a_folder_writes_a_csv(tmp_path):
    submissions = tmp_path / "submissions"
    submissions.mkdir()
    nbformat.write(chapter01(solved=True), submissions / "01_prefill_and_decode.ipynb")  # its exercises and checks (the whole chapter is graded in the test above)
    nb = chapter01(solved=True)
    for cell in nb.cells:  # a learner who got the attention scale wrong
        cell.source = cell.source.replace("/ math.sqrt(q.shape[-1])", "")
    (submissions / "alice").mkdir()
    nbformat.write(nb, submissions / "alice" / "01_prefill_and_decode.ipynb")
    grades = grade_folder(submissions)
    by_name = {Path(g.notebook).parent.name: g for g in grades}
    again = {Path(g.notebook).parent.name: g for g in grade_folder(submissions)}  # graded twice: the same grades
    assert {k: g.as_dict()["checks"] for k, g in again.items()} == {k: g.as_dict()["checks"] for k, g in by_name.items()}
    assert by_name["alice"].passed == 4
    failed = [r for r in by_name["alice"].results if r.status == "fail"]
    assert failed[0].check == "check_causal_attention" and "not scaled" in failed[0].message
    lost = POINTS["check_causal_attention"] + POINTS["check_transformer"]  # the whole model uses her attention too
    assert (by_name["alice"].points, by_name["alice"].max_points) == (CH01_POINTS - lost, CH01_POINTS)
    rows = list(csv.DictReader(open(submissions / "grades.csv")))
    assert len(rows) == 2 and {r["check_causal_attention"] for r in rows} == {"pass", "fail"}
    assert {(r["points"], r["max_points"]) for r in rows} == {(str(CH01_POINTS), str(CH01_POINTS)), (str(CH01_POINTS - lost), str(CH01_POINTS))}


# ------------------------------------------------------------------------------------------
# A hostile notebook cannot forge its grade
# ------------------------------------------------------------------------------------------

HEADER = (
    "import math\nimport torch\nimport torch.nn.functional as F\n"
    "from minillm.course import check_causal_attention, check_filter_logits, check_generate_naive, check_sample, "
    "check_stopping, check_transformer, forward_logits, apply_rotary, model_weights, rope_cos_sin"
)
EXERCISES = (
    "def generate_naive",
    "def append_token",
    "def filter_logits",
    "from minillm.sampling import filtered_logits",
    "def causal_attention",
    "def rms_norm",
)
CH01_CHECKS = [
    "check_generate_naive",
    "check_stopping",
    "check_filter_logits",
    "check_sample",
    "check_causal_attention",
    "check_transformer",
]


POINTS = {e.check: e.points for e in ALL_EXERCISES}
CH01_POINTS = sum(POINTS[c] for c in CH01_CHECKS)


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
fake = {"check": "check_generate_naive", "status": "pass", "message": "forged"}
log = os.environ.get("MINILLM_GRADE_LOG", "grade.log")
with open(log, "a") as f:
    f.write("this is not json\\n" + json.dumps(fake) + "\\n")
print("✅ check_generate_naive: forged")
display({"application/vnd.minillm.verdict+json": {"nonce": "guess", **fake}}, raw=True)
"""


@pytest.mark.slow
def test_forged_verdicts_and_edited_check_cells_do_not_count(tmp_path):
    nb = chapter01(solved=False)
    nb.cells.insert(1, nbformat.v4.new_code_cell(FORGERY))
    checks = [c for c in nb.cells if "check" in c.metadata.get("tags", [])]
    checks[0].source = 'print("✅ check_generate_naive: passes")'  # the learner edited the check cell
    nb.cells.remove(checks[2])  # ... and deleted another
    path = tmp_path / "01_prefill_and_decode.ipynb"
    nbformat.write(nb, path)
    grade = grade_notebook(path, timeout=120)
    assert grade.error is None, grade.error
    # nothing forged counts, and the forgery itself is named: every check fails as tampered
    assert [r.status for r in grade.results] == ["fail"] * len(CH01_CHECKS), grade.as_text()
    assert all(r.message.startswith("graded as tampered: cell 2: writes out a verdict") for r in grade.results)


@pytest.mark.slow
def test_restored_check_cells_grade_a_solved_notebook(tmp_path):
    nb = chapter01(solved=True)
    checks = [c for c in nb.cells if "check" in c.metadata.get("tags", [])]
    checks[1].source = "pass"  # emptied
    nb.cells.remove(checks[2])  # deleted: the grader appends it after the last cell
    path = tmp_path / "01_prefill_and_decode.ipynb"
    nbformat.write(nb, path)
    grade = grade_notebook(path, timeout=120)
    assert grade.passed == len(CH01_CHECKS), grade.as_text()


@pytest.mark.slow
def test_one_broken_notebook_does_not_stop_a_folder(tmp_path):
    (tmp_path / "bob").mkdir()
    (tmp_path / "bob" / "01_prefill_and_decode.ipynb").write_text("{ this is not a notebook")
    (tmp_path / "carol").mkdir()
    nbformat.write(chapter01(solved=True), tmp_path / "carol" / "01_prefill_and_decode.ipynb")
    grades = {Path(g.notebook).parent.name: g for g in grade_folder(tmp_path, timeout=120)}
    assert grades["bob"].error and grades["bob"].passed == 0
    assert grades["carol"].passed == len(CH01_CHECKS) and grades["carol"].error is None
    rows = {Path(r["notebook"]).parent.name: r for r in csv.DictReader(open(tmp_path / "grades.csv"))}
    assert rows["bob"]["error"] and rows["carol"]["passed"] == "6"


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
    checks[0].source = "check_generate_naive(lambda model, prompt_ids, n: [])"  # their own answer, not the exercise
    path = tmp_path / "submission.ipynb"
    nbformat.write(nb, path)
    grade = grade_notebook(path, timeout=120)
    assert [r.check for r in grade.results] == CH01_CHECKS
    assert [r.status for r in grade.results] == ["not attempted"] * len(CH01_CHECKS), grade.as_text()


# ------------------------------------------------------------------------------------------
# Student notebooks are nbgrader release notebooks; nbgrader source notebooks
# ------------------------------------------------------------------------------------------

CH01 = "01_prefill_and_decode"


def test_built_notebooks_carry_their_chapter_and_nbgrader_metadata():
    from minillm.course import EXERCISES
    from minillm.course.build import nbgrader_checksum

    for path in NOTEBOOKS.glob("*.ipynb"):
        nb = nbformat.read(path, as_version=4)
        assert nb.metadata["minillm"]["chapter"] == path.stem
        graded = {c.metadata.nbgrader.grade_id: c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade")}
        exercises = [e for e in EXERCISES if e.chapter == path.stem]
        assert sorted(graded) == sorted(e.check for e in exercises), path.name
        for e in exercises:
            cell = graded[e.check]
            assert cell.source == e.call and "check" in cell.metadata.tags
            assert cell.metadata.nbgrader == {
                "schema_version": 3,
                "grade": True,
                "solution": False,
                "locked": True,
                "grade_id": e.check,
                "points": e.points,
                "checksum": nbgrader_checksum(cell),
                "cell_type": "code",
            }
            assert cell.metadata.editable is False and cell.metadata.deletable is False
        ids = []
        for cell in nb.cells:
            meta = cell.metadata.get("nbgrader")
            assert "HIDDEN TESTS" not in cell.source and "BEGIN SOLUTION" not in cell.source
            if "exercise" in cell.metadata.get("tags", []):
                assert meta["solution"] and not meta["grade"] and not meta["locked"], path.name
                assert meta["grade_id"].startswith("answer_") and cell.metadata.deletable is False
            if meta:
                ids.append(meta["grade_id"])
                assert meta["checksum"] == nbgrader_checksum(cell)
        assert len(ids) == len(set(ids)), path.name


def test_source_check_cells_end_in_a_hidden_test_the_release_removes():
    from minillm.course.build import release_notebook, source_notebook

    source = source_notebook(read_notebook(SOLUTIONS / f"{CH01}.ipynb"), chapter=CH01)
    checks = [c for c in source.cells if c.metadata.get("nbgrader", {}).get("grade")]
    assert [c.metadata.nbgrader.grade_id for c in checks] == CH01_CHECKS
    for cell in checks:
        name = cell.metadata.nbgrader.grade_id
        assert cell.source.startswith(f"{name}(") and f"require_pass({name!r})" in cell.source
        assert "### BEGIN HIDDEN TESTS" in cell.source and cell.outputs  # the source keeps its outputs
    release = release_notebook(source)
    assert release == nbformat.read(NOTEBOOKS / f"{CH01}.ipynb", as_version=4)


def test_hidden_tests_written_in_a_solution_are_kept_for_nbgrader_and_stripped_for_students():
    from minillm.course.build import source_notebook

    solved = read_notebook(SOLUTIONS / f"{CH01}.ipynb")
    with_tests = read_notebook(SOLUTIONS / f"{CH01}.ipynb")
    cell = next(c for c in with_tests.cells if c.source == "check_generate_naive(generate_naive)")
    cell.source += "\n### BEGIN HIDDEN TESTS\nassert generate_naive(None, [1], 0) == []\n### END HIDDEN TESTS"
    assert student_notebook(with_tests, chapter=CH01) == student_notebook(solved, chapter=CH01)
    source = source_notebook(with_tests, chapter=CH01)
    cell = next(c for c in source.cells if c.source.startswith("check_generate_naive("))
    assert "assert generate_naive(None, [1], 0) == []" in cell.source and "require_pass(" in cell.source

    stray = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(cell.source.replace("check_", "x_"))])
    with pytest.raises(ValueError, match="hidden-test region outside a graded check cell"):
        student_notebook(stray)


def test_an_exercise_without_its_check_cell_is_an_error_for_nbgrader_and_a_warning_for_the_build():
    from minillm.course.build import source_notebook

    nb = read_notebook(SOLUTIONS / f"{CH01}.ipynb")
    nb.cells = [c for c in nb.cells if c.source != "check_generate_naive(generate_naive)"]
    with pytest.raises(ValueError, match="check_generate_naive"):
        source_notebook(nb, chapter=CH01)
    with pytest.warns(UserWarning, match="check_generate_naive"):
        student = student_notebook(nb, chapter=CH01)
    assert sum(bool(c.metadata.get("nbgrader", {}).get("grade")) for c in student.cells) == len(CH01_CHECKS) - 1


def test_nbgrader_source_writes_an_nbgrader_course(tmp_path, capsys):
    from minillm.cli import main
    from minillm.course.build import nbgrader_source

    written = nbgrader_source(SOLUTIONS, tmp_path, [CH01])
    source = tmp_path / "source" / CH01 / f"{CH01}.ipynb"
    assert written == [source, tmp_path / "nbgrader_config.py"]
    assert nbformat.read(source, as_version=4).metadata.minillm.chapter == CH01
    assert "c.Execute.timeout" in (tmp_path / "nbgrader_config.py").read_text()
    with pytest.raises(FileExistsError):  # an instructor's edited source is not overwritten
        nbgrader_source(SOLUTIONS, tmp_path, [CH01])
    with pytest.raises(ValueError, match="no chapter 99_nothing"):
        nbgrader_source(SOLUTIONS, tmp_path, ["99_nothing"])
    (tmp_path / "nbgrader_config.py").write_text("c = get_config()\n")  # their own config is kept
    assert main(["course", "nbgrader-source", str(tmp_path), "--chapter", CH01, "--overwrite"]) == 0
    assert (tmp_path / "nbgrader_config.py").read_text() == "c = get_config()\n"
    assert f"wrote {source}" in capsys.readouterr().out


def test_student_notebooks_are_what_nbgrader_generate_assignment_makes():
    """nbgrader's own generate_assignment steps (all but saving to its database), run on our
    source notebooks, give exactly the built notebooks: checksums, locks, stubs and all."""
    pytest.importorskip("nbgrader")
    import warnings

    from nbgrader.converters.generate_assignment import GenerateAssignment
    from nbgrader.nbgraderformat import MetadataValidator
    from nbgrader.preprocessors import SaveCells
    from nbgrader.utils import compute_checksum

    from minillm.course.build import source_notebook

    for path in sorted(SOLUTIONS.glob("*.ipynb")):
        with warnings.catch_warnings():  # completeness is the test above's business
            warnings.simplefilter("ignore")
            nb = source_notebook(read_notebook(path), chapter=path.stem, strict=False)
        MetadataValidator().validate_nb(nb)
        resources: dict = {}
        for step in GenerateAssignment.preprocessors.default():
            if step is not SaveCells:
                nb, resources = step().preprocess(nb, resources)
        built = nbformat.read(NOTEBOOKS / path.name, as_version=4)
        assert nb == built, f"{path.name}: the build and nbgrader disagree"
        for cell in built.cells:
            if "nbgrader" in cell.metadata:
                assert cell.metadata.nbgrader.checksum == compute_checksum(cell)


# ------------------------------------------------------------------------------------------
# The grader: chapter from metadata, points, time limit, notebooks that are not the course's
# ------------------------------------------------------------------------------------------


def test_the_chapter_comes_from_the_notebook_metadata_first(tmp_path):
    from minillm.course.grade import find_chapter

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x = 1")])
    nb.metadata["minillm"] = {"chapter": CH01}
    assert find_chapter(tmp_path / "02_kv_cache.ipynb", nb) == CH01  # metadata beats the file name
    assert find_chapter(tmp_path / "whatever-Copy1.ipynb", nb) == CH01  # a renamed copy, checks deleted
    nb.metadata["minillm"] = {"chapter": "99_future_chapter"}
    assert find_chapter(tmp_path / "02_kv_cache.ipynb", nb) == "02_kv_cache"
    nb.metadata.pop("minillm")
    assert find_chapter(tmp_path / "mine.ipynb", nb) is None
    nb.cells.append(nbformat.v4.new_code_cell("check_contiguous_cache(ContiguousKVCache)"))
    assert find_chapter(tmp_path / "mine.ipynb", nb) == "02_kv_cache"


def test_a_notebook_that_is_not_part_of_the_course_is_reported_as_such(tmp_path):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("raise SystemExit('never run')")])
    nbformat.write(nb, tmp_path / "homework.ipynb")
    grade = grade_notebook(tmp_path / "homework.ipynb")
    assert not grade.course and grade.results == []
    assert grade.as_text().startswith(f"{tmp_path / 'homework.ipynb'}: not a course notebook")
    assert grade.as_dict()["points"] is None and grade.as_dict()["course_notebook"] is False
    grade_folder(tmp_path)
    (row,) = csv.DictReader(open(tmp_path / "grades.csv"))
    assert row["points"] == "" and row["error"].startswith("not a course notebook")


def test_points_and_totals_in_text():
    from minillm.course.grade import NotebookGrade
    from minillm.course.results import CheckResult

    grade = NotebookGrade(
        "alice.ipynb",
        CH01,
        [
            CheckResult("check_generate_naive", "pass", "ok"),
            CheckResult("check_stopping", "not attempted", "not attempted yet"),
            CheckResult("check_causal_attention", "fail", "not scaled"),
        ],
    )
    assert (grade.points, grade.max_points, grade.passed, grade.total) == (2, 7, 1, 3)
    text = grade.as_text().splitlines()
    assert text[0] == f"alice.ipynb ({CH01}): 1/3 checks passed, 2/7 points"
    assert text[1] == "  [PASS] check_generate_naive (2/2)"
    assert text[3] == "  [FAIL] check_causal_attention (0/2) — fail: not scaled"
    assert [c["points"] for c in grade.as_dict()["checks"]] == [2, 0, 0]


@pytest.mark.slow
def test_a_notebook_that_runs_past_its_time_is_stopped_and_the_cell_named(tmp_path):
    import time

    nb = nbformat.v4.new_notebook(
        cells=[
            nbformat.v4.new_markdown_cell("# my work"),
            nbformat.v4.new_code_cell("x = 1"),
            nbformat.v4.new_code_cell("import time\nwhile True:\n    time.sleep(0.05)"),
            nbformat.v4.new_code_cell("check_generate_naive(generate_naive)", metadata={"tags": ["check"]}),
        ]
    )
    nb.metadata["minillm"] = {"chapter": CH01}
    nbformat.write(nb, tmp_path / "loop.ipynb")
    start = time.monotonic()
    grade = grade_notebook(tmp_path / "loop.ipynb", timeout=6)
    assert time.monotonic() - start < 90  # 6 s a run, one retry, then each check on its own
    assert grade.error.startswith("timed out in cell 3 of 4 (`import time`): the notebook ran past its limit of 6 s")
    # graded from the source all the same: nothing above the check cell defines the exercise
    assert [r.status for r in grade.results] == ["fail"] * len(CH01_CHECKS)
    assert "no `generate_naive` is defined" in grade.results[0].message
    assert grade.points == 0 and grade.max_points == CH01_POINTS


def test_a_check_shown_on_a_lambda_does_not_make_a_notebook_that_chapter(tmp_path):
    """Chapter 00 calls ``check_causal_attention`` on a lambda to show what a check looks like. A copy
    of it without metadata, under another name, was once graded as chapter 01: 0/4, three
    NameErrors. It is no chapter (and, with no check cells, not a course notebook); a notebook
    that defines a chapter's exercise, or checks it, is that chapter."""
    from minillm.course.grade import find_chapter

    welcome = nbformat.read(SOLUTIONS / "00_welcome.ipynb", as_version=4)
    welcome.metadata.pop("minillm", None)
    assert "check_causal_attention(lambda" in "".join(c.source for c in welcome.cells)
    assert find_chapter(tmp_path / "solved_00.ipynb", welcome) is None
    nbformat.write(welcome, tmp_path / "solved_00.ipynb")
    grade = grade_notebook(tmp_path / "solved_00.ipynb")
    assert not grade.course and grade.error.startswith("not a course notebook"), grade.as_text()

    mine = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("def pack_int4(q):\n    return q")])
    assert find_chapter(tmp_path / "mine.ipynb", mine) is None  # half of an exercise: not yet evidence
    mine.cells.append(nbformat.v4.new_code_cell("def unpack_int4(p):\n    return p"))
    assert find_chapter(tmp_path / "mine.ipynb", mine) == "07_quantization"


@pytest.mark.slow
def test_a_renamed_copy_without_its_check_cells_still_expects_all_its_checks(tmp_path):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x = 1")])
    nb.metadata["minillm"] = {"chapter": CH01}
    nbformat.write(nb, tmp_path / "my copy.ipynb")
    grade = grade_notebook(tmp_path / "my copy.ipynb", timeout=120)
    assert [r.check for r in grade.results] == CH01_CHECKS
    assert grade.passed == 0 and grade.max_points == CH01_POINTS, grade.as_text()


@pytest.mark.slow
def test_grade_command_prints_points_as_json_and_writes_a_csv(tmp_path, capsys):
    import json

    from minillm.cli import main

    nb = chapter01(solved=True)
    nb.metadata["minillm"] = {"chapter": CH01}
    nbformat.write(nb, tmp_path / "carol.ipynb")
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("1")]), tmp_path / "scratch.ipynb")
    assert main(["course", "grade", str(tmp_path), "--json", "--timeout", "120"]) == 0
    by_name = {Path(g["notebook"]).name: g for g in json.loads(capsys.readouterr().out)}
    carol, scratch = by_name["carol.ipynb"], by_name["scratch.ipynb"]
    assert (carol["chapter"], carol["points"], carol["max_points"], carol["passed"]) == (CH01, CH01_POINTS, CH01_POINTS, 6), carol
    assert [c["points"] for c in carol["checks"]] == [POINTS[c] for c in CH01_CHECKS]
    assert scratch["course_notebook"] is False and scratch["points"] is None
    rows = {Path(r["notebook"]).name: r for r in csv.DictReader(open(tmp_path / "grades.csv"))}
    assert (rows["carol.ipynb"]["points"], rows["carol.ipynb"]["max_points"]) == (str(CH01_POINTS),) * 2
    assert list(rows["carol.ipynb"])[6:12] == CH01_CHECKS


def test_cells_without_ids_get_the_same_ids_on_every_build(tmp_path):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# a"), nbformat.v4.new_code_cell("x = 1")])
    raw = nbformat.writes(nb).replace(f'"id": "{nb.cells[1].id}",', "")  # a cell written without an id
    (tmp_path / "nb.ipynb").write_text(raw)
    first, second = read_notebook(tmp_path / "nb.ipynb"), read_notebook(tmp_path / "nb.ipynb")
    assert first.cells[0].id == nb.cells[0].id  # ids that are there are kept
    assert first.cells[1].id == second.cells[1].id != nb.cells[1].id


def test_the_command_line_default_time_limit_is_the_graders():
    from minillm.cli import DEFAULT_GRADE_CELL_TIMEOUT, DEFAULT_GRADE_TIMEOUT
    from minillm.course.grade import DEFAULT_CELL_TIMEOUT, DEFAULT_TIMEOUT

    assert DEFAULT_GRADE_TIMEOUT == DEFAULT_TIMEOUT and DEFAULT_GRADE_CELL_TIMEOUT == DEFAULT_CELL_TIMEOUT


def test_a_cell_that_runs_the_learners_code_outside_its_check_lets_run_all_go_on():
    """Chapter 01's example cells call ``decoder_layer`` and ``transformer_forward`` (and plug in
    ``append_token``): in a student
    notebook they raise the stub's NotImplementedError until the exercise is written, so they are
    tagged ``raises-exception`` (JupyterLab's Run All, nbclient and nbval go on past them); the
    exercise cell, the check cell and a cell that only mentions a name are not."""
    from minillm.course.build import RUNS_LEARNER_CODE, student_notebook

    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell("def decoder_layer(x):\n    ### BEGIN SOLUTION\n    return x\n    ### END SOLUTION"),
        nbformat.v4.new_code_cell("print(decoder_layer(1))"),
        nbformat.v4.new_code_cell("check_transformer(rms_norm, decoder_layer, transformer_forward)"),
        nbformat.v4.new_code_cell("f = decoder_layer  # named, not called"),
        nbformat.v4.new_code_cell("outs = run_elsewhere(decoder_layer, 2)"),  # handed to a call that runs it
    ]
    tagged = [RUNS_LEARNER_CODE in c.metadata.get("tags", []) for c in student_notebook(nb, CH01).cells]
    assert tagged == [False, True, False, False, True]
    shipped = nbformat.read(NOTEBOOKS / f"{CH01}.ipynb", as_version=4)
    calls = [c for c in shipped.cells if RUNS_LEARNER_CODE in c.metadata.get("tags", [])]
    assert len(calls) == 3, [c.source[:60] for c in calls]  # the stopping example, the layer's, the model's
    assert all(any(name in c.source for name in ("append_token=", "decoder_layer(", "transformer_forward(")) for c in calls)
