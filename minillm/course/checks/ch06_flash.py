"""Chapter 06 (FlashAttention): the online-softmax update and the whole Triton kernel."""

from __future__ import annotations

import math

import torch

from minillm.course.compare import compare_tensors
from minillm.course.results import CheckFailed, check
from minillm.course.triton_guard import bounds_checked, out_of_bounds_in


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


def _same(got, expected: torch.Tensor) -> bool:
    return (
        isinstance(got, torch.Tensor)
        and got.shape == expected.shape
        and torch.allclose(got.float(), expected, rtol=1e-5, atol=1e-5)
    )


def _explain(got, expected: torch.Tensor, what: str, mistakes, note: str = "") -> None:
    """``got`` must be ``expected``; if it is what one of ``mistakes`` (tensor, words) computes,
    say so; otherwise say where it differs."""
    if _same(got, expected):
        return
    for candidate, words in mistakes:
        if _same(got, candidate):
            raise CheckFailed(f"{what}: {words}{note}")
    try:
        compare_tensors(got, expected, what)
    except CheckFailed as err:
        raise CheckFailed(f"{err}{note}") from None


def _online_step(online_softmax_update) -> None:
    """One update from a hand-made state: 4 query rows with a running max, sum and accumulator,
    a tile of 4 keys (square, so a max, a sum or p taken over the wrong axis has the right shape
    and is named) whose max is larger than the running one for rows 0-2 and smaller for row 3."""
    m = torch.tensor([0.5, 1.0, -0.3, 5.0])
    l_sum = torch.tensor([2.0, 3.0, 1.5, 4.0])
    acc = torch.tensor([[0.3, -1.2, 0.8], [1.5, 0.4, -0.6], [-0.7, 0.9, 0.2], [2.0, -0.5, 1.1]])
    scores = torch.tensor([[1.2, -0.4, 2.1, 0.3], [0.2, 2.5, -1.0, 1.7], [-2.0, 0.1, 0.9, -0.5], [0.7, 1.1, -0.2, 2.2]])
    v = torch.tensor([[0.6, -0.3, 1.4], [-1.1, 0.8, 0.5], [0.9, 1.7, -0.8], [0.2, -1.5, 0.7]])
    given = [t.clone() for t in (m, l_sum, acc, scores, v)]
    out = online_softmax_update(*given)
    if not isinstance(out, tuple) or len(out) != 3:
        raise CheckFailed(f"online_softmax_update should return (m, l, acc), got {type(out).__name__}")
    got_m, got_l, got_acc = out
    if all(isinstance(t, torch.Tensor) for t in out) and got_l.shape == acc.shape and got_acc.shape == l_sum.shape:
        raise CheckFailed("online_softmax_update returned (m, acc, l): return them in the order (m, l, acc)")
    note = ""
    if not torch.equal(given[0], m):
        note = (
            " (your function changed its argument m in place: whatever it computed from m afterwards, like "
            "exp(m - m_new), saw the new max instead of the old one)"
        )
    row_max = scores.max(-1).values
    m_new = torch.maximum(m, row_max)
    _explain(
        got_m,
        m_new,
        "the running max m after one update (from m = [0.5, 1, -0.3, 5], a tile of 4 keys)",
        [
            (
                row_max,
                "it is this tile's row max alone — the running max must remember the earlier tiles: "
                "m' = max(m, this tile's row max)",
            ),
            (
                torch.maximum(m, scores.max(0).values),
                "it is taken over the wrong axis — each query row's max over its keys (dim=-1), not each key's max "
                "over the queries",
            ),
            (torch.maximum(m, scores.max()), "it is the max of the whole tile — take one max per query row (dim=-1)"),
            (m, "it came back unchanged — return the new running max m' = max(m, this tile's row max)"),
        ],
        note,
    )
    alpha, grow = torch.exp(m - m_new), torch.exp(m_new - m)
    p, p_old = torch.exp(scores - m_new[:, None]), torch.exp(scores - m[:, None])
    l_new = l_sum * alpha + p.sum(-1)
    old_max = "the new tile's p is taken against the old max m — use p = exp(scores - m'), with the new running max"
    plain = (
        "l is the plain sum of exp(scores): keep it relative to the running max — p = exp(scores - m_new) — "
        "and when the max grows from m to m', multiply the old sum by exp(m - m') first"
    )
    _explain(
        got_l,
        l_new,
        "l after one update (from l = [2, 3, 1.5, 4])",
        [
            (
                l_sum + p.sum(-1),
                "l was never rescaled — when the max grows from m to m', multiply the old sum by exp(m - m') "
                "before adding the new tile's sum",
            ),
            (
                l_sum * grow + p.sum(-1),
                "l was rescaled the wrong way round — the old sum shrinks when the max grows: multiply it by "
                "exp(m - m') (at most 1), not exp(m' - m)",
            ),
            (l_sum * alpha + p_old.sum(-1), old_max),
            (l_sum + p_old.sum(-1), old_max),
            (l_sum + torch.exp(scores).sum(-1), plain),
            (l_sum * alpha + torch.exp(scores).sum(-1), plain),
            (l_sum * alpha + p.sum(0), "p is summed over the wrong axis — each query row's sum over its keys (dim=-1)"),
            (p.sum(-1), "it holds only this tile's sum — add it to the old sum, rescaled: l' = l·exp(m - m') + Σ p"),
        ],
        note,
    )
    acc_new = acc * alpha[:, None] + p @ v
    normalised = (
        "acc is divided by l — keep acc un-normalised (acc·exp(m - m') + p @ v_tile); it is divided by l once, "
        "after the last tile"
    )
    _explain(
        got_acc,
        acc_new,
        "acc after one update",
        [
            (
                acc + p @ v,
                "l is right but acc is not: rescale the accumulator too when the max changes "
                "(acc * exp(m_old - m_new)) before adding p @ v_tile",
            ),
            (
                acc * grow[:, None] + p @ v,
                "acc was rescaled the wrong way round — multiply it by exp(m - m') (at most 1), not exp(m' - m)",
            ),
            (acc * alpha[:, None] + p.T @ v, "it adds p.T @ v — p is [T, BLOCK_N], one row per query: add p @ v_tile"),
            (acc_new / l_new[:, None], normalised),
            ((acc * (l_sum * alpha)[:, None] + p @ v) / l_new[:, None], normalised),
            (p @ v, "it holds only this tile's p @ v — add it to the old accumulator, rescaled by exp(m - m')"),
        ],
        note,
    )


