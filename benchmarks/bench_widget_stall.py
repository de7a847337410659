"""How often a widget cell's reply goes unread until the cell's time limit (issue 32's idle kernel).

Runs a notebook of ``--cells`` copies of chapter 09's ``planner_widget()`` cell (dropdowns and
an Output widget the cell draws a plotly figure and a table into) under a per-cell limit of
``--limit`` seconds, once per client, each in a fresh kernel, and prints per client: the cells
that took the whole limit ("stalled": the kernel had replied long before), the median and the
longest cell, and the wall time. Clients:

- ``nbclient``: ``nbclient.NotebookClient`` as it comes (the grader before this fix);
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


def widget_notebook(cells: int):
    code = ["from minillm.viz.planner import planner_widget"] + ["planner_widget()"] * cells
    return nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in code])


def run(client_class, cells: int, limit: float) -> dict:
    nb = widget_notebook(cells)
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
    names = list(CLIENTS) if args.variants else ["nbclient", "headless"]
    print(f"# {cpu_description()}; {args.cells} planner-widget cells, {args.limit:g} s limit per cell")
    for name in names:
        r = run(CLIENTS[name], args.cells, args.limit)
        print(f"{name:13} stalled {r['stalled']:3d}/{r['cells']}  median cell {r['median_s']:.2f} s  "
              f"longest {r['max_s']:.1f} s  wall {r['wall_s']:.1f} s" + (f"  ({r['error']})" if r["error"] else ""),
              flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
