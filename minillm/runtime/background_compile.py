"""The compiled decode step, built while the engine already answers: tiered start-up.

Compiling SmolLM2-135M's decode step takes minutes on a laptop CPU (``compiled_decode.py``);
a learner's first cell should not wait for it. So an engine starts on the eager path at once
and a ``BackgroundBuild`` gets the compiled step ready behind it, the way a JIT runtime tiers
up from an interpreter:

1. packages already on disk (a warm machine) are loaded before the engine answers
   (``load_packages_on_disk``: about a second);
2. the missing ones are compiled by a separate, low-priority process (``compile_worker.py``),
   which shares no Python state with the engine and never holds its GIL;
3. each loaded graph is *offered* to the ``CompiledDecode``, which swaps it in at the start of
   the next step (``CompiledDecode.supports``) — never during one. A request in flight simply
   has its next token computed by the graph; its tokens are the same (the tests check it).

``status()`` says where it stands — building (which step, for how long), ready, or failed
(and why; the engine keeps decoding eagerly) — and ``LLM.fast_path_status()`` shows it.
``wait()`` blocks until it is ready, for benchmarks and ``minillm warmup``.
"""

from __future__ import annotations

import atexit
import json
import os
import pickle
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch

from minillm import trusted_cache
from minillm.assets import cache_dir
from minillm.config import EngineConfig, environment
from minillm.layers.cpu_prepack import release_plain_weights
from minillm.runtime.compile_files import owned_prefix, sweep_stale
from minillm.runtime.compile_worker import niceness
from minillm.runtime.compiled_decode import CompiledDecode, folded_tensors

# The worker lowers its priority (argv[1], compile_worker.niceness()) before it imports anything:
# torch's import is seconds of CPU.
LAUNCH = (
    "import os, sys; os.nice(int(sys.argv[1])); "
    "from minillm.runtime.compile_worker import main; sys.exit(main(sys.argv[2:]))"
)


@dataclass(frozen=True)
class FastPathStatus:
    """Where an engine's decode fast path stands (``LLM.fast_path_status()``)."""

    state: str  # "off" | "building" | "ready" | "failed"
    detail: str  # what it is doing, or why it failed / is off
    ready: tuple[int, ...] = ()  # batch sizes whose graphs run now (or from the next step)
    batch_sizes: tuple[int, ...] = ()  # all it builds
    seconds: float = 0.0  # since the build started (its total once ready or failed)

    @property
    def progress(self) -> float:
        """The share of the batch sizes ready, 0..1."""
        return len(self.ready) / len(self.batch_sizes) if self.batch_sizes else 1.0

    def __str__(self) -> str:
        return f"{self.state}: {self.detail}"


@dataclass
class CompileJob:
    """What the worker needs to rebuild the engine's model exactly and compile its step."""

    model_dir: str
    config: EngineConfig
    dtype: torch.dtype
    backend: str
    window: int | None
    attention_dtype: torch.dtype | None
    compute_dtype: torch.dtype
    max_model_len: int
    batch_sizes: tuple[int, ...]
    threads: int
    paths: dict[int, str]  # batch size -> package the worker must produce
    tensors: str | None = None  # the engine's folded tensors, saved for the worker to copy in
    parent_pid: int = field(default_factory=os.getpid)


EXIT_WAIT_S = 30.0  # at interpreter exit: how long a build thread may take to leave torch's C++ code
_LIVE_BUILDS: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _stop_builds_at_exit() -> None:
    """Every build still alive at interpreter exit stops first (``BackgroundBuild._at_exit``)."""
    for build in list(_LIVE_BUILDS):
        build._at_exit()


def load_packages_on_disk(compiled: CompiledDecode, job: CompileJob) -> tuple[int, ...]:
    """On a warm machine, load the packages already on disk now, before the engine answers, and
    leave only the missing ones to the ``BackgroundBuild``; the batch sizes loaded.

    Why not in the background as before: loading a package imports inductor (a second of Python
    holding the GIL) and reads ~300 MB, while the engine's first answers decoded eagerly beside it:
    a warm start's first two 32-token answers ran at 15.8 and 31.7 tok/s, then ~70 once the graphs
    were in; loaded here, the first ran at 63.4 and was done sooner (SmolLM2-135M, AMD EPYC, 2
    threads, medians of 3; ``benchmarks/bench_warm_start.py``). A package that is not there (a cold
    machine) costs nothing here; one that cannot be loaded is left to the background build, which
    reports it as before."""
    for folder in {Path(p).parent for p in job.paths.values()}:
        sweep_stale(folder)  # files of compiles whose processes were killed (compile_files.py)
    if any(Path(p).is_file() for p in job.paths.values()):
        compiled.prepare_operators()  # their library is on disk too (the compiling process built it first): ms
    loaded = []
    for batch, where in sorted(job.paths.items()):
        path = Path(where)
        if not path.is_file():
            continue
        try:
            if compiled.try_load(batch, path):
                loaded.append(batch)
        except Exception:  # noqa: BLE001 (an unsafe folder, say: the background build reports it)
            break
    if loaded:
        compiled.swap_in()
        job.paths = {b: p for b, p in job.paths.items() if b not in loaded}
    return tuple(loaded)