def _online_first_tile(online_softmax_update) -> None:
    """The first update, from the initial state (m = -inf, l = 0, acc = 0), on a tile whose scores
    are all far below 0: m must become each row's max, whatever its sign."""
    scores = torch.tensor([[-98.0, -101.5, -99.2], [-104.0, -100.3, -102.6]])
    v = torch.tensor([[0.6, -0.3], [-1.1, 0.8], [0.9, 1.7]])
    out = online_softmax_update(torch.full((2,), float("-inf")), torch.zeros(2), torch.zeros(2, 2), scores, v)
    if not isinstance(out, tuple) or len(out) != 3:
        raise CheckFailed(f"online_softmax_update should return (m, l, acc), got {type(out).__name__}")
    m_new = scores.max(-1).values
    p = torch.exp(scores - m_new[:, None])
    what = "after the first tile (m = -inf, l = 0, acc = 0; every score near -100)"
    note = " — m = -inf needs no special case (keep it): exp(-inf - m') = 0 already makes the first update right"
    _explain(out[0], m_new, f"the running max m {what}", [], note)
    _explain(out[1], p.sum(-1), f"l {what}", [], note)
    _explain(out[2], p @ v, f"acc {what}", [], note)


@check
def check_online_softmax(online_softmax_update) -> str:
    """``online_softmax_update(m, l, acc, scores_tile, v_tile) -> (m, l, acc)``."""
    _online_step(online_softmax_update)
    _online_first_tile(online_softmax_update)
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
    if not l_right:
        raise CheckFailed(
            f"l after 3 tiles is {l_sum[0].item():.5g} for row 0, expected {expected_l[0].item():.5g} (the sum "
            "of exp(score - final max)), though single updates were right: does your function keep state between "
            "calls? Everything it needs comes in as (m, l, acc)"
        )
    raise CheckFailed(
        "l is right but acc / l after 3 tiles differs from softmax(scores) @ V, though single updates were right: "
        "does your function keep state between calls? Everything it needs comes in as (m, l, acc)"
    )


