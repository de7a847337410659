"""Attention kernels in Triton: FlashAttention for prefill, paged attention for decode.

Both kernels read K/V where they already are — packed in one tensor, or scattered over the
paged pool through block tables — and never build the ``[T, S]`` score matrix in memory:

- ``flash_attention`` (prefill): each program owns ``BLOCK_M`` queries of one sequence and one
  head, walks that sequence's keys ``BLOCK_N`` at a time and keeps a **running** softmax — the
  row maximum ``m``, the sum of exponentials ``l`` and the weighted sum of values ``acc`` —
  rescaling what it has when a larger maximum appears (the *online softmax*). Variable-length
  packed batches via ``cu_seqlens``; causal or not; queries may continue a cached prefix (they
  sit at the *end* of their sequence's keys); GQA by indexing the shared K/V head, never
  repeating it.
- ``paged_decode`` (decode): one query token per sequence; each program handles one KV head
  and the whole group of query heads that share it, so every K/V block is read once for the
  group — and multiplies them as one small matrix product (the group padded to the tensor
  cores' 16 rows; ``DecodeConfig.tensor_cores``), not as fp32 broadcasts in registers. Long contexts are split over several programs (split-K, "flash-decoding") whose
  partial softmax states are merged afterwards, so a small batch still fills the GPU.
- ``write_kv``: the new tokens' K and V into the pool through the slot mapping, one program
  per token; ``rope_write_kv`` does the same from the fused q/k/v projection's output and
  applies RoPE to q and K on the way (the engine's Triton step calls this one).

**An 8-bit pool** (``kv_cache_dtype="int8"`` or ``"fp8"``, ``kvcache/quantization.py``): ``write_kv``
quantizes each new token's K and V per head as it stores them (the scale ``max|x| / 127``, or
``/ 448`` for fp8 e4m3, goes to the pool's scale tensor), and both attention kernels load the
8-bit values with their scales and dequantize **in registers**, right after the load. That is
the point of doing it in the kernel: decode is bound by the bytes it reads, and those are now
one per value (plus a 4-byte scale per token and head) instead of two or four, while the
arithmetic — scores, softmax, weighted sum — stays fp32 exactly as before. A constexpr
``KV_QUANT`` (0 none, 1 int8, 2 fp8) selects the code at compile time, so the unquantized
kernels are unchanged. The rounding is the reference's (``quantize_kv``) bit for bit: IEEE
division (``tl.fdiv(..., ieee_rounding=True)``, not the GPU's fast approximate one), round half
to even, and the e4m3 encoding and decoding done with integer bit arithmetic (``_e4m3_bits``,
``_e4m3_value``): portable to GPUs without fp8 conversions (before sm_89), and correct under
the interpreter, whose float → fp8 cast drops the carry when rounding crosses a power of two
(it turns 126 into 64).

On a machine without CUDA the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``,
set by ``minillm/triton_setup.py`` before triton is imported): slow, but the same code, which is how the course
runs them on a laptop. The interpreter computes bfloat16 arithmetic wrongly, so there every load is
upcast to fp32 first (bf16 → fp32 is exact). On a GPU that upcast is not free: fp32 operands
take twice the registers and run the tensor cores at their tf32 rate, half the bf16 one — one
of the reasons the first H200 run measured ``flash_attention`` at 0.09-0.13× SDPA
(``benchmarks/results/gpu-2026-12-04/``). So on a GPU the prefill kernel multiplies bf16/fp16
inputs as they are, with fp32 sums (``FlashConfig``, which lists the other steps it takes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minillm.attention.decode_tuning import DEFAULT as DEFAULT_DECODE
from minillm.attention.decode_tuning import DecodeConfig
from minillm.config import KVCacheDtype
from minillm.triton_setup import INTERPRETED, tl, triton  # sets up (and checks) the interpreter first

NO_WINDOW = 1 << 30  # "no sliding window": a window longer than any context


def _kv_quant(kv_cache_dtype: KVCacheDtype | str, k_scales: torch.Tensor | None,
              v_scales: torch.Tensor | None) -> int:  # fmt: skip
    """The kernels' ``KV_QUANT`` code of a pool (``KVCacheDtype.kernel_code``), checking an 8-bit
    one comes with its scales."""
    code = KVCacheDtype(kv_cache_dtype).kernel_code
    if code and (k_scales is None or v_scales is None):
        raise ValueError(f"an {kv_cache_dtype} pool needs k_scales and v_scales ([num_slots, kv_heads])")
    if code and k_scales.stride() != v_scales.stride():
        raise ValueError("k_scales and v_scales must have the same layout")
    return code


# ---- 8-bit K/V: the same numbers as kvcache/quantization.py, in registers --------------------------


@triton.jit
def _round_half_even(x):
    """``torch.round`` for ``|x| < 2**22``: adding 2**23 leaves no fraction bits, so the FPU rounds
    (half to even); the integer is read back from the sum's bits (``libdevice.rint`` does the
    same on a GPU, but the interpreter has no libdevice)."""
    r = ((tl.abs(x) + 8388608.0).to(tl.int32, bitcast=True) - 0x4B000000).to(tl.float32)  # 2**23's bits
    return tl.where(x < 0, -r, r)


@triton.jit
def _e4m3_bits(x):
    """fp32 ``x`` (``|x| <= 448``) → its float8 e4m3fn bit pattern (int32 0..255), rounded to
    nearest, half to even — what ``x.to(torch.float8_e4m3fn).view(torch.uint8)`` gives."""
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag_bits = bits & 0x7FFFFFFF
    mag = mag_bits.to(tl.float32, bitcast=True)
    # Normal (|x| >= 2**-6): keep 3 of fp32's 23 mantissa bits, rounding half to even; a carry
    # out of the mantissa bumps the exponent, as it should. Then rebias the exponent 127 → 7.
    rounded = mag_bits + 0x7FFFF + ((mag_bits >> 20) & 1)
    normal = (rounded >> 20) - (120 << 3)
    # Subnormal: multiples of 2**-9. In 2**14 + |x| the FPU rounds |x| to exactly that spacing;
    # 8 such steps is 2**-6, whose e4m3 pattern is 8 too.
    sub = (mag + 16384.0).to(tl.int32, bitcast=True) - 0x46800000  # 2**14's bits
    return sign | tl.where(mag < 0.015625, sub, normal)


@triton.jit
def _e4m3_value(code):
    """float8 e4m3fn bit patterns (int32 0..255) → fp32 values (exact)."""
    mag = code & 0x7F
    normal = ((mag << 20) + (120 << 23)).to(tl.float32, bitcast=True)  # exponent rebiased 7 → 127
    sub = mag.to(tl.float32) * 0.001953125  # e == 0: mantissa * 2**-9
    value = tl.where(mag < 8, sub, normal)
    return tl.where(code >= 128, -value, value)


@triton.jit
def _quantize(x, KV_QUANT: tl.constexpr):
    """``x[H, D]`` fp32 → (values to store ``[H, D]``, scales ``[H]``), as ``quantize_kv``."""
    if KV_QUANT == 1:
        top = 127.0
    else:
        top = 448.0
    scale = tl.fdiv(tl.maximum(tl.max(tl.abs(x), 1), 1e-8), top, ieee_rounding=True)
    scaled = tl.fdiv(x, scale[:, None], ieee_rounding=True)
    if KV_QUANT == 1:
        q = tl.minimum(tl.maximum(_round_half_even(scaled), -127.0), 127.0)
    else:
        q = _e4m3_bits(tl.minimum(tl.maximum(scaled, -448.0), 448.0))
    return q, scale


@triton.jit
def _dequantize(raw, scale, KV_QUANT: tl.constexpr):
    """Loaded 8-bit values ``[N, D]`` and their scales ``[N]`` → fp32, as ``dequantize_kv``."""
    if KV_QUANT == 2:
        values = _e4m3_value(raw.to(tl.int32))
    else:
        values = raw.to(tl.float32)
    return values * scale[:, None]


@dataclass(frozen=True)
class FlashConfig:
    """How ``flash_attention`` runs: its tiles, and the steps that make it fast — each a switch,
    so ``benchmarks/bench_gpu.py`` can measure what each one is worth (chapter 06's ladder).

    - ``block_m`` × ``block_n``: queries a program owns × keys per step. Bigger tiles re-read K/V
      fewer times (once per ``block_m`` queries) and give the tensor cores matrix products big
      enough to fill them, up to what the registers hold.
    - ``num_warps``, ``num_stages``: threads per program, and how many K/V tiles Triton loads
      ahead while the current one is computed (software pipelining of the loop's loads).
    - ``input_dtype_dots``: multiply in the inputs' bf16/fp16 with fp32 sums (FlashAttention-2's
      way) instead of upcasting to fp32 first: half the register and shared-memory bytes, and the
      tensor cores' bf16 rate (twice their tf32 rate). Off under Triton's interpreter, whose
      bf16 arithmetic is wrong, and for an 8-bit pool (its values are dequantized in fp32).
    - ``skip_interior_masks``: only the key tiles on the causal diagonal (or a window's edge, or
      the last partial tile) need the mask; every tile wholly inside runs a second copy of the
      loop body without it (Triton's fused-attention tutorial: its ``STAGE`` argument).
    - ``exp2``: ``exp(x) = exp2(x · log2 e)``, with ``log2 e`` folded into the softmax scale, so
      each score costs one multiply and the GPU's native ``exp2`` instead of a scaled ``exp``.
    """

    block_m: int = 32
    block_n: int = 32
    num_warps: int = 4
    num_stages: int = 2
    input_dtype_dots: bool = True
    skip_interior_masks: bool = True
    exp2: bool = True


def flash_config(head_dim: int, dtype: torch.dtype, device: torch.device) -> FlashConfig:
    """Tiles per head dimension and dtype. On a GPU, Triton's fused-attention tutorial's shapes:
    128 queries × 64 keys, 3 stages, 4 warps up to head dim 64 and 8 to 128; half the queries
    for fp32 inputs (their registers are twice as wide) and beyond 128. Under the interpreter
    (no GPU) 32 × 32 tiles: the same arithmetic, and what the tests were sized for."""
    if device.type != "cuda" or INTERPRETED:
        return FlashConfig()
    if dtype == torch.float32 or head_dim > 128:
        return FlashConfig(block_m=64, block_n=32 if head_dim > 64 else 64, num_warps=4, num_stages=2)
    return FlashConfig(block_m=128, block_n=64, num_warps=4 if head_dim <= 64 else 8, num_stages=3)


@triton.jit
def _flash_tiles(
    acc, l_i, m_i, q, K, V, K_scale, V_scale, block_tables,
    lo, hi, seq, kv_head, k_start, end, q_pos, m_valid, offs_d, d_valid,
    stride_kn, stride_kh, stride_vn, stride_vh, stride_bt, stride_sn, stride_sh,
    qk_scale, page_size, window,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, PAGED: tl.constexpr,
    PRECISION: tl.constexpr, KV_QUANT: tl.constexpr, DOT_DTYPE: tl.constexpr, EXP2: tl.constexpr,
):  # fmt: skip
    """The online softmax over key tiles ``lo, lo + BLOCK_N, ... < hi``. ``MASKED`` False: every
    key of every tile is visible to every query (the caller chose the tiles), so no mask is built
    and no load is guarded."""
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_valid = offs_n < end
        if PAGED:  # key position -> block (through the table) -> slot in the pool
            if MASKED:
                block = tl.load(block_tables + seq * stride_bt + offs_n // page_size, mask=n_valid, other=0)
            else:
                block = tl.load(block_tables + seq * stride_bt + offs_n // page_size)
            rows = block * page_size + offs_n % page_size
        else:
            rows = k_start + offs_n
        if MASKED:
            kv_mask = n_valid[:, None] & d_valid[None, :]
        else:
            kv_mask = d_valid[None, :]
        k = tl.load(K + rows[:, None] * stride_kn + kv_head * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(V + rows[:, None] * stride_vn + kv_head * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
        if KV_QUANT != 0:  # an 8-bit pool: one byte per value loaded, dequantized here in registers
            scale_rows = rows * stride_sn + kv_head * stride_sh
            k = _dequantize(k, tl.load(K_scale + scale_rows, mask=n_valid, other=0.0), KV_QUANT)
            v = _dequantize(v, tl.load(V_scale + scale_rows, mask=n_valid, other=0.0), KV_QUANT)
        # Scores in fp32 sums from DOT_DTYPE operands; in log2 units when EXP2 (qk_scale holds log2 e).
        s = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision=PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
        if MASKED:
            allowed = n_valid[None, :] & m_valid[:, None] & (offs_n[None, :] > q_pos[:, None] - window)
            if CAUSAL:
                allowed = allowed & (offs_n[None, :] <= q_pos[:, None])
            s = tl.where(allowed, s, float("-inf"))
        # The online softmax update: new running max, rescale the old sum and accumulator.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        if MASKED:
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
        else:
            m_safe = m_new  # every row sees this whole tile: its maximum is finite
        if EXP2:
            p = tl.exp2(s - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
        else:
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _flash_attention_kernel(
    Q, K, V, Out, K_scale, V_scale,
    cu_seqlens_q, cu_seqlens_k, seqlens_k, block_tables,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_on, stride_oh, stride_bt,
    stride_sn, stride_sh,
    qk_scale, group, head_dim, page_size, window,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    CAUSAL: tl.constexpr, PAGED: tl.constexpr, PRECISION: tl.constexpr, KV_QUANT: tl.constexpr,
    DOT_DTYPE: tl.constexpr, EXP2: tl.constexpr, SKIP_INTERIOR_MASKS: tl.constexpr,
):  # fmt: skip
    tile, seq, head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_start = tl.load(cu_seqlens_q + seq)
    q_len = tl.load(cu_seqlens_q + seq + 1) - q_start
    if tile * BLOCK_M >= q_len:
        return
    k_len = tl.load(seqlens_k + seq)
    kv_head = head // group
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # query index within the sequence
    offs_d = tl.arange(0, HEAD_DIM)
    m_valid = offs_m < q_len
    d_valid = offs_d < head_dim
    q = tl.load(
        Q + (q_start + offs_m)[:, None] * stride_qn + head * stride_qh + offs_d[None, :],
        mask=m_valid[:, None] & d_valid[None, :],
        other=0.0,
    ).to(DOT_DTYPE)
    q_pos = k_len - q_len + offs_m  # the queries are the last q_len of the sequence's k_len positions
    first = k_len - q_len + tile * BLOCK_M  # this tile's first and last query positions
    last = k_len - q_len + tl.minimum((tile + 1) * BLOCK_M, q_len) - 1

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    end = k_len
    if CAUSAL:  # keys after this tile's last query are never needed
        end = last + 1
    # With a sliding window, keys before the first query's window are never needed either.
    lo = tl.maximum(0, first - window + 1) // BLOCK_N * BLOCK_N
    k_start = 0
    if not PAGED:
        k_start = tl.load(cu_seqlens_k + seq)
    # Key tiles [inner_lo, inner_hi) are visible to every query of the tile: all at or before the
    # first query (causal) or the last key, and inside the last query's window.
    inner_lo, inner_hi = lo, lo
    if SKIP_INTERIOR_MASKS:
        visible_to_all = k_len
        if CAUSAL:
            visible_to_all = first + 1
        inner_lo = tl.minimum(tl.maximum(lo, (last - window + 1 + BLOCK_N - 1) // BLOCK_N * BLOCK_N), end)
        inner_hi = tl.minimum(tl.maximum(inner_lo, visible_to_all // BLOCK_N * BLOCK_N), end)
    acc, l_i, m_i = _flash_tiles(
        acc, l_i, m_i, q, K, V, K_scale, V_scale, block_tables, lo, inner_lo, seq, kv_head, k_start, end, q_pos,
        m_valid, offs_d, d_valid, stride_kn, stride_kh, stride_vn, stride_vh, stride_bt, stride_sn, stride_sh,
        qk_scale, page_size, window, BLOCK_N, True, CAUSAL, PAGED, PRECISION, KV_QUANT, DOT_DTYPE, EXP2,
    )  # fmt: skip
    if SKIP_INTERIOR_MASKS:
        acc, l_i, m_i = _flash_tiles(
            acc, l_i, m_i, q, K, V, K_scale, V_scale, block_tables, inner_lo, inner_hi, seq, kv_head, k_start, end,
            q_pos, m_valid, offs_d, d_valid, stride_kn, stride_kh, stride_vn, stride_vh, stride_bt, stride_sn,
            stride_sh, qk_scale, page_size, window, BLOCK_N, False, CAUSAL, PAGED, PRECISION, KV_QUANT, DOT_DTYPE,
            EXP2,
        )  # fmt: skip
    acc, l_i, m_i = _flash_tiles(
        acc, l_i, m_i, q, K, V, K_scale, V_scale, block_tables, inner_hi, end, seq, kv_head, k_start, end, q_pos,
        m_valid, offs_d, d_valid, stride_kn, stride_kh, stride_vn, stride_vh, stride_bt, stride_sn, stride_sh,
        qk_scale, page_size, window, BLOCK_N, True, CAUSAL, PAGED, PRECISION, KV_QUANT, DOT_DTYPE, EXP2,
    )  # fmt: skip
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        Out + (q_start + offs_m)[:, None] * stride_on + head * stride_oh + offs_d[None, :],
        out.to(Out.dtype.element_ty),
        mask=m_valid[:, None] & d_valid[None, :],
    )


LOG2E = 1.4426950408889634  # log2(e): exp(x) = exp2(x * LOG2E)


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    scale: float,
    causal: bool = True,
    cu_seqlens_k: torch.Tensor | None = None,
    block_tables: torch.Tensor | None = None,
    block_size: int = 16,
    block_m: int | None = None,
    block_n: int | None = None,
    window: int | None = None,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
    kv_cache_dtype: KVCacheDtype | str = "auto",
    config: FlashConfig | None = None,
) -> torch.Tensor:
    """Attention for packed variable-length sequences. ``q[N, H, D]`` holds every sequence's
    queries back to back (``cu_seqlens_q[S+1]`` marks where each starts). Keys come either
    packed, ``k, v[Nk, KV, D]`` with ``cu_seqlens_k``, or from the paged pool — ``k, v`` the pool
    as ``[num_slots, KV, D]`` and ``block_tables[S, max_blocks]``. Sequence ``i`` has
    ``seqlens_k[i]`` keys; its queries are the last ones of those positions (a prefill that
    continues a cached prefix). ``window``: sliding-window attention, each query sees its last
    ``window`` keys. An 8-bit pool (``kv_cache_dtype="int8"`` or ``"fp8"``) passes its scales,
    ``k_scales, v_scales[num_slots, KV]``. ``config``: tiles and switches (``flash_config``
    picks them per head dimension when omitted; ``block_m`` / ``block_n`` override its tiles).
    Returns ``[N, H, D]`` in ``q``'s dtype."""
    paged = block_tables is not None
    if not paged and cu_seqlens_k is None:
        raise ValueError("flash_attention needs cu_seqlens_k (packed keys) or block_tables (paged keys)")
    kv_quant = _kv_quant(kv_cache_dtype, k_scales, v_scales)
    if kv_quant and not paged:
        raise ValueError("8-bit K/V are read from the paged pool: pass block_tables")
    n, heads, dim = q.shape
    group = heads // k.shape[1]
    config = config or flash_config(dim, q.dtype, q.device)
    block_m, block_n = block_m or config.block_m, block_n or config.block_n
    out = torch.empty_like(q)
    num_seqs = cu_seqlens_q.numel() - 1
    if n == 0 or num_seqs == 0:
        return out
    low = config.input_dtype_dots and q.dtype in (torch.bfloat16, torch.float16) and not kv_quant and not INTERPRETED
    grid = (triton.cdiv(max_seqlen_q, block_m), num_seqs, heads)
    dummy = cu_seqlens_q  # an unused pointer argument still needs a tensor
    _flash_attention_kernel[grid](
        q, k, v, out, k_scales if kv_quant else dummy, v_scales if kv_quant else dummy,
        cu_seqlens_q, cu_seqlens_k if not paged else dummy, seqlens_k, block_tables if paged else dummy,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        block_tables.stride(0) if paged else 0,
        k_scales.stride(0) if kv_quant else 0, k_scales.stride(1) if kv_quant else 0,
        scale * LOG2E if config.exp2 else scale, group, dim, block_size, NO_WINDOW if window is None else window,
        BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=max(16, triton.next_power_of_2(dim)),
        # fp32 products of upcast bf16 q and K are exact in tf32 (8 significant bits fit in 11); an
        # 8-bit pool's dequantized values are not, so they multiply in true fp32 ("ieee").
        CAUSAL=causal, PAGED=paged, KV_QUANT=kv_quant,
        PRECISION="ieee" if q.dtype == torch.float32 or kv_quant else "tf32",
        DOT_DTYPE=(tl.bfloat16 if q.dtype == torch.bfloat16 else tl.float16) if low else tl.float32,
        EXP2=config.exp2, SKIP_INTERIOR_MASKS=config.skip_interior_masks,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    return out


@triton.jit
def _paged_decode_kernel(
    Q, K, V, K_scale, V_scale, M_part, L_part, O_part,
    context_lens, block_tables,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_bt, stride_sn, stride_sh,
    stride_ms, stride_mh, stride_os, stride_oh, stride_osplit,
    scale, group, head_dim, page_size, split_len, window,
    GROUP: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, KV_QUANT: tl.constexpr,
    DOT: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    ctx = tl.load(context_lens + seq)
    start = split * split_len
    end = tl.minimum(ctx, start + split_len)
    start = tl.maximum(start, ctx - window)  # sliding window: older keys are not attended
    offs_g = tl.arange(0, GROUP)  # the query heads sharing this KV head
    offs_d = tl.arange(0, HEAD_DIM)
    g_valid = offs_g < group
    d_valid = offs_d < head_dim
    heads = kv_head * group + offs_g
    q = tl.load(
        Q + seq * stride_qn + heads[:, None] * stride_qh + offs_d[None, :],
        mask=g_valid[:, None] & d_valid[None, :],
        other=0.0,
    ).to(tl.float32)  # [GROUP, D]
    m_i = tl.full([GROUP], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP], tl.float32)
    acc = tl.zeros([GROUP, HEAD_DIM], tl.float32)
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_valid = offs_n < end
        block = tl.load(block_tables + seq * stride_bt + offs_n // page_size, mask=n_valid, other=0)
        rows = block * page_size + offs_n % page_size
        kv_mask = n_valid[:, None] & d_valid[None, :]
        k = tl.load(K + rows[:, None] * stride_kn + kv_head * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(V + rows[:, None] * stride_vn + kv_head * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
        if KV_QUANT != 0:  # an 8-bit pool: one byte per value loaded, dequantized here in registers
            scale_rows = rows * stride_sn + kv_head * stride_sh
            k = _dequantize(k, tl.load(K_scale + scale_rows, mask=n_valid, other=0.0), KV_QUANT)
            v = _dequantize(v, tl.load(V_scale + scale_rows, mask=n_valid, other=0.0), KV_QUANT)
        if DOT:  # the group's queries (padded to 16 rows) as one matrix product on the tensor cores
            s = tl.dot(q.to(DOT_DTYPE), tl.trans(k.to(DOT_DTYPE)), input_precision=PRECISION) * scale
        else:  # a broadcast multiply-add in fp32 registers: [GROUP, BLOCK_N, HEAD_DIM] products at once
            s = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], 2) * scale  # [GROUP, BLOCK_N]
        s = tl.where(n_valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if DOT:
            acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=PRECISION)
        else:
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], 1)
        m_i = m_new
    # Partial results of this split: running max, sum, and the unnormalised weighted values.
    tl.store(M_part + seq * stride_ms + heads * stride_mh + split, m_i, mask=g_valid)
    tl.store(L_part + seq * stride_ms + heads * stride_mh + split, l_i, mask=g_valid)
    tl.store(
        O_part + seq * stride_os + heads[:, None] * stride_oh + split * stride_osplit + offs_d[None, :],
        acc,
        mask=g_valid[:, None] & d_valid[None, :],
    )


def decode_splits(num_seqs: int, num_kv_heads: int, max_context: int, block_n: int, device: torch.device,
                  programs_per_sm: int = 2) -> int:  # fmt: skip
    """How many programs share one sequence's context: enough to give every streaming
    multiprocessor ``programs_per_sm`` programs when the batch alone cannot, never a split
    under 256 keys, at most 16."""
    if device.type != "cuda":
        return 1 if max_context <= 256 else 2  # the interpreter: a little split-K, for coverage
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    programs = num_seqs * num_kv_heads
    wanted = max(1, (programs_per_sm * sms) // max(programs, 1))
    return max(1, min(wanted, max_context // 256, 16))


def paged_decode(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    block_size: int,
    max_context: int,
    num_splits: int | None = None,
    block_n: int | None = None,
    window: int | None = None,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
    kv_cache_dtype: KVCacheDtype | str = "auto",
    config: DecodeConfig = DEFAULT_DECODE,
) -> torch.Tensor:
    """One query token per sequence, ``q[B, H, D]``, against K/V in the pool (``[num_slots, KV, D]``)
    through ``block_tables[B, max_blocks]``; ``context_lens[B]`` keys each (the last ``window`` of
    them with sliding-window attention). An 8-bit pool (``kv_cache_dtype="int8"`` or ``"fp8"``)
    passes its scales, ``k_scales, v_scales[num_slots, KV]``. ``config`` holds the launch settings
    (``decode_tuning.py``); ``block_n`` and ``num_splits`` override its. Returns ``[B, H, D]``."""
    kv_quant = _kv_quant(kv_cache_dtype, k_scales, v_scales)
    b, heads, dim = q.shape
    kv_heads = k_pool.shape[1]
    group = heads // kv_heads
    block_n = block_n or config.block_n
    if num_splits is None:
        num_splits = decode_splits(b, kv_heads, max_context, block_n, q.device, config.programs_per_sm)
    split_len = triton.cdiv(triton.cdiv(max_context, num_splits), block_n) * block_n
    m_part = torch.empty((b, heads, num_splits), dtype=torch.float32, device=q.device)
    l_part = torch.empty_like(m_part)
    o_part = torch.empty((b, heads, num_splits, dim), dtype=torch.float32, device=q.device)
    # Tensor cores take at least 16 rows: the group's queries padded to 16 (the padded rows load
    # zeros and are never stored), and keys in steps of at least 16.
    # An 8-bit pool keeps the broadcast path: its dequantized values stay in exact fp32 arithmetic.
    dot = config.tensor_cores and block_n >= 16 and not kv_quant
    low = dot and q.dtype in (torch.bfloat16, torch.float16) and not INTERPRETED
    _paged_decode_kernel[(b, kv_heads, num_splits)](
        q, k_pool, v_pool, k_scales if kv_quant else m_part, v_scales if kv_quant else m_part, m_part, l_part, o_part,
        context_lens, block_tables,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1),
        block_tables.stride(0), k_scales.stride(0) if kv_quant else 0, k_scales.stride(1) if kv_quant else 0,
        m_part.stride(0), m_part.stride(1), o_part.stride(0), o_part.stride(1), o_part.stride(2),
        scale, group, dim, block_size, split_len, NO_WINDOW if window is None else window,
        GROUP=max(16 if dot else 2, triton.next_power_of_2(group)), BLOCK_N=block_n,
        HEAD_DIM=max(16, triton.next_power_of_2(dim)), KV_QUANT=kv_quant, DOT=dot,
        DOT_DTYPE=(tl.bfloat16 if q.dtype == torch.bfloat16 else tl.float16) if low else tl.float32,
        PRECISION="tf32" if low else "ieee",  # fp32 operands multiply in fp32 (bf16 ones ignore it)
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    return merge_splits(m_part, l_part, o_part, q.dtype)


@triton.jit
def _merge_splits_kernel(
    M_part, L_part, O_part, Out,
    stride_ms, stride_mh, stride_os, stride_oh, stride_osplit, stride_on, stride_oh_out,
    num_splits, head_dim,
    SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr,
):  # fmt: skip
    """One program per (sequence, head): the log-sum-exp merge of its splits' partial states."""
    seq, head = tl.program_id(0), tl.program_id(1)
    offs_s = tl.arange(0, SPLITS)
    offs_d = tl.arange(0, HEAD_DIM)
    s_valid = offs_s < num_splits
    d_valid = offs_d < head_dim
    m = tl.load(M_part + seq * stride_ms + head * stride_mh + offs_s, mask=s_valid, other=float("-inf"))
    sums = tl.load(L_part + seq * stride_ms + head * stride_mh + offs_s, mask=s_valid, other=0.0)
    o = tl.load(
        O_part + seq * stride_os + head * stride_oh + offs_s[:, None] * stride_osplit + offs_d[None, :],
        mask=s_valid[:, None] & d_valid[None, :],
        other=0.0,
    )
    m_max = tl.max(m, 0)
    weight = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_max))  # an empty split (m = -inf) weighs 0
    total = tl.sum(sums * weight, 0)
    out = tl.sum(o * weight[:, None], 0) / total
    tl.store(Out + seq * stride_on + head * stride_oh_out + offs_d, out.to(Out.dtype.element_ty), mask=d_valid)


def merge_splits(m_part: torch.Tensor, l_part: torch.Tensor, o_part: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Merge split-K partial states (``m, l[B, H, S]`` running max and sum, ``o[B, H, S, D]``
    unnormalised weighted values) into ``[B, H, D]``: rescale each split to the global max, then
    divide by the total sum — the log-sum-exp rule. One kernel launch (the PyTorch form,
    ``merge_splits_reference``, is six), which matters when a decode step is launch-bound."""
    b, heads, splits, dim = o_part.shape
    # The interpreter rounds fp32 → bf16 wrongly (it truncates): there the kernel writes fp32.
    out = torch.empty((b, heads, dim), dtype=torch.float32 if INTERPRETED else dtype, device=o_part.device)
    _merge_splits_kernel[(b, heads)](
        m_part, l_part, o_part, out,
        m_part.stride(0), m_part.stride(1), o_part.stride(0), o_part.stride(1), o_part.stride(2),
        out.stride(0), out.stride(1), splits, dim,
        SPLITS=max(2, triton.next_power_of_2(splits)), HEAD_DIM=max(16, triton.next_power_of_2(dim)),
    )  # fmt: skip
    return out.to(dtype)


def merge_splits_reference(m_part, l_part, o_part, dtype: torch.dtype) -> torch.Tensor:
    """``merge_splits`` in PyTorch (the rule written out; the test's reference)."""
    m_max = m_part.amax(dim=-1, keepdim=True)
    weight = torch.exp(m_part - m_max).nan_to_num(0.0)  # an empty split has m = -inf
    total = (l_part * weight).sum(-1, keepdim=True)
    return ((o_part * weight[..., None]).sum(2) / total).to(dtype)


@triton.jit
def _write_kv_kernel(
    K_new, V_new, K_pool, V_pool, K_scale, V_scale, slots,
    stride_kn, stride_vn, stride_pk, stride_pv, stride_sn, stride_sh, row_size, kv_heads, head_dim,
    ROW: tl.constexpr, HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, KV_QUANT: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0)
    slot = tl.load(slots + token)
    if KV_QUANT == 0:
        offs = tl.arange(0, ROW)
        valid = offs < row_size  # one token's [kv_heads * head_dim] row, contiguous in both tensors
        tl.store(K_pool + slot * stride_pk + offs, tl.load(K_new + token * stride_kn + offs, mask=valid), mask=valid)
        tl.store(V_pool + slot * stride_pv + offs, tl.load(V_new + token * stride_vn + offs, mask=valid), mask=valid)
    else:  # an 8-bit pool: the row as [kv_heads, head_dim], quantized per head on its way in
        offs_h = tl.arange(0, HEADS)
        offs_d = tl.arange(0, HEAD_DIM)
        h_valid = offs_h < kv_heads
        valid = h_valid[:, None] & (offs_d < head_dim)[None, :]
        offs = offs_h[:, None] * head_dim + offs_d[None, :]
        scale_offs = slot * stride_sn + offs_h * stride_sh
        k = tl.load(K_new + token * stride_kn + offs, mask=valid, other=0.0).to(tl.float32)
        k_q, k_scale = _quantize(k, KV_QUANT)
        tl.store(K_pool + slot * stride_pk + offs, k_q.to(K_pool.dtype.element_ty), mask=valid)
        tl.store(K_scale + scale_offs, k_scale, mask=h_valid)
        v = tl.load(V_new + token * stride_vn + offs, mask=valid, other=0.0).to(tl.float32)
        v_q, v_scale = _quantize(v, KV_QUANT)
        tl.store(V_pool + slot * stride_pv + offs, v_q.to(V_pool.dtype.element_ty), mask=valid)
        tl.store(V_scale + scale_offs, v_scale, mask=h_valid)


@triton.jit
def _rope_write_kv_kernel(
    QKV, Cos, Sin, Q_out, K_pool, V_pool, K_scale, V_scale, slots,
    stride_t, stride_h, stride_ct, stride_st, stride_qt, stride_qh, stride_pk, stride_pv, stride_sn, stride_sh,
    heads, kv_heads, head_dim,
    ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, KV_QUANT: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0)
    offs_h = tl.arange(0, ROWS)  # this token's q heads, then its K heads, then its V heads
    offs_d = tl.arange(0, HEAD_DIM)
    d_valid = offs_d < head_dim
    is_q = offs_h < heads
    is_k = (offs_h >= heads) & (offs_h < heads + kv_heads)
    is_v = (offs_h >= heads + kv_heads) & (offs_h < heads + 2 * kv_heads)
    row = QKV + token * stride_t + offs_h[:, None] * stride_h
    valid = (offs_h < heads + 2 * kv_heads)[:, None] & d_valid[None, :]
    x = tl.load(row + offs_d[None, :], mask=valid, other=0.0).to(tl.float32)
    # RoPE as apply_rope computes it: x·cos + roll(x, D/2)·signed_sin, the roll a second load.
    rolled = tl.load(row + ((offs_d + head_dim // 2) % head_dim)[None, :], mask=valid, other=0.0).to(tl.float32)
    cos = tl.load(Cos + token * stride_ct + offs_d, mask=d_valid, other=0.0).to(tl.float32)
    sin = tl.load(Sin + token * stride_st + offs_d, mask=d_valid, other=0.0).to(tl.float32)
    rotated = x * cos[None, :] + rolled * sin[None, :]
    tl.store(Q_out + token * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :],
             rotated.to(Q_out.dtype.element_ty), mask=is_q[:, None] & d_valid[None, :])  # fmt: skip
    slot = tl.load(slots + token)
    k_rows = tl.where(is_k, offs_h - heads, 0)
    v_rows = tl.where(is_v, offs_h - heads - kv_heads, 0)
    k_mask = is_k[:, None] & d_valid[None, :]
    v_mask = is_v[:, None] & d_valid[None, :]
    k_at = K_pool + slot * stride_pk + k_rows[:, None] * head_dim + offs_d[None, :]
    v_at = V_pool + slot * stride_pv + v_rows[:, None] * head_dim + offs_d[None, :]
    if KV_QUANT == 0:
        tl.store(k_at, rotated.to(K_pool.dtype.element_ty), mask=k_mask)
        tl.store(v_at, x.to(V_pool.dtype.element_ty), mask=v_mask)
    else:  # an 8-bit pool: each K and V head quantized on its way in, as write_kv does
        k_q, k_scale = _quantize(rotated, KV_QUANT)
        tl.store(k_at, k_q.to(K_pool.dtype.element_ty), mask=k_mask)
        tl.store(K_scale + slot * stride_sn + k_rows * stride_sh, k_scale, mask=is_k)
        v_q, v_scale = _quantize(x, KV_QUANT)
        tl.store(v_at, v_q.to(V_pool.dtype.element_ty), mask=v_mask)
        tl.store(V_scale + slot * stride_sn + v_rows * stride_sh, v_scale, mask=is_v)


def rope_write_kv(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    signed_sin: torch.Tensor,
    heads: int,
    kv_heads: int,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slots: torch.Tensor,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
    kv_cache_dtype: KVCacheDtype | str = "auto",
) -> torch.Tensor:
    """RoPE and the K/V write in one kernel: ``qkv[N, heads + 2·kv_heads, D]`` (the fused
    projection's output, q heads then K then V) with ``cos, signed_sin[N, D]`` (``RotaryEmbedding``'s
    tables at each token's position). Rotates q and K as ``apply_rope`` does, stores K and V at
    pool rows ``slots[N]`` as ``write_kv`` does (quantized for an 8-bit pool), and returns the
    rotated ``q[N, heads, D]``. One launch where a decode step's layer otherwise makes four (two
    element-wise ops and a roll for RoPE, then the write) — the GPU step is bound by launches.
    Each token's heads are one program: ``next_power_of_2(heads + 2·kv_heads) × D`` values."""
    kv_quant = _kv_quant(kv_cache_dtype, k_scales, v_scales)
    n, rows, dim = qkv.shape
    if rows != heads + 2 * kv_heads:
        raise ValueError(f"rope_write_kv: qkv has {rows} heads, not heads + 2·kv_heads = {heads + 2 * kv_heads}")
    if dim % 2:
        raise ValueError(f"rope_write_kv: head dim {dim} must be even (RoPE rotates pairs)")
    if k_pool.stride(1) != dim or k_pool.stride(2) != 1 or v_pool.stride(1) != dim or v_pool.stride(2) != 1:
        raise ValueError("rope_write_kv: the pools must be [num_slots, kv_heads, D] with contiguous rows")
    q = torch.empty((n, heads, dim), dtype=qkv.dtype, device=qkv.device)
    if n == 0:
        return q
    if qkv.stride(2) != 1:
        qkv = qkv.contiguous()
    cos, signed_sin = cos.contiguous(), signed_sin.contiguous()  # views of the tables' rows: no copy
    _rope_write_kv_kernel[(n,)](
        qkv, cos, signed_sin, q, k_pool, v_pool, k_scales if kv_quant else k_pool, v_scales if kv_quant else v_pool,
        slots, qkv.stride(0), qkv.stride(1), cos.stride(0), signed_sin.stride(0), q.stride(0), q.stride(1),
        k_pool.stride(0), v_pool.stride(0), k_scales.stride(0) if kv_quant else 0, k_scales.stride(1) if kv_quant else 0,
        heads, kv_heads, dim,
        ROWS=triton.next_power_of_2(rows), HEAD_DIM=max(16, triton.next_power_of_2(dim)), KV_QUANT=kv_quant,
    )  # fmt: skip
    return q


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slots: torch.Tensor,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
    kv_cache_dtype: KVCacheDtype | str = "auto",
) -> None:
    """Store ``k, v[N, KV, D]`` at pool rows ``slots[N]`` (pool ``[num_slots, KV, D]``), fused in one
    kernel. An 8-bit pool (``kv_cache_dtype="int8"`` or ``"fp8"``) gets each token's K and V
    quantized per head as ``quantize_kv`` does, their scales written to ``k_scales, v_scales[num_slots, KV]``."""
    kv_quant = _kv_quant(kv_cache_dtype, k_scales, v_scales)
    n = k.shape[0]
    if n == 0:
        return
    k, v = k.contiguous(), v.contiguous()
    kv_heads, dim = k.shape[1], k.shape[2]
    row = kv_heads * dim
    _write_kv_kernel[(n,)](
        k, v, k_pool, v_pool, k_scales if kv_quant else k_pool, v_scales if kv_quant else v_pool, slots,
        k.stride(0), v.stride(0), k_pool.stride(0), v_pool.stride(0),
        k_scales.stride(0) if kv_quant else 0, k_scales.stride(1) if kv_quant else 0, row, kv_heads, dim,
        ROW=triton.next_power_of_2(row), HEADS=max(2, triton.next_power_of_2(kv_heads)),
        HEAD_DIM=triton.next_power_of_2(dim), KV_QUANT=kv_quant,
    )  # fmt: skip
