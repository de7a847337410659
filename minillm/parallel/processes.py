"""Worker processes owned by a driver: started, joined into one process group, watched, stopped.

Every multi-process engine here (tensor / pipeline parallel, disaggregated prefill/decode) has
the same shape: the driver — a notebook kernel, a server, a script — starts ``world_size``
workers (``start_method``: forked from a server that has imported torch) joined by
``torch.distributed`` (gloo on CPU, NCCL on CUDA) and talks to them over pipes; the driver
itself never joins the process group, so it can create and drop engines freely. ``WorkerGroup`` owns them:

- while the driver waits for a message it also watches every worker: one that raises reports
  its traceback and exits, one that dies is seen through its process sentinel — either way
  every worker is stopped and ``RankFailed`` names the rank and why;
- a KeyboardInterrupt (a notebook's stop button) while they run a step stops them too (the
  caller's ``except``: a pipe may be half read); one between steps leaves them serving;
- workers ignore Ctrl-C (the driver's to handle) and end themselves when the driver's process
  disappears (a kernel restart kills it without any clean-up), so none is left behind.
"""

from __future__ import annotations

import datetime as dt
import os
import signal
import threading
import time
import traceback
import weakref
from multiprocessing.connection import wait

import torch
import torch.distributed as dist

from minillm.parallel import start_method
from minillm.parallel.launch import RankFailed, Rendezvous

START_TIMEOUT = 600.0  # seconds for every worker to load its part of the model
STEP_TIMEOUT = 600.0


class WorkerGroup:
    """``target(spec, rank, conn)`` on ``world_size`` new processes (``target`` must be a
    module-level function). ``stop_ranks``: who is told ``("stop",)`` at shutdown (the others
    are told by them, e.g. rank 0's broadcast)."""

    def __init__(self, target, spec, world_size: int, backend: str = "gloo", threads: int = 1, stop_ranks=(0,)):
        ctx = start_method.context()
        self.rendezvous = Rendezvous()
        self.conns, self.procs = [], []
        env = start_method.environment()
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            args = (target, spec, rank, world_size, self.rendezvous, backend, threads, child, os.getpid(), env)
            proc = ctx.Process(target=_bootstrap, args=args, daemon=True, name=f"minillm-rank{rank}")
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)
        self._finalizer = weakref.finalize(self, _stop, self.procs, self.conns, tuple(stop_ranks), self.rendezvous)
        self.closed_because: str | None = None

    def check_open(self) -> None:
        if self.closed_because is not None:
            raise RuntimeError(
                f"this engine's worker processes were stopped ({self.closed_because}); create a new engine"
            )

    def failure(self) -> str | None:
        """Why these workers can no longer serve (stopped, or a rank has exited); None while all run."""
        if self.closed_because is not None:
            return f"the worker processes were stopped ({self.closed_because})"
        for rank, proc in enumerate(self.procs):
            if not proc.is_alive():
                return f"rank {rank} exited with code {proc.exitcode}"
        return None

    def send(self, rank: int, message) -> None:
        self.conns[rank].send(message)

    def receive(self, ranks, timeout: float, doing: str) -> tuple[int, tuple]:
        """The next message from one of ``ranks`` — watching every worker meanwhile."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self.shutdown("timed out")
                raise TimeoutError(
                    f"ranks {sorted(ranks)} did not {doing} within {timeout:.0f} s; every worker was stopped"
                )
            ready = wait(self.conns + [p.sentinel for p in self.procs], timeout=min(left, 1.0))
            for rank, conn in enumerate(self.conns):
                if conn in ready:
                    silent = False
                    try:
                        message = conn.recv()
                    except (EOFError, OSError):
                        self.procs[rank].join(1.0)  # its pipe closed as it died: let it be reaped, for its code
                        message, silent = ("error", f"exited with code {self.procs[rank].exitcode} (its pipe closed)"), True
                    if message[0] == "error":
                        self._fail(*self._culprit(rank, message[1], silent))
                    if rank in ranks:
                        return rank, message
            for rank, proc in enumerate(self.procs):
                if proc.sentinel in ready and not self.conns[rank].poll():
                    proc.join(1.0)
                    hint = ""
                    if doing.startswith("load"):
                        hint = (" (the workers start as spawned ones do: a script must create a parallel engine under "
                                "`if __name__ == '__main__':`, or each worker re-runs the script)")  # fmt: skip
                    self._fail(rank, f"exited with code {proc.exitcode} without a word{hint}")

    def gather_ready(self, doing: str = "load its part of the model") -> list:
        """Each worker's first message ``("ready", info)``, in rank order."""
        infos = [None] * len(self.procs)
        pending = set(range(len(self.procs)))
        try:
            while pending:
                rank, (_, info) = self.receive(pending, START_TIMEOUT, doing)
                infos[rank] = info
                pending.discard(rank)
        except BaseException:
            self.shutdown("failed to start")
            raise
        return infos

    def shutdown(self, reason: str = "shut down") -> None:
        """Stop every worker (idempotent)."""
        if self.closed_because is None:
            self.closed_because = reason
        self._finalizer()

    def _culprit(self, rank: int, why: str, silent: bool = False) -> tuple[int, str]:
        """Who really failed. A peer's collective breaks when a rank dies or raises, and the
        peer's report may arrive first: give the others a moment, then prefer a rank that was
        killed or crashed without a word (non-zero exit, nothing sent), then one that reported
        an error of its own, over a report of a broken connection."""
        if silent:
            return rank, why
        said: dict[int, str] = {}
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            for other, proc in enumerate(self.procs):
                if other == rank or other in said:
                    continue
                try:
                    if self.conns[other].poll():
                        message = self.conns[other].recv()
                        if message[0] == "error":
                            said[other] = message[1]
                        continue
                except (EOFError, OSError):
                    pass
                if proc.exitcode not in (None, 0) and other not in said:
                    first = why.splitlines()[0] if why else ""
                    return other, f"exited with code {proc.exitcode} without a word (then rank {rank}: {first})"
            time.sleep(0.05)
        if _broken_link(why):
            for other, message in said.items():
                if not _broken_link(message):
                    return other, message
        return rank, why

    def _fail(self, rank: int, why: str):
        self.shutdown(f"rank {rank} failed")
        raise RankFailed(rank, why)


