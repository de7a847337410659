"""Grades an instructor can trust (``minillm/course/isolated.py``, ``grade.py``): every graded
check runs again in a fresh process from the learner's source, so a notebook cannot redefine a
check, write a verdict or hand in the package's own answer; a hung notebook names the code cell
that hung, with its last output, and is retried once; the same folder graded twice grades alike
(``test_course_build.py``)."""

from __future__ import annotations

import textwrap
import time
from pathlib import Path

import nbformat
import pytest

from minillm.course.grade import grade_notebook
from minillm.course.isolated import TAMPERED, LearnerCell, definitions, run_check, tamper_findings
from tests.test_course_build import CH01, chapter01

pytestmark = pytest.mark.slow

SOLVED_GENERATE = (
    "from minillm.course import forward_logits\n"
    "def generate_naive(model, prompt_ids, max_new_tokens):\n"
    "    ids = list(prompt_ids)\n"
    "    for _ in range(max_new_tokens):\n"
    "        ids.append(int(forward_logits(model, ids)[-1].argmax()))\n"
    "    return ids[len(prompt_ids):]\n"
)
SIGNATURE = "def generate_naive(model, prompt_ids, max_new_tokens)"


def cells(*sources: str) -> list[LearnerCell]:
    return [LearnerCell(i + 1, textwrap.dedent(s)) for i, s in enumerate(sources)]


# ---------------------------------------------------------------------------------------------
# Forgeries
# ---------------------------------------------------------------------------------------------

FOUR_LINE_FORGERY = """
from minillm.course import results
from minillm.course.results import CheckResult
def check_generate_naive(fn):
    results._record(CheckResult("check_generate_naive", "pass", "forged"))
"""


def test_the_four_line_forgery_is_caught(tmp_path):
    """The issue's forgery, in an exercise cell: in the notebook it reads "pass | forged"; graded,
    every check of the notebook is a fail naming the cell and what it did."""
    nb = chapter01(solved=False)
    exercise = next(i for i, c in enumerate(nb.cells) if c.source.startswith("def generate_naive"))
    nb.cells[exercise].source += "\n" + FOUR_LINE_FORGERY
    nbformat.write(nb, tmp_path / f"{CH01}.ipynb")
    grade = grade_notebook(tmp_path / f"{CH01}.ipynb", timeout=120)
    assert grade.passed == 0 and grade.points == 0, grade.as_text()
    first = grade.results[0]
    assert first.status == "fail" and first.message.startswith(TAMPERED), first.message
    assert f"cell {exercise + 1}: defines `check_generate_naive`" in first.message
    assert "`._record`" in first.message


@pytest.mark.parametrize(
    "forgery",
    [
        # the same forgery hidden from a reader: it runs when the def runs (a default value)
        "def generate_naive(model, prompt_ids, max_new_tokens, "
        "_=getattr(__import__('minillm.course.results', fromlist=['x']), '_re' + 'cord')"
        "(getattr(__import__('minillm.course.results', fromlist=['x']), 'Check' + 'Result')"
        "('check_generate_naive', 'pass', 'x'))):\n"
        "    return []\n",
        # replacing the check in the package, from a decorator
        "def swap(fn):\n"
        "    import minillm.course as c\n"
        "    setattr(c, 'check_generate_naive', lambda f: None)\n"
        "    return fn\n"
        "@swap\n"
        f"{SIGNATURE}:\n"
        "    return []\n",
    ],
    ids=["verdict-written-at-def-time", "check-replaced-by-a-decorator"],
)
def test_forgeries_a_reader_would_miss_do_not_pass_in_the_fresh_process(forgery):
    assert tamper_findings(cells(forgery)) == []  # nothing a reader's scan sees ...
    result = run_check("check_generate_naive", cells(forgery))
    assert result.status == "fail", result  # ... but the check that grades is the package's own


def test_a_library_function_replaced_while_the_check_runs_is_tampering():
    source = (
        "import torch\n"
        "from minillm.course import forward_logits\n"
        f"{SIGNATURE}:\n"
        "    answer = int(forward_logits(model, prompt_ids)[-1].argmax())\n"
        "    torch.argmax = lambda *a, **k: torch.tensor(answer)\n"  # the check's own argmax now agrees
        "    return [answer] * max_new_tokens\n"
    )
    result = run_check("check_generate_naive", cells(source))
    assert result.status == "fail" and result.message.startswith(TAMPERED), result
    assert "cell 1 put its own `argmax` into torch" in result.message


def test_the_package_answer_imported_and_returned_is_reported():
    """The issue's shortcut: import the package's own int8 quantizer and return what it returns."""
    source = """
    import torch
    from minillm.quantization.int8 import quantize_int8

    def quantize_per_channel(weight):
        return quantize_int8(weight)
    """
    result = run_check("check_quantize_per_channel", cells(source))
    assert result.status == "fail", result
    assert "cell 1 called the package's minillm.quantization.int8.quantize_int8" in result.message
    assert "an answer to this exercise that is not yours" in result.message


