"""Weight-only int8 / int4 matmuls in Triton: ``y = x · dequantize(W)ᵀ`` without a dequantized ``W``.

Why a kernel of our own: a decode step at batch 1 multiplies one activation row by every weight
matrix of the model, so it is **bandwidth bound** — its time is the bytes of the weights divided
by the memory bandwidth, and the arithmetic is free. Storing a weight in 1 byte (int8) or half a
byte (int4) instead of 2 (bf16) only pays if the matmul *reads* 1 or 0.5 byte per weight: that
is the whole gain. The reference path (``dequantize`` + ``F.linear``) does the opposite — it
writes the bf16 matrix to memory and reads it back, 2 + 2 bytes per weight on top of the
low-bit read, slower than plain bf16. These kernels load a tile of the low-bit matrix,
dequantize it **in registers** and feed it straight to ``tl.dot`` (fp32 accumulation); the
bf16 matrix never exists in memory.

- ``int8_matmul(x[M, K], q int8 [N, K], scale [N])``: per-output-channel scales factor out of
  the sum, ``x · (q·s)ᵀ = (x · qᵀ) · s``, so the loop multiplies by the integers (exact in
  bf16: |q| ≤ 127) and the scale is applied once to the accumulator at the end.
- ``int4_matmul(x[M, K], packed uint8 [N, K/2], scale, minimum [N, K/group], group)``: each
  byte holds two values, low nibble first (``pack_int4``); a tile of ``BLOCK_K/2`` bytes per row
  is split into its low and high nibbles and interleaved back into ``BLOCK_K`` columns.
  ``BLOCK_K`` divides the group, so a tile lies in one group: one ``(scale, minimum)`` per output
  row per tile, ``w = q · scale + minimum`` computed in fp32, then rounded to the activations'
  dtype — the rounding the reference makes too.

Two tile shapes, chosen by the number of rows ``M``:

- **decode** (``M ≤ 16``, GEMV-shaped): ``BLOCK_M = 16`` (the smallest ``tl.dot`` takes; the
  padding rows are masked and cost no memory traffic), narrow ``BLOCK_N = 32`` so that many
  programs stream the matrix in parallel, long ``BLOCK_K`` to amortise each program's loop.
  (Small layers — SmolLM2's 576 × 576 — give few programs; a split-K variant would fill the GPU,
  but at that size a step is dominated by launch overhead anyway, which CUDA graphs remove.)
- **prefill** (GEMM-shaped): ``64 × 64`` output tiles, where each loaded weight tile is reused
  by 64 rows, so the kernel becomes compute bound like a plain matmul.

On a GPU, bf16/fp16 activations are multiplied in their own dtype on the tensor cores (fp32
accumulation); fp32 activations use exact-fp32 (``ieee``) dots. Without CUDA the kernels run
under Triton's interpreter (``TRITON_INTERPRET=1``, set and checked by ``minillm/triton_setup.py``,
whose ``triton`` we import) — slow, for tests. The
interpreter computes bfloat16 arithmetic wrongly, so there every load is upcast to fp32 first
and the fp32 result is rounded to bf16 by PyTorch.

The engine calls these from ``Int8Method.apply`` / ``Int4Method.apply`` when the activations
are on CUDA; the CPU engine keeps PyTorch's CPU kernels. Tests call them (or the methods'
``apply_triton``) directly on CPU tensors under the interpreter.
"""

from __future__ import annotations

import torch

from minillm.triton_setup import INTERPRETED, tl, triton  # sets up (and checks) the interpreter first

DECODE_ROWS = 16  # up to this many rows: the GEMV-shaped config

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages); int4's BLOCK_K is also capped by the group.
DECODE_CONFIG = (16, 32, 128, 4, 4)
PREFILL_CONFIG = (64, 64, 64, 4, 3)


def _config(m: int) -> tuple[int, int, int, int, int]:
    return DECODE_CONFIG if m <= DECODE_ROWS else PREFILL_CONFIG


def _upcast(x: torch.Tensor) -> bool:
    """Dot in fp32: for fp32 activations, and always under the interpreter (wrong bf16 arithmetic)."""
    return INTERPRETED or x.dtype == torch.float32


def _out_dtype(x: torch.Tensor) -> torch.dtype:
    """The interpreter also rounds fp32 → bf16 wrongly (it truncates): there the kernel writes
    fp32 and PyTorch rounds. On a GPU the kernel writes ``x``'s dtype (``.to`` is then a no-op)."""
    return torch.float32 if INTERPRETED else x.dtype


