"""Chapter 05 (attention variants): grouped-query attention, pooling K/V heads, the sliding window's release."""

from __future__ import annotations

import math

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import minillm.hooks as hooks
from minillm.course.compare import compare_tensors, compare_tokens, int_cases
from minillm.course.results import CheckFailed, LearnerRaised, check, learner_frames_of

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


def _gqa_diagnosis(gqa_attention, q, k, v, mask, scale, got, atol) -> str | None:
    """Why a grouped attention's output (right shape and dtype, wrong values) is wrong: the
    reference recomputed under each mistake's behaviour, the one the output matches named."""

    def matches(ref: torch.Tensor) -> bool:
        return torch.allclose(got.float(), ref.float(), atol=atol, equal_nan=True)

    heads, kv_heads, t, d = q.shape[1], k.shape[1], q.shape[2], q.shape[3]
    group = heads // kv_heads
    if kv_heads > 1 and heads != kv_heads:
        k_tiled, v_tiled = k.repeat(1, group, 1, 1), v.repeat(1, group, 1, 1)
        if matches(_mha_reference(q, k_tiled, v_tiled, mask, scale)):
            return (
                "query heads are matched to the wrong K/V heads: query head h shares K/V head h // G "
                "(heads 0..G-1 → K/V head 0), not h % KV"
            )
    if matches(_mha_reference(q, k, v, None, scale)):
        return "the mask was not applied: hide the keys where mask is False (scores → -inf before the softmax)"
    if matches(_mha_reference(q, k, v, ~mask, scale)):
        return (
            "the mask is inverted: True means the query may attend to that key — fill -inf where mask is False "
            "(masked_fill(~mask, ...)), not where it is True"
        )
    for used, words in (
        (1.0, "not scaled at all"),
        (1 / scale, f"divided by scale={scale:.3g} instead of multiplied by it"),
        (d**-0.5, f"multiplied by 1/sqrt(D)={d**-0.5:.3g}, not by the scale argument ({scale:.3g})"),
        (scale * scale, "multiplied by scale twice"),
    ):
        if not math.isclose(used, scale) and matches(_mha_reference(q, k, v, mask, used)):
            return f"the scores q·k are {words}: multiply them by the scale the engine passes, once"
    # Which query's mask row did each output row get? Outputs under every single row of the mask:
    rows = [_mha_reference(q, k, v, mask[:, :, [j] * t], scale).float() for j in range(t)]
    close = torch.stack([(got.float() - r).abs().amax(-1) <= atol for r in rows], -1)  # [B, H, T, row]
    if bool(close.any(-1).all()) and not bool(close.diagonal(dim1=2, dim2=3).all()):
        b, h, i = (int(x) for x in torch.nonzero(~close.diagonal(dim1=2, dim2=3))[0])
        j = int(close[b, h, i].nonzero()[0])
        return (
            f"query head {h} at query {i} was masked with the mask row of query {j}: in the folded "
            f"[B, KV, G*T, S] scores, row g*T + t belongs to query t of the group's head g, so the mask's T axis "
            "must repeat once per head of the group (view the scores as [B, KV, G, T, S] and mask with "
            "mask[:, :, None])"
        )
    ones = gqa_attention(q, k, torch.ones_like(v), mask, scale)
    if isinstance(ones, torch.Tensor) and ones.shape == got.shape and not matches(torch.ones_like(got)):
        return (
            "with V all ones your output is not all ones, so a query's attention weights do not sum to 1 over "
            "the keys: take the softmax over the last axis (the keys), not over the queries"
        )
    return None