def worker_environment(threads: int, rows_kernel: bool = False) -> dict[str, str]:
    """What the compile worker's environment adds to ours: its thread count, whether its graphs
    call the bf16 rows kernel (as this engine named them: decided once, here), and inductor's cache
    in a folder of its own (``<cache>/inductor-worker``) unless the user chose one — the worker
    sweeps, fills and records its folder under a lock for a whole compile
    (``trusted_cache.inductor_session``), while this process's own ``torch.compile`` uses
    ``<cache>/inductor``, whose files it records only at exit."""
    extra = {"OMP_NUM_THREADS": str(threads), "MINILLM_CPU_BF16_ROWS": "1" if rows_kernel else "0"}
    # By value, not by who set it: a process started by an engine's process inherits minillm's
    # folder as "the environment", and a worker sharing it with an in-process compile (which holds
    # it shared until it exits) would wait for ever for the tree to itself.
    chosen = trusted_cache.inductor_cache()
    if chosen is None or trusted_cache.is_minillms_inductor_folder(chosen):
        extra["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir() / "inductor-worker")
    return extra


class BackgroundBuild:
    """Loads or compiles ``compiled``'s packages behind a running engine (module docstring)."""

    def __init__(self, compiled: CompiledDecode, job: CompileJob):
        self.compiled, self.job = compiled, job
        self._lock = threading.Lock()
        self._state, self._detail = "building", "starting"
        self._started, self._finished = time.perf_counter(), None
        self._worker: subprocess.Popen | None = None
        self._log_tail: deque[str] = deque(maxlen=8)
        self._closed = False
        self._failure_reported = False
        self._thread = threading.Thread(target=self._run, daemon=True, name="minillm-fast-path")
        self._thread.start()
        _LIVE_BUILDS.add(self)  # weakly: an engine's build must not outlive it for the sake of exit

    # ----------------------------------------------------------------------------------------
    # What the engine and the learner see
    # ----------------------------------------------------------------------------------------

    def status(self) -> FastPathStatus:
        with self._lock:
            end = self._finished or time.perf_counter()
            ready = tuple(sorted(set(self.compiled.graphs) | set(self.compiled._offered)))
            return FastPathStatus(self._state, self._detail, ready, self.compiled.batch_sizes, end - self._started)

    def wait(self, timeout: float | None = None) -> FastPathStatus:
        """Block until ready or failed (or ``timeout`` seconds); the status then."""
        self._thread.join(timeout)
        self.compiled.swap_in()
        return self.status()

    def take_failure(self) -> str | None:
        """Why the build failed, the first time it is asked after it did (the engine warns once)."""
        with self._lock:
            if self._state != "failed" or self._failure_reported or self._closed:  # closed: the caller knows
                return None
            self._failure_reported = True
            return self._detail

    def _at_exit(self) -> None:
        """Stop the build before the interpreter finalizes. The build thread is a daemon, but it
        runs torch's C++ code (saving the tensors for the worker, loading a compiled package):
        a process that exits right after its first answer, mid-build, otherwise tears down the
        C++ runtime under that thread and dies with "terminate called without an active
        exception" (SIGABRT) after its output is written. Closing makes the thread leave at its
        next step (the worker is stopped, the job is not started); the wait is bounded."""
        self.close()
        self._thread.join(EXIT_WAIT_S)

    def close(self) -> None:
        """Stop the worker (an engine closed before its step was compiled)."""
        with self._lock:  # a worker started from now on is stopped at once (_compile)
            self._closed = True
            worker = self._worker
        if worker is not None and worker.poll() is None:
            worker.terminate()
            try:
                worker.wait(timeout=5)
            except subprocess.TimeoutExpired:
                worker.kill()

    # ----------------------------------------------------------------------------------------
    # The build, on its own thread
    # ----------------------------------------------------------------------------------------

    def _set(self, state: str, detail: str) -> None:
        with self._lock:
            self._state, self._detail = state, detail
            if state in ("ready", "failed"):
                self._finished = time.perf_counter()

    def _run(self) -> None:
        try:
            if self.compiled.drop_rows_kernel_if_unbuildable():  # renames the packages: without the kernel
                named = self.compiled.package_paths()
                self.job.paths = {b: str(named[b]) for b in self.job.paths}
            self._set("building", "building our operators' C++ kernels")
            self.compiled.prepare_operators()  # before any graph that calls them is loaded
            missing = {}
            for batch, path in self.job.paths.items():
                self._set("building", f"loading the compiled {self.compiled.describe(batch)} step")
                if not self.compiled.try_load(batch, Path(path)):
                    missing[batch] = path
            if missing:
                self._compile(missing)
            self._set("ready", f"compiled decode steps for {', '.join(self.compiled.describe(b) for b in self.compiled.batch_sizes)}")
        except Exception as error:
            self._set("failed", f"{error}; decoding eagerly")
        finally:  # the graphs hold their own packed copies; eager steps read the oneDNN-packed ones
            release_plain_weights(self.compiled.module.model)

    def _compile(self, missing: dict[int, str]) -> None:
        self._set("building", "starting the compiler in a low-priority process")
        nice = niceness()  # a bad MINILLM_COMPILE_NICENESS fails the build here, named, before any file is written
        job = CompileJob(**{**vars(self.job), "paths": missing})
        folder = trusted_cache.private_dir(Path(next(iter(missing.values()))).parent)  # beside the packages
        # The engine's exact tensors travel with the job: a model rebuilt from the checkpoint can
        # differ in the last bit (calibrated quantization), and the graph must fold in these.
        # Named after this process (compile_files.py): if it is killed before the clean-up below,
        # the next engine start removes them; the worker removes them as soon as it has read them.
        with tempfile.NamedTemporaryFile("wb", dir=folder, prefix=owned_prefix("tensors"), suffix=".pt",
                                         delete=False) as saved:  # fmt: skip
            torch.save(folded_tensors(self.compiled.module.model), saved)
        job.tensors = saved.name
        with tempfile.NamedTemporaryFile("wb", dir=folder, prefix=owned_prefix("job"), suffix=".pkl",
                                         delete=False) as handle:  # fmt: skip
            pickle.dump(job, handle)
        try:
            with self._lock:
                if self._closed:
                    raise RuntimeError("the engine was closed before its decode step compiled")
                self._worker = subprocess.Popen(
                    [sys.executable, "-c", LAUNCH, str(nice), handle.name],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                    env=environment.for_children(**worker_environment(job.threads, self.compiled.rows_kernel_cpu)),
                )
            threading.Thread(target=self._read_log, daemon=True, name="minillm-fast-path-log").start()
            self._follow(self._worker)
        finally:
            Path(handle.name).unlink(missing_ok=True)
            Path(saved.name).unlink(missing_ok=True)

    def _follow(self, worker: subprocess.Popen) -> None:
        """Turn the worker's events into status, loading each package as it is reported."""
        failure = None
        for line in worker.stdout:
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue  # a stray print from a library
            if not isinstance(event, dict) or "event" not in event:
                continue
            if event["event"] == "waiting":
                self._set("building", "waiting for another engine's compile to finish (one at a time)")
            elif event["event"] == "compiling":
                self._set("building", f"compiling the {self.compiled.describe(event['batch'])} step ({event['index']} of {event['of']}), "
                                      "in a low-priority process; decoding eagerly meanwhile")  # fmt: skip
            elif event["event"] == "compiled":
                self._set("building", f"loading the compiled {self.compiled.describe(event['batch'])} step")
                self.compiled.load(event["batch"], Path(event["path"]))
                if event["seconds"]:
                    self.compiled.compile_seconds[event["batch"]] = event["seconds"]
            elif event["event"] == "failed":
                failure = event["error"]
        code = worker.wait()
        if self._closed:
            raise RuntimeError("the engine was closed before its decode step compiled")
        if failure or code != 0:
            tail = " | ".join(self._log_tail)
            raise RuntimeError(f"compiling the decode step failed ({failure or f'exit code {code}'})"
                               + (f"; the compiler's last words: {tail}" if tail and not failure else ""))  # fmt: skip

    def _read_log(self) -> None:
        for line in self._worker.stderr:
            if line.strip():
                self._log_tail.append(line.strip()[-300:])