@triton.jit
def _int8_matmul_kernel(
    X, W, S, Out,
    M, N, K,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_om, stride_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_valid, n_valid = offs_m < M, offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_valid = offs_k < K
        a = tl.load(
            X + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
            mask=m_valid[:, None] & k_valid[None, :],
            other=0.0,
        )
        if UPCAST:
            a = a.to(tl.float32)
        # [BLOCK_N, BLOCK_K] int8, contiguous along K: 1 byte per weight is all that is read.
        q = tl.load(
            W + offs_n[:, None] * stride_wn + offs_k[None, :] * stride_wk,
            mask=n_valid[:, None] & k_valid[None, :],
            other=0,
        )
        acc = tl.dot(a, tl.trans(q.to(a.dtype)), acc, input_precision=PRECISION)  # integers: exact in bf16
    scale = tl.load(S + offs_n, mask=n_valid, other=0.0).to(tl.float32)
    out = acc * scale[None, :]  # the per-channel scale factors out of the sum
    tl.store(
        Out + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on,
        out.to(Out.dtype.element_ty),
        mask=m_valid[:, None] & n_valid[None, :],
    )


@triton.jit
def _int4_matmul_kernel(
    X, P, S, Z, Out,
    M, N, K,
    stride_xm, stride_xk, stride_pn, stride_pk, stride_sn, stride_sg, stride_om, stride_on,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_b = tl.arange(0, BLOCK_K // 2)  # bytes of one tile row: two columns each
    m_valid, n_valid = offs_m < M, offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):  # K is a multiple of BLOCK_K (it divides the group): no K mask
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(X + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk, mask=m_valid[:, None], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
        packed = tl.load(
            P + offs_n[:, None] * stride_pn + (k0 // 2 + offs_b)[None, :] * stride_pk,
            mask=n_valid[:, None],
            other=0,
        )  # [BLOCK_N, BLOCK_K / 2] bytes: half a byte per weight
        q = tl.interleave(packed & 0xF, packed >> 4)  # [BLOCK_N, BLOCK_K]: low nibble = even column
        group = k0 // GROUP  # the whole tile lies in one group
        scale = tl.load(S + offs_n * stride_sn + group * stride_sg, mask=n_valid, other=0.0).to(tl.float32)
        low = tl.load(Z + offs_n * stride_sn + group * stride_sg, mask=n_valid, other=0.0).to(tl.float32)
        w = q.to(tl.float32) * scale[:, None] + low[:, None]  # dequantized in registers, never stored
        acc = tl.dot(a, tl.trans(w.to(a.dtype)), acc, input_precision=PRECISION)
    tl.store(
        Out + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on,
        acc.to(Out.dtype.element_ty),
        mask=m_valid[:, None] & n_valid[None, :],
    )


def _check(x: torch.Tensor, weight: torch.Tensor, k: int) -> None:
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x must be [M, {k}], got {tuple(x.shape)}")
    if x.device != weight.device:
        raise ValueError(f"x is on {x.device}, the weights on {weight.device}")


def int8_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x[M, K] · (qweight[N, K] · scales[N, None])ᵀ`` → ``[M, N]`` in ``x``'s dtype."""
    n, k = qweight.shape
    _check(x, qweight, k)
    if qweight.dtype != torch.int8 or scales.shape != (n,):
        raise ValueError(f"int8_matmul wants int8 [N, K] weights and [N] scales, got {qweight.dtype}, {scales.shape}")
    m = x.shape[0]
    out = torch.empty((m, n), dtype=_out_dtype(x), device=x.device)
    if m == 0:
        return out.to(x.dtype)
    block_m, block_n, block_k, warps, stages = _config(m)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _int8_matmul_kernel[grid](
        x, qweight, scales, out,
        m, n, k,
        x.stride(0), x.stride(1), qweight.stride(0), qweight.stride(1), out.stride(0), out.stride(1),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        UPCAST=_upcast(x), PRECISION="ieee" if _upcast(x) else "tf32",
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out.to(x.dtype)


def int4_matmul(
    x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, group_size: int
) -> torch.Tensor:
    """``x[M, K] · Wᵀ`` with ``W[N, K]`` = ``unpack_int4(packed[N, K/2]) · scale + minimum`` per
    group of ``group_size`` columns (``scale``, ``minimum``: ``[N, K/group_size]``) → ``[M, N]``
    in ``x``'s dtype."""
    n, half = packed.shape
    k = 2 * half
    _check(x, packed, k)
    if group_size < 16 or group_size & (group_size - 1):
        raise ValueError(f"int4_matmul needs a power-of-two group size of at least 16, got {group_size}")
    groups = k // group_size
    if packed.dtype != torch.uint8 or k % group_size or scale.shape != (n, groups) or minimum.shape != scale.shape:
        raise ValueError(
            f"int4_matmul wants uint8 [N, K/2] weights and [N, K/{group_size}] scales and minima; got "
            f"{packed.dtype} {tuple(packed.shape)}, {tuple(scale.shape)}, {tuple(minimum.shape)}"
        )
    if scale.stride() != minimum.stride():
        minimum = minimum.contiguous()
        scale = scale.contiguous()
    m = x.shape[0]
    out = torch.empty((m, n), dtype=_out_dtype(x), device=x.device)
    if m == 0:
        return out.to(x.dtype)
    block_m, block_n, block_k, warps, stages = _config(m)
    block_k = min(block_k, group_size)  # powers of two: a tile never straddles two groups
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _int4_matmul_kernel[grid](
        x, packed, scale, minimum, out,
        m, n, k,
        x.stride(0), x.stride(1), packed.stride(0), packed.stride(1), scale.stride(0), scale.stride(1),
        out.stride(0), out.stride(1),
        GROUP=group_size, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        UPCAST=_upcast(x), PRECISION="ieee" if _upcast(x) else "tf32",
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out.to(x.dtype)
