"""The process that compiles an engine's decode step while the engine answers eagerly.

``python -m minillm.runtime.compile_worker JOB`` — ``JOB`` is a pickled ``CompileJob`` written by
``background_compile.py``. The worker is its own process, so the compiler (minutes of Python)
shares no interpreter, no GIL and no OpenMP pool with the engine, and it runs at a low CPU
priority (``os.nice``, ``niceness()``), so the engine's steps preempt it whenever they want a core.

It rebuilds the engine's model exactly as the engine did (the same checkpoint, dtype and
``configure_model`` set-up), checks that the package names it computes — which fingerprint every
tensor the graph folds in — are the ones the engine expects (else the engine's weights are not
the checkpoint's, and a package would not match them), then compiles each missing batch size,
smallest first. It reports on stdout, one JSON object per line::

    {"event": "waiting"}                      (another engine's compile holds the machine's slot)
    {"event": "compiling", "batch": 1, "index": 1, "of": 2}
    {"event": "compiled", "batch": 1, "path": "...", "seconds": 95.2}
    {"event": "failed", "error": "..."}

and leaves when the engine's process does (a watchdog thread), so a closed notebook leaves no
compiler running. The engine loads each package as it is reported (``background_compile.py``).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import os
import pickle
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import BinaryIO

import torch

from minillm import trusted_cache
from minillm.config import ModelConfig, environment
from minillm.kvcache.paged import PagedKVCache
from minillm.models import load_model
from minillm.runtime.compile_files import own_partials
from minillm.runtime.compiled_decode import KEEP_PACKAGES, CompiledDecode, copy_folded_tensors, prune_packages
from minillm.runtime.model_setup import configure_model
from minillm.tokenizer import Tokenizer

# Lower than anything a learner runs: the engine, JupyterLab and the browser come first.
NICENESS = 19
NICENESS_VARIABLE = "MINILLM_COMPILE_NICENESS"


def niceness() -> int:
    """The compiler's priority: ``NICENESS`` unless ``MINILLM_COMPILE_NICENESS`` (0-19) says
    otherwise. At 19 the compile takes only what nothing else wants: beside two busy threads on a
    2-core machine, a tiny model's compile took 439 s instead of 76 s. A machine whose other work
    is not a learner's engine — a test suite, an instructor's ``minillm warmup`` on a shared
    host — may set it lower."""
    if not environment.is_set(NICENESS_VARIABLE):
        return NICENESS
    raw = environment.get(NICENESS_VARIABLE)
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if not 0 <= value <= 19:
        raise ValueError(f"{NICENESS_VARIABLE}={raw!r}: give a niceness from 0 (normal priority) to 19 (the lowest)")
    return value


def emit(event: str, **fields) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


def follow_parent(parent_pid: int, folder: Path) -> None:
    """Exit when the process that started us has gone (its engine no longer wants the graphs),
    removing the package half written into ``folder`` first."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        for partial in own_partials(folder):
            partial.unlink(missing_ok=True)
        os._exit(3)

    threading.Thread(target=watch, daemon=True, name="minillm-follow-parent").start()


def cache_inductor_templates() -> None:
    """Parse each of inductor's C++ GEMM templates once instead of once per matrix product.

    A profile of one SmolLM2-135M decode-step compile (cProfile, 2 cores) spent 29.5 of its 140 s
    in ``jinja2.Environment.from_string``: 2,685 parses of the same few template strings, two
    per weight matrix (``KernelTemplate._template_from_string``). A parsed template renders any
    number of times, so a cache keyed by the source changes nothing but the time. Only in this
    worker process; skipped if a torch version lays its code out otherwise."""
    try:
        # deferred: torch._inductor takes 1.3 s to import, and a torch without this layout is skipped
        from torch._inductor.codegen.common import KernelTemplate
    except ImportError:
        return
    original = getattr(KernelTemplate, "_template_from_string", None)
    if original is None or hasattr(original, "cache_info"):
        return
    KernelTemplate._template_from_string = staticmethod(functools.lru_cache(maxsize=None)(original))


