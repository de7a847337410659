"""Grades that hold against a determined student (issue 46): the package's answers refuse the
learner's code in the grading process (``course/guard.py``), the answers on disk are out of its
reach (``course/sandbox.py``), and the constructs that reach around a grader are named.

Each attack below is a learner's exercise cell graded by ``run_check`` — the fresh process the
grader uses, *without* the grader's static scan — so the runtime layer is tested on its own; the
scan is tested apart (``reach_findings``), and the issue's three forgeries end to end."""

from __future__ import annotations

import textwrap

import nbformat
import pytest

from minillm.course.grade import grade_notebook
from minillm.course.isolated import TAMPERED, LearnerCell, run_check
from minillm.course.reach import reach_findings
from minillm.course.sandbox import answer_folders
from tests.test_course_build import CH01, chapter01

pytestmark = pytest.mark.slow

FILTER = "def filter_logits(logits, temperature, top_k, top_p):\n"
REFUSED = "not available while grading"


def cells(*sources: str) -> list[LearnerCell]:
    return [LearnerCell(i + 1, textwrap.dedent(s)) for i, s in enumerate(sources)]


# ---------------------------------------------------------------------------------------------
# The issue's three forgeries (each passed before: 6 of 7 points, nothing reported)
# ---------------------------------------------------------------------------------------------

PROFILE_OFF = (
    "import sys\n"
    "from minillm.sampling import filter_logits as _engine_filter\n"
    f"{FILTER}"
    "    sys.setprofile(None)  # the old watch of the package's answers\n"
    "    return _engine_filter(logits, temperature, top_k, top_p)\n"
)
POOL_WORKER = (
    "from concurrent.futures import ThreadPoolExecutor\n"
    "from minillm.attention import torch_attention\n"
    "def causal_attention(q, k, v):\n"
    "    with ThreadPoolExecutor(1) as pool:  # no notebook frame above the call\n"
    "        return pool.submit(torch_attention, q, k, v, None, True, q.shape[-1] ** -0.5).result()\n"
)
SOLVED_NOTEBOOK = (
    "import json, pathlib\n"
    "import minillm\n"
    "def generate_naive(model, prompt_ids, max_new_tokens):\n"
    "    path = pathlib.Path(minillm.__file__).parents[1] / 'solutions' / '01_prefill_and_decode.ipynb'\n"
    "    namespace = {}\n"
    "    for cell in json.loads(path.read_text())['cells']:\n"
    "        source = ''.join(cell['source'])\n"
    "        if cell['cell_type'] == 'code' and 'import' in source.split('\\n')[0]:\n"
    "            exec(source, namespace)\n"
    "        if cell['cell_type'] == 'code' and source.startswith('def generate_naive'):\n"
    "            exec(source, namespace)\n"
    "    return namespace['generate_naive'](model, prompt_ids, max_new_tokens)\n"
)


def test_the_package_answer_refuses_a_learner_who_switched_the_watch_off():
    result = run_check("check_filter_logits", cells(PROFILE_OFF))
    assert result.status == "fail", result
    assert "cell 1 called the package's minillm.sampling.filter_logits" in result.message, result
    assert REFUSED in result.message


def test_the_package_answer_refuses_a_pool_worker_running_it_for_the_learner():
    result = run_check("check_causal_attention", cells(POOL_WORKER))
    assert result.status == "fail", result
    assert "code on a thread the package did not start called the package's minillm.attention" in result.message
    assert REFUSED in result.message


def test_the_solved_notebooks_are_out_of_the_grading_process_reach():
    result = run_check("check_generate_naive", cells(SOLVED_NOTEBOOK))
    assert result.status == "fail", result
    assert "01_prefill_and_decode.ipynb" in result.message, result  # the read it tried, named
    assert result.sandbox == "answers hidden", result.sandbox


