"""Course checks never lie: every exercise's correct answers pass, its typical wrong answers fail
with the intended message, and a check's own crash is never blamed on the learner.

The answers live in ``catalogue/``, one module per chapter (``catalogue/__init__.py``)."""

from __future__ import annotations

from pathlib import Path

import catalogue
import pytest
import torch
import torch.nn.functional as F
from catalogue import answers_by_check
from catalogue.ch01 import causal_attention, generate_naive
from catalogue.ch06 import triton_available

import minillm.course as course
from minillm.course import EXERCISES, CheckFailed
from minillm.course.results import CHECK_ERROR, FAIL, PASS, CheckError, _latest
from minillm.kvcache.block_manager import block_hash as package_block_hash

RIGHT, WRONG = answers_by_check()


def _params(table):
    return [
        pytest.param(check, answer, id=f"{check}-{n}")
        for check, answers in table.items()
        for n, answer in enumerate(answers)
    ]


def test_every_exercise_has_a_catalogue():
    for exercise in EXERCISES:
        if exercise.check == "check_flash_kernel" and not triton_available():
            continue
        assert len(RIGHT.get(exercise.check, [])) >= 2, f"{exercise.check}: fewer than 2 correct answers"
        wrong = len(WRONG.get(exercise.check, []))
        assert wrong >= 12, f"{exercise.check}: {wrong} wrong answers, fewer than 12"
    assert set(RIGHT) <= {e.check for e in EXERCISES}


def test_the_catalogue_is_one_module_per_chapter_listed_in_order():
    """Each chapter's answers in its own module, every module listed in ``CHAPTERS`` (nothing
    found by scanning a folder), each check's answers in its own exercise's chapter, and the
    merged tables fresh on each call (a caller adding to them changes no one else's)."""
    folder = Path(catalogue.__file__).parent
    names = [chapter.__name__.rsplit(".", 1)[1] for chapter in catalogue.CHAPTERS]
    assert names == sorted(p.stem for p in folder.glob("ch*.py")) == [f"ch{n:02d}" for n in range(1, 11)]
    chapter_of = {e.check: e.chapter[:2] for e in EXERCISES}
    for module in catalogue.CHAPTERS:
        checks = set(module.ANSWERS.right_answers) | set(module.ANSWERS.wrong_answers)
        strays = {c: chapter_of.get(c) for c in checks if chapter_of.get(c) != module.__name__[-2:]}
        assert not strays, f"{module.__name__} holds answers of other chapters' checks: {strays}"
    right, _ = answers_by_check()
    right["check_generate_naive"].append(("added by a caller",))
    assert ("added by a caller",) not in answers_by_check()[0]["check_generate_naive"]


@pytest.mark.parametrize("check,answer", _params(RIGHT))
def test_correct_answer_passes(check, answer, capsys):
    result = getattr(course, check)(*answer)
    assert result.status == PASS, result
    assert f"✅ {check}" in capsys.readouterr().out


@pytest.mark.parametrize("check,case", _params(WRONG))
def test_wrong_answer_fails_with_its_message(check, case):
    answer, fragment = case
    with pytest.raises(CheckFailed) as err:
        getattr(course, check)(*answer)
    assert not isinstance(err.value, CheckError), f"the check crashed on a wrong answer: {err.value}"
    assert fragment in str(err.value), str(err.value)
    assert _latest[check].status == FAIL


# ---- how failures look and whom they blame -------------------------------------------------------


def test_learner_crash_shows_one_line_and_only_the_learners_frames():
    def causal_attention(q, k, v):
        return helper(q)

    def helper(q):
        return 1 // 0

    with pytest.raises(CheckFailed) as err:
        course.check_causal_attention(causal_attention)
    lines = err.value._render_traceback_()
    assert lines[0] == (
        "\x1b[31m❌ check_causal_attention: your code raised ZeroDivisionError: integer division or modulo by zero"
        "\x1b[0m"
    )
    frames = "".join(lines[1:])
    assert "in causal_attention" in frames and "in helper" in frames
    assert "minillm" not in frames and "site-packages" not in frames
    assert len(lines) <= 6


