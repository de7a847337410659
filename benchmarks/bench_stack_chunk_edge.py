"""Why ``minillm.viz.display.figure_widget`` imports plotly's widget module on a thread of its own.

CPython 3.11 keeps a thread's frames in chunks; a loop whose calls cross a chunk's end allocates
and frees a chunk on every call (https://github.com/python/cpython/issues/142183, fixed in
3.13). plotly's widget module imports ``rfc3987_syntax`` (through nbformat and jsonschema), which
builds 38 lark parsers at import: a second of pure-Python loops, and slower when they sit on a
chunk's edge — which depends only on how deep the import is called.

    python benchmarks/bench_stack_chunk_edge.py            # both tables, ~3 minutes

1. One lark parser (``rfc3987_syntax``'s "iri" grammar) built at call depths 0-125 in this
   process: median ms per build at each depth, 5 builds each.
2. The first ``FigureWidget`` in a fresh interpreter, called at depths 0-47 (one chunk): plotly's plain
   ``go.FigureWidget`` against ``figure_widget`` (the import on a new thread), seconds, one
   process per cell of the table.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import subprocess
import sys
import time

CHILD = r"""
import sys, time
depth, how = int(sys.argv[1]), sys.argv[2]
import plotly.graph_objects as go
def make():
    start = time.perf_counter()
    if how == "plotly":
        go.FigureWidget()
    else:
        from minillm.viz.display import figure_widget
        figure_widget()
    return time.perf_counter() - start
import ipywidgets, minillm.viz.display  # imported first in both: only the widget module differs
def at(n):
    return at(n - 1) if n else make()
print(at(depth))
"""


def lark_build_ms(depths, repeats: int = 5) -> dict[int, float]:
    from lark import Lark
    from rfc3987_syntax import syntax_helpers as rfc

    def build():
        start = time.perf_counter()
        Lark(rfc.grammar, start="iri", parser=rfc.RFC3987_SYNTAX_PARSER_TYPE)
        return time.perf_counter() - start

    def at(n):
        return at(n - 1) if n else build()

    return {d: statistics.median(at(d) for _ in range(repeats)) * 1e3 for d in depths}


def first_widget_s(depth: int, how: str) -> float:
    out = subprocess.run([sys.executable, "-c", CHILD, str(depth), how], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--widget-depths", type=int, nargs="*", default=list(range(0, 48)))
    args = parser.parse_args()
    print(f"Python {platform.python_version()}, {platform.processor() or platform.machine()}")
    builds = lark_build_ms(range(0, 126, 1))
    typical = statistics.median(builds.values())
    print(f"\n1. one lark parser: median {typical:.0f} ms over depths 0-125; depths at ≥ 1.5× that:")
    print("   " + (", ".join(f"{d}: {ms:.0f} ms" for d, ms in builds.items() if ms >= 1.5 * typical) or "none"))
    print("\n2. the first FigureWidget in a fresh interpreter, seconds")
    print(f"{'depth':>6} {'go.FigureWidget':>16} {'figure_widget':>14}")
    rows = []
    for depth in args.widget_depths:
        plain, threaded = first_widget_s(depth, "plotly"), first_widget_s(depth, "minillm")
        rows.append((plain, threaded))
        print(f"{depth:>6} {plain:16.2f} {threaded:14.2f}")
    print(f"{'max':>6} {max(r[0] for r in rows):16.2f} {max(r[1] for r in rows):14.2f}")
    print(f"{'median':>6} {statistics.median(r[0] for r in rows):16.2f} {statistics.median(r[1] for r in rows):14.2f}")


if __name__ == "__main__":
    main()
