"""Why ``minillm.viz.display.figure_widget`` imports plotly's widget module on a thread of its own.

CPython 3.11 keeps a thread's frames in chunks; a loop whose calls cross a chunk's end allocates
and frees a chunk on every call (https://github.com/python/cpython/issues/142183, fixed in
3.13). plotly's widget module imports ``rfc3987_syntax`` (through nbformat and jsonschema), which
builds 38 lark parsers at import: a second of pure-Python loops, and slower when they sit on a
chunk's edge — which depends only on how deep the import is called.

    python benchmarks/bench_stack_chunk_edge.py              # all three tables, ~4 minutes
    python benchmarks/bench_stack_chunk_edge.py --tables 3   # the engine's step only

1. One lark parser (``rfc3987_syntax``'s "iri" grammar) built at call depths 0-125 in this
   process: median ms per build at each depth, 5 builds each.
2. The first ``FigureWidget`` in a fresh interpreter, called at depths 0-47 (one chunk): plotly's plain
   ``go.FigureWidget`` against ``figure_widget`` (the import on a new thread), seconds, one
   process per cell of the table.
3. The engine's decode step (the null model of ``bench_step_overhead.py`` behind the paged runner,
   64 running sequences, 1 thread) called at depths 0-47: median µs per step at each depth, as a
   share of the median over all depths.
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


def engine_step_us(depths, running: int = 64, steps: int = 8) -> dict[int, float]:
    import random

    import torch
    from bench_step_overhead import NullModel

    from minillm import LLMEngine, SamplingParams

    torch.set_num_threads(1)
    total = len(depths) * steps + 16
    engine = LLMEngine("tiny-shakespeare-1m", compile=False, num_threads=1, adapt_threads=False, max_num_seqs=running,
                       max_num_batched_tokens=max(512, running * 8), max_model_len=8 + total + 8, kv_cache_memory=None)  # fmt: skip
    engine.runner.model = NullModel(engine.model_config.vocab_size, running)
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=total, ignore_eos=True)
    for _ in range(running):
        engine.add_request([rng.randrange(1, 200) for _ in range(8)], params)
    while engine.scheduler.waiting or not all(s.is_decoding for s in engine.scheduler.running):
        engine.step()

    def run():
        samples = []
        for _ in range(steps):
            start = time.perf_counter()
            engine.step()
            samples.append(time.perf_counter() - start)
        return statistics.median(samples)

    def at(n):
        return at(n - 1) if n else run()

    out = {d: at(d) * 1e6 for d in depths}
    engine.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--widget-depths", type=int, nargs="*", default=list(range(0, 48)))
    parser.add_argument("--tables", type=int, nargs="*", default=[1, 2, 3], choices=[1, 2, 3])
    args = parser.parse_args()
    print(f"Python {platform.python_version()}, {platform.processor() or platform.machine()}")
    if 3 in args.tables:
        steps = engine_step_us(range(48))
        typical = statistics.median(steps.values())
        print(f"\n3. the engine's step, null model, 64 sequences: median {typical:.0f} µs over depths 0-47; "
              f"per depth as a share of it: min {min(steps.values()) / typical:.2f}, max {max(steps.values()) / typical:.2f}")  # fmt: skip
        print("   " + " ".join(f"{d}:{us / typical:.2f}" for d, us in steps.items()))
    if 1 in args.tables:
        builds = lark_build_ms(range(0, 126, 1))
        typical = statistics.median(builds.values())
        print(f"\n1. one lark parser: median {typical:.0f} ms over depths 0-125; depths at ≥ 1.5× that:")
        print("   " + (", ".join(f"{d}: {ms:.0f} ms" for d, ms in builds.items() if ms >= 1.5 * typical) or "none"))
    if 2 in args.tables:
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