def test_the_course_private_reference_is_reported_too():
    source = """
    from minillm.course.checks import ch01_decode

    def generate_naive(model, prompt_ids, max_new_tokens):
        x = torch.ones(1, 1, 2, 2)
        ch01_decode._reference_attention(x, x, x)
        return [0] * max_new_tokens
    """
    result = run_check("check_generate_naive", cells("import torch\n" + textwrap.dedent(source)))
    assert result.status == "fail" and "cell 1 calls the course's own _reference_attention" in result.message, result


def test_a_definition_that_needs_a_computed_global_is_told_why():
    first = "from minillm import LLM\nllm = LLM('smollm2-135m')\nBIAS = 0\n"
    second = f"{SIGNATURE}:\n    return [BIAS + len(llm.tokenizer) * 0] * max_new_tokens\n"
    result = run_check("check_generate_naive", cells(first, second))
    assert result.status == "fail"
    assert "cell 1's computation of `llm`" in result.message and "pass it to your function" in result.message


def test_only_definitions_imports_and_constants_are_kept():
    python, kept, dropped = definitions(
        "import torch\n%time x = 1\nBLOCK = 16\nSHAPE = (BLOCK, 2)\nmodel = torch.nn.Linear(2, 2)\n"
        "def f():\n    return BLOCK\nprint(f())\nclass A:\n    pass\n"
    )
    kinds = [(type(node).__name__, quiet) for node, quiet in kept]
    assert kinds == [("Import", False), ("Assign", True), ("Assign", True), ("FunctionDef", False),
                     ("ClassDef", False)]  # fmt: skip
    assert dropped == {"model": "Assign"} and "run_line_magic" in python


def test_a_syntax_error_or_a_missing_function_is_named():
    result = run_check("check_generate_naive", cells(f"{SIGNATURE}\n    return []\n"))
    assert result.status == "fail" and "no `generate_naive` is defined" in result.message
    assert "cell 1 has a syntax error" in result.message


def test_a_check_that_never_ends_is_stopped_and_named():
    source = f"{SIGNATURE}:\n    print('thinking')\n    while True:\n        pass\n"
    result = run_check("check_generate_naive", cells(source), timeout=20)
    assert result.status == "fail" and "did not finish within 20 s" in result.message
    assert "thinking" in result.message  # its last output


def test_ctrl_c_while_a_check_runs_stops_its_process_too():
    """The grader's Ctrl-C while a check runs: the check's process (and its session) ends with it,
    instead of running on to its end — the grader would otherwise wait for it as it exits."""
    import os
    import signal
    import threading

    from conftest import child_pids

    before = child_pids()
    source = f"{SIGNATURE}:\n    while True:\n        pass\n"
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # (a shell's `cmd &` ignores SIGINT)
    started = threading.Event()
    try:
        # A real SIGINT, as a terminal sends: `_thread.interrupt_main()` only sets Python's flag, which
        # a main thread blocked in select() sees when the wait times out (120 s in run15), not at once.
        press = lambda: (started.wait(), time.sleep(3), os.kill(os.getpid(), signal.SIGINT))  # noqa: E731
        threading.Thread(target=press, daemon=True).start()
        with pytest.raises(KeyboardInterrupt):
            started.set()
            run_check("check_generate_naive", cells(source), timeout=120)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert child_pids() - before == set()


def test_ctrl_c_as_the_check_process_starts_stops_it_too(monkeypatch):
    """A Ctrl-C that lands while the checker is still starting (seconds under load: the fork server
    may be importing torch) is held back until the checker is known, then stops it — before, such a
    checker ran a learner's endless loop on a core for the rest of the CI run (run23)."""
    import signal

    from minillm.course import isolated

    started = []

    class PressedWhileStarting(isolated._Checker):
        def __init__(self, *args):
            super().__init__(*args)
            started.append(self.process.pid)
            signal.raise_signal(signal.SIGINT)  # the key press, as the start finishes

    monkeypatch.setattr(isolated, "_Checker", PressedWhileStarting)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            run_check("check_generate_naive", cells(f"{SIGNATURE}:\n    while True:\n        pass\n"), timeout=120)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert started
    try:
        with open(f"/proc/{started[0]}/stat") as stat:
            state = stat.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        state = "gone"
    assert state in ("gone", "Z"), f"the checker {started[0]} still runs (state {state})"


def test_a_second_verdict_on_the_channel_is_tampering():
    """The learner's code finds the grader's pipe and writes a pass on it before the check ends."""
    source = """
    import json, os

    def generate_naive(model, prompt_ids, max_new_tokens):
        forged = (json.dumps({"status": "pass", "message": "forged"}) + "\\n").encode()
        for fd in os.listdir("/proc/self/fd"):
            try:
                if os.readlink(f"/proc/self/fd/{fd}").startswith("pipe:"):
                    os.write(int(fd), forged)
            except OSError:
                pass
        return []
    """
    result = run_check("check_generate_naive", cells(source))
    assert result.status == "fail" and result.message != "forged", result
    assert TAMPERED in result.message


# ---------------------------------------------------------------------------------------------
# No silent hangs
# ---------------------------------------------------------------------------------------------


