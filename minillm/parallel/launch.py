"""Run a function on ``world_size`` processes joined by ``torch.distributed`` — and never leave
a process behind.

For one function run once on every rank — the course's checks, tests and benchmarks of single
blocks: spawn the ranks, join them into one process group (gloo on CPU; NCCL on CUDA), run,
collect each rank's result. (Engines keep long-lived workers instead: ``processes.WorkerGroup``,
which watches them the same way.) The hard part is failure: a rank that raises, is killed, or hangs
in a collective would otherwise leave the others blocked forever. So the parent owns the
ranks: it waits for one report per rank against a deadline, and on the first error, unexpected
exit or timeout it terminates every rank and raises an error that names the rank and why.
"""

from __future__ import annotations

import datetime as dt
import os
import pickle
import queue
import socket
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class RankFailed(RuntimeError):
    """A rank raised or died; ``rank`` says which and the message why (its traceback)."""

    def __init__(self, rank: int, message: str):
        super().__init__(f"rank {rank} failed: {message}")
        self.rank = rank


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(fn, world_size: int, *args, timeout: float = 120.0, backend: str = "gloo", threads: int = 1) -> list:
    """``fn(rank, world_size, *args)`` on every rank (``fn`` must be a module-level function:
    the ranks are spawned, not forked); returns the results in rank order."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} must be a positive integer")
    ctx = mp.get_context("spawn")
    reports = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(fn, rank, world_size, port, backend, threads, args, reports), daemon=True)
        for rank in range(world_size)
    ]
    results: dict[int, object] = {}
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        while len(results) < world_size:
            try:
                kind, rank, payload = reports.get(timeout=0.2)
            except queue.Empty:
                for rank, p in enumerate(procs):
                    if rank not in results and p.exitcode is not None:
                        # It may have reported just before exiting: look once more before blaming it.
                        try:
                            kind, r, payload = reports.get(timeout=1.0)
                        except queue.Empty:
                            raise RankFailed(rank, f"exited with code {p.exitcode} without a result") from None
                        if kind == "error":
                            raise RankFailed(r, payload) from None
                        results[r] = pickle.loads(payload)
                if time.monotonic() > deadline:
                    missing = [r for r in range(world_size) if r not in results]
                    raise TimeoutError(
                        f"ranks {missing} gave no result within {timeout:.0f} s (a hang in a collective?)"
                    ) from None
                continue
            if kind == "error":
                raise RankFailed(rank, payload)
            results[rank] = pickle.loads(payload)
        return [results[r] for r in range(world_size)]
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()


def _rank_main(fn, rank, world_size, port, backend, threads, args, reports) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(threads)
    try:
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=dt.timedelta(seconds=60))
        # Pickled here, by value: a tensor put on the queue as it is would be shared through a file
        # descriptor that the parent fetches from this process, which may have exited by then.
        reports.put(("ok", rank, pickle.dumps(fn(rank, world_size, *args))))
    except BaseException:  # noqa: BLE001 (reported to the parent, which ends every rank)
        tb = traceback.format_exc(limit=8)
        reports.put(("error", rank, tb.strip().splitlines()[-1] + "\n" + tb))  # the error first, then where
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
