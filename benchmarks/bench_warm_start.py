"""A warm start: the engine's first answers when its compiled decode step is already on disk.

    python benchmarks/bench_warm_start.py                # SmolLM2-135M, 3 rounds, ~1 minute
    python benchmarks/bench_warm_start.py --rounds 5

Run ``minillm warmup`` first (the packages must be on disk for this checkout's code). Each round
starts two fresh processes, one after the other, on that warm cache; each times ``LLM(model)``
with the defaults from before ``import minillm``, then runs five 32-token greedy generations
back to back, as a notebook does right after its first cell:

* **shipped** — the packages on disk are loaded before ``LLM()`` returns
  (``background_compile.load_packages_on_disk``), without inductor's instruction-set probes
  (``compiled_decode.load_package``);
* **before** — the same code with both turned off: the packages are loaded by the background
  build's thread while the first answers decode eagerly beside it, with inductor's probes.

Prints, per case, the median over the rounds of ``LLM()``'s seconds, the time until the first
answer was complete, each generation's tokens per second, and the CPU. Nothing else should run
meanwhile (2 cores).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from statistics import median

import torch

from minillm.machine import machine_description

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import minillm.engine.builder as builder
import minillm.runtime.compiled_decode as compiled_decode
if sys.argv[2] == "before":
    import torch
    builder.load_packages_on_disk = lambda compiled, job: ()
    compiled_decode.load_package = lambda path: torch._inductor.aoti_load_package(str(path))
from minillm import LLM, SamplingParams
llm = LLM(sys.argv[1])
t1 = time.perf_counter()
params = SamplingParams(max_tokens=32, ignore_eos=True, temperature=0)
rates, first = [], None
for _ in range(5):
    start = time.perf_counter()
    out = llm.generate(["The three primary colours are"], params)[0]
    end = time.perf_counter()
    rates.append(len(out.token_ids) / (end - start))
    first = first or end - t0
status = llm.fast_path_status()
print(json.dumps({"llm": t1 - t0, "first_answer": first, "rates": rates, "state": status.state,
                  "compiled": sorted(llm.engine.graphs.compile_seconds)}))
"""


def cpu() -> str:
    """The CPU's model, cores and the flags that decide the fast paths (``minillm.machine``)."""
    m = machine_description(torch.device("cpu"))
    return f"{m['cpu']}, {m['cpu_count']} CPUs, flags {' '.join(m['cpu_flags']) or '-'}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    root = Path(__file__).resolve().parents[1]
    runs: dict[str, list[dict]] = {"shipped": [], "before": []}
    for _ in range(args.rounds):
        for case in runs:
            out = subprocess.run([sys.executable, "-c", CHILD, args.model, case], capture_output=True, text=True,
                                 cwd=root, timeout=600)  # fmt: skip
            if out.returncode:
                raise RuntimeError(out.stderr[-2000:])
            row = json.loads(out.stdout.strip().splitlines()[-1])
            if row["compiled"]:
                raise RuntimeError(f"{case}: it compiled {row['compiled']}; run `minillm warmup` first")
            runs[case].append(row)
    print(f"{cpu()}; {args.model}, warm cache, {args.rounds} rounds, medians")
    print(f"{'case':>8} {'LLM() s':>8} {'first answer s':>15}   tok/s of generations 1-5")
    for case, rows in runs.items():
        rates = [median(r["rates"][i] for r in rows) for i in range(5)]
        print(f"{case:>8} {median(r['llm'] for r in rows):>8.2f} {median(r['first_answer'] for r in rows):>15.2f}   "
              + " ".join(f"{x:6.1f}" for x in rates))  # fmt: skip


if __name__ == "__main__":
    main()
