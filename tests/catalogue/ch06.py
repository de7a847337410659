"""Chapter 06, FlashAttention: the answers its exercises' checks are tested against (see
``catalogue/__init__.py``)."""

from __future__ import annotations

import torch

from catalogue.answers import Answers
from minillm.machine import triton_available

ANSWERS = Answers()
right, wrong = ANSWERS.right, ANSWERS.wrong


# ---- 06: FlashAttention (the online softmax; the Triton kernel at the end) ---------------------


def online_softmax_update(m, l_sum, acc, scores, v):
    m_new = torch.maximum(m, scores.max(dim=-1).values)
    alpha = torch.exp(m - m_new)
    p = torch.exp(scores - m_new[:, None])
    return m_new, l_sum * alpha + p.sum(-1), acc * alpha[:, None] + p @ v


def online_softmax_logsumexp(m, l_sum, acc, scores, v):
    tile_max = scores.amax(dim=1)
    new_max = torch.where(tile_max > m, tile_max, m)
    old_weight = (m - new_max).exp()
    weights = (scores - new_max.unsqueeze(1)).exp()
    return new_max, old_weight * l_sum + weights.sum(1), old_weight.unsqueeze(1) * acc + weights @ v


def _online(m, l_sum, acc, scores, v, rescale_l=True, rescale_acc=True, running=True, subtract=True):
    m_new = torch.maximum(m, scores.max(-1).values) if running else scores.max(-1).values
    alpha = torch.exp(m - m_new)
    p = torch.exp(scores - m_new[:, None]) if subtract else torch.exp(scores)
    return (
        m_new,
        (l_sum * alpha if rescale_l else l_sum) + p.sum(-1),
        (acc * alpha[:, None] if rescale_acc else acc) + p @ v,
    )


right("check_online_softmax", online_softmax_update)
right("check_online_softmax", online_softmax_logsumexp)
wrong("check_online_softmax", "never rescaled", lambda *a: _online(*a, rescale_l=False))
wrong("check_online_softmax", "rescale the accumulator", lambda *a: _online(*a, rescale_acc=False))
wrong("check_online_softmax", "running max m", lambda *a: _online(*a, running=False))
wrong(
    "check_online_softmax",
    "plain sum of exp(scores)",
    lambda *a: _online(*a, subtract=False, rescale_l=False, rescale_acc=False),
)
wrong("check_online_softmax", "should return (m, l, acc)", lambda *a: _online(*a)[1:])


# ---- ch06: more wrong answers a learner writes: the online-softmax update


def _update(
    m,
    l_sum,
    acc,
    scores,
    v,
    *,
    tile_max="rows",
    in_place=False,
    inverted=False,
    old_max=False,
    sum_dim=-1,
    carry_l=True,
    carry_acc=True,
    transpose_p=False,
    normalise=False,
    return_old_m=False,
    order=("m", "l", "acc"),
):
    """The update of the solution, with one of a learner's slips."""
    if tile_max == "rows":
        tile = scores.max(dim=-1).values
    elif tile_max == "columns":
        tile = scores.max(dim=0).values  # the max over the queries, one per key
    else:
        tile = scores.max()  # one max for the whole tile
    m_new = torch.maximum(m, tile, out=m) if in_place else torch.maximum(m, tile)
    alpha = torch.exp(m_new - m) if inverted else torch.exp(m - m_new)
    p = torch.exp(scores - (m if old_max else m_new)[:, None])
    new_l = (l_sum * alpha if carry_l else 0) + p.sum(dim=sum_dim)
    new_acc = (acc * alpha[:, None] if carry_acc else 0) + (p.T @ v if transpose_p else p @ v)
    if normalise:
        new_acc = new_acc / new_l[:, None]
    values = {"m": m if return_old_m else m_new, "l": new_l, "acc": new_acc}
    return tuple(values[name] for name in order)


def online_softmax_no_infinity(m, l_sum, acc, scores, v):
    """Avoids -inf by starting the running max at 0: a row whose scores are all negative gets
    the wrong max (and, far enough below 0, an l that underflows)."""
    return _update(torch.nan_to_num(m, neginf=0.0), l_sum, acc, scores, v)


def online_softmax_in_place(m, l_sum, acc, scores, v):
    """Correct, and updates the caller's l and acc in place (allowed: they are the loop's state)."""
    m_new = torch.maximum(m, scores.amax(-1))
    scale = (m - m_new).exp()
    weights = (scores - m_new.unsqueeze(-1)).exp()
    l_sum.mul_(scale).add_(weights.sum(-1))
    acc.mul_(scale.unsqueeze(-1)).addmm_(weights, v)
    return m_new, l_sum, acc


