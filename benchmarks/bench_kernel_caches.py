"""What oneDNN's kernel caches keep per new prompt length, with PyTorch's defaults and bounded.

    python benchmarks/bench_kernel_caches.py                     # 200 new lengths, tiny-shakespeare-8m
    python benchmarks/bench_kernel_caches.py --lengths 100 --capacity 64

Each case runs in a fresh process (the capacities are read when the first kernel is built): an
fp32 engine (compile off: the eager linear layers are the subject) generates 2 tokens for prompts
of ``--lengths`` lengths it has not seen before, and glibc's ``mallinfo2`` (after a trim) gives the
bytes in use before and after. ``minillm serve`` runs bounded (``minillm/server/heap.py``).
Also prints the seconds each case took: a smaller cache rebuilds evicted kernels.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

CASE = """
import json, sys, time
from minillm.server import heap
if int(sys.argv[1]):
    heap.bound_kernel_caches(int(sys.argv[1]))
from minillm import LLM, SamplingParams
llm = LLM(sys.argv[3], dtype="fp32", kv_cache_memory=64 << 20, compile=False, enable_prefix_caching=False)
run = lambda n: llm.generate(" ".join(["KING"] * n), SamplingParams(max_tokens=2, ignore_eos=True))
for n in (1, 2, 3):
    run(n)
before, start = heap.malloc_stats()["in_use"], time.perf_counter()
for n in range(4, 4 + int(sys.argv[2])):
    run(n)
print(json.dumps({"grown_mb": (heap.malloc_stats()["in_use"] - before) / 1e6, "seconds": time.perf_counter() - start}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny-shakespeare-8m")
    parser.add_argument("--lengths", type=int, default=200)
    parser.add_argument("--capacity", type=int, default=256, help="the bounded case's entries per cache")
    args = parser.parse_args()
    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}
    results = {}
    for name, capacity in (("PyTorch's defaults (1,024 each)", 0), (f"bounded ({args.capacity} each)", args.capacity)):
        done = subprocess.run([sys.executable, "-c", CASE, str(capacity), str(args.lengths), args.model],
                              capture_output=True, text=True, env=env, cwd=Path(__file__).parents[1])  # fmt: skip
        if done.returncode:
            raise SystemExit(done.stderr[-2000:])
        results[name] = json.loads(done.stdout.strip().splitlines()[-1])
        r = results[name]
        print(f"{name}: malloc in use {r['grown_mb']:+.1f} MB after {args.lengths} new prompt lengths "
              f"({r['grown_mb'] / args.lengths:.2f} MB per length), {r['seconds']:.1f} s")  # fmt: skip


if __name__ == "__main__":
    main()