def test_the_issue_forgeries_earn_no_points_end_to_end(tmp_path):
    """The issue's notebook: chapter 01 with the three forgeries in its exercise cells."""
    nb = chapter01(solved=False)
    forged = {"def generate_naive": SOLVED_NOTEBOOK, "def filter_logits": PROFILE_OFF,
              "def causal_attention": POOL_WORKER}  # fmt: skip
    for cell in nb.cells:
        for start, source in forged.items():
            if cell.source.startswith(start):
                cell.source = source
    nbformat.write(nb, tmp_path / f"{CH01}.ipynb")
    grade = grade_notebook(tmp_path / f"{CH01}.ipynb", timeout=240)
    assert grade.points == 0, grade.as_text()
    rows = {r.check: r for r in grade.results}
    for check in ("check_generate_naive", "check_filter_logits", "check_causal_attention"):
        assert rows[check].status == "fail" and rows[check].message.startswith(TAMPERED), rows[check]
    named = rows["check_filter_logits"].message
    assert "uses `.setprofile`" in named and "uses `.__file__`" in named, named


# ---------------------------------------------------------------------------------------------
# Five more ways around a grader, each refused at run time
# ---------------------------------------------------------------------------------------------

ATTACKS = {
    "importlib by a computed name": (
        "import importlib\n"
        f"{FILTER}"
        "    module = importlib.import_module('minillm.' + 'sampl' + 'ing')\n"
        "    return getattr(module, 'filter_' + 'logits')(logits, temperature, top_k, top_p)\n"
    ),
    "gc.get_objects() to find the function": (
        "import gc\n"
        f"{FILTER}"
        "    for obj in gc.get_objects():\n"
        "        try:\n"
        "            found = obj.__name__ == 'filter_logits' and obj.__module__ == 'minillm.sampling'\n"
        "        except Exception:\n"
        "            continue\n"
        "        if found:\n"
        "            return obj(logits, temperature, top_k, top_p)\n"
        "    raise LookupError('not found')\n"
    ),
    "a function rebuilt from its code object": (
        "import types\n"
        "from minillm.sampling import filter_logits as _engine\n"
        f"{FILTER}"
        "    copy = types.FunctionType(_engine.__code__, _engine.__globals__, 'mine', _engine.__defaults__,\n"
        "                              _engine.__closure__)\n"
        "    return copy(logits, temperature, top_k, top_p)\n"
    ),
    "the installed source read and run again": (
        "import minillm.sampling as _module\n"
        f"{FILTER}"
        "    namespace = {}\n"
        "    exec(open(_module.__file__).read(), namespace)\n"
        "    return namespace['filter_logits'](logits, temperature, top_k, top_p)\n"
    ),
    "a fresh import after taking it out of sys.modules": (
        "import importlib, sys\n"
        f"{FILTER}"
        "    saved = sys.modules.pop('minillm.sampling')\n"
        "    try:\n"
        "        fresh = importlib.import_module('minillm.sampling')\n"
        "    finally:\n"
        "        sys.modules['minillm.sampling'] = saved\n"
        "    return fresh.filter_logits(logits, temperature, top_k, top_p)\n"
    ),
    "pickled to a fresh interpreter": (
        "import pickle, subprocess, sys\n"
        "from minillm.sampling import filter_logits as _engine\n"
        f"{FILTER}"
        "    job = pickle.dumps((_engine, (logits, temperature, top_k, top_p)))\n"
        "    run = ('import pickle, sys; fn, args = pickle.loads(sys.stdin.buffer.read()); '\n"
        "           'sys.stdout.buffer.write(pickle.dumps(fn(*args)))')\n"
        "    done = subprocess.run([sys.executable, '-c', run], input=job, capture_output=True)\n"
        "    if done.returncode:\n"
        "        raise RuntimeError(done.stderr.decode()[-300:])\n"
        "    return pickle.loads(done.stdout)\n"
    ),
    "the hook's reference": (
        "import minillm.hooks as hooks\n"
        f"{FILTER}"
        "    return hooks.default('filter_logits')(logits, temperature, top_k, top_p)\n"
    ),
}


