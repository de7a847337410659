"""The driver's side of a tensor- / pipeline-parallel engine: a ``ModelRunner`` whose model lives
in ``tp_size × pp_size`` worker processes.

The engine keeps its loop — schedule, sample, append — in the driver process, exactly as for
one process: only ``runner.execute(inputs)`` changes. It sends the step to rank 0 (which
broadcasts it) and waits for the logits. The notebook's or server's process never joins the
process group, so a kernel can create and drop parallel engines freely.

Failure is the driver's job: while it waits it also watches every worker. A worker that
raises reports its traceback and exits; one that dies is seen through its process sentinel;
either way the driver stops every worker and raises ``RankFailed`` naming the rank. A
KeyboardInterrupt (a notebook's stop button) stops the workers too, and workers end on their
own when the driver's process disappears (a kernel restart), so none is ever left behind.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import weakref
from collections.abc import Hashable
from multiprocessing.connection import wait

import torch
import torch.multiprocessing as mp

from minillm.engine.runner import StepInputs
from minillm.parallel.launch import RankFailed, free_port
from minillm.parallel.worker import ShardSpec, ShardWorker

START_TIMEOUT = 600.0  # seconds for every rank to load its shard
STEP_TIMEOUT = 600.0


class DistributedRunner:
    """``execute(inputs) → logits`` on worker processes (see the module docstring)."""

    def __init__(self, spec: ShardSpec, backend: str = "gloo"):
        ctx = mp.get_context("spawn")
        port = free_port()
        self.spec = spec
        self.conns, self.procs = [], []
        for rank in range(spec.world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker_main, args=(spec, rank, port, backend, child, os.getpid()), daemon=True)
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)
        self._finalizer = weakref.finalize(self, _stop_workers, self.procs, self.conns)
        self._step_id = 0
        self.record_timings = False  # ask every rank for its compute intervals each step
        self.last_timings: list[dict] | None = None  # every rank's spans of the last step (record_timings)
        self.closed_because: str | None = None
        self.ranks: list[dict] = [None] * spec.world_size
        try:
            pending = set(range(spec.world_size))
            while pending:
                rank, (_, info) = self._receive(pending, START_TIMEOUT, "load its shard")
                self.ranks[rank] = info
                pending.discard(rank)
        except BaseException:
            self.shutdown("failed to start")
            raise

    def execute(self, inputs: StepInputs) -> torch.Tensor:
        if self.closed_because is not None:
            raise RuntimeError(f"this engine's worker processes were stopped ({self.closed_because}); create a new engine")
        self._step_id += 1
        try:
            self.conns[0].send(("step", self._step_id, inputs, self.record_timings))
            while True:
                _, (kind, step_id, logits, timings) = self._receive({0}, STEP_TIMEOUT, "finish a step")
                if step_id == self._step_id:  # (an interrupted step's late answer is dropped)
                    self.last_timings = timings
                    return torch.from_numpy(logits)
        except KeyboardInterrupt:
            self.shutdown("interrupted")
            raise

    def release(self, request_id: Hashable) -> None:
        pass  # the blocks belong to the driver's block manager

    def shutdown(self, reason: str = "shut down") -> None:
        """Stop every worker (idempotent)."""
        if self.closed_because is None:
            self.closed_because = reason
        self._finalizer()

    def _receive(self, ranks: set[int], timeout: float, doing: str) -> tuple[int, tuple]:
        """The next message from one of ``ranks`` — watching every worker meanwhile: an error
        report or a death from any rank stops them all and raises ``RankFailed``."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self.shutdown("timed out")
                raise TimeoutError(f"ranks {sorted(ranks)} did not {doing} within {timeout:.0f} s; every worker was stopped")
            ready = wait(self.conns + [p.sentinel for p in self.procs], timeout=min(left, 1.0))
            for rank, conn in enumerate(self.conns):
                if conn in ready:
                    try:
                        message = conn.recv()
                    except (EOFError, OSError):
                        message = ("error", f"exited with code {self.procs[rank].exitcode} (its pipe closed)")
                    if message[0] == "error":
                        self._fail(rank, message[1])
                    if rank in ranks:
                        return rank, message
            for rank, proc in enumerate(self.procs):
                if proc.sentinel in ready and not self.conns[rank].poll():
                    proc.join(1.0)
                    hint = ""
                    if doing == "load its shard":
                        hint = (" (the workers are spawned: a script must create a parallel engine under "
                                "`if __name__ == '__main__':`, or each worker re-runs the script)")
                    self._fail(rank, f"exited with code {proc.exitcode} without a word{hint}")

    def _fail(self, rank: int, why: str):
        self.shutdown(f"rank {rank} failed")
        raise RankFailed(rank, why)


class InProcessRunner:
    """Rank 0 of a ``torchrun`` launch: this process is the driver *and* rank 0 — it broadcasts
    each step to the other ranks (started by torchrun, waiting in ``ShardWorker.serve``) and
    runs its own part in place. torchrun, not the engine, owns the processes here."""

    def __init__(self, worker: ShardWorker):
        self.worker = worker
        self.ranks = worker.gather_descriptions()
        self.record_timings = False
        self.last_timings: list[dict] | None = None  # every rank's spans of the last step (record_timings)
        # Release the other ranks when this engine is closed, collected, or the program ends.
        self._finalizer = weakref.finalize(self, worker.broadcast_stop)

    def execute(self, inputs: StepInputs) -> torch.Tensor:
        if not self._finalizer.alive:
            raise RuntimeError("this engine's ranks were stopped; create a new engine")
        logits, self.last_timings = self.worker.broadcast_and_step(inputs, self.record_timings)
        return logits

    def release(self, request_id: Hashable) -> None:
        pass

    def shutdown(self, reason: str = "shut down") -> None:
        self._finalizer()


def _stop_workers(procs, conns) -> None:
    try:
        if procs and procs[0].is_alive():
            conns[0].send(("stop",))  # rank 0 broadcasts it: every rank leaves its loop
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


def _exit_with_parent(parent_pid: int) -> None:
    """A worker ends itself when the driver is gone (a kernel restart kills it without
    running any clean-up): its parent changes from the driver to init."""

    def watch():
        while True:
            time.sleep(0.5)
            if os.getppid() != parent_pid:
                os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def _worker_main(spec: ShardSpec, rank: int, port: int, backend: str, conn, parent_pid: int) -> None:
    import datetime as dt
    import traceback

    import torch.distributed as dist

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's to handle
    _exit_with_parent(parent_pid)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(spec.threads)
    try:
        dist.init_process_group(
            backend, rank=rank, world_size=spec.world_size, timeout=dt.timedelta(seconds=STEP_TIMEOUT)
        )
        worker = ShardWorker(spec, rank)
        conn.send(("ready", worker.describe()))
        worker.serve(conn if rank == 0 else None)
    except BaseException:  # noqa: BLE001 (reported to the driver, which stops every rank)
        tb = traceback.format_exc(limit=8)
        try:
            conn.send(("error", tb.strip().splitlines()[-1] + "\n" + tb))
        except OSError:
            pass
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
