"""Batch-1 TPOT of the compiled 1-row decode graph of whichever minillm is on ``PYTHONPATH``,
so that two checkouts can be run one after the other on the same machine (a regression hunt).

    MINILLM_CACHE=/tmp/cache PYTHONPATH=/tmp/old python benchmarks/bench_batch1_compiled.py old
    MINILLM_CACHE=/tmp/cache PYTHONPATH=.        python benchmarks/bench_batch1_compiled.py new

SmolLM2-135M in bf16, 2 threads, ``compile_batch_sizes=(1,)`` (the graph is compiled on the first
run of a checkout and loaded after), 64-token random prompts, 64 new tokens; prints one JSON
line: every request's TPOT and the median without the first. Uses only the public API of
2026-12-01 onward. Run the checkouts alternately, several rounds: on a shared machine one
checkout's median moves by more than a regression's size between rounds.
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import time

import torch

from minillm import LLM, SamplingParams


def main(label: str) -> dict:
    torch.set_num_threads(2)
    llm = LLM("smollm2-135m", dtype="bf16", compile=True, compile_batch_sizes=(1,), num_threads=2)
    started = time.perf_counter()
    status = llm.wait_for_fast_path()
    waited = time.perf_counter() - started
    rng = random.Random(0)
    tpots = []
    for _ in range(7):
        prompt = [rng.randrange(100, 40000) for _ in range(64)]
        out = llm.generate([prompt], SamplingParams(max_tokens=64, ignore_eos=True))[0]
        tpots.append(out.metrics.tpot * 1000)
    row = {
        "checkout": label,
        "state": status.state,
        "waited_s": round(waited, 1),
        "tpot_ms": [round(t, 2) for t in tpots],
        "median": round(statistics.median(tpots[1:]), 2),
    }
    print(json.dumps(row))
    return row


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "this checkout")