@pytest.mark.parametrize("attack", list(ATTACKS), ids=lambda a: a.replace(" ", "-"))
def test_a_way_around_the_grader_gets_no_pass(attack):
    result = run_check("check_filter_logits", cells(ATTACKS[attack]))
    assert result.status == "fail", (attack, result)
    assert result.sandbox == "answers hidden", result.sandbox
    if attack in ("importlib by a computed name", "gc.get_objects() to find the function",
                  "a function rebuilt from its code object", "the hook's reference"):  # fmt: skip
        assert "cell 1 called the package's minillm.sampling.filter_logits" in result.message, result
    elif attack == "pickled to a fresh interpreter":  # its stand-in refused, or the answers' source was not there
        assert REFUSED in result.message or "No module named 'minillm.sampling'" in result.message, result
    else:  # the source it would run again is not there
        assert "filter_logits" in result.message or "KeyError" in result.message, result


def test_a_subclass_that_inherits_the_package_class_gets_no_pass():
    """No learner frame runs when an inherited method does: the stand-in looks at the instance's
    class instead."""
    source = "import minillm.kvcache.contiguous as c\nclass ContiguousKVCache(c.ContiguousKVCache):\n    pass\n"
    result = run_check("check_contiguous_cache", cells(source))
    assert result.status == "fail", result
    assert "your class ContiguousKVCache (it inherits the package's code) called the package's" in result.message


#: A review's attacks (2026-12-05), each of which passed the first version of the stand-ins, and
#: what now refuses it: (check, source, the report's words).
REVIEW_ATTACKS = {
    "a decorator that hands back functools.partial(reference)": ("check_filter_logits", (
        "import functools\n"
        "from minillm.sampling import filter_logits as _engine\n"
        "def _mine(f):\n"
        "    return functools.partial(_engine)\n"
        "@_mine\n"
        f"{FILTER}"
        "    raise NotImplementedError()\n"
    ), "`filter_logits` is a functools.partial, not a function written in your cells"),
    "a class body's staticmethod(partial(reference)) bound as a constant": ("check_filter_logits", (
        "import functools\n"
        "from minillm.sampling import filter_logits as _engine\n"
        "class _Box:\n"
        "    fn = staticmethod(functools.partial(_engine))\n"
        "filter_logits = _Box.fn\n"
    ), "is a functools.partial"),
    "a finalizer that runs the reference as the learner's frame ends": ("check_causal_attention", (
        "import torch, weakref, itertools, collections\n"
        "from minillm.attention import torch_attention\n"
        "class _Token:\n"
        "    pass\n"
        "def causal_attention(q, k, v):\n"
        "    out, results, token = torch.empty_like(q), [], _Token()\n"
        "    weakref.finalize(token, collections.deque(maxlen=0).extend, itertools.chain(\n"
        "        map(results.append, map(torch_attention, [q], [k], [v], [None], [True], [q.shape[-1] ** -0.5])),\n"
        "        map(out.copy_, results)))\n"
        "    return out\n"
    ), "code running for your function (a partial, a finalizer, code renamed as the package's) called the "
       "package's minillm.attention.torch_attention"),
    "the learner's own code renamed as the package's file": ("check_filter_logits", (
        "from minillm.sampling import filter_logits as _engine\n"
        "import minillm.sampling as _s\n"
        f"{FILTER}"
        "    return _engine(logits, temperature, top_k, top_p)\n"
        "class _Patch:\n"
        "    _c = '__co' + 'de__'\n"
        "    setattr(filter_logits, _c, getattr(filter_logits, _c).replace(co_filename=getattr(_s, '__fi' + 'le__')))\n"
    ), "is the function __main__.filter_logits"),
    "torch's fused attention reached by a computed name": ("check_causal_attention", (
        "import torch.nn.functional as F\n"
        "def causal_attention(q, k, v):\n"
        "    return getattr(F, 'scaled_dot_' + 'product_attention')(q, k, v, is_causal=True)\n"
    ), "cell 1 called torch.nn.functional.scaled_dot_product_attention, which is not available while grading"),
}