def _flash_allowed(t: int, s: int, causal: bool, diagonal: bool = True, prefix: bool = True) -> torch.Tensor:
    """Which keys each query sees: the queries are the last ``t`` of ``s`` positions (after a cached
    prefix); ``diagonal=False`` hides a query's own key, ``prefix=False`` forgets the prefix."""
    if not causal:
        return torch.ones(t, s, dtype=torch.bool)
    pos = torch.arange(t) + (s - t if prefix else 0)
    keys = torch.arange(s)[None, :]
    return keys <= pos[:, None] if diagonal else keys < pos[:, None]


def _attend(q, k, v, allowed: torch.Tensor, scale: float, normalized: bool = True) -> torch.Tensor:
    """Attention; ``normalized=False`` leaves out the softmax's division by the row sum (what a
    kernel that stores ``acc`` instead of ``acc / l_i`` returns)."""
    scores = torch.einsum("thd,shd->hts", q.float(), k.float()) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    weights = torch.softmax(scores, -1) if normalized else torch.exp(scores - scores.amax(-1, keepdim=True))
    return torch.einsum("hts,shd->thd", weights, v.float())


def _flash_reference(q, k, v, causal: bool) -> torch.Tensor:
    return _attend(q, k, v, _flash_allowed(q.shape[0], k.shape[0], causal), q.shape[-1] ** -0.5)


def _flash_tiled(q, k, v, allowed: torch.Tensor, block: int, slip: str) -> torch.Tensor:
    """The kernel's loop over key tiles of ``block`` keys, with one slip: ``"l"`` / ``"acc"`` not
    rescaled when the max grows, ``"reset"``: each tile replaces the running state."""
    scores = torch.einsum("thd,shd->hts", q.float(), k.float()) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~allowed, float("-inf"))
    values = v.float().transpose(0, 1)  # [H, S, D]
    m = torch.full(scores.shape[:2], float("-inf"))
    l_sum = torch.zeros(scores.shape[:2])
    acc = torch.zeros(*scores.shape[:2], v.shape[-1])
    for start in range(0, scores.shape[-1], block):
        tile = scores[..., start : start + block]
        m_new = torch.maximum(m, tile.amax(-1))
        m_safe = torch.where(m_new == float("-inf"), 0.0, m_new)
        p = torch.exp(tile - m_safe[..., None])
        alpha = torch.zeros_like(m) if slip == "reset" else torch.exp(m - m_safe)
        l_sum = (l_sum if slip == "l" else l_sum * alpha) + p.sum(-1)
        acc = (acc if slip == "acc" else acc * alpha[..., None]) + p @ values[:, start : start + block]
        m = m_new
    return (acc / l_sum[..., None]).transpose(0, 1)


_DIAGONAL = (
    "a query row saw only masked (-inf) keys: a query attends to keys up to and including its own position "
    "(offs_n <= q_pos, not <)"
)
_TILE_SLIPS = {
    "l": "the running sum l is not rescaled when the max grows: l_i * alpha + tl.sum(p, 1), with alpha = "
    "exp(m_i - m_new)",
    "acc": "the accumulator is not rescaled when the max grows: acc * alpha[:, None] + tl.dot(p, v)",
    "reset": "only the last key tile counts: each tile must add to the running state (l_i, acc rescaled, and "
    "m_i = m_new carried to the next tile), not replace it",
}