def test_wrong_answer_is_one_red_line():
    with pytest.raises(CheckFailed) as err:
        course.check_causal_attention(lambda q, k, v: torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, -1) @ v)
    assert err.value._render_traceback_() == [f"\x1b[31m❌ check_causal_attention: {err.value}\x1b[0m"]


def test_a_crash_inside_the_check_is_not_blamed_on_the_learner(monkeypatch):
    import minillm.course.checks.ch01_decode as checks

    def broken(*args, **kwargs):
        raise IndexError("index 0 is out of bounds")  # a bug in the check's own code

    monkeypatch.setattr(checks, "reference_tokens", broken)
    with pytest.raises(CheckError) as err:
        course.check_generate_naive(generate_naive)
    assert "the check itself failed — please report" in str(err.value)
    assert "IndexError: index 0 is out of bounds" in str(err.value)
    assert "your code" not in str(err.value).split("(")[0]
    assert _latest["check_generate_naive"].status == CHECK_ERROR


def test_nan_from_the_learner_is_explained_not_a_crash():
    def hides_diagonal(q, k, v):
        t = q.shape[-2]
        keep = torch.ones(t, t, dtype=torch.bool).tril(-1)
        scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
        return torch.softmax(scores.masked_fill(~keep, float("-inf")), -1) @ v

    with pytest.raises(CheckFailed) as err:
        course.check_causal_attention(hides_diagonal)
    assert not isinstance(err.value, CheckError)
    assert "nan" in str(err.value) and "diagonal" in str(err.value)


@pytest.mark.parametrize(
    "check,args",
    [
        ("check_block_hash", (package_block_hash,)),
        ("check_causal_attention", (F.scaled_dot_product_attention,)),
    ],
)
def test_package_functions_are_not_graded_as_the_learners(check, args):
    with pytest.raises(CheckFailed, match="not a function you wrote"):
        getattr(course, check)(*args)


def test_reference_answers_of_other_tests_still_pass():
    assert course.check_causal_attention(causal_attention).status == PASS


def test_in_a_notebook_a_failed_check_is_a_short_red_line(tmp_path):
    """What a learner sees in Jupyter: one red line for a wrong answer; for a crash, that line
    plus the learner's own frames — not a traceback through the package."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell("import torch\nfrom minillm.course import check_causal_attention"),
        nbformat.v4.new_code_cell(  # no causal mask
            "def causal_attention(q, k, v):\n    return torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, -1) @ v"
        ),
        nbformat.v4.new_code_cell("check_causal_attention(causal_attention)"),
        nbformat.v4.new_code_cell(
            "def causal_attention(q, k, v):\n    return pick(q)\n\ndef pick(q):\n    return 1 // 0"
        ),
        nbformat.v4.new_code_cell("check_causal_attention(causal_attention)"),
        nbformat.v4.new_code_cell(
            "def causal_attention(q, k, v):\n    t = q.shape[-2]\n    s = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5\n"
            "    return torch.softmax(s.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float('-inf')), -1) @ v"
        ),
        nbformat.v4.new_code_cell("check_causal_attention(causal_attention)"),
    ]
    client = NotebookClient(nb, timeout=120, allow_errors=True, kernel_name="python3")
    client.execute(cwd=str(tmp_path))  # a passing check in a kernel keeps a record (your_engine/): not in the repo
    wrong = [o for o in nb.cells[2].outputs if o.output_type == "error"][0]
    assert len(wrong.traceback) == 1
    assert wrong.traceback[0].startswith("\x1b[31m❌ check_causal_attention: no causal mask")
    crash = [o for o in nb.cells[4].outputs if o.output_type == "error"][0]
    assert crash.traceback[0] == (
        "\x1b[31m❌ check_causal_attention: your code raised ZeroDivisionError: integer division or modulo by zero"
        "\x1b[0m"
    )
    frames = "".join(crash.traceback[1:])
    assert "return pick(q)" in frames and "return 1 // 0" in frames
    assert "minillm" not in frames and len(crash.traceback) <= 4
    right = "".join(o.get("text", "") for o in nb.cells[6].outputs)
    assert right.startswith("✅ check_causal_attention: your attention runs inside every layer")