@pytest.mark.parametrize("attack", list(REVIEW_ATTACKS), ids=lambda a: a.replace(" ", "-"))
def test_a_review_attack_gets_no_pass(attack):
    check, source, words = REVIEW_ATTACKS[attack]
    result = run_check(check, cells(source))
    assert result.status == "fail" and words in result.message, (attack, result)


@pytest.mark.parametrize("attack", [a for a in ATTACKS if a != "the hook's reference"],  # ordinary code to read:
                         ids=lambda a: a.replace(" ", "-"))  # the stand-in refuses it at run time  # fmt: skip
def test_the_static_scan_names_each_way_around(attack):
    found = reach_findings(cells(ATTACKS[attack]))
    assert found and all(f.startswith("cell 1: ") for f in found), (attack, found)


def test_the_issue_forgeries_are_named_by_the_scan():
    assert "cell 1: uses `.setprofile`" in reach_findings(cells(PROFILE_OFF))
    assert "cell 1: uses `.__file__`" in reach_findings(cells(SOLVED_NOTEBOOK))
    assert reach_findings(cells("import ctypes\n", "def f():\n    return ctypes.c_int(1)\n")) == [
        "cell 2: uses `ctypes` (raw memory)"]
    assert reach_findings(cells("def f(x):\n    return getattr(x, 'settrace')\n")) == [
        "cell 1: names `settrace` in a string"]
    assert reach_findings(cells("def f():\n    import gc\n    return gc\n"))[0] == (
        "cell 1: imports `gc` (the interpreter's object graph)")


def test_a_scratch_cell_the_grader_never_runs_costs_nothing():
    """Top-level statements are not run in the grading process: ``gc.collect()`` or a look at a
    signature there reaches nothing."""
    scratch = "import gc, inspect\ngc.collect()\nprint(inspect.signature(filter_logits))\n"
    assert reach_findings(cells(scratch)) == []


# ---------------------------------------------------------------------------------------------
# Honest answers are untouched
# ---------------------------------------------------------------------------------------------

def honest_filter() -> str:
    """The solved filter_logits, written with torch.nn.functional's softmax: imports a learner
    may well use."""
    from pathlib import Path

    solved = nbformat.read(Path(__file__).resolve().parents[1] / "solutions" / f"{CH01}.ipynb", as_version=4)
    cell = next(c.source for c in solved.cells if c.cell_type == "code" and c.source.startswith("def filter_logits"))
    return "import torch\nimport torch.nn.functional as F\n" + cell.replace("x.softmax(dim=-1)", "F.softmax(x, dim=-1)")


def test_an_honest_answer_with_torch_functional_passes_and_is_not_flagged():
    source = honest_filter()
    assert "F.softmax(" in source
    assert reach_findings(cells(source)) == []
    result = run_check("check_filter_logits", cells(source))
    assert result.status == "pass", result
    assert result.sandbox == "answers hidden"


def test_the_answers_are_hidden_only_from_the_grading_process():
    """The folders the grader hides are there for everyone else (its mounts are its own)."""
    folders = answer_folders()
    assert any(f.name == "solutions" for f in folders), folders
    assert all(any(f.iterdir()) for f in folders if f.name in ("solutions", "tests")), folders


@pytest.mark.parametrize("chapter", [c for c in ("02_kv_cache", "03_paged_kv_cache", "04_batching",
                                                 "05_attention_variants", "06_flash_attention", "07_quantization",
                                                 "08_speculative_decoding", "09_parallelism", "10_serving")])  # fmt: skip
