"""The driver's side of a tensor- / pipeline-parallel engine: a ``ModelRunner`` whose model lives
in ``tp_size × pp_size`` worker processes.

The engine keeps its loop — schedule, sample, append — in the driver process, exactly as for
one process: only ``runner.execute(inputs)`` changes. It sends the step to rank 0 (which
broadcasts it) and waits for the logits. The notebook's or server's process never joins the
process group, so a kernel can create and drop parallel engines freely.

The processes are a ``WorkerGroup`` (``processes.py``): a rank that raises or dies stops them
all with ``RankFailed`` naming it; a KeyboardInterrupt during a step stops them too (the step's
pipe may be half read). One that lands between steps — while the driver schedules or samples —
leaves them serving, and the engine usable, as a one-process engine is after Ctrl-C.
"""

from __future__ import annotations

import weakref
from collections.abc import Hashable

import torch
import torch.distributed as dist

from minillm.parallel.processes import STEP_TIMEOUT, WorkerGroup
from minillm.parallel.worker import ShardSpec, ShardWorker
from minillm.runtime.runner import StepInputs


class DistributedRunner:
    """``execute(inputs) → logits`` on worker processes (see the module docstring)."""

    def __init__(self, spec: ShardSpec, backend: str = "gloo"):
        self.spec = spec
        self.workers = WorkerGroup(_shard_main, spec, spec.world_size, backend, spec.threads)
        self.procs = self.workers.procs
        self._step_id = 0
        self.record_timings = False  # ask every rank for its compute spans each step
        self.last_timings: list[dict] | None = None  # every rank's spans of the last step (record_timings)
        self.ranks: list[dict] = self.workers.gather_ready("load its shard")

    def execute(self, inputs: StepInputs) -> torch.Tensor:
        self.workers.check_open()
        self._step_id += 1
        try:
            self.workers.send(0, ("step", self._step_id, inputs, self.record_timings))
            while True:
                _, (kind, step_id, logits, timings) = self.workers.receive({0}, STEP_TIMEOUT, "finish a step")
                if step_id == self._step_id:  # (an interrupted step's late answer is dropped)
                    self.last_timings = timings
                    return torch.from_numpy(logits)
        except KeyboardInterrupt:
            self.shutdown("interrupted")
            raise

    def release(self, request_id: Hashable) -> None:
        pass  # the blocks belong to the driver's block manager

    def failure(self) -> str | None:
        """Why this runner can no longer run a step (a dead or stopped rank); None if it can."""
        return self.workers.failure()

    def shutdown(self, reason: str = "shut down") -> None:
        """Stop every worker (idempotent)."""
        self.workers.shutdown(reason)


def _shard_main(spec: ShardSpec, rank: int, conn) -> None:
    worker = ShardWorker(spec, rank)
    conn.send(("ready", worker.describe()))
    worker.serve(conn if rank == 0 else None)


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
        self._finalizer = weakref.finalize(self, _finish_torchrun, worker)

    def execute(self, inputs: StepInputs) -> torch.Tensor:
        if not self._finalizer.alive:
            raise RuntimeError("this engine's ranks were stopped; create a new engine")
        logits, self.last_timings = self.worker.broadcast_and_step(inputs, self.record_timings)
        return logits

    def release(self, request_id: Hashable) -> None:
        pass

    def shutdown(self, reason: str = "shut down") -> None:
        self._finalizer()


def _finish_torchrun(worker: ShardWorker) -> None:
    """Tell the other ranks to stop, then take down this rank's process group: a gloo group
    still alive when the interpreter exits aborts the process (its threads are never joined)."""
    worker.broadcast_stop()
    if dist.is_initialized():
        dist.destroy_process_group()