@contextlib.contextmanager
def one_compile_at_a_time(folder: Path):
    """Hold the machine's compile slot: a chapter that starts several engines (fp32, int8, int4)
    must not run several compilers side by side, each holding a model and gigabytes of compiler
    state on a laptop; the others wait here, before loading anything."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "compiler.lock", "w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            emit("waiting")
            fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def build(job, tensors: BinaryIO | None) -> None:
    """Rebuild the engine's model and compile its missing packages (see the module docstring);
    ``tensors``: the engine's folded tensors (``read_job``)."""
    torch.set_num_threads(job.threads)  # the generated loops are parallelised for the engine's thread count
    model_config = ModelConfig.from_folder(job.model_dir)
    model = load_model(job.model_dir, job.dtype, torch.device("cpu"), max_positions=job.max_model_len)
    tokenizer = Tokenizer(job.model_dir) if job.config.quantization else None  # calibration data
    configure_model(model, job.config, job.backend, job.window, job.attention_dtype, tokenizer)
    if tensors is not None:  # the engine's exact values (a calibrated rebuild can differ in the last bit)
        with tensors:
            copy_folded_tensors(model, torch.load(tensors, weights_only=True))
    # A pool of a few blocks: the package serves every pool size (the slot count is a free dimension).
    cache = PagedKVCache(model_config, 4, job.config.block_size, job.dtype, torch.device("cpu"),
                         job.config.kv_cache_dtype)  # fmt: skip
    compiled = CompiledDecode(model, cache, job.window, job.compute_dtype, job.batch_sizes)
    # The names fingerprint what the graph folds in; the engine chose the folder.
    mine = {b: p.name for b, p in compiled.package_paths().items() if b in job.paths}
    theirs = {b: Path(p).name for b, p in job.paths.items()}
    if mine != theirs:
        raise RuntimeError(
            f"the packages this worker would compile ({sorted(mine.values())}) are not the engine's "
            f"({sorted(theirs.values())}): minillm's source changed since the engine started?"
        )
    for index, batch in enumerate(sorted(job.paths), 1):
        emit("compiling", batch=batch, index=index, of=len(job.paths))
        seconds = compiled.compile_package(batch, Path(job.paths[batch]), progress=False)
        emit("compiled", batch=batch, path=job.paths[batch], seconds=round(seconds, 1))
    prune_packages(KEEP_PACKAGES, Path(job.paths[batch]).parent)


def read_job(path: str) -> tuple[object, BinaryIO | None]:
    """The job, and its tensors file open for reading — both files removed from the folder at
    once: an open file's data stays readable until it is closed, and its disk space is freed
    then, or when this process dies however it dies (compile_files.py)."""
    try:
        with open(path, "rb") as handle:
            job = pickle.load(handle)
    finally:
        Path(path).unlink(missing_ok=True)
    if not job.tensors:
        return job, None
    tensors = open(job.tensors, "rb")  # noqa: SIM115 (closed by build, after reading it)
    Path(job.tensors).unlink(missing_ok=True)
    return job, tensors


def main(argv: list[str]) -> int:
    job, tensors = read_job(argv[0])
    follow_parent(job.parent_pid, Path(next(iter(job.paths.values()))).parent)
    wanted = niceness()
    if os.getpriority(os.PRIO_PROCESS, 0) < wanted:  # started some other way than background_compile's LAUNCH
        os.nice(wanted - os.getpriority(os.PRIO_PROCESS, 0))
    cache_inductor_templates()
    try:
        with one_compile_at_a_time(Path(next(iter(job.paths.values()))).parent):
            with trusted_cache.inductor_session():  # nothing inductor finds on disk runs unless we recorded it
                build(job, tensors)
    except BaseException as error:  # reported to the engine, which keeps running eagerly
        traceback.print_exc(file=sys.stderr)
        emit("failed", error=f"{type(error).__name__}: {error}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