def _broken_link(report: str) -> bool:
    """Is this error report a collective that failed because a peer went away?"""
    first = report.splitlines()[0] if report else ""
    return any(k in first for k in ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "gloo"))


def _stop(procs, conns, stop_ranks, rendezvous=None) -> None:
    for rank in stop_ranks:
        try:
            if procs[rank].is_alive():
                conns[rank].send(("stop",))
        except (OSError, ValueError):
            pass
    deadline = time.monotonic() + 5
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join()
    for conn in conns:
        conn.close()
    if rendezvous is not None:
        rendezvous.close()


def _exit_with_driver(driver_pid: int) -> None:
    """End this worker when the driver is gone (``start_method.driver_gone``)."""
    first_parent = os.getppid()

    def watch():
        while True:
            time.sleep(0.5)
            if start_method.driver_gone(driver_pid, first_parent):
                os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def _bootstrap(target, spec, rank, world_size, rendezvous, backend, threads, conn, driver_pid, env) -> None:
    start_method.adopt_environment(env)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's to handle
    _exit_with_driver(driver_pid)
    torch.set_num_threads(threads)
    try:
        rendezvous.join(backend, rank, world_size, dt.timedelta(seconds=STEP_TIMEOUT))
        target(spec, rank, conn)
    except BaseException:  # noqa: BLE001 (reported to the driver, which stops every rank)
        tb = traceback.format_exc(limit=8)
        try:
            conn.send(("error", tb.strip().splitlines()[-1] + "\n" + tb))
        except OSError:
            pass
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
