"""How worker processes start: forked from a server that has already imported torch.

A *spawned* process is a fresh interpreter: before it runs a line of ours it imports torch and
minillm again. On an AMD EPYC with 2 cores a 2-rank all-reduce took 2.5 s spawned and 0.09 s
forked from the server, a 4-rank one 5.4 s and 0.13 s, a 2-rank engine started and asked for
8 tokens 7.0 s and 1.1 s (medians after the first call, ``benchmarks/bench_worker_start.py``).
Every course check of a parallel exercise and every parallel engine paid that, per rank, per
call. Forking the driver itself would be instant but is unsafe: a notebook kernel or a server
has threads, an OpenMP pool, perhaps a CUDA context, and a fork copies them half-made.

Python's **forkserver** start method (Linux's default from Python 3.14) is the safe middle: the
first worker start launches one server process for this driver, which imports the modules named
in ``PRELOAD`` and then only forks copies of itself, one per new worker — a process that has run
no thread and no kernel, so the copies are sound. ``multiprocessing`` still starts each child
the way ``spawn`` does in every other respect (the target and its arguments are pickled; a
script must guard its engine with ``if __name__ == "__main__":``). Where there is no fork server
(Windows), workers are spawned.

One thing a spawned child has that a forked one lacks: the driver's environment *as it is now*
(the server copied it once, when it started). So every worker starts with ``adopt_environment``.
"""

from __future__ import annotations

import contextlib
import os
import sys

import torch.multiprocessing as mp

from minillm.config.environment import adopt, choose_triton_mode, for_children

#: What the fork server imports once, so that no worker imports it again: torch, and the
#: modules whose functions the workers run (ranks of a check, of an engine, of a cluster).
PRELOAD = (
    "torch",
    "torch.distributed",
    "torch._dynamo",  # entered by any TorchDispatchMode (the TP check watches collectives with one): 1.5 s
    "minillm.parallel.launch",
    "minillm.parallel.processes",
    "minillm.parallel.executor",
    "minillm.cluster.disagg",
    "minillm.cluster.replicas",
    "minillm.course.checks.ch09_tensor_parallel",
    "minillm.course.isolated",  # the grader's fresh process for each notebook's checks
)


def context():
    """The multiprocessing context workers start from: the fork server where the platform has one."""
    choose_triton_mode()  # the fork server copies this environment and preloads torch._dynamo (triton)
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))  # read when the server starts (the first worker)
    return ctx


def environment() -> dict[str, str]:
    """The driver's environment, to hand to a worker (``adopt_environment``)."""
    return for_children()


def adopt_environment(env: dict[str, str] | None) -> None:
    """In a worker, first thing: the driver's environment from when it started this worker."""
    if env is not None:
        adopt(env)


def driver_gone(driver_pid: int, first_parent: int) -> bool:
    """Has the driver ``driver_pid`` ended? A spawned worker's parent is the driver: it changes
    from ``first_parent`` (the parent when the worker started) when the driver dies. A forked
    worker's parent is the fork server, which lives on while it has workers: so the driver's pid
    is checked too."""
    if os.getppid() != first_parent:
        return True
    try:
        os.kill(driver_pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # the pid now belongs to another user's process: ours is gone
        return True
    return False


@contextlib.contextmanager
def without_main_script():
    """Start a process inside this block and it will not import the driver's main script.

    A process started from the fork server (or spawned) imports the driver's ``__main__`` file
    again, as ``__mp_main__``, so that functions defined there can be unpickled; a script without
    ``if __name__ == "__main__":`` then runs again in the child. A child whose target lives in a
    package needs none of it — the grader's checker (``course/isolated.py``): an instructor's
    grading script without the guard would grade again inside every grading. ``multiprocessing``
    reads the script's path from ``__main__.__file__`` / ``__spec__`` while the process starts, so
    they are hidden for that moment."""
    main = vars(sys.modules["__main__"]) if "__main__" in sys.modules else {}
    saved = {name: main[name] for name in ("__file__", "__spec__") if name in main}
    try:
        main.pop("__file__", None)
        if "__spec__" in saved:
            main["__spec__"] = None
        yield
    finally:
        main.update(saved)
