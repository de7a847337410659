"""How often a widget cell's reply goes unread until the cell's time limit (issue 32's idle kernel).

Runs a notebook of ``--cells`` copies of a widget cell under a per-cell limit of ``--limit``
seconds, in a fresh kernel per run, and prints per run: the cells that took the whole limit
("stalled": the kernel had replied long before), the median and the longest cell, the wall time.
The cells:

- ``drawn-while-running``: chapter 09's planner widget as it was before this fix — an Output
  widget the cell draws a plotly figure and a table into (``with out: display(fig)``);
- ``planner-widget``: ``planner_widget()`` as shipped, which sets the Output widget's contents.

The clients:

- ``nbclient``: ``nbclient.NotebookClient`` as it comes (nbgrader's and papermill's runner, and
  the grader before this fix);
- ``headless``: ``minillm.course.headless.HeadlessNotebookClient``, as the grader runs now;
- ``no-emulation`` and ``sliced-wait``: each of its two changes alone (``--variants``).

    python benchmarks/bench_widget_stall.py [--cells 60] [--limit 12] [--variants]

A benchmark, not a test (``tests/test_headless_client.py`` is the test); nothing else should run.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
from bench_cold_kernel import cpu_description  # noqa: E402

from minillm.course.headless import HeadlessNotebookClient, _sliced  # noqa: E402


class NoEmulation(NotebookClient):
    def __init__(self, nb, km=None, **kw):
        super().__init__(nb, km=km, **kw)
        self.widget_registry = {}


class SlicedWait(NotebookClient):
    async def async_start_new_kernel_client(self):
        kc = await super().async_start_new_kernel_client()
        kc.shell_channel.get_msg = _sliced(kc.shell_channel.get_msg)
        return kc


CLIENTS = {"nbclient": NotebookClient, "headless": HeadlessNotebookClient,
           "no-emulation": NoEmulation, "sliced-wait": SlicedWait}  # fmt: skip


SETUP = "import ipywidgets as w\nfrom minillm.parallel.planner import table\nfrom minillm.viz.planner import planner_figure, planner_widget"
CELLS = {
    "drawn-while-running": """\
out = w.Output()
fig, plans = planner_figure("Llama-2-70B", "H100 SXM 80GB")
out.clear_output(wait=True)
with out:
    display(fig)
    print(table(plans))
out""",
    "planner-widget": "planner_widget()",
}


def run(client_class, cell: str, cells: int, limit: float) -> dict:
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in [SETUP] + [cell] * cells])
    began: dict[int, float] = {}
    took: dict[int, float] = {}
    client = client_class(
        nb, timeout=limit, kernel_name="python3", allow_errors=True,
        on_cell_start=lambda cell, cell_index: began.__setitem__(cell_index, time.monotonic()),
        on_cell_executed=lambda cell, cell_index, execute_reply: took.__setitem__(
            cell_index, time.monotonic() - began[cell_index]),
    )  # fmt: skip
    start = time.monotonic()
    error = None
    try:
        client.execute(stderr=subprocess.DEVNULL)
    except Exception as err:  # a cell that timed out for real: say so, keep the others' figures
        error = f"{type(err).__name__}: {str(err).splitlines()[0][:120]}"
    widget_cells = [s for i, s in took.items() if i > 0]
    return {
        "stalled": sum(s >= limit - 0.5 for s in widget_cells),
        "cells": len(widget_cells),
        "median_s": statistics.median(widget_cells) if widget_cells else float("nan"),
        "max_s": max(widget_cells, default=float("nan")),
        "wall_s": time.monotonic() - start,
        "error": error,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cells", type=int, default=60)
    parser.add_argument("--limit", type=float, default=12.0)
    parser.add_argument("--variants", action="store_true", help="also each of the two changes alone")
    args = parser.parse_args()
    runs = [("drawn-while-running", name) for name in (CLIENTS if args.variants else ["nbclient", "headless"])]
    runs.append(("planner-widget", "nbclient"))
    print(f"# {cpu_description()}; {args.cells} cells a run, {args.limit:g} s limit per cell")
    for cell, name in runs:
        r = run(CLIENTS[name], CELLS[cell], args.cells, args.limit)
        print(f"{cell:19} {name:13} stalled {r['stalled']:3d}/{r['cells']}  median cell {r['median_s']:.2f} s  "
              f"longest {r['max_s']:.1f} s  wall {r['wall_s']:.1f} s" + (f"  ({r['error']})" if r["error"] else ""),
              flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
