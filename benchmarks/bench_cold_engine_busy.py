"""A fresh engine on a cold cache, quiet and beside one busy core: where its first seconds go.

    python benchmarks/bench_cold_engine_busy.py        # 8M model, fp32, ~1 minute

Chapter 10's notebook, run as shipped, took 55.6 s alone and 88.1 s beside a one-core busy loop.
This separates one suspect, the thread governor (``runtime/thread_governor.py``), from the
engine's start: for each case a new interpreter with a cache holding no compiled kernel builds
``LLM("tiny-shakespeare-8m", dtype="fp32")`` and generates 4 × 64 tokens twice. Cases: quiet with
the machine's threads; busy (a plain Python loop on one core at normal priority) with the
machine's threads; busy with ``OMP_NUM_THREADS=1``. Prints the seconds of each part and the
governor's thread count at the end.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import time
t0 = time.perf_counter()
import torch
from minillm import LLM, SamplingParams
t1 = time.perf_counter()
llm = LLM("tiny-shakespeare-8m", dtype="fp32")
t2 = time.perf_counter()
params = SamplingParams(max_tokens=64, ignore_eos=True)
llm.generate(["ROMEO.\n"] * 4, params)
t3 = time.perf_counter()
llm.generate(["ROMEO.\n"] * 4, params)
t4 = time.perf_counter()
g = llm.engine.threads
print(f"{t1 - t0:7.1f} {t2 - t1:7.1f} {t3 - t2:7.2f} {t4 - t3:7.2f} {g.threads:>8} {g.others_busy:8.2f}")
"""
BUSY = "import time\nt = time.time()\nwhile time.time() - t < 120: pass"


def run(busy: bool, threads: int | None) -> str:
    with tempfile.TemporaryDirectory() as cache:
        env = {k: v for k, v in os.environ.items() if k not in ("MINILLM_CACHE", "OMP_NUM_THREADS")}
        env["MINILLM_CACHE"] = cache  # no compiled kernel, no measurements: a cold cache
        if threads:
            env["OMP_NUM_THREADS"] = str(threads)
        competitor = subprocess.Popen([sys.executable, "-c", BUSY]) if busy else None
        try:
            out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=600,
                                 cwd=Path(__file__).resolve().parents[1])  # fmt: skip
        finally:
            if competitor:
                competitor.kill()
        if out.returncode:
            raise RuntimeError(out.stderr[-2000:])
        return out.stdout.strip().splitlines()[-1]


def main() -> None:
    print(f"{os.cpu_count()} CPUs; seconds: import, LLM(), 1st generate, 2nd generate; governor threads, others' busy cores")
    print(f"{'case':>26} {'import':>7} {'LLM()':>7} {'gen 1':>7} {'gen 2':>7} {'threads':>8} {'others':>8}")
    for label, busy, threads in (("quiet, machine's threads", False, None), ("busy, machine's threads", True, None),
                                 ("busy, 1 thread", True, 1)):  # fmt: skip
        print(f"{label:>26} {run(busy, threads)}")


if __name__ == "__main__":
    main()