right("check_online_softmax", online_softmax_in_place)
wrong("check_online_softmax", "rescaled the wrong way round", lambda *a: _update(*a, inverted=True))
wrong("check_online_softmax", "p is taken against the old max", lambda *a: _update(*a, old_max=True))
wrong("check_online_softmax", "not each key's max", lambda *a: _update(*a, tile_max="columns"))
wrong("check_online_softmax", "the max of the whole tile", lambda *a: _update(*a, tile_max="whole"))
wrong("check_online_softmax", "p is summed over the wrong axis", lambda *a: _update(*a, sum_dim=0))
wrong("check_online_softmax", "it adds p.T @ v", lambda *a: _update(*a, transpose_p=True))
wrong("check_online_softmax", "acc is divided by l", lambda *a: _update(*a, normalise=True))
wrong("check_online_softmax", "only this tile's sum", lambda *a: _update(*a, carry_l=False))
wrong("check_online_softmax", "only this tile's p @ v", lambda *a: _update(*a, carry_acc=False))
wrong("check_online_softmax", "changed its argument m in place", lambda *a: _update(*a, in_place=True))
wrong("check_online_softmax", "it came back unchanged", lambda *a: _update(*a, return_old_m=True))
wrong("check_online_softmax", "returned (m, acc, l)", lambda *a: _update(*a, order=("m", "acc", "l")))
wrong("check_online_softmax", "after the first tile", online_softmax_no_infinity)


# ---- the Triton kernel of chapter 06: one kernel, a mistake chosen by a constexpr ----------------