def _flash_diagnosis(q, k, v, causal: bool, got: torch.Tensor) -> str | None:
    """Why a kernel's output (right shape, wrong values) is wrong: attention recomputed under each
    mistake's behaviour, the one the output matches named."""
    t, s, d = q.shape[0], k.shape[0], q.shape[-1]
    got = got.detach().float().cpu()
    if not bool(torch.isfinite(got).any()):
        return (
            "every output is NaN, so the first key tile already went wrong: there m_i = -inf and l_i = 0, and "
            "every exponent must be taken against the new max — p = exp(s - m_new) and alpha = exp(m_i - m_new), "
            "which is 0 there (anything minus -inf in an exponent is inf, and inf / inf or 0 · inf is NaN)"
        )
    allowed = _flash_allowed(t, s, causal)
    scale = d**-0.5

    def candidates():
        if causal:
            yield lambda: _attend(q, k, v, _flash_allowed(t, s, True, diagonal=False), scale), _DIAGONAL
            if t != s:
                yield (
                    lambda: _attend(q, k, v, _flash_allowed(t, s, True, prefix=False), scale),
                    "the causal mask ignores the cached prefix: query i sits at position q_pos = S - T + i and "
                    "sees the keys up to q_pos, not up to i",
                )
        else:
            yield (
                lambda: _attend(q, k, v, _flash_allowed(t, s, True), scale),
                "the kernel hides later keys even though causal=False: apply the causal mask only if CAUSAL",
            )
        for used, words in (
            (1.0, "not scaled: multiply tl.dot(q, tl.trans(k)) by scale"),
            (d**0.5, "divided by scale: multiply them by it"),
            (scale * scale, "multiplied by scale twice"),
            (
                scale * math.log(2),
                "used with exp2 as if it were exp: exp2(x) = exp(x · ln 2), so multiply the scores by "
                "log2(e) = 1.4427 first (or use tl.exp)",
            ),
        ):
            yield lambda used=used: _attend(q, k, v, allowed, used), f"the scores q·kᵀ are {words}"
        yield (
            lambda: _attend(q, k, k, allowed, scale),
            "the output is a weighted sum of keys: the values were loaded from K — load them from V",
        )
        yield (
            lambda: _attend(q, k, v, allowed, scale, normalized=False),
            "the output is acc without the softmax's denominator: store acc / l_i[:, None]",
        )
        if not causal:  # a causal query never sees past S anyway
            for pad in sorted({-s % block for block in (16, 32, 64, 128)} - {0}):
                padded = (torch.cat([x, x.new_zeros(pad, *x.shape[1:])]) for x in (k, v))
                yield (
                    lambda pad=pad, padded=tuple(padded): _attend(q, *padded, _flash_allowed(t, s + pad, False), scale),
                    f"the last tile's {pad} keys past S (loaded as 0) take part in the softmax: hide offs_n >= S "
                    "with -inf",
                )
        for block in (16, 32, 64, 128):
            if block < s:
                for slip, words in _TILE_SLIPS.items():
                    yield lambda block=block, slip=slip: _flash_tiled(q, k, v, allowed, block, slip), words

    for reference, words in candidates():
        if torch.allclose(got, reference(), atol=1e-4, equal_nan=True):
            return words
    return None


def _launch(flash_forward, q, k, v, causal: bool):
    """The learner's launcher on these inputs, every load and store of its kernel bounds-checked
    (``triton_guard``): an access past the tensors is named instead of corrupting the process."""
    with bounds_checked():
        try:
            return flash_forward(q, k, v, causal)
        except Exception as err:
            outside = out_of_bounds_in(err)
            if outside is None:
                raise
            raise CheckFailed(f"for T={q.shape[0]}, S={k.shape[0]}, causal={causal}: {outside}") from None


