"""Our C++ kernels, compiled with PyTorch's own toolchain and loaded only when this cache built them.

Two kernels ship as C++ source (``attention/cpu_paged_decode.cpp``, ``layers/cpu_bf16_rows.cpp``).
Each is compiled at first use with inductor's C++ toolchain — the one ``torch.compile`` uses on
CPU: same compiler flags, OpenMP runtime and SIMD headers — and kept in
``<cache>/compiled/kernels/`` with its record (``trusted_cache.py``), so later starts load it in
milliseconds. This module is that road, shared: ``load_library(source)``.
"""

from __future__ import annotations

import contextlib
import ctypes
import platform
import threading
from pathlib import Path

import torch

from minillm import trusted_cache
from minillm.assets import cache_dir
from minillm.config import environment


def load_library(source_file: Path, prelude: bool = True, folder: Path | None = None) -> ctypes.CDLL:
    """Compile (or find on disk) and load the library built from ``source_file`` (each call looks
    again: callers keep what it returns) — only a library recorded when this
    cache built it (``minillm/trusted_cache.py``: loading a library runs its code).

    ``prelude``: the source is compiled after inductor's ``cpp_prefix.h`` (its SIMD types, which
    our kernels use); ``native_operators.cpp`` includes the headers it needs itself. ``folder``:
    where (default ``kernels_dir()``); a build holds its folder's lock throughout.

    Inductor loads whatever file sits at the path it computes for a source, so our kernels are
    built in a folder of its own, ``<cache>/compiled/kernels/`` (inductor's cache folder is
    pointed there for this build, on this thread only), where every library must carry a
    record: before inductor looks, every folder is checked and every unrecorded library is
    deleted — built again, never loaded — and after it built one, the new library is recorded."""
    # deferred: torch._inductor takes 1.3 s to import; only a first build of the kernel needs it
    from torch._inductor import codecache

    source = ("#include <torch/csrc/inductor/cpp_prefix.h>\n" if prelude else "") + Path(source_file).read_text()
    folder = trusted_cache.private_dir(folder or kernels_dir())
    with trusted_cache.holding(folder):  # another process's fresh library is not swept before it is recorded
        trusted_cache.sweep_unrecorded(folder, (".so",))
        with cache_dir_on_this_thread(codecache, folder):
            library = _build(codecache.CppCodeCache, source)
        trusted_cache.record_unrecorded(folder, (".so",))
    return library




OPERATORS_SOURCE = Path(__file__).with_name("native_operators.cpp")
_OPERATORS_BUILD_LOCK = threading.Lock()
_OPERATORS_REGISTER_LOCK = threading.Lock()
_operators: tuple[ctypes.CDLL | None, str | None] | None = None  # (library, why not): once built or failed


def build_operators() -> str | None:
    """Build (or find in the cache) and load the library of our operators' C++ kernels
    (``native_operators.cpp``) — ~10 s of ``g++`` against PyTorch's headers on a cold cache,
    milliseconds after — before the first graph that calls them is loaded
    (``CompiledDecode.prepare_operators``): on the background build's thread, or on the
    constructor's when it loads packages already on disk (which the process that compiled them
    built the library for). None when loaded, else why not (once per process: a failed build is
    not retried). A library of its own so that neither kernel's build waits for those headers
    (an eager engine's first answer waits for the attention kernel's)."""
    global _operators
    with _OPERATORS_BUILD_LOCK:
        if _operators is None:
            try:
                # A folder of its own: its slower build must not hold the kernels' folder's lock,
                # which every process loading a kernel takes, built or not.
                _operators = load_library(OPERATORS_SOURCE, prelude=False, folder=kernels_dir().parent / "operators"), None
            except Exception as error:  # any build failure: the operators' Python functions serve
                said = " / ".join(line.strip() for line in str(error).splitlines() if line.strip())
                _operators = None, f"{type(error).__name__}: {said[-600:]}"
        return _operators[1]


def operators_failure() -> str | None:
    """Why the operators' library did not build in this process (None: built, or not tried yet)."""
    return None if _operators is None else _operators[1]


