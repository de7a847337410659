"""The ``cpu`` backend's paged step: decode rows through our C++ kernel, prefill as the reference.

On CPU the reference decode (``paged.py``) gathers each bucket's blocks into a padded copy,
upcasts it to fp32 where that is faster (``precision.py``) and calls SDPA: three passes over
the keys per layer, over padding too. In a 32-sequence SmolLM2-135M bf16 step on a 2-core
CPU without AMX, SDPA, the upcast copies and the gather took ~60% of the CPU time
(``benchmarks/profile_decode_step.py``). The kernel (``cpu_paged_decode.cpp``) reads each
sequence's blocks in place, for exactly its own context, computing in fp32 — the fp32
reference's arithmetic in another summation order (``benchmarks/bench_cpu_attention.py`` times
the two).

It is compiled at first use with PyTorch's own C++ toolchain (inductor's, the one
``torch.compile`` uses on CPU: same compiler flags, OpenMP runtime and SIMD headers) and kept in
``<cache>/compiled/kernels/`` with its record, so later starts load it in milliseconds
(``native_build.py``). Prefill chunks use the reference path; an 8-bit pool is not read here (``auto``
picks ``sdpa`` for it, whose reference dequantizes as it gathers).
"""

from __future__ import annotations

import ctypes
import functools
import threading
from pathlib import Path

import torch

from minillm.attention.layout import StepLayout
from minillm.attention.paged import ReferencePagedStep, write_kv
from minillm.native_build import load_library, register_operator

SOURCE = Path(__file__).with_name("cpu_paged_decode.cpp")
POOL_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


@functools.cache
def _library() -> ctypes.CDLL:
    """The kernel's library, compiled at first use and kept in ``<cache>/compiled/kernels/``, loaded
    only when this cache built it (``native_build.load_library``)."""
    return load_library(SOURCE)


def operator_in_cpp() -> bool:
    """Register the operator's C++ kernel (``minillm/native_operators.cpp``) where its library is
    built (``native_build.build_operators``: this does not build it) and the kernel is; whether
    ``minillm::paged_decode`` runs it here — else the Python function ``paged_decode_op``. Called
    before the first graph that calls it is loaded (``CompiledDecode.prepare_operators``)."""
    if kernel_unavailable_reason() is not None:
        return False
    return register_operator("paged_decode", [_typed_kernel(name) for name in ("float32", "bfloat16", "float16")]) is None


_BUILD_LOCK = threading.Lock()


def kernel_unavailable_reason() -> str | None:
    """None when the kernel compiles and loads here; else why not (no C++ compiler, ...).
    Asked once per process: a failed build is not retried by every engine. Safe from any
    thread: a second caller waits for the first one's build (``start_building``)."""
    with _BUILD_LOCK:
        return _unavailable_reason()


def start_building() -> None:
    """Build (or load) the kernel in a thread now, so that a cold build (seconds of ``g++``, in a
    subprocess that does not hold the GIL) overlaps what an engine does next — reading the
    tokenizer and the weights — instead of following it. ``kernel_unavailable_reason`` then
    waits for it.

    One import happens here, on the caller's thread, first: ``torch.utils.cpp_extension`` (0.15 s),
    which imports setuptools. Setuptools appends its vendored packages to ``sys.path`` and
    imports a ``backports`` namespace package; the tokenizer the caller reads next imports
    urllib3, which runs ``from backports import zstd``. With the two imports on two threads, a
    worker's tokenizer import failed once in a suite run with ``KeyError: 'backports'``."""
    if _unavailable_reason.cache_info().currsize == 0:
        import torch.utils.cpp_extension  # noqa: F401  # deferred: 0.15 s (setuptools), on this thread on purpose (above)

        threading.Thread(target=_build_early, name="minillm-cpu-kernel-build", daemon=True).start()


