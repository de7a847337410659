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
  group. Long contexts are split over several programs (split-K, "flash-decoding") whose
  partial softmax states are merged afterwards, so a small batch still fills the GPU.
- ``write_kv``: the new tokens' K and V into the pool through the slot mapping, one program
  per token.

On a machine without CUDA the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``
is set here before the kernels are defined): slow, but the same code, which is how the course
runs them on a laptop. The interpreter computes bfloat16 arithmetic wrongly, so every load is
upcast to fp32 first; on a GPU that costs nothing (bf16 → fp32 is exact, and ``tf32`` dot
products of upcast bf16 values are exact too).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

if os.environ.get("TRITON_INTERPRET") == "1" and type(tl.zeros).__name__ != "InterpretedFunction":
    raise ImportError(
        "triton was imported before TRITON_INTERPRET=1 was set, so its helpers are compiled for a GPU this "
        "machine does not have: import minillm first, or set TRITON_INTERPRET=1 in the environment"
    )


NO_WINDOW = 1 << 30  # "no sliding window": a window longer than any context


@triton.jit
def _flash_attention_kernel(
    Q, K, V, Out,
    cu_seqlens_q, cu_seqlens_k, seqlens_k, block_tables,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_on, stride_oh, stride_bt,
    scale, group, head_dim, page_size, window,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    CAUSAL: tl.constexpr, PAGED: tl.constexpr, PRECISION: tl.constexpr,
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
    ).to(tl.float32)
    q_pos = k_len - q_len + offs_m  # the queries are the last q_len of the sequence's k_len positions

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    end = k_len
    if CAUSAL:  # keys after this tile's last query are never needed
        end = tl.minimum(k_len, k_len - q_len + (tile + 1) * BLOCK_M)
    # With a sliding window, keys before the first query's window are never needed either.
    lo = tl.maximum(0, k_len - q_len + tile * BLOCK_M - window + 1) // BLOCK_N * BLOCK_N
    if not PAGED:
        k_start = tl.load(cu_seqlens_k + seq)
    for start_n in range(lo, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_valid = offs_n < end
        if PAGED:  # key position -> block (through the table) -> slot in the pool
            block = tl.load(block_tables + seq * stride_bt + offs_n // page_size, mask=n_valid, other=0)
            rows = block * page_size + offs_n % page_size
        else:
            rows = k_start + offs_n
        kv_mask = n_valid[:, None] & d_valid[None, :]
        k = tl.load(K + rows[:, None] * stride_kn + kv_head * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(V + rows[:, None] * stride_vn + kv_head * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision=PRECISION) * scale  # [BLOCK_M, BLOCK_N]
        allowed = n_valid[None, :] & m_valid[:, None] & (offs_n[None, :] > q_pos[:, None] - window)
        if CAUSAL:
            allowed = allowed & (offs_n[None, :] <= q_pos[:, None])
        s = tl.where(allowed, s, float("-inf"))
        # The online softmax update: new running max, rescale the old sum and accumulator.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision=PRECISION)
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        Out + (q_start + offs_m)[:, None] * stride_on + head * stride_oh + offs_d[None, :],
        out.to(Out.dtype.element_ty),
        mask=m_valid[:, None] & d_valid[None, :],
    )


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
    block_m: int = 32,
    block_n: int = 32,
    window: int | None = None,
) -> torch.Tensor:
    """Attention for packed variable-length sequences. ``q[N, H, D]`` holds every sequence's
    queries back to back (``cu_seqlens_q[S+1]`` marks where each starts). Keys come either
    packed, ``k, v[Nk, KV, D]`` with ``cu_seqlens_k``, or from the paged pool — ``k, v`` the pool
    as ``[num_slots, KV, D]`` and ``block_tables[S, max_blocks]``. Sequence ``i`` has
    ``seqlens_k[i]`` keys; its queries are the last ones of those positions (a prefill that
    continues a cached prefix). ``window``: sliding-window attention, each query sees its last
    ``window`` keys. Returns ``[N, H, D]`` in ``q``'s dtype."""
    paged = block_tables is not None
    if not paged and cu_seqlens_k is None:
        raise ValueError("flash_attention needs cu_seqlens_k (packed keys) or block_tables (paged keys)")
    n, heads, dim = q.shape
    group = heads // k.shape[1]
    out = torch.empty_like(q)
    num_seqs = cu_seqlens_q.numel() - 1
    if n == 0 or num_seqs == 0:
        return out
    grid = (triton.cdiv(max_seqlen_q, block_m), num_seqs, heads)
    dummy = cu_seqlens_q  # an unused pointer argument still needs a tensor
    _flash_attention_kernel[grid](
        q, k, v, out,
        cu_seqlens_q, cu_seqlens_k if not paged else dummy, seqlens_k, block_tables if paged else dummy,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        block_tables.stride(0) if paged else 0,
        scale, group, dim, block_size, NO_WINDOW if window is None else window,
        BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=max(16, triton.next_power_of_2(dim)),
        CAUSAL=causal, PAGED=paged, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )  # fmt: skip
    return out


@triton.jit
def _paged_decode_kernel(
    Q, K, V, M_part, L_part, O_part,
    context_lens, block_tables,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_bt,
    stride_ms, stride_mh, stride_os, stride_oh, stride_osplit,
    scale, group, head_dim, page_size, split_len, window,
    GROUP: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
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
        # One query per head: a broadcast multiply-add instead of a (too small) matrix product.
        s = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], 2) * scale  # [GROUP, BLOCK_N]
        s = tl.where(n_valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
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


def decode_splits(num_seqs: int, num_kv_heads: int, max_context: int, block_n: int, device: torch.device) -> int:
    """How many programs share one sequence's context: enough to give every streaming
    multiprocessor ~2 programs when the batch alone cannot, never a split under 256 keys."""
    if device.type != "cuda":
        return 1 if max_context <= 256 else 2  # the interpreter: a little split-K, for coverage
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    programs = num_seqs * num_kv_heads
    wanted = max(1, (2 * sms) // max(programs, 1))
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
    block_n: int = 32,
    window: int | None = None,
) -> torch.Tensor:
    """One query token per sequence, ``q[B, H, D]``, against K/V in the pool (``[num_slots, KV, D]``)
    through ``block_tables[B, max_blocks]``; ``context_lens[B]`` keys each (the last ``window`` of
    them with sliding-window attention). Returns ``[B, H, D]``."""
    b, heads, dim = q.shape
    kv_heads = k_pool.shape[1]
    group = heads // kv_heads
    if num_splits is None:
        num_splits = decode_splits(b, kv_heads, max_context, block_n, q.device)
    split_len = triton.cdiv(triton.cdiv(max_context, num_splits), block_n) * block_n
    m_part = torch.empty((b, heads, num_splits), dtype=torch.float32, device=q.device)
    l_part = torch.empty_like(m_part)
    o_part = torch.empty((b, heads, num_splits, dim), dtype=torch.float32, device=q.device)
    _paged_decode_kernel[(b, kv_heads, num_splits)](
        q, k_pool, v_pool, m_part, l_part, o_part,
        context_lens, block_tables,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1),
        block_tables.stride(0),
        m_part.stride(0), m_part.stride(1), o_part.stride(0), o_part.stride(1), o_part.stride(2),
        scale, group, dim, block_size, split_len, NO_WINDOW if window is None else window,
        GROUP=max(2, triton.next_power_of_2(group)), BLOCK_N=block_n, HEAD_DIM=max(16, triton.next_power_of_2(dim)),
    )  # fmt: skip
    if num_splits == 1:
        return (o_part[:, :, 0] / l_part).to(q.dtype)
    # Merge the splits: rescale each to the global max, then normalise by the total sum.
    m_max = m_part.amax(dim=-1, keepdim=True)
    weight = torch.exp(m_part - m_max).nan_to_num(0.0)  # an empty split has m = -inf
    total = (l_part * weight).sum(-1, keepdim=True)
    return ((o_part * weight[..., None]).sum(2) / total).to(q.dtype)


@triton.jit
def _write_kv_kernel(
    K_new, V_new, K_pool, V_pool, slots,
    stride_kn, stride_vn, stride_pk, stride_pv, row_size,
    ROW: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0)
    slot = tl.load(slots + token)
    offs = tl.arange(0, ROW)
    valid = offs < row_size  # one token's [kv_heads * head_dim] row, contiguous in both tensors
    tl.store(K_pool + slot * stride_pk + offs, tl.load(K_new + token * stride_kn + offs, mask=valid), mask=valid)
    tl.store(V_pool + slot * stride_pv + offs, tl.load(V_new + token * stride_vn + offs, mask=valid), mask=valid)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor) -> None:
    """Store ``k, v[N, KV, D]`` at pool rows ``slots[N]`` (pool ``[num_slots, KV, D]``), fused in one kernel."""
    n = k.shape[0]
    if n == 0:
        return
    k, v = k.contiguous(), v.contiguous()
    row = k.shape[1] * k.shape[2]
    _write_kv_kernel[(n,)](
        k, v, k_pool, v_pool, slots, k.stride(0), v.stride(0), k_pool.stride(0), v_pool.stride(0), row,
        ROW=triton.next_power_of_2(row),
    )  # fmt: skip
