"""Chapters 05-06 checks: reference answers pass, typical wrong answers fail with a useful message."""

from __future__ import annotations

import pytest
import torch

from minillm.attention import triton_available
from minillm.course import check_flash_kernel, check_gqa_attention, check_online_softmax
from minillm.course.results import NOT_ATTEMPTED, PASS, CheckFailed


def gqa_attention(q, k, v, mask, scale):
    b, h, t, d = q.shape
    kv, s = k.shape[1], k.shape[2]
    g = h // kv
    scores = (q.reshape(b, kv, g * t, d) @ k.transpose(-1, -2)).float() * scale
    if mask is not None:
        scores = scores.view(b, kv, g, t, s).masked_fill(~mask.unsqueeze(2), float("-inf")).view(b, kv, g * t, s)
    return (torch.softmax(scores, -1).to(v.dtype) @ v).view(b, h, t, d)


def online_softmax_update(m, l_sum, acc, scores, v):
    m_new = torch.maximum(m, scores.max(dim=-1).values)
    alpha = torch.exp(m - m_new)
    p = torch.exp(scores - m_new[:, None])
    return m_new, l_sum * alpha + p.sum(-1), acc * alpha[:, None] + p @ v


def test_gqa_reference_passes():
    assert check_gqa_attention(gqa_attention).status == PASS


def test_gqa_by_repeating_kv_is_refused():
    def repeating(q, k, v, mask, scale):
        g = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        scores = (q @ k.transpose(-1, -2)) * scale
        return torch.softmax(scores.masked_fill(~mask, float("-inf")), -1) @ v

    with pytest.raises(CheckFailed, match="copies K/V once per query head"):
        check_gqa_attention(repeating)


def test_gqa_wrong_head_order_is_explained():
    def interleaved(q, k, v, mask, scale):  # query head h paired with K/V head h % KV
        b, h, t, d = q.shape
        kv = k.shape[1]
        q = q.view(b, h // kv, kv, t, d).transpose(1, 2).reshape(b, kv, (h // kv) * t, d)
        scores = (q @ k.transpose(-1, -2)) * scale
        s = k.shape[2]
        scores = scores.view(b, kv, h // kv, t, s).masked_fill(~mask.unsqueeze(2), float("-inf")).view(b, kv, -1, s)
        out = (torch.softmax(scores, -1) @ v).view(b, kv, h // kv, t, d).transpose(1, 2)
        return out.reshape(b, h, t, d)

    with pytest.raises(CheckFailed, match="wrong K/V heads"):
        check_gqa_attention(interleaved)


def test_online_softmax_reference_and_mistakes():
    assert check_online_softmax(online_softmax_update).status == PASS

    def no_rescale_of_sum(m, l_sum, acc, scores, v):
        m_new = torch.maximum(m, scores.max(dim=-1).values)
        alpha = torch.exp(m - m_new)
        p = torch.exp(scores - m_new[:, None])
        return m_new, l_sum + p.sum(-1), acc * alpha[:, None] + p @ v

    with pytest.raises(CheckFailed, match="rescale"):
        check_online_softmax(no_rescale_of_sum)

    def no_rescale_of_acc(m, l_sum, acc, scores, v):
        m_new = torch.maximum(m, scores.max(dim=-1).values)
        alpha = torch.exp(m - m_new)
        p = torch.exp(scores - m_new[:, None])
        return m_new, l_sum * alpha + p.sum(-1), acc + p @ v

    with pytest.raises(CheckFailed, match="accumulator"):
        check_online_softmax(no_rescale_of_acc)


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
def test_flash_kernel_check():
    from minillm.attention.triton_kernels import flash_attention

    def flash_forward(q, k, v, causal):
        t, s = q.shape[0], k.shape[0]
        cu_q, cu_k = torch.tensor([0, t]), torch.tensor([0, s])
        return flash_attention(
            q, k, v, cu_q, torch.tensor([s]), t, q.shape[-1] ** -0.5, causal, cu_k, block_m=16, block_n=16
        )

    assert check_flash_kernel(flash_forward).status == PASS

    def never_causal(q, k, v, causal):
        return flash_forward(q, k, v, False)

    with pytest.raises(CheckFailed, match="ignores causality"):
        check_flash_kernel(never_causal)

    def unwritten(q, k, v, causal):
        raise NotImplementedError()

    assert check_flash_kernel(unwritten).status == NOT_ATTEMPTED


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
def test_unwritten_triton_kernel_is_not_attempted():
    """The student notebook's kernel raises NotImplementedError inside @triton.jit; the interpreter
    wraps it, and the check must still say "not attempted", not "failed"."""
    import triton
    import triton.language as tl

    @triton.jit
    def skeleton(X, N: tl.constexpr):
        offs = tl.arange(0, N)
        raise NotImplementedError()
        tl.store(X + offs, offs)

    def flash_forward(q, k, v, causal):
        skeleton[(1,)](torch.zeros(16), N=16)
        return q

    assert check_flash_kernel(flash_forward).status == NOT_ATTEMPTED
