"""Checks for chapters 05 (attention variants) and 06 (FlashAttention)."""

from __future__ import annotations

import contextlib
import math

import torch

from minillm.course.checks import _compare_tensors, _compare_tokens
from minillm.course.results import CheckFailed, check

VARIANT_MODEL = "tiny-shakespeare-8m"  # GQA: 8 query heads share 4 K/V heads


def _mha_reference(q, k, v, mask, scale):
    """Grouped attention the memory-hungry way: repeat each K/V head for its query heads."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = (q @ k.transpose(-1, -2)).float() * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return (torch.softmax(scores, -1).to(v.dtype) @ v).to(q.dtype)


@contextlib.contextmanager
def _no_repeating():
    """Fail if K/V get copied once per query head (the point of GQA is not to)."""
    saved = torch.Tensor.repeat_interleave, torch.repeat_interleave, torch.Tensor.repeat

    def refuse(*args, **kwargs):
        raise CheckFailed(
            "your function copies K/V once per query head (repeat/repeat_interleave): the result is right but "
            "the memory saving of GQA is gone. Fold each group of query heads into one batch row instead: "
            "q.view(B, KV, G * T, D) attends to k[B, KV, S, D] directly"
        )

    torch.Tensor.repeat_interleave = torch.repeat_interleave = torch.Tensor.repeat = refuse
    try:
        yield
    finally:
        torch.Tensor.repeat_interleave, torch.repeat_interleave, torch.Tensor.repeat = saved


@check
def check_gqa_attention(gqa_attention, model: str = VARIANT_MODEL) -> str:
    """``gqa_attention(q[B,H,T,D], k[B,KV,S,D], v, mask, scale)``: grouped K/V heads, no copies."""
    gen = torch.Generator().manual_seed(0)
    for heads, kv_heads in ((6, 2), (4, 4), (4, 1)):
        q = torch.randn(2, heads, 5, 8, generator=gen)
        k, v = torch.randn(2, kv_heads, 7, 8, generator=gen), torch.randn(2, kv_heads, 7, 8, generator=gen)
        mask = (torch.arange(7)[None, :] <= torch.arange(2, 7)[:, None])[None, None].expand(2, 1, 5, 7)
        expected = _mha_reference(q, k, v, mask, 8**-0.5)
        with _no_repeating():
            got = gqa_attention(q, k, v, mask, 8**-0.5)
        if isinstance(got, torch.Tensor) and got.shape == expected.shape and heads != kv_heads:
            wrong_order = _mha_reference(
                q, k.repeat(1, heads // kv_heads, 1, 1), v.repeat(1, heads // kv_heads, 1, 1), mask, 8**-0.5
            )
            if kv_heads > 1 and torch.allclose(got, wrong_order, atol=1e-5):
                raise CheckFailed(
                    "query heads are matched to the wrong K/V heads: query head h shares K/V head h // G "
                    "(heads 0..G-1 → K/V head 0), not h % KV"
                )
        _compare_tensors(got, expected, f"gqa_attention with {heads} query heads and {kv_heads} K/V heads")
    from minillm import LLM, SamplingParams

    def backend(q, k, v, mask, is_causal, scale):
        if mask is None and is_causal:
            t, s = q.shape[2], k.shape[2]
            mask = (torch.arange(s)[None, :] <= torch.arange(s - t, s)[:, None])[None, None].expand(q.shape[0], 1, t, s)
        return gqa_attention(q, k, v, mask, scale)

    llm = LLM(model, dtype="fp32", mode="contiguous", attention_backend="torch")
    ids = llm.tokenizer.encode("KING.\nNow is the winter of our discontent")
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    expected_tokens = llm.generate([ids], params)[0].token_ids
    from minillm.attention import AttentionBackend

    llm.model.attention_backend = AttentionBackend("learner", backend)
    got_tokens = llm.generate([ids], params)[0].token_ids
    _compare_tokens(
        got_tokens,
        expected_tokens,
        "the 8M model (8 query heads, 4 K/V heads) on your attention",
        "check the head grouping",
    )
    c = llm.model_config
    return (
        f"your grouped attention runs every layer of a {c.num_heads}-query/{c.num_kv_heads}-K/V-head model without "
        "copying K/V: 16 tokens identical to the engine"
    )


# ---------------------------------------------------------------------------------------------
# Chapter 06: FlashAttention
# ---------------------------------------------------------------------------------------------


def _tiled_softmax_attention(update, scores: torch.Tensor, v: torch.Tensor, block: int):
    t, d = scores.shape[0], v.shape[1]
    m = torch.full((t,), float("-inf"))
    l_sum = torch.zeros(t)
    acc = torch.zeros(t, d)
    for start in range(0, scores.shape[1], block):
        out = update(m, l_sum, acc, scores[:, start : start + block], v[start : start + block])
        if not isinstance(out, tuple) or len(out) != 3:
            raise CheckFailed(f"online_softmax_update should return (m, l, acc), got {type(out).__name__}")
        m, l_sum, acc = out
    return m, l_sum, acc


@check
def check_online_softmax(online_softmax_update) -> str:
    """``online_softmax_update(m, l, acc, scores_tile, v_tile) -> (m, l, acc)``."""
    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(6, 20, generator=gen) * 3
    scores[:, 13] += 12  # a much larger score arrives late: the running max must jump
    v = torch.randn(20, 4, generator=gen)
    m, l_sum, acc = _tiled_softmax_attention(online_softmax_update, scores, v, block=8)
    expected_m = scores.max(-1).values
    expected_l = torch.exp(scores - expected_m[:, None]).sum(-1)
    _compare_tensors(m, expected_m, "the running max m after the last tile")
    if torch.allclose(acc / l_sum[:, None], torch.softmax(scores, -1) @ v, atol=1e-5):
        _compare_tensors(
            l_sum, expected_l, "the running sum l after the last tile (relative to the final max)", atol=1e-4
        )
        return "your online softmax, fed 3 tiles of 8 keys, gives exactly softmax(scores) @ V — without ever holding a whole row"
    naive_l = torch.exp(scores).sum(-1)  # forgot to rescale by exp(m_old - m_new)
    if torch.allclose(l_sum, naive_l, rtol=1e-3):
        raise CheckFailed(
            "l was never rescaled: when the max grows from m to m', multiply the old sum by exp(m - m') first"
        )
    raise CheckFailed(
        "acc / l differs from softmax(scores) @ V: rescale the accumulator too when the max changes "
        "(acc * exp(m_old - m_new)) before adding p @ v_tile"
    )


def _flash_reference(q, k, v, causal: bool) -> torch.Tensor:
    t, s = q.shape[0], k.shape[0]
    scores = torch.einsum("thd,shd->hts", q.float(), k.float()) / math.sqrt(q.shape[-1])
    if causal:
        allowed = torch.arange(s)[None, :] <= torch.arange(s - t, s)[:, None]
        scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hts,shd->thd", torch.softmax(scores, -1), v.float())


@check
def check_flash_kernel(flash_forward) -> str:
    """``flash_forward(q[T,H,D], k[S,H,D], v, causal) -> o[T,H,D]``, launching your Triton kernel."""
    gen = torch.Generator().manual_seed(1)
    for t, s, causal in ((40, 40, True), (40, 40, False), (5, 37, True), (1, 9, True)):
        q = torch.randn(t, 2, 16, generator=gen)
        k, v = torch.randn(s, 2, 16, generator=gen), torch.randn(s, 2, 16, generator=gen)
        got = flash_forward(q, k, v, causal)
        expected = _flash_reference(q, k, v, causal)
        full = _flash_reference(q, k, v, False)
        if causal and isinstance(got, torch.Tensor) and got.shape == full.shape and not torch.allclose(expected, full):
            if torch.allclose(got.float(), full, atol=1e-4):
                raise CheckFailed(
                    "the kernel ignores causality: hide keys at positions after each query's (offs_n > q_pos → -inf)"
                )
        _compare_tensors(got, expected, f"your kernel's output for T={t}, S={s}, causal={causal}", atol=1e-4)
    return "your Triton kernel matches attention exactly on tiles that do not divide the lengths, causal and not, with a cached prefix"