def _build_early() -> None:
    """``start_building``'s thread. An import error here (inductor's modules imported while the
    main thread imports others) is not the kernel's answer: forgotten, so the engine's own call
    builds again."""
    with _BUILD_LOCK:
        reason = _unavailable_reason()
        if reason and reason.startswith(("ImportError", "AttributeError")):
            _unavailable_reason.cache_clear()


@functools.cache
def _unavailable_reason() -> str | None:
    try:
        _library()
    except Exception as error:  # any build failure means: use the reference path
        lines = [line.strip() for line in str(error).splitlines() if line.strip()] or [""]
        # The first line says what failed; the compiler's own complaint is at the end.
        said = lines[0] if len(lines) == 1 else f"{lines[0]} ... {' / '.join(lines[-3:])}"
        return f"{type(error).__name__}: {said[:600]}"
    return None


def paged_decode_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
    scale: float,
    window: int | None = None,
    check: bool = True,
    visible: torch.Tensor | None = None,
) -> torch.Tensor:
    """``q[B, H, D]`` (one query per sequence) against ``k_pool, v_pool[slots, KV, D]``: row ``b``
    attends to the keys at positions ``0 .. context_lens[b]-1`` (the last ``window`` of them with
    a sliding window), found through ``block_tables[b]``. Returns ``[B, H, D]`` in ``q``'s dtype.

    ``visible[B]`` (int64; default all ``-1``): bit ``j`` of ``visible[b]`` says whether row ``b``
    sees the key ``j`` places before its own (bit 0: itself), for ``j < 63``; keys further back
    are always seen. A speculative tree's node sees its ancestors and not its siblings
    (``ancestor_bits``); ``-1`` is a plain causal row.

    The kernel trusts its arguments (it reads memory through raw pointers), so they are checked
    here first; ``check=False`` skips the checks that read the tables' values, for a caller that
    checked them once for many calls (``CpuPagedStep``, once per step rather than per layer)."""
    for name, t in (("q", q), ("k_pool", k_pool), ("v_pool", v_pool), ("block_tables", block_tables)):
        if t.device.type != "cpu":
            raise ValueError(f"the CPU decode kernel reads CPU tensors; {name} is on {t.device}")
    for name, pool in (("k_pool", k_pool), ("v_pool", v_pool)):
        if pool.dtype not in POOL_DTYPES:
            raise ValueError(f"the CPU decode kernel reads {list(POOL_DTYPES)} pools; {name} is {pool.dtype}")
        if not pool.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    batch, heads, dim = q.shape
    kv_heads = k_pool.shape[1]
    if (
        v_pool.shape != k_pool.shape
        or v_pool.dtype != k_pool.dtype
        or heads % kv_heads
        or k_pool.shape[2] != dim
        or block_tables.shape[0] != batch
        or context_lens.shape != (batch,)
    ):
        raise ValueError(
            f"shapes do not match: q {tuple(q.shape)}, k_pool {tuple(k_pool.shape)} {k_pool.dtype}, v_pool "
            f"{tuple(v_pool.shape)} {v_pool.dtype}, block_tables {tuple(block_tables.shape)}, "
            f"context_lens {tuple(context_lens.shape)}"
        )
    tables = block_tables.to(torch.long).contiguous()
    lens = context_lens.to(torch.long).contiguous()
    if visible is None:
        visible = torch.full((batch,), -1, dtype=torch.long)
    if visible.shape != (batch,) or visible.dtype != torch.long or visible.device.type != "cpu":
        raise ValueError(f"visible must be a CPU int64 tensor of shape ({batch},), one mask per row; got "
                         f"{visible.dtype} {tuple(visible.shape)}")  # fmt: skip
    visible = visible.contiguous()
    if check and batch:
        check_tables(tables, lens, block_size, k_pool.shape[0] // block_size)
    q32 = q.float().contiguous()
    out = torch.empty_like(q32)
    _typed_kernel(POOL_DTYPES[k_pool.dtype])(
        q32.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), tables.data_ptr(), lens.data_ptr(), visible.data_ptr(),
        out.data_ptr(),
        batch, heads, kv_heads, dim, tables.shape[1], block_size, window or 0, scale,
    )  # fmt: skip
    return out.to(q.dtype)