@check
def check_flash_kernel(flash_forward) -> str:
    """``flash_forward(q[T,H,D], k[S,H,D], v, causal) -> o[T,H,D]``, launching your Triton kernel."""
    gen = torch.Generator().manual_seed(1)
    # (queries, keys, causal, size of q): the last case's scores reach ±100s, where a running max that is
    # not each row's own overflows exp
    for t, s, causal, size in (
        (40, 40, True, 1),
        (40, 40, False, 1),
        (5, 37, True, 1),
        (1, 9, True, 1),
        (16, 16, False, 40),
    ):
        q = torch.randn(t, 2, 16, generator=gen) * size
        k, v = torch.randn(s, 2, 16, generator=gen), torch.randn(s, 2, 16, generator=gen)
        got = _launch(flash_forward, q, k, v, causal)
        expected = _flash_reference(q, k, v, causal)
        full = _flash_reference(q, k, v, False)
        if causal and isinstance(got, torch.Tensor) and got.shape == full.shape and not torch.allclose(expected, full):
            if torch.allclose(got.float(), full, atol=1e-4):
                raise CheckFailed(
                    "the kernel ignores causality: hide keys at positions after each query's (offs_n > q_pos → -inf)"
                )
        hint = None
        if isinstance(got, torch.Tensor) and got.shape == expected.shape:
            if not torch.allclose(got.detach().float().cpu(), expected, atol=1e-4):
                hint = _flash_diagnosis(q, k, v, causal, got)
        what = f"your kernel's output for T={t}, S={s}, causal={causal}"
        nan_hint = hint or (
            "a NaN or inf where attention is finite: every row must see at least one key, and every exponent "
            "must be at most 0 — p = exp(s - m_new), alpha = exp(m_i - m_new), with m_new each query row's running "
            "max (tl.max(s, 1))"
        )
        try:
            compare_tensors(got, expected, what, atol=1e-4, nan_hint=nan_hint)
        except CheckFailed as err:
            raise (CheckFailed(f"{err} — {hint}") if hint and hint not in str(err) else err) from None
    # Rows whose every score lies far below 0 (about -300 here): a running max that starts at 0 instead of
    # -inf (or exponents taken without the max) underflow every exp to 0, and 0 / 0 is NaN.
    q = -20.0 * torch.ones(16, 2, 16)
    k, v = torch.rand(16, 2, 16, generator=gen) + 3.0, torch.randn(16, 2, 16, generator=gen)
    compare_tensors(
        _launch(flash_forward, q, k, v, False), _flash_reference(q, k, v, False),
        "your kernel's output for T=S=16 where every score is about -300", atol=1e-4,
        nan_hint="rows whose scores are all far below 0 came out NaN: the running max must start at -inf "
        "(tl.full([BLOCK_M], float('-inf'), tl.float32)), not 0, and every exponent is taken against it — with a "
        "max of 0 each exp(s) underflows to 0, l_i stays 0, and acc / l_i is 0 / 0",
    )  # fmt: skip
    # In memory, the rows after S belong to something else (here NaN): a load not masked with offs_n < S
    # reads them, and even a weight of 0 times NaN spoils the output.
    for t, s, causal in ((5, 37, True), (40, 37, False)):
        q = torch.randn(t, 2, 16, generator=gen)
        k, v = (torch.full((s + 64, 2, 16), float("nan")) for _ in range(2))
        k[:s], v[:s] = torch.randn(s, 2, 16, generator=gen), torch.randn(s, 2, 16, generator=gen)
        got = _launch(flash_forward, q, k[:s], v[:s], causal)
        expected = _flash_reference(q, k[:s], v[:s], causal)
        compare_tensors(
            got, expected, f"your kernel's output for T={t}, S={s}, causal={causal}, with other data after K and V",
            atol=1e-4,
            nan_hint="your kernel reads K or V rows past S (the memory after them holds other data, here NaN): mask "
            "both loads with offs_n < S — even a weight of 0 times a NaN value is NaN",
        )  # fmt: skip
    return "your Triton kernel matches attention exactly on tiles that do not divide the lengths, causal and not, with a cached prefix"
