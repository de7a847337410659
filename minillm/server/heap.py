"""Keep a long-running server's resident memory flat: fewer malloc arenas, and freed heap handed
back to the operating system.

Why a server needs this and a notebook does not: glibc's ``malloc`` gives each thread that
allocates its own *arena* (up to 8 per core), and frees memory into it without returning it to
the kernel unless the top of the heap happens to be free. A server's threads — the event loop,
the parsing pool, the engine thread — allocate and free request bodies, token lists and small
tensors of every size for hours, so each arena fragments: RSS creeps up by megabytes a minute
although Python's own objects do not grow (``tracemalloc`` shows KiB). ``malloc_trim(0)`` walks
every arena and returns its free pages (``madvise``); capping the arenas bounds how many heaps
can fragment at all. Both are what ``MALLOC_ARENA_MAX`` and a periodic trim do for other Python
servers (see glibc's manual, "Memory Allocation Tunables").

Only Linux with glibc has these calls; elsewhere (macOS, musl) each function does nothing and
says so by returning ``False``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import sys

from minillm.config import environment

log = logging.getLogger(__name__)

M_ARENA_MAX = -8  # mallopt's parameter number, from glibc's <malloc.h>
ARENA_MAX = 2  # the event loop and the engine thread each get one; more only fragment further
TRIM_EVERY_S = 30.0  # a trim takes about a millisecond per arena: cheap at this period


def _glibc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim, libc.mallopt  # noqa: B018 (musl has neither: then we do nothing)
    except (OSError, AttributeError):
        return None
    return libc


_LIBC = _glibc()


# Entries kept by each of oneDNN's two shape-keyed caches in a served process (see below).
KERNEL_CACHE_CAPACITY = 256
KERNEL_CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def bound_kernel_caches(capacity: int = KERNEL_CACHE_CAPACITY) -> dict[str, str]:
    """Bound the two caches of compiled oneDNN kernels that grow with every new matrix shape.

    Each linear layer on CPU runs a oneDNN kernel generated (JIT) for its exact shape: the rows
    are the step's token count, so every prefill length and every decode batch size makes new
    ones. oneDNN keeps them in its primitive cache (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``) and
    PyTorch's ideep layer in another (``LRU_CACHE_CAPACITY``), 1,024 entries each by default —
    1.92 MB per new prompt length for tiny-shakespeare-8m in fp32 (``benchmarks/bench_kernel_caches.py``),
    kept until 1,024 are reached. That
    was the served process's steady RSS growth under mixed traffic (issue 30;
    ``benchmarks/census_server_heap.py`` found it outside Python's allocator). A server sees
    unbounded variety of lengths, so it keeps ``capacity`` entries (most recently used) of each.

    Both are read when the first kernel is built, so this must run before an engine does
    anything; a value the operator set in the environment is kept. Returns what was set."""
    if capacity < 1:
        raise ValueError(f"bound_kernel_caches: capacity must be at least 1, not {capacity}")
    set_here = {}
    for name in KERNEL_CACHE_VARIABLES:
        if environment.set_default(name, str(capacity)):
            set_here[name] = str(capacity)
    return set_here


def limit_arenas(count: int = ARENA_MAX) -> bool:
    """Cap malloc's arenas at ``count`` for threads that start from now on (call it before the
    server starts its threads). True if the cap was set."""
    if count < 1:
        raise ValueError(f"limit_arenas: count must be at least 1, not {count}")
    if _LIBC is None:
        return False
    return bool(_LIBC.mallopt(M_ARENA_MAX, count))


def trim() -> bool:
    """Return every arena's free pages to the operating system. True if glibc released any."""
    if _LIBC is None:
        return False
    return bool(_LIBC.malloc_trim(0))


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]  # fmt: skip


def malloc_stats() -> dict[str, int] | None:
    """glibc's view of the heap after a trim (``mallinfo2``), in bytes: ``in_use`` (allocated and
    not freed), ``free_held`` (freed but kept in an arena: fragmentation), ``mmapped`` (large
    blocks mapped on their own), ``arena`` (all the arenas hold). Growth of ``in_use`` that
    ``tracemalloc`` does not see was allocated outside Python (PyTorch's C++, a tokenizer's Rust).
    None without glibc 2.33's ``mallinfo2``."""
    if _LIBC is None or not hasattr(_LIBC, "mallinfo2"):
        return None
    _LIBC.mallinfo2.restype = _MallInfo2
    _LIBC.malloc_trim(0)
    info = _LIBC.mallinfo2()
    return {"in_use": info.uordblks, "free_held": info.fordblks, "mmapped": info.hblkhd, "arena": info.arena}


def freeze_startup_heap() -> int:
    """Move every object alive now — torch's and transformers' modules, the model, the engines —
    into the garbage collector's permanent generation, which its collections never walk; returns
    how many objects that is.

    Why a server: CPython's cyclic collector now and then walks every tracked object (its oldest
    generation), and a served process holds a few hundred thousand, nearly all made at start-up
    and alive until exit. With 1,024 sequences decoding, such a walk stopped a step for about
    190 ms (`benchmarks/bench_step_overhead.py --freeze-gc`, docs/benchmarks.md). Frozen, they
    are skipped; what the requests allocate is still collected. Only the server does this,
    after its engines are built and warmed up: it keeps them until it exits. A notebook that
    builds engine after engine must not — an engine frozen and dropped later would stay until
    exit if any part of it is a reference cycle. SGLang (``freeze_gc``) and vLLM
    (``freeze_gc_heap``) freeze after warm-up for the same reason."""
    gc.collect()  # what is garbage already is not frozen
    gc.freeze()
    return gc.get_freeze_count()