def _looping_notebook(tmp_path: Path) -> Path:
    nb = nbformat.v4.new_notebook(
        cells=[
            nbformat.v4.new_markdown_cell("# my work"),
            nbformat.v4.new_code_cell(SOLVED_GENERATE),
            nbformat.v4.new_code_cell(
                "import time\nprint('step 1 done', flush=True)\nwhile True:\n    time.sleep(0.05)"
            ),
            nbformat.v4.new_markdown_cell("Next, the check."),
            nbformat.v4.new_code_cell("check_generate_naive(generate_naive)", metadata={"tags": ["check"]}),
        ]
    )
    nb.metadata["minillm"] = {"chapter": CH01}
    nbformat.write(nb, tmp_path / "loop.ipynb")
    return tmp_path / "loop.ipynb"


def test_a_hung_cell_is_named_with_its_last_output_retried_once_and_still_graded(tmp_path):
    grade = grade_notebook(_looping_notebook(tmp_path), timeout=120, cell_timeout=8)
    assert grade.error.startswith("timed out in cell 3 of 5 (`import time`): the cell ran past its limit of 8 s")
    assert "'step 1 done'" in grade.error and "the first run stopped too" in grade.error
    assert grade.retried and "cell 3" in grade.retried
    # the hang does not cost the exercise that was written: it is graded from its source
    assert grade.results[0].check == "check_generate_naive" and grade.results[0].status == "pass", grade.as_text()


def test_time_lost_between_cells_is_not_blamed_on_a_markdown_cell(tmp_path, monkeypatch):
    """The notebook's time runs out while no cell runs (as when the kernel idles between cells):
    the report names the last code cell that finished and says the time went outside the cells,
    never a markdown cell."""
    import minillm.course.grade as grade_module

    clock = {"t": 0.0}
    real = grade_module._now
    monkeypatch.setattr(grade_module, "_now", lambda: real() + clock["t"])
    nb = nbformat.v4.new_notebook(
        cells=[
            nbformat.v4.new_code_cell("x = 1"),
            nbformat.v4.new_markdown_cell("Between the cells."),
            nbformat.v4.new_code_cell("y = 2"),
            nbformat.v4.new_code_cell("assert x + y == 3", metadata={"tags": ["check"]}),
        ]
    )
    path = tmp_path / "idle.ipynb"  # not a course chapter: its own check cell, nothing graded apart
    nbformat.write(nb, path)

    original = grade_module._run

    def run_then_idle(*args, **kwargs):  # 1000 s pass while the kernel sits between cells 1 and 3
        from nbclient import NotebookClient

        execute_cell = NotebookClient.async_execute_cell

        async def slow(self, cell, cell_index, **kw):
            if cell_index == 1:
                clock["t"] += 1000
            return await execute_cell(self, cell, cell_index, **kw)

        monkeypatch.setattr(NotebookClient, "async_execute_cell", slow)
        return original(*args, **kwargs)

    monkeypatch.setattr(grade_module, "_run", run_then_idle)
    grade = grade_notebook(path, timeout=900)
    assert "ran out after cell 1 of 4 (`x = 1`) finished" in grade.error, grade.error
    assert "outside them" in grade.error and "cell 2" not in grade.error


def test_a_solution_that_uses_the_course_scheduler_view_is_not_a_shortcut():
    """Chapter 04's solved scheduler reads the check's view of the scheduler (a course class with
    private-looking dunder methods): that is the exercise's input, not the course's answer."""
    from minillm.course import CHECKS_BY_CHAPTER
    from minillm.course.grade import restore_check_cells
    from minillm.course.isolated import learner_cells, run_checks

    root = Path(__file__).resolve().parent.parent / "solutions"
    nb = nbformat.read(root / "04_batching.ipynb", as_version=4)
    graded = restore_check_cells(nb, CHECKS_BY_CHAPTER["04_batching"], "nonce")
    results = run_checks([(name, learner_cells(nb, i, graded)) for i, name in graded.items()], cwd=str(root))
    assert {name: r.status for name, r in results.items()} == {name: "pass" for name in graded.values()}, results


def test_a_grading_script_without_a_main_guard_runs_once(tmp_path):
    """The fresh process each notebook's checks run in is forked from a server that has imported
    torch and the course (``isolated._Checker``). Started the way ``spawn`` starts a process, it
    would import the grader's main script again: an instructor's script without
    ``if __name__ == "__main__":`` would then grade again inside every grading. It runs once, and
    the check's verdict comes back."""
    import subprocess
    import sys

    runs = tmp_path / "runs.txt"
    script = tmp_path / "grade_my_class.py"
    script.write_text(
        textwrap.dedent(f"""
        from minillm.course.isolated import LearnerCell, run_checks
        with open({str(runs)!r}, "a") as f:
            f.write("ran\\n")
        cell = LearnerCell(1, {SOLVED_GENERATE!r})
        print(run_checks([("check_generate_naive", [cell])])["check_generate_naive"].status)
    """)
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "pass", done.stdout[-2000:]
    assert runs.read_text() == "ran\n"
