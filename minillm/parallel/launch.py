"""Run a function on ``world_size`` processes joined by ``torch.distributed`` — and never leave
a process behind.

For one function run once on every rank — the course's checks, tests and benchmarks of single
blocks: start the ranks (``start_method``: forked from a server that has imported torch), join them into one process group (gloo on CPU; NCCL on CUDA), run,
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
import shutil
import socket
import tempfile
import time
import traceback

import torch
import torch.distributed as dist

from minillm.config import environment
from minillm.parallel import start_method


class RankFailed(RuntimeError):
    """A rank raised or died; ``rank`` says which and the message why (its traceback)."""

    def __init__(self, rank: int, message: str):
        super().__init__(f"rank {rank} failed: {message}")
        self.rank = rank


class Rendezvous:
    """Where one host's ranks find each other: a ``FileStore`` in a private folder (0700).

    The usual ``MASTER_ADDR``/``MASTER_PORT`` rendezvous makes rank 0 run a TCPStore, which
    listens on every interface, unauthenticated, on a port the driver probed free and then let
    go (another process may take it in between). A store that is a file in a folder only this
    user can open has no port and no race; and gloo (NCCL) is told to use the loopback
    interface, so the ranks' own connections never leave the host. Delete with ``close()``."""

    def __init__(self):
        self.folder = tempfile.mkdtemp(prefix="minillm-rendezvous-")  # mode 0700
        self.path = os.path.join(self.folder, "store")

    def join(self, backend: str, rank: int, world_size: int, timeout: dt.timedelta) -> None:
        """In a rank: join the process group (``dist.init_process_group``) through this store."""
        loopback = loopback_interface()
        if loopback is not None:
            environment.set_default("GLOO_SOCKET_IFNAME", loopback)
            environment.set_default("NCCL_SOCKET_IFNAME", loopback)
        store = dist.FileStore(self.path, world_size)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)

    def close(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def loopback_interface() -> str | None:
    """The loopback interface's name (``lo`` on Linux, ``lo0`` on macOS), if there is one."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    return next((n for n in names if n in ("lo", "lo0")), None)


def run_ranks(fn, world_size: int, *args, timeout: float = 120.0, backend: str = "gloo", threads: int = 1) -> list:
    """``fn(rank, world_size, *args)`` on every rank (``fn`` must be a module-level function:
    the ranks unpickle it, as spawned processes would); returns the results in rank order."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} must be a positive integer")
    ctx = start_method.context()
    reports = ctx.Queue()
    rendezvous = Rendezvous()
    env = start_method.environment()
    procs = [
        ctx.Process(target=_rank_main, args=(fn, rank, world_size, rendezvous, backend, threads, args, reports, env),
                    daemon=True)  # fmt: skip
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
        rendezvous.close()


def _rank_main(fn, rank, world_size, rendezvous, backend, threads, args, reports, env=None) -> None:
    start_method.adopt_environment(env)
    torch.set_num_threads(threads)
    try:
        rendezvous.join(backend, rank, world_size, dt.timedelta(seconds=60))
        # Every rank past its connections before any goes on: a rank whose function needs no
        # collective would otherwise finish and tear its sockets down while a slower rank is still
        # connecting to it ("Gloo connectFullMesh failed ... Connection closed by peer").
        dist.barrier()
        # Pickled here, by value: a tensor put on the queue as it is would be shared through a file
        # descriptor that the parent fetches from this process, which may have exited by then.
        reports.put(("ok", rank, pickle.dumps(fn(rank, world_size, *args))))
    except BaseException as exc:  # noqa: BLE001 (reported to the parent, which ends every rank)
        tb = traceback.format_exc(limit=8)
        first = " ".join("".join(traceback.format_exception_only(type(exc), exc)).split())  # one line, however long
        reports.put(("error", rank, first + "\n" + tb))  # the error first, then where
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