@check
def check_gqa_attention(gqa_attention, model: str = VARIANT_MODEL) -> str:
    """``gqa_attention(q[B,H,T,D], k[B,KV,S,D], v, mask, scale)``: grouped K/V heads, no copies."""
    gen = torch.Generator().manual_seed(0)
    cases = (
        (6, 2, 8**-0.5, torch.float32),
        (4, 4, 8**-0.5, torch.float32),
        (4, 1, 0.3, torch.float32),  # a scale that is not 1/sqrt(D), as some models have
        (4, 2, 8**-0.5, torch.bfloat16),  # the engine's half-precision dtype
    )
    for heads, kv_heads, scale, dtype in cases:
        # q as the engine hands it over: a transposed view, not contiguous (q.view would fail)
        q = torch.randn(2, 5, heads, 8, generator=gen).transpose(1, 2).to(dtype)
        k = torch.randn(2, kv_heads, 7, 8, generator=gen).to(dtype)
        v = torch.randn(2, kv_heads, 7, 8, generator=gen).to(dtype)
        mask = (torch.arange(7)[None, :] <= torch.arange(2, 7)[:, None])[None, None].expand(2, 1, 5, 7)
        expected = _mha_reference(q, k, v, mask, scale)
        atol = 1e-5 if dtype == torch.float32 else 3e-2
        what = f"gqa_attention with {heads} query heads and {kv_heads} K/V heads" + (
            f" in {str(dtype).removeprefix('torch.')}" if dtype != torch.float32 else ""
        )
        watch = _CopyWatch(k, v, heads // kv_heads)
        try:
            with watch:
                got = gqa_attention(q, k, v, mask, scale)
        except LearnerRaised as err:
            cause = err.__cause__
            if dtype == torch.float32 or not any(w in str(cause) for w in ("dtype", "scalar type")):
                raise
            failure = CheckFailed(
                f"with {str(dtype).removeprefix('torch.')} q, k, v your code raised {type(cause).__name__}: {cause} — "
                "the scores and softmax are in fp32: cast the weights back to v's dtype (.to(v.dtype)) before "
                "multiplying by v"
            )
            failure.learner_frames = learner_frames_of(cause)
            raise failure from None
        if isinstance(got, torch.Tensor) and got.dtype == torch.float32 and dtype != torch.float32:
            raise CheckFailed(
                f"{what} returned float32: the output must have q's dtype — cast the fp32 softmax weights back "
                "with .to(v.dtype) before multiplying by v, so the product (and your output) stays in v's dtype"
            )
        hint = None
        if isinstance(got, torch.Tensor) and got.shape == expected.shape and got.dtype == expected.dtype:
            if not torch.allclose(got.float(), expected.float(), atol=atol):
                hint = _gqa_diagnosis(gqa_attention, q, k, v, mask, scale, got, atol)
        folded = (q.shape[0], kv_heads, heads // kv_heads * q.shape[2], q.shape[3])
        if isinstance(got, torch.Tensor) and heads != kv_heads and tuple(got.shape) == folded:
            hint = "that is the folded [B, KV, G*T, D] layout: reshape the result back to [B, H, T, D]"
        if hint and "wrong K/V heads" in hint:
            raise CheckFailed(hint)
        try:
            compare_tensors(got, expected, what, atol=atol)
        except CheckFailed as err:
            raise (CheckFailed(f"{err} — {hint}") if hint else err) from None
        if heads != kv_heads and watch.copied_by:
            raise CheckFailed(
                f"with {heads} query heads on {kv_heads} K/V heads, your function made a copy of K/V {heads // kv_heads}× "
                f"their size ({watch.copied_by}): that is one copy per query head, and GQA's memory saving is gone. "
                "Fold each group of query heads into the query axis instead: q.reshape(B, KV, G*T, D) attends to "
                "k[B, KV, S, D] directly"
            )
    from minillm import LLM, SamplingParams
    from minillm.course.plugs import gqa_backend

    backend = gqa_backend(gqa_attention)
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


POOLING_MODEL = "tiny-shakespeare-mha"  # 4 query heads, 4 K/V heads: trained as MHA for this chapter


def _pool_reference(weight: torch.Tensor, heads: int, kv_heads: int) -> torch.Tensor:
    rows, cols = weight.shape
    d, g = rows // heads, heads // kv_heads
    return weight.float().view(kv_heads, g, d, cols).mean(1).reshape(kv_heads * d, cols).to(weight.dtype)


def _pooling_mistakes(weight: torch.Tensor, heads: int, kv_heads: int):
    """What each slip computes on ``weight`` (as [KV*D, in], fp32), and what it means."""
    rows, cols = weight.shape
    d, g = rows // heads, heads // kv_heads
    grouped = weight.float().view(kv_heads, g, d, cols)  # [KV, G, D, in]: the right grouping
    strided = (
        "the heads were grouped with a stride (pooled head j from heads j, j+KV, j+2·KV, ...): a group is "
        "G consecutive heads — pooled head j is the mean of heads j·G .. j·G+G-1, because query head h uses "
        "K/V head h // G (view the rows as [KV, G, D, in] and average over dim 1)"
    )
    yield grouped.sum(1), "the heads of each group were summed, not averaged: divide by the group size G = H / KV"
    yield (
        grouped.sum(1) / kv_heads,
        "each group's sum was divided by num_kv_heads: divide by the group size G = num_heads // num_kv_heads",
    )
    yield grouped.sum(1) / heads, "each group's sum was divided by num_heads: divide by G = num_heads // num_kv_heads"
    yield grouped[:, 0], "only the first head of each group was kept: average all G heads of the group"
    yield grouped[:, -1], "only the last head of each group was kept: average all G heads of the group"
    yield (
        grouped[:, :-1].mean(1),
        "the last head of each group was left out: a group is heads j·G .. j·G+G-1, all G of them",
    )
    yield grouped[:, 1:].mean(1), "the first head of each group was left out: a group is heads j·G .. j·G+G-1"
    yield weight.float().view(g, kv_heads, d, cols).mean(0), strided
    yield grouped.mean(0), strided
    yield (
        weight.float().view(kv_heads, d, g, cols).mean(2),
        "the rows of a head were split the wrong way: head h owns the D consecutive rows h·D .. h·D+D-1, so the "
        "rows view as [KV, G, D, in] (heads outer, each head's D rows inner), not [KV, D, G, in]",
    )


def _pooling_shape_hint(shape: tuple, heads: int, kv_heads: int, d: int, cols: int) -> str:
    g = heads // kv_heads
    if shape == (heads * d, cols):
        return (
            "that is the shape before pooling, [H*D, in]: return KV heads, each the mean of its group "
            "(do not repeat the pooled heads back to H)"
        )
    if shape == (g * d, cols) and g != kv_heads:
        return (
            "that is [G*D, in]: the mean was taken across the groups (over the KV axis), not within each "
            "group — view the rows as [KV, G, D, in] and average over dim 1"
        )
    if shape == (kv_heads * g, cols) and g != d:
        return (
            "that is [KV*G, in]: each head's D rows were averaged together — average the G heads of a group "
            "instead, row by row (dim 1 of [KV, G, D, in])"
        )
    if shape in ((kv_heads, d, cols), (kv_heads, 1, d, cols)):
        return "the pooled heads are still separate: reshape them to [KV*D, in]"
    if shape in ((kv_heads * d,), (kv_heads * d * cols,)):
        return "the input columns were lost: keep the weight's second axis, [KV*D, in]"
    if len(shape) == 2 and shape[0] == heads * d:
        return "the columns were pooled: the heads are the weight's rows (out_features first), [H*D, in]"
    return ""


@check
def check_head_pooling(pool_heads, model: str = POOLING_MODEL) -> str:
    """``pool_heads(weight[H*D, in], num_heads, num_kv_heads) -> [KV*D, in]``: the K/V projections
    of an MHA checkpoint mean-pooled, group by group, into GQA/MQA ones."""
    gen = torch.Generator().manual_seed(5)
    cases = (
        # heads, kv heads, head_dim, in_features, dtype
        (8, 2, 3, 5, torch.float32),  # groups of 4 on 2 K/V heads: G ≠ KV, and G*D, KV*G, KV*D all differ
        (4, 2, 3, 5, torch.float32),
        (4, 1, 4, 6, torch.float32),  # MQA: one group of all the heads
        (4, 4, 3, 5, torch.float32),  # as many K/V heads as heads: nothing to pool
        (6, 3, 8, 1, torch.float32),  # a bias, as the conversion passes it: one column
        (4, 2, 16, 32, torch.bfloat16),  # the tiny models' checkpoint dtype
    )
    for heads, kv_heads, d, cols, dtype in cases:
        weight = torch.randn(heads * d, cols, generator=gen).to(dtype)
        saved = weight.clone()
        what = (
            f"pool_heads(weight [{heads * d}, {cols}]"
            + (f" in {str(dtype).removeprefix('torch.')}" if dtype != torch.float32 else "")
            + f", num_heads={heads}, num_kv_heads={kv_heads})"
        )
        try:
            got = pool_heads(weight, heads, kv_heads)
        except LearnerRaised as err:
            cause = err.__cause__
            if not isinstance(cause, RuntimeError) or "shape" not in str(cause):
                raise
            failure = CheckFailed(
                f"{what}: your code raised RuntimeError: {cause} — the {heads * d} rows are num_heads={heads} heads "
                f"of D = rows // num_heads = {d} rows each, and a group holds G = num_heads // num_kv_heads = "
                f"{heads // kv_heads} of them: view the rows as [num_kv_heads, G, D, in]"
            )
            failure.learner_frames = learner_frames_of(cause)
            raise failure from None
        if not torch.equal(weight, saved):
            raise CheckFailed(
                f"{what} changed the weight it was given: the checkpoint's own tensor must stay as it was — build "
                "the pooled weight as a new tensor (no in-place /=, +=, .div_() on the weight or a view of it)"
            )
        expected = _pool_reference(weight, heads, kv_heads)
        hint = ""
        if isinstance(got, torch.Tensor) and tuple(got.shape) != tuple(expected.shape):
            hint = _pooling_shape_hint(tuple(got.shape), heads, kv_heads, d, cols)
        elif isinstance(got, torch.Tensor) and got.dtype != dtype:
            hint = (
                f"the pooled weight must keep the checkpoint's dtype ({str(dtype).removeprefix('torch.')}): "
                "average in fp32 if you like, then cast back with .to(weight.dtype)"
            )
        elif isinstance(got, torch.Tensor) and not torch.allclose(got.float(), expected.float(), atol=2e-2):
            for mistake, words in _pooling_mistakes(weight, heads, kv_heads):
                mistake = mistake.reshape(-1, cols)
                if mistake.shape == got.shape and torch.allclose(got.float(), mistake, atol=2e-2):
                    hint = words
                    break
        try:
            compare_tensors(got, expected, what, atol=1e-5 if dtype == torch.float32 else 2e-2)
        except CheckFailed as err:
            raise (CheckFailed(f"{err} — {hint}") if hint else err) from None

    import tempfile
    from pathlib import Path

    from minillm import LLM, SamplingParams
    from minillm.assets import heldout_text, resolve_model
    from minillm.config import ModelConfig
    from minillm.kv_head_pooling import pool_kv_heads
    from minillm.models import load_model
    from minillm.tools.evaluation import perplexity

    calls = []

    def recording(weight, num_heads, num_kv_heads):
        calls.append(tuple(weight.shape))
        return pool_heads(weight, num_heads, num_kv_heads)

    source = resolve_model(model)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    prompts = ["KING.\nNow is the winter of our discontent", "ROMEO.\nBut soft, what light"]
    config, ids = ModelConfig.from_folder(source), None
    with tempfile.TemporaryDirectory() as tmp:
        for kv_heads in (2, 1):
            with hooks.override(pool_heads=recording):  # every K and V projection of every layer
                yours = pool_kv_heads(source, Path(tmp) / f"yours-{kv_heads}", kv_heads)
            package = pool_kv_heads(source, Path(tmp) / f"package-{kv_heads}", kv_heads)
            llm = LLM(str(yours), dtype="fp32", mode="contiguous", attention_backend="torch")
            name = f"the model pooled by your function to {kv_heads} K/V head{'s' if kv_heads > 1 else ''}"
            reference = LLM(str(package), dtype="fp32", mode="contiguous", attention_backend="torch")
            expected_tokens = [o.token_ids for o in reference.generate(prompts, params)]
            for n, (out, ref) in enumerate(zip(llm.generate(prompts, params), expected_tokens)):
                compare_tokens(out.token_ids, ref, f"{name}, request {n}", "check the grouping of the heads")
            ids = ids or llm.tokenizer.encode(heldout_text()[:4000])[:257]
            got_ppl = perplexity(load_model(yours, torch.float32), ids, window=128)
            ref_ppl = perplexity(load_model(package, torch.float32), ids, window=128)
            if not math.isclose(got_ppl, ref_ppl, rel_tol=1e-3):
                raise CheckFailed(
                    f"{name} has held-out perplexity {got_ppl:.2f} on 256 tokens, the package's pooling "
                    f"{ref_ppl:.2f}: check the grouping of the heads"
                )
    return (
        f"your pooling converted {model} ({config.num_heads} query heads, {config.num_kv_heads} K/V heads) to "
        f"GQA-2 and MQA — {len(calls)} K/V projections pooled; greedy tokens and held-out perplexity the same as "
        "with the package's conversion"
    )


def _behind(n: int, window: int, block: int) -> int:
    return max(0, n - window + 1) // block


# What a wrong count computes instead (a value, or a tuple of values it may take), and what that
# means, for the unit cases' diagnosis.
_WINDOW_MISTAKES = (
    (
        lambda n, w, b: _behind(n + 1, w, b),
        "your count is one token ahead: the next query sits at position num_computed_tokens (the computed "
        "tokens are positions 0..num_computed_tokens-1), so the first visible one is num_computed_tokens - window + 1",
    ),
    (
        lambda n, w, b: _behind(n - 1, w, b),
        "your count is one token behind: the window's `window` positions include the query itself, so the "
        "first visible one is num_computed_tokens - window + 1",
    ),
    (lambda n, w, b: _behind(n, b, w), "your count has window and block_size the other way round"),
    (
        lambda n, w, b: -(-n // b) - _behind(n, w, b),
        "that is how many blocks the sequence keeps: return how many leading blocks it can give back",
    ),
    (
        lambda n, w, b: max(0, round((n - w + 1) / b)),
        "a partly visible block was counted: round down to whole blocks (//), not to the nearest",
    ),
    (
        lambda n, w, b: -(-max(0, n - w + 1) // b),
        "a partly visible block was counted: round down to whole blocks (//), not up",
    ),
    (
        lambda n, w, b: (max(0, n - w), max(0, n - w + 1)),  # with or without the query's own position
        "that counts positions, not blocks: divide by block_size, rounding down",
    ),
)


def _values(mistake: int | tuple[int, ...]) -> tuple[int, ...]:
    return mistake if isinstance(mistake, tuple) else (mistake,)


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
        (13, 8, 4, 1, "the next query (position 13) sees positions 6..13: block 1 (4-7) still holds 6 and 7"),
        (14, 8, 4, 1, "the next query (position 14) sees positions 7..14: block 1 (4-7) still holds position 7"),
        (15, 8, 4, 2, "the next query (position 15) sees 8..15: blocks 0 and 1 are behind it"),
        (100, 16, 16, 5, "the next query (position 100) sees 85..100: blocks 0-4 (positions 0-79) are behind it"),
        (12, 6, 4, 1, "the next query (position 12) sees positions 7..12: block 1 (4-7) still holds position 7"),
        (0, 4, 4, 0, "an empty sequence has nothing to release"),
        (2, 12, 4, 0, "a sequence far shorter than the window keeps every block"),
        (3, 8, 1, 0, "with 1-token blocks, a sequence shorter than the window still keeps every block"),
        (10, 4, 1, 7, "the next query (position 10) sees 7..10: the 1-token blocks 0-6 are behind it"),
    ]
    names = ("num_computed_tokens", "window", "block_size")
    for *args, expected, why in cases:
        got = blocks_behind_window(*args)
        try:
            int_cases(lambda *_, got=got: got, "blocks_behind_window", [(*args, expected, why)], names)
        except CheckFailed as err:
            if not isinstance(got, int) or isinstance(got, bool):
                raise
            hints = [
                words
                for mistake, words in _WINDOW_MISTAKES
                if all(blocks_behind_window(n, w, b) in _values(mistake(n, w, b)) for n, w, b, *_ in cases)
            ]
            if got < 0:
                hints.append("a count of blocks is never negative: clamp at 0")
            raise (CheckFailed(f"{err} — {hints[0]}") if hints else err) from None
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