def register_operator(name: str, kernels: list) -> str | None:
    """Register the C++ kernel of our operator ``minillm::<name>`` for the CPU, handing it
    ``kernels`` — ``ctypes`` functions of our kernels' own libraries, which it calls. Never builds
    (``build_operators`` does) and never waits for a build. None when it is registered (now or
    before), else why not: the operator then runs its Python function (registered for every
    device) — the same results, a trip into Python a call slower (~7 µs a product and ~20 µs an
    attention call on a 2-core AMD EPYC; 151 calls a compiled step of SmolLM2-135M).

    PyTorch's dispatcher is not meant to change while a call of the same operator runs on another
    thread, so it is registered once per process, before the first graph that calls it is loaded
    (``CompiledDecode.prepare_operators``; a second engine's call finds it registered and changes
    nothing), and nothing else calls it through the dispatcher on CPU meanwhile (eager steps call
    the kernels through ``ctypes``; the EAGLE head calls the Python function by name)."""
    built = _operators
    if built is None:
        return "the operators' library is not built yet (native_build.build_operators)"
    library, reason = built
    if library is None:
        return reason
    with _OPERATORS_REGISTER_LOCK:
        register = getattr(library, f"minillm_register_{name}")
        register.argtypes = [ctypes.c_void_p] * len(kernels)
        register.restype = ctypes.c_int
        if register(*(ctypes.cast(kernel, ctypes.c_void_p).value for kernel in kernels)) < 0:
            return f"registering minillm::{name}'s C++ kernel failed"
        return None


def kernels_dir() -> Path:
    """Where our kernels' libraries are built and kept (and nothing else)."""
    return cache_dir() / "compiled" / "kernels"


def cache_dir_on_this_thread(module, folder: Path):
    """Inside the ``with``, ``module.cache_dir()`` answers ``folder`` on this thread — inductor's
    own answer on every other (a compiled package loading on another thread keeps its cache)."""
    return _answer_on_this_thread(module, "cache_dir", str(folder))


_PICK_LOCK = threading.RLock()  # re-entrant: a build inside a load on one thread must not wait on itself


def _build(cpp_code_cache, source: str):
    """``CppCodeCache.load(source)`` with the SIMD instruction set named by the CPU itself.

    Inductor picks its instruction set by compiling and loading a probe program for each one the
    CPU reports (AMX, AVX-512 VNNI, AVX-512, AVX2, with their bf16/fp16 variants): about 10
    builds, 19 of the 36 s a learner's first ``LLM(...)`` took on a cold cache (Intel Xeon with
    AMX, 2 cores; ``benchmarks/bench_cold_kernel.py``). Our kernels need only the vector width
    (the bf16 one names its own instructions per function), so on x86 this takes AVX-512 or AVX2
    as PyTorch's own CPU detection reports them (no builds), for our libraries and on this thread only: inductor's ``pick_vec_isa`` answers every
    other thread as before. A compiler that rejects those flags gets a build the probing way;
    any other failure is the build's own (raised)."""
    try:
        # deferred: torch._inductor takes 1.3 s to import; only a first build needs it
        from torch._inductor import codecache, cpu_vec_isa

        isa = _isa_from_cpu_flags(cpu_vec_isa)
    except (ImportError, AttributeError):  # another PyTorch's private names: its own pick
        return cpp_code_cache.load(source)
    if isa is None:
        return cpp_code_cache.load(source)
    with isa_on_this_thread(codecache, isa):
        try:
            return cpp_code_cache.load(source)
        except Exception as error:
            if not _rejects_flags(error, isa):
                raise
    return cpp_code_cache.load(source)  # inductor's own probes decide


def isa_on_this_thread(module, isa):
    """Inside the ``with``, ``module.pick_vec_isa()`` answers ``isa`` on this thread, and inductor's
    own (probing) answer on every other; restored on the way out. One at a time (a lock): a kernel
    build here and a compiled package's load (``compiled_decode.load_package``) both use it."""
    return _answer_on_this_thread(module, "pick_vec_isa", isa)


@contextlib.contextmanager
def _answer_on_this_thread(module, name: str, answer):
    """Inside the ``with``, ``module.<name>()`` returns ``answer`` on this thread and calls the
    original on every other; restored on the way out. One at a time (``_PICK_LOCK``, read inside
    it: another thread's stand-in is never taken for inductor's own)."""
    caller = threading.get_ident()
    with _PICK_LOCK:
        original = getattr(module, name)
        setattr(module, name, lambda: answer if threading.get_ident() == caller else original())
        try:
            yield
        finally:
            setattr(module, name, original)


def _rejects_flags(error: Exception, isa) -> bool:
    """Whether a failed build's message names one of ``isa``'s compiler flags (an old compiler)."""
    said = str(error)
    return any(flag in said for flag in isa.build_arch_flags().split())


def _isa_from_cpu_flags(cpu_vec_isa):
    """Inductor's AVX-512 or AVX2 description when this x86 CPU has it (no probe builds), else
    None (other architectures, or ``ATEN_CPU_CAPABILITY`` set: inductor's own rules apply)."""
    if platform.machine() not in ("x86_64", "AMD64") or environment.get("ATEN_CPU_CAPABILITY"):
        return None
    if torch.cpu._is_avx512_supported():
        return cpu_vec_isa.VecAVX512()
    if torch.cpu._is_avx2_supported():
        return cpu_vec_isa.VecAVX2()
    return None
