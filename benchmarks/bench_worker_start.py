"""How long a parallel call takes to start its workers: spawned (a fresh interpreter per rank)
against forked from the fork server that has imported torch (``minillm.parallel.start_method``).

Three shapes, each timed both ways in this one run: a course check's 2-rank all-reduce and a
4-rank one (``run_ranks``), and a tensor-parallel engine of the 8M model on 2 ranks, created and
asked for 8 tokens (``WorkerGroup``). The first call of each way is printed apart: the fork
server's first call starts the server (it imports torch once). Run:

    python benchmarks/bench_worker_start.py
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.multiprocessing as mp

from minillm import LLM, SamplingParams
from minillm.machine import machine_description
from minillm.parallel import start_method
from minillm.parallel.launch import run_ranks

REPEATS = 5


def all_reduce(rank, world_size):
    import torch
    import torch.distributed as dist

    t = torch.ones(4)
    dist.all_reduce(t)
    return t.tolist()


def tp_engine():
    llm = LLM("tiny-shakespeare-8m", dtype="fp32", tensor_parallel_size=2, compile=False)
    llm.generate("KING.\nNow is", SamplingParams(max_tokens=8, ignore_eos=True))
    llm.close()


def seconds(fn) -> tuple[float, float]:
    """The first call's seconds, and the median of the next ``REPEATS``."""
    start = time.perf_counter()
    fn()
    first = time.perf_counter() - start
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return first, statistics.median(times)


def main() -> None:
    fork_server = start_method.context
    shapes = {
        "check, 2 ranks": lambda: run_ranks(all_reduce, 2),
        "check, 4 ranks": lambda: run_ranks(all_reduce, 4),
        "TP-2 engine, 8 tokens": tp_engine,
    }
    print(f"{machine_description(torch.device('cpu'))}; first call, then the median of {REPEATS}")
    print(f"{'shape':>22} {'spawned':>18} {'fork server':>18} {'ratio':>7}")
    for name, fn in shapes.items():
        start_method.context = lambda: mp.get_context("spawn")
        spawned = seconds(fn)
        start_method.context = fork_server
        forked = seconds(fn)
        print(f"{name:>22} {spawned[0]:7.2f} s {spawned[1]:7.2f} s {forked[0]:7.2f} s {forked[1]:7.2f} s "
              f"{spawned[1] / forked[1]:6.1f}x")  # fmt: skip


if __name__ == "__main__":
    main()
