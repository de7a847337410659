"""How `make test` shares out the suite (``conftest.pytest_collection_modifyitems``): on an xdist
worker, a module's tests form one unit (its costly fixtures are built once) unless the module is
spread; units go out longest first by ``durations.json``; outside xdist nothing is touched."""

from __future__ import annotations

import json

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
    groups = {i.nodeid: [m.args[0] for m in i.marks if m.name == "xdist_group"] for i in items}
    assert groups["tests/test_b.py::t1"] == groups["tests/test_b.py::t2"] == ["tests/test_b.py"]
    assert groups["tests/test_notebooks.py::nb[big]"] == []  # a spread module: each test goes out alone


def test_outside_xdist_the_order_is_as_written(seconds, monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    items = _items()
    conftest.pytest_collection_modifyitems(None, items)
    assert [i.nodeid for i in items] == [i.nodeid for i in _items()] and not any(i.marks for i in items)
