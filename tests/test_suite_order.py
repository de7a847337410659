"""How `make test` shares out the suite (``conftest.pytest_collection_modifyitems``): on an xdist
worker, a module's tests form one unit (its costly fixtures are built once) unless the module is
spread; units go out longest first by ``durations.json``; outside xdist nothing is touched."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import conftest
import pytest


class _Item:
    def __init__(self, nodeid: str, notebook: bool = False):
        self.nodeid, self.marks, self.notebook = nodeid, [], notebook

    def add_marker(self, mark):
        self.marks.append(mark)

    def get_closest_marker(self, name):
        return self.notebook if name == "notebook" else None


@pytest.fixture
def seconds(tmp_path, monkeypatch):
    path = tmp_path / "durations.json"
    path.write_text(json.dumps({"tests/test_b.py::t1": 5.0, "tests/test_b.py::t2": 5.0, "tests/test_a.py::t1": 8.0,
                                "tests/test_notebooks.py::nb[big]": 300.0}))  # fmt: skip
    monkeypatch.setattr(conftest, "DURATIONS", path)


def _items():
    return [_Item("tests/test_a.py::t1"), _Item("tests/test_b.py::t1"), _Item("tests/test_b.py::t2"),
            _Item("tests/test_notebooks.py::nb[small]", True), _Item("tests/test_notebooks.py::nb[big]", True)]  # fmt: skip


def test_on_a_worker_modules_are_units_and_the_longest_go_first(seconds, monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    items = _items()
    conftest.pytest_collection_modifyitems(None, items)
    assert [i.nodeid for i in items] == [
        "tests/test_notebooks.py::nb[big]",  # 300 s
        "tests/test_notebooks.py::nb[small]",  # a notebook not yet measured: NOTEBOOK_S = 40 s
        "tests/test_b.py::t1", "tests/test_b.py::t2",  # one unit of 10 s
        "tests/test_a.py::t1",  # 8 s
    ]  # fmt: skip
    assert conftest.unit_of("tests/test_b.py::t1") == conftest.unit_of("tests/test_b.py::t2") == "tests/test_b.py"
    assert conftest.unit_of("tests/test_notebooks.py::nb[big]") == "tests/test_notebooks.py::nb[big]"  # spread: alone


def test_outside_xdist_the_order_is_as_written(seconds, monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    items = _items()
    conftest.pytest_collection_modifyitems(None, items)
    assert [i.nodeid for i in items] == [i.nodeid for i in _items()] and not any(i.marks for i in items)


@pytest.mark.parametrize("probe", range(8))
def test_probe_records_its_worker(probe):
    """Run by the test below, in a two-worker pytest of its own: says which worker ran it."""
    log = os.environ.get("MINILLM_SUITE_ORDER_PROBE")
    if not log:
        pytest.skip("a probe for test_a_module_runs_on_one_worker_in_a_real_two_worker_run")
    with open(log, "a") as f:
        f.write(f"{os.environ['PYTEST_XDIST_WORKER']} {probe}\n")


@pytest.mark.parametrize("spread", [False, True])
def test_a_module_runs_on_one_worker_in_a_real_two_worker_run(tmp_path, spread):
    """Eight probes of one module, beside another module's tests, in `make test`'s own
    scheduling (``conftest.pytest_xdist_make_scheduler``): one worker runs them all. Spread and
    alone, they are eight units, and the scheduler starts both workers on them. (With ``--dist loadgroup`` and
    ``xdist_group`` marks, which pytest 9 ignores, a module's tests were split.)"""
    log = tmp_path / "workers.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env["MINILLM_SUITE_ORDER_PROBE"] = str(log)
    env["MINILLM_TEST_SPREAD_ALSO"] = "test_suite_order.py" if spread else ""
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadscope", "--no-loadscope-reorder",
         "-p", "no:cacheprovider", "-o", "addopts=", "tests/test_suite_order.py::test_probe_records_its_worker"]
        + ([] if spread else ["tests/test_block_manager.py"]),
        cwd=root, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:]
    runs = [line.split() for line in log.read_text().splitlines()]
    assert sorted(int(probe) for _, probe in runs) == list(range(8))
    assert len({worker for worker, _ in runs}) == (2 if spread else 1), runs