def test_every_solved_check_passes_with_the_answers_out_of_reach(chapter):
    """Every solved exercise, graded in the fresh process with its stand-ins in place and the
    answers hidden: no honest solution calls what the stand-ins refuse (chapter 01: graded whole
    in ``test_course_build.py``)."""
    from pathlib import Path

    from minillm.course import CHECKS_BY_CHAPTER
    from minillm.course.grade import restore_check_cells
    from minillm.course.isolated import learner_cells, run_checks

    root = Path(__file__).resolve().parents[1] / "solutions"
    nb = nbformat.read(root / f"{chapter}.ipynb", as_version=4)
    graded = restore_check_cells(nb, CHECKS_BY_CHAPTER[chapter], "nonce")
    results = run_checks([(name, learner_cells(nb, i, graded)) for i, name in graded.items()], cwd=str(root))
    assert {n: r.status for n, r in results.items()} == {n: "pass" for n in graded.values()}, results
    assert {r.sandbox for r in results.values()} == {"answers hidden"}


@pytest.mark.parametrize("user", ["this user", "an unprivileged user"])
def test_the_folders_are_hidden_for_root_and_for_a_normal_user(user):
    """``hide_answers`` in a child process — as root a mount namespace, as anyone else one inside a
    user namespace — empties the folder there and leaves it as it was for everyone else."""
    import json
    import os
    import shutil
    import tempfile
    from pathlib import Path

    from minillm.course.sandbox import hide_answers

    if user == "an unprivileged user" and os.getuid() != 0:
        pytest.skip("this user is unprivileged already (the other case)")
    tmp = Path(tempfile.mkdtemp())  # where nobody may look too (pytest's tmp_path is its owner's alone)
    os.chmod(tmp, 0o755)
    folder = tmp / "solutions"
    folder.mkdir()
    (folder / "01.ipynb").write_text("the answers")
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop to nobody where asked, hide, report what it sees
        try:
            if user == "an unprivileged user":
                os.setgid(65534)
                os.setuid(65534)
            why = hide_answers([folder])
            os.write(write, json.dumps([why, sorted(os.listdir(folder))]).encode())
        except BaseException as err:  # noqa: BLE001 - said to the parent, which fails on it
            os.write(write, json.dumps([f"the child failed: {err!r}", None]).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        why, seen = json.loads(pipe.read())
    os.waitpid(pid, 0)
    assert seen is not None, why
    if why is not None:  # the kernel refused: said, not claimed
        assert "namespace" in why or "could not" in why, why
    else:
        assert seen == [], seen
    assert sorted(os.listdir(folder)) == ["01.ipynb"]
    shutil.rmtree(tmp)


def test_a_machine_that_refuses_the_sandbox_is_said_so_in_every_row(tmp_path):
    """Where the kernel refuses a namespace, the report does not claim the answers were hidden:
    each row says so, the CSV's sandbox column and the JSON's per-check field too."""
    import csv
    import json

    from minillm.course.grade import NotebookGrade, write_csv
    from minillm.course.isolated import _verdict

    refused = "the kernel refused a mount namespace (Operation not permitted)"
    rows = [_verdict(name, json.dumps({"status": status, "message": "m", "exposed": refused}))
            for name, status in (("check_generate_naive", "pass"), ("check_filter_logits", "fail"))]  # fmt: skip
    grade = NotebookGrade(notebook="n.ipynb", chapter=CH01, results=rows)
    text = grade.as_text().splitlines()[1:]
    assert len(text) == 2 and all(f"[answers NOT hidden: {refused}]" in line for line in text), text
    assert all(c["sandbox"] == f"answers NOT hidden: {refused}" for c in grade.as_dict()["checks"])
    write_csv([grade], tmp_path / "grades.csv")
    with open(tmp_path / "grades.csv", newline="") as f:
        (row,) = list(csv.DictReader(f))
    assert row["sandbox"] == f"answers NOT hidden: {refused}"