def check_tables(block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int, num_blocks: int) -> None:
    """``ValueError`` unless every row's context fits its table and the blocks it reads are in
    the pool (a released entry, ``-1``, must have been replaced by the null block)."""
    if int(context_lens.min()) < 1:
        raise ValueError(
            f"context_lens must be >= 1 (a decode row sees at least its own key); got {context_lens.tolist()}"
        )
    longest = int(context_lens.max())
    if longest > block_tables.shape[1] * block_size:
        raise ValueError(
            f"a context of {longest} tokens needs {-(-longest // block_size)} blocks of {block_size}; "
            f"block_tables has {block_tables.shape[1]} per row"
        )
    lowest, highest = int(block_tables.min()), int(block_tables.max())
    if lowest < 0 or highest >= num_blocks:
        raise ValueError(f"block ids must be in [0, {num_blocks}) (the pool's blocks); got {lowest}..{highest}")


OPERATOR = torch.library.Library("minillm", "DEF")  # held for the process: the operator lives as long as it
OPERATOR.define(
    "paged_decode(Tensor q, Tensor k_pool, Tensor v_pool, Tensor block_tables, Tensor context_lens, "
    "Tensor visible, int block_size, float scale, int window) -> Tensor"
)


@functools.cache
def _typed_kernel(pool_dtype: str):
    """The kernel for one pool dtype with its C signature declared, so that ``ctypes`` passes
    plain Python ints and floats straight through (no ``c_void_p`` objects built per call)."""
    kernel = getattr(_library(), f"paged_decode_{pool_dtype}")
    kernel.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 7 + [ctypes.c_float]
    kernel.restype = None
    return kernel


def paged_decode_op(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    visible: torch.Tensor,
    block_size: int,
    scale: float,
    window: int,
) -> torch.Tensor:
    """The kernel as a PyTorch operator, ``minillm::paged_decode`` (``window`` 0: none), so that
    a compiled graph can call it: inductor cannot see into a ``ctypes`` call, but it keeps an
    operator as a call in the generated code (an AOTInductor package finds it by name through
    PyTorch's dispatcher, once this module is imported). The compiled decode graphs with a free
    row count attend this way (``StaticKernelDecodeStep``), once per layer per step.

    Why not ``torch.library.custom_op``: its wrappers (autograd, dynamo's guard, the
    redispatch) cost about as much again as this whole call, 30 times a step
    (``benchmarks/bench_kernel_operator.py``). This is the plain ``Library`` registration, and
    its checks look only at shapes and dtypes — no tensor operations: the compiled step builds
    its int64 tables itself, and ``paged_decode_attention`` is the checked entry for anyone else.

    Registered for every device (``CompositeExplicitAutograd``): once the operator's C++ kernel for
    the CPU is registered (``operator_in_cpp``; the same checks, in ``minillm/native_operators.cpp``),
    PyTorch's dispatcher prefers that one — ~20 µs less a call, 30 calls a step — and this
    function runs only where it could not be built, or when called by name."""
    batch, heads, dim = q.shape
    if (
        any(t.device.type != "cpu" for t in (q, k_pool, v_pool, block_tables, context_lens, visible))
        or k_pool.dtype not in POOL_DTYPES
        or v_pool.dtype != k_pool.dtype
        or v_pool.shape != k_pool.shape
        or not (k_pool.is_contiguous() and v_pool.is_contiguous())
        or k_pool.shape[2] != dim
        or heads % k_pool.shape[1]
        or block_tables.dtype != torch.long
        or context_lens.dtype != torch.long
        or visible.dtype != torch.long
        or not (block_tables.is_contiguous() and context_lens.is_contiguous() and visible.is_contiguous())
        or block_tables.shape[0] != batch
        or context_lens.shape != (batch,)
        or visible.shape != (batch,)
    ):
        raise ValueError(
            f"minillm::paged_decode: q {tuple(q.shape)}, k_pool {tuple(k_pool.shape)} {k_pool.dtype}, v_pool "
            f"{tuple(v_pool.shape)} {v_pool.dtype}, block_tables {tuple(block_tables.shape)} {block_tables.dtype}, "
            f"context_lens {tuple(context_lens.shape)} {context_lens.dtype}, visible {tuple(visible.shape)} "
            f"{visible.dtype} (devices: {q.device}, {k_pool.device}, {block_tables.device}): contiguous CPU pools of one of "
            f"{list(POOL_DTYPES)} and contiguous int64 tables, one row per query, are needed"
        )
    q32 = q.float().contiguous()
    out = torch.empty_like(q32)
    _typed_kernel(POOL_DTYPES[k_pool.dtype])(
        q32.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), block_tables.data_ptr(), context_lens.data_ptr(),
        visible.data_ptr(), out.data_ptr(), batch, heads, k_pool.shape[1], dim, block_tables.shape[1], block_size, window, scale,
    )  # fmt: skip
    return out.to(q.dtype)


