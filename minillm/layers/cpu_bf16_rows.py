"""bf16 linear layers for a few rows at once through our own C++ kernel (AVX-512 BF16, no AMX).

A decode step of one row is bound by reading the weights; the compiled step's one-row graph
does that near the memory's bandwidth. A step of a few rows — a speculative verify step (the
last token and its k guesses, up to ~11 rows for a tree), or a batch of 8 — must read the same
weights once and multiply them by every row. On a CPU without AMX the compiled step's GEMMs
did that badly: inductor's generated kernels convert bf16 to fp32 lane by lane and spend one
fused multiply-add per weight per row, and oneDNN's small-M path took 16.6 ms for one step's
products at 2 rows, where this kernel takes 11.0. Measured on an AMD EPYC (Zen 4, 2 cores; ``benchmarks/bench_bf16_rows.py``), the
compiled step of SmolLM2-135M took 10.2 ms for one row and 18.1, 16.9, 22.0 ms for 2, 4, 8 rows;
with the kernel 12.9, 14.0, 18.4 ms. With more rows the multiplications themselves take the
time (one step's products: 11.0 ms for 2 rows, 15.3 for 11, 48.2 for 64, level with oneDNN's
there), and the gain shrinks.

``cpu_bf16_rows.cpp`` multiplies with VDPBF16PS (32 bf16 products summed into 16 fp32 lanes per
instruction) over a weight packed once for it, so the first few rows cost little more than one.
It is an operator, ``minillm::linear_bf16_rows``, so that a compiled graph calls it: while the
compiled decode step's free-row graph is traced (``runtime/compiled_decode.py``), the linear
layers' ``traced_linear`` emits the operator on the weight packed in the graph — a chain of
view/permute/copy of a constant, which freezing folds into the packed constant itself. Eager
steps, the one-row graph, layers with a bias and, by default, CPUs with AMX (whose tile GEMMs
the compiler already uses; ``MINILLM_CPU_BF16_ROWS``) are not touched.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import platform
import threading
from pathlib import Path

import torch
import torch.nn.functional as F

from minillm.config import environment
from minillm.native_build import load_library, register_operator

SOURCE = Path(__file__).with_name("cpu_bf16_rows.cpp")
COLUMN_BLOCK = 16  # output columns per packed block (one AVX-512 register of fp32 sums)

OPERATOR = torch.library.Library("minillm", "FRAGMENT")  # held for the process, as the operator must be
OPERATOR.define("linear_bf16_rows(Tensor x, Tensor packed) -> Tensor")


def _capabilities() -> dict:
    if platform.machine() not in ("x86_64", "AMD64") or not hasattr(torch.cpu, "get_capabilities"):
        return {}
    return torch.cpu.get_capabilities()


def cpu_supports() -> bool:
    """Whether graphs on this CPU should use the kernel: by default (``MINILLM_CPU_BF16_ROWS=auto``)
    an x86 CPU with AVX-512 BF16 and without AMX (whose tile GEMMs the compiler already
    generates, faster); ``1``: any CPU with AVX-512 BF16 (to test or measure it there); ``0``: none."""
    choice = environment.get("MINILLM_CPU_BF16_ROWS")
    if choice not in ("auto", "0", "1"):
        raise ValueError(f"MINILLM_CPU_BF16_ROWS={choice!r}: expected auto, 0 or 1")
    caps = _capabilities()
    if choice == "0" or not caps.get("avx512_bf16", False):
        return False
    return choice == "1" or not caps.get("amx_bf16", False)


def required() -> bool:
    """``MINILLM_CPU_BF16_ROWS=1``: the kernel was asked for, so a failure to build it is an error;
    under ``auto`` the graphs are compiled without it instead."""
    return environment.get("MINILLM_CPU_BF16_ROWS") == "1"


@functools.cache
def unavailable_reason() -> str | None:
    """None when the kernel can run here (any x86 CPU with AVX-512 BF16, AMX or not); else why
    not (the CPU, or a compiler without the AVX-512 BF16 intrinsics). Asked once per process."""
    reason = None
    if not _capabilities().get("avx512_bf16", False):
        reason = "this CPU has no AVX-512 BF16"
    else:
        try:
            _kernel()
        except Exception as error:  # any build failure: the compiler's own GEMMs are used
            said = " / ".join(line.strip() for line in str(error).splitlines() if line.strip())
            reason = f"{type(error).__name__}: {said[-600:]}"
    _ANSWERED.append(reason)  # read by ready(), which must not ask (and build) itself
    return reason


_ANSWERED: list[str | None] = []  # unavailable_reason's answer, once given
FEW_ROWS = 16  # an eager caller's products go through the kernel up to this many rows (level with oneDNN by ~64)


def ready() -> bool:
    """Whether the kernel is built and can run here — without building it: an eager caller on an
    engine's thread (the EAGLE head's proposals) must not wait seconds for ``g++`` on a cold
    cache. True once ``unavailable_reason`` has answered None (the compiled step's build asks it
    on its own thread, at every start)."""
    return bool(_ANSWERED) and _ANSWERED[0] is None and unavailable_reason() is None


@functools.cache
def _kernel():
    kernel = load_library(SOURCE).linear_bf16_rows
    kernel.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3
    kernel.restype = None
    return kernel


def operator_in_cpp() -> bool:
    """Register the operator's C++ kernel (``minillm/native_operators.cpp``) where the kernel can
    run (building the kernel if no one has: the graphs that call the operator need it anyway) and
    the operators' library is built (``native_build.build_operators``: not built here). Whether
    ``minillm::linear_bf16_rows`` runs it here — else the Python function below. Called before the
    first graph that calls it is loaded (``CompiledDecode.prepare_operators``)."""
    return unavailable_reason() is None and register_operator("linear_bf16_rows", [_kernel()]) is None


def packs(weight: torch.Tensor) -> bool:
    """Whether ``weight[N, K]`` fits the packed layout: bf16, K even, N a multiple of 16."""
    n, k = weight.shape
    return weight.dtype == torch.bfloat16 and k % 2 == 0 and n % COLUMN_BLOCK == 0


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight[N, K]`` (a linear layer's, out × in) as ``[N/16, K/2, 16, 2]``: per block of 16
    output columns and pair of inputs, the columns' two weights side by side. Plain tensor
    operations, so that inside a graph with freezing they fold into a constant."""
    n, k = weight.shape
    return weight.reshape(n // COLUMN_BLOCK, COLUMN_BLOCK, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def linear_bf16_rows(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """``x[M, K] · Wᵀ`` for ``packed = pack(W)``: ``[M, N]`` bf16, fp32 sums rounded once. The
    kernel reads raw pointers, so shapes and dtypes are checked here (no tensor operations: it
    runs once per linear layer per step).

    The operator's Python kernel, registered for every device (``CompositeExplicitAutograd``): once
    its C++ kernel for the CPU is registered (``operator_in_cpp``; the same checks, in
    ``minillm/native_operators.cpp``), PyTorch's dispatcher prefers that one, and this function
    runs only where it could not be built, or when called by name."""
    if (
        x.dim() != 2
        or packed.dim() != 4
        or x.dtype != torch.bfloat16
        or packed.dtype != torch.bfloat16
        or tuple(packed.shape[2:]) != (COLUMN_BLOCK, 2)
        or x.shape[1] != 2 * packed.shape[1]
        or not packed.is_contiguous()
        or x.device.type != "cpu"
        or packed.device.type != "cpu"
    ):
        raise ValueError(
            f"minillm::linear_bf16_rows: x {tuple(x.shape)} {x.dtype} on {x.device}, packed "
            f"{tuple(packed.shape)} {packed.dtype}: expected bf16 CPU x[M, K] and a contiguous "
            f"packed[N/16, K/2, 16, 2] (cpu_bf16_rows.pack)"
        )
    reason = unavailable_reason()  # cached: a CPU without the instructions must not run them
    if reason is not None:
        raise RuntimeError(f"minillm::linear_bf16_rows cannot run here: {reason}")
    x = x.contiguous()
    m, k = x.shape
    n = packed.shape[0] * COLUMN_BLOCK
    out = torch.empty((m, n), dtype=torch.bfloat16, device="cpu")
    if m:
        _kernel()(x.data_ptr(), packed.data_ptr(), out.data_ptr(), m, k, n)
    return out


OPERATOR.impl("linear_bf16_rows", linear_bf16_rows, "CompositeExplicitAutograd")


@torch.library.register_fake("minillm::linear_bf16_rows")
def _(x, packed):
    return x.new_empty((x.shape[0], packed.shape[0] * COLUMN_BLOCK))


_TRACING = threading.local()


@contextlib.contextmanager
def in_traced_graph(enabled: bool = True):
    """While a compiled graph is traced on this thread, linear layers multiply through the kernel
    (``traced_linear``) — for the free-row decode graph on a CPU the kernel serves."""
    before = getattr(_TRACING, "on", False)
    _TRACING.on = enabled
    try:
        yield
    finally:
        _TRACING.on = before


def traced_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` as a traced graph should compute it: through the kernel inside
    ``in_traced_graph`` where the weight fits its layout, else ``F.linear`` — and for a layer with
    a bias (Qwen2's q/k/v), which ``F.linear`` adds before its one rounding to bf16."""
    if not getattr(_TRACING, "on", False) or bias is not None or not packs(weight) or x.dtype != torch.bfloat16:
        return F.linear(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1])
    return torch.ops.minillm.linear_bf16_rows(rows, pack(weight)).view(*x.shape[:-1], weight.shape[0])
