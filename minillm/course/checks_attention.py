"""Checks for chapters 05 (attention variants) and 06 (FlashAttention)."""

from __future__ import annotations

import math

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import minillm.hooks as hooks
from minillm.course.compare import compare_tensors, compare_tokens, int_cases
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


class _CopyWatch(TorchDispatchMode):
    """Watches every tensor operation of the learner's function for one that turns K or V (or
    a tensor derived from them, like ``k.float()``) into something ``G`` times their size: a
    copy of K/V per query head, whatever function made it (repeat, repeat_interleave,
    expand + reshape, a broadcasting matmul that materialises them, an index)."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, group: int):
        super().__init__()
        self.tracked = {k.untyped_storage().data_ptr(), v.untyped_storage().data_ptr()}
        self.small = max(k.numel(), v.numel())
        self.limit = group * min(k.numel(), v.numel())
        self.copied_by: str | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if any(t.untyped_storage().data_ptr() in self.tracked for t in inputs):
            for t in pytree.tree_leaves(out):
                if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                    continue
                if t.untyped_storage().data_ptr() in self.tracked:
                    continue  # a view (expand, transpose, ...): no new memory
                if t.numel() >= self.limit and self.copied_by is None:
                    self.copied_by = str(func)
                elif t.numel() <= self.small:
                    self.tracked.add(t.untyped_storage().data_ptr())  # k.float(), k.contiguous(), ...
        return out


@check
def check_gqa_attention(gqa_attention, model: str = VARIANT_MODEL) -> str:
    """``gqa_attention(q[B,H,T,D], k[B,KV,S,D], v, mask, scale)``: grouped K/V heads, no copies."""
    gen = torch.Generator().manual_seed(0)
    for heads, kv_heads in ((6, 2), (4, 4), (4, 1)):
        # q as the engine hands it over: a transposed view, not contiguous (q.view would fail)
        q = torch.randn(2, 5, heads, 8, generator=gen).transpose(1, 2)
        k, v = torch.randn(2, kv_heads, 7, 8, generator=gen), torch.randn(2, kv_heads, 7, 8, generator=gen)
        mask = (torch.arange(7)[None, :] <= torch.arange(2, 7)[:, None])[None, None].expand(2, 1, 5, 7)
        expected = _mha_reference(q, k, v, mask, 8**-0.5)
        watch = _CopyWatch(k, v, heads // kv_heads)
        with watch:
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
        compare_tensors(got, expected, f"gqa_attention with {heads} query heads and {kv_heads} K/V heads")
        if heads != kv_heads and watch.copied_by:
            raise CheckFailed(
                f"with {heads} query heads on {kv_heads} K/V heads, your function made a copy of K/V {heads // kv_heads}× "
                f"their size ({watch.copied_by}): that is one copy per query head, and GQA's memory saving is gone. "
                "Fold each group of query heads into the query axis instead: q.reshape(B, KV, G*T, D) attends to "
                "k[B, KV, S, D] directly"
            )
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
    with hooks.override(torch_attention=backend):  # every layer's attention
        got_tokens = llm.generate([ids], params)[0].token_ids
    compare_tokens(
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


@check
def check_window_release(blocks_behind_window, model: str = VARIANT_MODEL) -> str:
    """``blocks_behind_window(num_computed_tokens, window, block_size) -> int``: leading blocks no
    future query can see, which the block manager gives back."""
    cases = [
        # computed, window, block size, expected, why
        (5, 8, 4, 0, "a sequence shorter than the window keeps every block"),
        (8, 8, 4, 0, "the next query (position 8) still sees position 1, in block 0"),
        (
            11,
            8,
            4,
            1,
            "the next query (position 11) sees positions 4..11: block 0 (positions 0-3) is behind the window",
        ),
        (12, 8, 4, 1, "the next query (position 12) sees positions 5..12: block 1 (4-7) is still partly visible"),
        (15, 8, 4, 2, "the next query (position 15) sees 8..15: blocks 0 and 1 are behind it"),
        (100, 16, 16, 5, "the next query (position 100) sees 85..100: blocks 0-4 (positions 0-79) are behind it"),
        (0, 4, 4, 0, "an empty sequence has nothing to release"),
    ]
    int_cases(blocks_behind_window, "blocks_behind_window", cases, ("num_computed_tokens", "window", "block_size"))
    from minillm import LLM, SamplingParams

    params = SamplingParams(max_tokens=40, ignore_eos=True)
    prompts = ["KING.\nNow is the winter of our discontent", "ROMEO.\nBut soft, what light"]
    expected_tokens = [
        o.token_ids for o in LLM(model, dtype="fp32", mode="naive", sliding_window=12).generate(prompts, params)
    ]
    llm = LLM(model, dtype="fp32", attention_backend="torch", sliding_window=12, block_size=4)
    with hooks.override(blocks_behind_window=blocks_behind_window):  # the block manager's release after every step
        outputs = llm.generate(prompts, params)
    peak = [record.blocks_used for record in llm.engine.step_records]  # each step's, after its release
    for n, (out, ref) in enumerate(zip(outputs, expected_tokens)):
        compare_tokens(
            out.token_ids,
            ref,
            f"request {n} with a 12-token window on your release",
            "a block may go only when every one of its positions is before the next query's window",
        )
    longest = max(len(llm.tokenizer.encode(p)) for p in prompts) + params.max_tokens
    bound = len(prompts) * (12 // 4 + 2)
    if max(peak) > bound:
        raise CheckFailed(
            f"two sequences of up to {longest} tokens with a 12-token window held up to {max(peak)} blocks of 4: "
            f"blocks behind the window were not given back (at most {bound} are ever visible)"
        )
    return (
        f"with your release, two {longest}-token sequences under a 12-token window never held more than "
        f"{max(peak)} blocks of 4 tokens (without it: {2 * -(-longest // 4)}), tokens identical to the naive engine"
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
    compare_tensors(m, expected_m, "the running max m after the last tile")
    l_right = torch.allclose(l_sum, expected_l, rtol=1e-4)
    if l_right and torch.allclose(acc / l_sum[:, None], torch.softmax(scores, -1) @ v, atol=1e-5):
        return "your online softmax, fed 3 tiles of 8 keys, gives exactly softmax(scores) @ V — without ever holding a whole row"
    if not l_right and torch.allclose(l_sum, torch.exp(scores).sum(-1), rtol=1e-3):
        raise CheckFailed(
            "l is the plain sum of exp(scores): keep it relative to the running max — p = exp(scores - m_new) — "
            "and when the max grows from m to m', multiply the old sum by exp(m - m') first"
        )
    if not l_right:
        raise CheckFailed(
            f"l after the last tile is {l_sum[0].item():.5g} for row 0, expected {expected_l[0].item():.5g} (the sum "
            "of exp(score - final max)): l was never rescaled — when the max grows from m to m', multiply the old "
            "sum by exp(m - m') before adding the new tile's sum"
        )
    raise CheckFailed(
        "l is right but acc / l differs from softmax(scores) @ V: rescale the accumulator too when the max changes "
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
        compare_tensors(
            got,
            expected,
            f"your kernel's output for T={t}, S={s}, causal={causal}",
            atol=1e-4,
            nan_hint="a query row saw only masked (-inf) keys: a query attends to keys up to and including its "
            "own position (offs_n <= q_pos, not <)",
        )
    return "your Triton kernel matches attention exactly on tiles that do not divide the lengths, causal and not, with a cached prefix"
