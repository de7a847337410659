"""The client that runs notebooks unattended (``minillm/course/headless.py``): a widget cell's
reply is read when it comes, not at the cell's time limit (issue 32's idle kernel: plain
nbclient left a quarter to a half of the cells that draw into an Output widget waiting for
their whole limit), and the grader sees what a cell wrote into a widget."""

from __future__ import annotations

import asyncio
import time
from queue import Empty

import nbformat
import pytest

from minillm.course.grade import grade_notebook
from minillm.course.headless import HeadlessNotebookClient, _sliced

pytestmark = pytest.mark.slow


# A cell that draws into an Output widget while it runs, as chapter 09's planner widget did
# (and as a learner's own widget may): nbclient's emulation answers each draw on the shell socket.
DRAWN_WHILE_RUNNING = """\
out = w.Output()
fig, plans = planner_figure("Llama-2-70B", "H100 SXM 80GB")
out.clear_output(wait=True)
with out:
    display(fig)
    print(table(plans))
out"""
SETUP = "import ipywidgets as w\nfrom minillm.parallel.planner import table\nfrom minillm.viz.planner import planner_figure, planner_widget"


def _cell_seconds(client_class, cell: str, copies: int, limit: float) -> dict[int, float]:
    """Seconds each copy of ``cell`` took, as the client saw it, under a per-cell ``limit``. One
    more copy runs first, uncounted: a kernel's first plotly figure loads plotly's validators,
    seconds on a slow machine (6.4 s once here), which is not the stall (a stalled cell takes
    its whole limit)."""
    cells = [SETUP] + [cell] * (copies + 1)
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    began, took = {}, {}
    client_class(
        nb, timeout=limit, kernel_name="python3",
        on_cell_start=lambda cell, cell_index: began.__setitem__(cell_index, time.monotonic()),
        on_cell_executed=lambda cell, cell_index, execute_reply: took.__setitem__(
            cell_index, time.monotonic() - began[cell_index]),
    ).execute()  # fmt: skip
    return {i: round(s, 1) for i, s in took.items() if i > 1}


def test_cells_drawing_into_a_widget_reply_without_waiting_for_their_limit():
    """24 such cells under an 8 s limit, run as the grader runs them: none takes anywhere near
    it. Plain nbclient stalls a quarter to a half of them for the whole limit
    (``benchmarks/bench_widget_stall.py``), so it fails this test all but once in hundreds."""
    seconds = _cell_seconds(HeadlessNotebookClient, DRAWN_WHILE_RUNNING, copies=24, limit=8)
    assert len(seconds) == 24 and max(seconds.values()) < 6, seconds


def test_the_planner_widget_does_not_stall_a_plain_notebook_runner():
    """nbgrader's autograde (and papermill) run notebooks with plain nbclient: chapter 09's planner
    widget sets its Output widget's contents instead of drawing into it while the cell runs, so
    nothing is echoed to the kernel and no cell waits for its limit — and it still shows the
    figure and the table."""
    from nbclient import NotebookClient

    seconds = _cell_seconds(NotebookClient, "planner_widget()", copies=24, limit=8)
    assert len(seconds) == 24 and max(seconds.values()) < 6, seconds
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(SETUP), nbformat.v4.new_code_cell(
        "shown = planner_widget().children[-1].outputs\n"
        "print(sorted(shown[0]['data']), shown[1]['text'].splitlines()[0])")])  # fmt: skip
    NotebookClient(nb, timeout=60, kernel_name="python3").execute()
    printed = nb.cells[1].outputs[0]["text"]
    assert "application/vnd.plotly.v1+json" in printed and "TP" in printed, printed


def test_the_grader_shows_what_a_stopped_cell_wrote_into_a_widget(tmp_path):
    """A cell that prints into an Output widget, then hangs: the grade's last output is that text
    (with nbclient's widget emulation it went into the widget, and the grade said "no output")."""
    nb = nbformat.v4.new_notebook(
        cells=[
            nbformat.v4.new_code_cell("import time\nimport ipywidgets as w\nout = w.Output()\ndisplay(out)"),
            nbformat.v4.new_code_cell("with out:\n    print('layer 3 of 30 loaded')\ntime.sleep(120)"),
            nbformat.v4.new_code_cell("assert True", metadata={"tags": ["check"]}),
        ]
    )
    nbformat.write(nb, tmp_path / "widget_then_hang.ipynb")
    grade = grade_notebook(tmp_path / "widget_then_hang.ipynb", timeout=120, cell_timeout=4)
    assert grade.error.startswith("timed out in cell 2 of 3 (`with out:`): the cell ran past its limit of 4 s")
    assert "its last output: 'layer 3 of 30 loaded'" in grade.error, grade.error


class _LostWakeUp:
    """A shell channel whose reply is there from ``ready_at`` on, but whose wait only notices it
    when the wait ends (the lost wake-up: a waiting poll sleeps its whole timeout, then a last
    zero-timeout poll finds what is there)."""

    def __init__(self, ready_at: float | None):
        self.ready_at, self.calls = ready_at, 0

    async def get_msg(self, timeout=None):
        self.calls += 1
        await asyncio.sleep(timeout)
        if self.ready_at is not None and time.monotonic() >= self.ready_at:
            return {"msg_type": "execute_reply"}
        raise Empty


def test_a_lost_wake_up_costs_one_slice_not_the_whole_wait():
    channel = _LostWakeUp(ready_at=time.monotonic() + 0.05)
    start = time.monotonic()
    msg = asyncio.run(_sliced(channel.get_msg, slice_s=0.1)(timeout=30))
    assert msg == {"msg_type": "execute_reply"}
    assert time.monotonic() - start < 5.0  # the whole wait was 30 s


def test_a_sliced_wait_still_ends_empty_at_its_deadline():
    channel = _LostWakeUp(ready_at=None)
    start = time.monotonic()
    with pytest.raises(Empty):
        asyncio.run(_sliced(channel.get_msg, slice_s=0.1)(timeout=0.45))
    waited = time.monotonic() - start
    assert 0.44 <= waited < 3.0, waited
    assert channel.calls >= 2


def test_a_wait_without_a_timeout_slices_until_the_reply():
    channel = _LostWakeUp(ready_at=time.monotonic() + 0.25)
    assert asyncio.run(_sliced(channel.get_msg, slice_s=0.1)(timeout=None)) == {"msg_type": "execute_reply"}
    assert channel.calls >= 3