OPERATOR.impl("paged_decode", paged_decode_op, "CompositeExplicitAutograd")


@torch.library.register_fake("minillm::paged_decode")
def _(q, k_pool, v_pool, block_tables, context_lens, visible, block_size, scale, window):
    # What the tracer needs: the output's shape, dtype and strides — contiguous, as the kernel
    # returns it whatever q's strides (``empty_like`` would copy a view's strides, and the graph
    # would then read the output wrongly).
    return q.new_empty(q.shape)


class StaticKernelDecodeStep:
    """A static decode step (``layout.static_decode``, the compiled step's shape) whose rows
    attend through the kernel, as an operator in the graph: each row reads exactly its own
    ``context_lens[b]`` keys in place, so rows of very different lengths cost what they need —
    where ``StaticDecodeStep`` makes every row attend over the longest row's window (fine for
    a few rows, a loss for many)."""

    def __init__(self, layout: StepLayout):
        self.layout, self.pool = layout, layout.pool
        # The compiled step always passes each row's ancestor bits; a layout without them: plain rows.
        self.visible = layout.visible
        if self.visible is None:
            self.visible = torch.full_like(layout.context_lens_tensor, -1)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """``q[1, B, H, D]``, ``k, v[1, B, KV, D]`` (one new token per row) → ``[1, B, H, D]``."""
        pool, layout = self.pool, self.layout
        write_kv(pool, layer, layout.slot_mapping, k[0], v[0])
        out = torch.ops.minillm.paged_decode(q[0], pool.k_slots[layer], pool.v_slots[layer], layout.block_tables,
                              layout.context_lens_tensor, self.visible, pool.block_size, scale,
                              layout.window or 0)  # fmt: skip
        return out[None]


class CpuPagedStep(ReferencePagedStep):
    """The reference step (prefill spans; the K/V writes are the ``paged_attention`` hook's) with
    every decode row attended by the kernel in one call per layer — exact per-row lengths, so no
    length buckets and no masks."""

    def plan_decodes(self, layout: StepLayout) -> None:
        nd = layout.num_decodes
        self.decode_tables = layout.block_tables[:nd].contiguous()
        self.decode_lens = torch.tensor(layout.context_lens[:nd], dtype=torch.long)
        self.decode_visible = layout.visible  # None: every row plainly causal
        if nd:  # once per step, not per layer
            pool = layout.pool
            check_tables(self.decode_tables, self.decode_lens, pool.block_size, len(pool.k_slots[0]) // pool.block_size)

    def _decode(self, q: torch.Tensor, layer: int, scale: float) -> torch.Tensor:
        pool = self.pool
        return paged_decode_attention(
            q, pool.k_slots[layer], pool.v_slots[layer], self.decode_tables, self.decode_lens,
            pool.block_size, scale, self.layout.window, check=False, visible=self.decode_visible,
        )  # fmt: skip