if triton_available():
    from minillm.triton_setup import tl, triton  # triton ready for this machine (its interpreter without CUDA)

    @triton.jit
    def _flash_kernel(
        Q, K, V, Out, T, S, stride_qt, stride_qh, stride_ks, stride_kh, scale,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr,
        MISTAKE: tl.constexpr, ALWAYS_CAUSAL: tl.constexpr = False,
    ):  # fmt: skip
        tile, head = tl.program_id(0), tl.program_id(1)
        offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_DIM)
        q_ptrs = Q + offs_m[:, None] * stride_qt + head * stride_qh + offs_d[None, :]
        if MISTAKE == 19:
            q = tl.load(q_ptrs).to(tl.float32)  # no mask: the last tile reads rows past T
        else:
            q = tl.load(q_ptrs, mask=offs_m[:, None] < T, other=0.0).to(tl.float32)
        if MISTAKE == 17:
            q_pos = S - T + tile * BLOCK_M + tl.zeros([BLOCK_M], tl.int32)  # the tile's first row's position
        else:
            q_pos = S - T + offs_m
        if MISTAKE == 16:
            m_i = tl.zeros([BLOCK_M], tl.float32)  # "the max starts at 0"
        else:
            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        for start_n in range(0, S, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            kv_offsets = offs_n[:, None] * stride_ks + head * stride_kh + offs_d[None, :]
            k = tl.load(K + kv_offsets, mask=offs_n[:, None] < S, other=0.0).to(tl.float32)
            if MISTAKE == 10:
                v = tl.load(K + kv_offsets, mask=offs_n[:, None] < S, other=0.0).to(tl.float32)  # copy-paste: K
            else:
                v = tl.load(V + kv_offsets, mask=offs_n[:, None] < S, other=0.0).to(tl.float32)
            s = tl.dot(q, tl.trans(k))
            if MISTAKE == 8:
                s = s / scale
            elif MISTAKE != 4:
                s = s * scale
            if MISTAKE == 6:
                allowed = offs_n[None, :] >= 0  # forgets the keys past S in the last tile
            else:
                allowed = offs_n[None, :] < S
            if CAUSAL or ALWAYS_CAUSAL:
                if MISTAKE == 1:
                    allowed = allowed & (offs_n[None, :] < q_pos[:, None])  # hides the diagonal
                elif MISTAKE == 7:
                    allowed = allowed & (offs_n[None, :] <= offs_m[:, None])  # forgets the cached prefix
                elif MISTAKE != 2:
                    allowed = allowed & (offs_n[None, :] <= q_pos[:, None])
            s = tl.where(allowed, s, float("-inf"))
            if MISTAKE == 14:
                m_new = tl.maximum(m_i, tl.max(s, 0))  # the max over the queries, one per key
            else:
                m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            if MISTAKE == 9:
                p = tl.exp2(s - m_safe[:, None])  # exp2 without log2(e) folded into the scores
                alpha = tl.exp2(m_i - m_safe)
            elif MISTAKE == 13:
                p = tl.exp(s - m_i[:, None])  # against the old max
                alpha = tl.exp(m_i - m_safe)
            elif MISTAKE == 12:
                p = tl.exp(s - m_safe[:, None])
                alpha = tl.exp(m_safe - m_i)  # inverted rescale
            else:
                p = tl.exp(s - m_safe[:, None])
                alpha = tl.exp(m_i - m_safe)
            if MISTAKE == 5:
                l_i = l_i + tl.sum(p, 1)
            else:
                l_i = l_i * alpha + tl.sum(p, 1)
            if MISTAKE == 3:
                acc = acc + tl.dot(p, v)
            else:
                acc = acc * alpha[:, None] + tl.dot(p, v)
            if MISTAKE != 11:  # 11 forgets to carry the running max
                m_i = m_new
        if MISTAKE == 15:
            out = acc  # forgets the softmax's denominator
        else:
            out = acc / l_i[:, None]
        o_ptrs = Out + offs_m[:, None] * stride_qt + head * stride_qh + offs_d[None, :]
        if MISTAKE == 18:
            tl.store(o_ptrs, out, mask=offs_m[:, None] <= T)  # one row too many
        else:
            tl.store(o_ptrs, out, mask=offs_m[:, None] < T)

    @triton.jit
    def _flash_kernel_bias(
        Q, K, V, Out, T, S, stride_qt, stride_qh, stride_ks, stride_kh, scale,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr,
    ):  # fmt: skip
        """Independent: an additive -inf bias, exp2 with log2(e) folded into the scale."""
        row_block, h = tl.program_id(0), tl.program_id(1)
        rows = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
        dims = tl.arange(0, HEAD_DIM)
        queries = tl.load(
            Q + rows[:, None] * stride_qt + h * stride_qh + dims[None, :], mask=rows[:, None] < T, other=0.0
        )
        queries = queries.to(tl.float32) * (scale * 1.4426950408889634)
        last_key = rows + (S - T)
        best = tl.zeros([BLOCK_M], tl.float32) - float("inf")
        total = tl.zeros([BLOCK_M], tl.float32)
        out = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        for first in range(0, S, BLOCK_N):
            cols = first + tl.arange(0, BLOCK_N)
            ptr = cols[:, None] * stride_ks + h * stride_kh + dims[None, :]
            keys = tl.load(K + ptr, mask=cols[:, None] < S, other=0.0).to(tl.float32)
            vals = tl.load(V + ptr, mask=cols[:, None] < S, other=0.0).to(tl.float32)
            hidden = cols[None, :] >= S
            if CAUSAL:
                hidden = hidden | (last_key[:, None] - cols[None, :] < 0)
            logits = tl.dot(queries, tl.trans(keys)) + tl.where(hidden, float("-inf"), 0.0)
            new_best = tl.maximum(best, tl.max(logits, 1))
            shift = tl.where(new_best == float("-inf"), 0.0, new_best)
            weights = tl.exp2(logits - shift[:, None])
            decay = tl.exp2(best - shift)
            total = total * decay + tl.sum(weights, 1)
            out = out * decay[:, None] + tl.dot(weights, vals)
            best = new_best
        tl.store(
            Out + rows[:, None] * stride_qt + h * stride_qh + dims[None, :],
            out / total[:, None],
            mask=rows[:, None] < T,
        )

    def _launcher(kernel, block=16, **extra):
        def flash_forward(q, k, v, causal=True):
            t, heads, dim = q.shape
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
            out = torch.empty_like(q)
            grid = (triton.cdiv(t, block), heads)
            kernel[grid](
                q, k, v, out, t, k.shape[0], q.stride(0), q.stride(1), k.stride(0), k.stride(1), dim**-0.5,
                BLOCK_M=block, BLOCK_N=block, HEAD_DIM=dim, CAUSAL=causal, **extra,
            )  # fmt: skip
            return out

        return flash_forward

    right("check_flash_kernel", _launcher(_flash_kernel, MISTAKE=0))
    right("check_flash_kernel", _launcher(_flash_kernel_bias, block=32))
    FLASH_KERNEL_WRONG = [
        ((_launcher(_flash_kernel, MISTAKE=1),), "up to and including its own position"),
        ((_launcher(_flash_kernel, MISTAKE=2),), "ignores causality"),
        ((_launcher(_flash_kernel, MISTAKE=3),), "the accumulator is not rescaled"),
        ((_launcher(_flash_kernel, MISTAKE=4),), "the scores q·kᵀ are not scaled"),
        ((_launcher(_flash_kernel, MISTAKE=5),), "the running sum l is not rescaled"),
        ((_launcher(_flash_kernel, MISTAKE=0, ALWAYS_CAUSAL=True),), "causal=False differs from the reference"),
        ((_launcher(_flash_kernel, MISTAKE=6),), "keys past S"),
        ((_launcher(_flash_kernel, MISTAKE=7),), "ignores the cached prefix"),
        ((_launcher(_flash_kernel, MISTAKE=8),), "divided by scale"),
        ((_launcher(_flash_kernel, MISTAKE=9),), "exp2"),
        ((_launcher(_flash_kernel, MISTAKE=10),), "values were loaded from K"),
        ((_launcher(_flash_kernel, MISTAKE=11),), "only the last key tile"),
        ((_launcher(_flash_kernel, MISTAKE=12),), "every output is NaN"),
        ((_launcher(_flash_kernel, MISTAKE=13),), "every output is NaN"),
        ((_launcher(_flash_kernel, MISTAKE=14),), "each query row's running max (tl.max(s, 1))"),
        ((_launcher(_flash_kernel, MISTAKE=15),), "store acc / l_i"),
        ((_launcher(_flash_kernel, MISTAKE=16),), "must start at -inf"),
        ((_launcher(_flash_kernel, MISTAKE=17),), "your kernel's output for T=40, S=40, causal=True"),
        ((_launcher(_flash_kernel, MISTAKE=18),), "a tl.store touched"),
        ((_launcher(_flash_kernel, MISTAKE=19),), "a tl.load touched"),
    ]
    for fns, fragment in FLASH_KERNEL_WRONG:
        wrong("check_flash_kernel", fragment, *fns)
