"""Chapter 09's whole piece: tensor-parallel attention — one rank's share of a causal GQA
attention layer with RoPE from the full checkpoint matrices, and the one all-reduce that completes it.

``tp_attention(x, positions, wq, wk, wv, wo, num_heads, num_kv_heads, rope_theta, rank, world_size)``:
the rank keeps its whole groups of heads (column-parallel q/k/v: the rows of its heads), rotates
its queries and keys by their positions (RoPE acts on each head alone, so every rank rotates its
own), attends with them alone, multiplies by its columns of ``wo`` (row-parallel: a partial sum)
and all-reduces. Two stages, both on two real ranks (``ch09_ranks``: the learner's source travels
and runs there, every all-reduce is counted):

1. **diagnosis on hand-made weights** — 8 query heads over 4 K/V heads of 8 dims on a hidden
   size of 40 (so that rows, columns and a rank's share of the heads cannot be mixed up
   silently), then 6 over 2 (groups of 3 on a rank) at positions that skip one (RoPE depends on
   the positions' differences: only a gap tells positions used from ``arange(T)``); a wrong
   output is recomputed under the classic slips (no causal mask, no scaling, ``repeat`` where GQA
   needs ``repeat_interleave``, no RoPE, RoPE on adjacent pairs or on the values too or on the
   queries alone, the positions ignored, the frequencies inverted, the turn reversed, every rank computing every
   head, the all-reduce in the wrong place or averaged) and the one it matches is named;
2. **the real model's layer** — the bundled 8M model's first attention layer (its checkpoint's
   q/k/v/o weights and rope_theta, 8 query heads over 4 K/V heads of 32 dims) on its embedded
   prompt: both ranks' outputs equal the one-process attention.
"""

from __future__ import annotations

import torch

from minillm.course.checks.ch09_ranks import AllReduceWatch, as_learner, learner_fn_from_source, run_on_ranks, source_of
from minillm.course.results import CheckFailed, check

WORLD, TOKENS = 2, 6
MODEL = "tiny-shakespeare-8m"


def rope(z: torch.Tensor, positions: torch.Tensor, theta: float, slip: str | None = None) -> torch.Tensor:
    """``z [heads, T, d]`` rotated by RoPE as Llama does: pair ``(i, i + d/2)`` of row ``t`` turns by
    ``positions[t] · theta^(-2i/d)`` (or under a slip: adjacent pairs, the positions ignored, the
    frequencies inverted, the turn reversed)."""
    d = z.shape[-1]
    exponent = torch.arange(0, d, 2, dtype=torch.float32) / d
    inv_freq = theta**exponent if slip == "inverted_freq" else theta**-exponent
    where = torch.arange(z.shape[-2]) if slip == "positions_ignored" else positions
    angles = where.float()[:, None] * inv_freq  # [T, d/2]
    if slip == "adjacent_pairs":  # pairs (2i, 2i + 1)
        a, b = z[..., 0::2], z[..., 1::2]
        return torch.stack([a * angles.cos() - b * angles.sin(), b * angles.cos() + a * angles.sin()], -1).flatten(-2)
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    if slip == "reversed_turn":
        sin = -sin
    return z * cos + torch.cat([-z[..., d // 2 :], z[..., : d // 2]], -1) * sin


def attention(x, positions, wq, wk, wv, wo, num_heads: int, num_kv_heads: int, rope_theta: float,
              slip: str | None = None) -> torch.Tensor:  # fmt: skip
    """Causal GQA attention with RoPE of ``x[T, H]`` in one process (or under one of a learner's slips)."""
    t, d = x.shape[0], wq.shape[0] // num_heads
    q = (x @ wq.T).view(t, num_heads, d).transpose(0, 1)
    k = (x @ wk.T).view(t, num_kv_heads, d).transpose(0, 1)
    v = (x @ wv.T).view(t, num_kv_heads, d).transpose(0, 1)
    rope_slip = slip if slip in ("adjacent_pairs", "positions_ignored", "inverted_freq", "reversed_turn") else None
    if slip != "no_rope":
        q = rope(q, positions, rope_theta, rope_slip)
        k = k if slip == "queries_only" else rope(k, positions, rope_theta, rope_slip)
        v = rope(v, positions, rope_theta) if slip == "values_too" else v
    group = num_heads // num_kv_heads
    spread = (lambda z: z.repeat(group, 1, 1)) if slip == "repeat" else (lambda z: z.repeat_interleave(group, 0))
    k, v = spread(k), spread(v)
    scores = q @ k.transpose(1, 2) * (1.0 if slip == "unscaled" else d**-0.5)
    if slip != "non_causal":
        scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
    out = (scores.softmax(-1) @ v).transpose(0, 1).reshape(t, num_heads * d)
    return out @ wo.T


def sharded(x, positions, wq, wk, wv, wo, num_heads: int, num_kv_heads: int, rope_theta: float,
            slip: str | None = None) -> torch.Tensor:  # fmt: skip
    """What the ranks' all-reduce gives when each runs ``attention`` on its own heads under ``slip``
    (a slip such as ``repeat`` acts on a rank's local heads, so it is recomputed rank by rank)."""
    d, nq, nkv = wq.shape[0] // num_heads, num_heads // WORLD, num_kv_heads // WORLD
    total = 0
    for r in range(WORLD):
        q_rows, kv_rows = slice(r * nq * d, (r + 1) * nq * d), slice(r * nkv * d, (r + 1) * nkv * d)
        total = total + attention(x, positions, wq[q_rows], wk[kv_rows], wv[kv_rows], wo[:, q_rows], nq, nkv,
                                  rope_theta, slip)  # fmt: skip
    return total


def _case(seed: int, hidden: int, num_heads: int, num_kv_heads: int, dim: int, positions: list[int],
          theta: float) -> tuple:  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(TOKENS, hidden, generator=g)
    wq = torch.randn(num_heads * dim, hidden, generator=g) / hidden**0.5
    wk, wv = (torch.randn(num_kv_heads * dim, hidden, generator=g) / hidden**0.5 for _ in range(2))
    wo = torch.randn(hidden, num_heads * dim, generator=g) / (num_heads * dim) ** 0.5
    return x, torch.tensor(positions), wq, wk, wv, wo, num_heads, num_kv_heads, theta


def _model_case() -> tuple:
    """The 8M model's first attention layer and its embedded prompt (the weights as the checkpoint has them)."""
    from minillm.assets import resolve_model
    from minillm.course.weights import model_weights
    from minillm.models.loader import load_model

    model = load_model(resolve_model(MODEL), torch.float32, "cpu", 64)
    weights, config = model_weights(model), model.config
    layer = weights.layers[0]
    x = weights.embed_tokens[torch.tensor([72, 1187, 15, 9, 301, 44])]
    heads = (config.num_heads, config.num_kv_heads)
    positions = torch.arange(x.shape[0])
    return (x, positions, layer.q_proj, layer.k_proj, layer.v_proj, layer.o_proj, *heads, config.rope_theta)


def _rank(rank, world, source, name, cases) -> list[dict]:
    """One rank: the learner's function on every case, its all-reduces counted (outputs as numpy:
    a tensor would travel through a file descriptor the exiting rank may close first)."""
    fn = as_learner(learner_fn_from_source, source, name)
    results = []
    for x, positions, wq, wk, wv, wo, nh, nkv, theta in cases:
        with AllReduceWatch() as watch:
            out = as_learner(fn, x.clone(), positions.clone(), wq.clone(), wk.clone(), wv.clone(), wo.clone(), nh, nkv,
                             theta, rank, world)  # fmt: skip
        array = out.detach().float().cpu().numpy() if isinstance(out, torch.Tensor) else None
        results.append({"out": array, "type": type(out).__name__, "all_reduces": watch.shapes})
    return results


def _close(a, b) -> bool:
    return a.shape == b.shape and torch.allclose(a.float(), b.float(), atol=1e-4, rtol=1e-4)


def _diagnose(what: str, case: tuple, results: list[dict]) -> None:
    """Raise the message that names what the ranks did, unless every rank returned the attention."""
    x, positions, wq, wk, wv, wo, nh, nkv, theta = case
    ref = attention(*case)
    per_q, d = nh // WORLD, wq.shape[0] // nh
    slices = (
        f"rank r keeps rows r*{per_q * d}:(r+1)*{per_q * d} of wq (its {per_q} query heads of {d} dims), rows "
        f"r*{nkv // WORLD * d}:(r+1)*{nkv // WORLD * d} of wk and wv (their {nkv // WORLD} K/V heads), and the "
        f"matching columns of wo"
    )
    if all(r["type"] == "NoneType" for r in results):
        raise CheckFailed(
            f"{what}: every rank returned None: dist.all_reduce works in place and returns None — call it on the "
            "partial output, then return that tensor"
        )
    for r, res in enumerate(results):
        if res["out"] is None:
            raise CheckFailed(f"{what}: rank {r} returned a {res['type']}: every rank returns the full [T, H] output")
        if tuple(res["out"].shape) != tuple(ref.shape):
            raise CheckFailed(f"{what}: rank {r} returned shape {tuple(res['out'].shape)}, expected "
                              f"{tuple(ref.shape)} ([T, H])")  # fmt: skip
    outs = [torch.from_numpy(r["out"]) for r in results]
    counts = [len(r["all_reduces"]) for r in results]
    if all(_close(o, ref) for o in outs):
        if max(counts) == 0:
            raise CheckFailed(
                f"{what}: each rank computed every head: right, but with all the weights on every rank — keep only "
                f"this rank's ({slices}) and add the partial outputs with one all-reduce"
            )
        if counts != [1] * WORLD:
            raise CheckFailed(f"{what}: the output is right, but the ranks called all_reduce {counts} times: one per "
                              "attention layer, after the row-parallel o projection")  # fmt: skip
        return
    odd = [s for r in results for s in r["all_reduces"] if s != tuple(ref.shape)]
    if odd:
        raise CheckFailed(
            f"{what}: you all-reduced a {list(odd[0])} tensor, not the [T, H] partial output: the ranks' attention "
            "outputs are different heads (columns), to be multiplied by their columns of wo first — the all-reduce "
            "goes after the o projection"
        )
    if max(counts) == 0:
        raise CheckFailed(
            f"{what}: no rank called all_reduce, so each returned only its heads' share of the output (a partial "
            "sum): add them with dist.all_reduce(out) after the o projection"
        )
    if max(counts) > 1:
        raise CheckFailed(f"{what}: the ranks called all_reduce {counts} times: one, after the o projection")
    if all(_close(o, ref / WORLD) for o in outs):
        raise CheckFailed(f"{what}: the output is 1/{WORLD} of the attention's: the all-reduce's sum is the answer, "
                          "do not divide it by world_size")  # fmt: skip
    if all(_close(o, WORLD * ref) for o in outs):
        raise CheckFailed(f"{what}: the output is {WORLD}× the attention's: every rank computed every head and the "
                          f"all-reduce added {WORLD} copies — each rank uses only its slices: {slices}")  # fmt: skip
    slips = {
        "non_causal": "every query attends to every key: hide the keys after each query (a lower-triangular mask "
        "of the T×T scores, -inf above the diagonal)",
        "unscaled": f"the scores q·kᵀ are not scaled: divide them by sqrt(d) = sqrt({d})",
        "repeat": "query head h reads K/V head h // group (a group's query heads are consecutive): "
        "k.repeat_interleave(group, dim) gives that; .repeat(...) pairs head h with K/V head h % kv_heads",
        "no_rope": "no RoPE: rotate every query and key head by its row's position before the scores (each rank "
        "rotates its own heads; RoPE acts on each head alone)",
        "adjacent_pairs": "your RoPE rotates pairs (0,1), (2,3), ...; this model (Llama) pairs dimension i with "
        "i + d/2: rotate_half(z) = cat(-z[..., d/2:], z[..., :d/2])",
        "values_too": "you rotated the values too: RoPE turns queries and keys only (the scores see positions; "
        "the values are what is averaged)",
        "queries_only": "you rotated the queries but not the keys: both, by their own rows' positions",
        "positions_ignored": f"RoPE used the row numbers 0..T-1, not positions {positions.tolist()}: turn row t by "
        "positions[t]",
        "inverted_freq": "the frequencies are inverted: pair i turns by position × rope_theta^(-2i/d) — the first "
        "pair fastest, the last slowest",
        "reversed_turn": "your RoPE turns the other way: rotate_half(z) = cat(-z[..., d/2:], z[..., :d/2]) — the "
        "second half negated and moved first — then z·cos + rotate_half(z)·sin",
    }
    for slip, words in slips.items():
        if all(_close(o, sharded(*case, slip=slip)) for o in outs):
            raise CheckFailed(f"{what}: {words}")
    error = max(float((o - ref).abs().max()) for o in outs)
    raise CheckFailed(
        f"{what}: after the all-reduce the output differs from one-process attention by up to {error:.3g}: each "
        f"rank must take whole groups — {slices} — and its query head j reads its K/V head j // group"
    )


def try_on_ranks(tp_attention, seed: int = 0) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Run ``tp_attention`` on two ranks over a small hand-made layer (8 query heads over 4 K/V
    heads, hidden size 40, 6 tokens at positions 0-5, rope_theta 10000): each rank's output, and the
    one-process attention's."""
    case = _case(seed, 40, 8, 4, 8, list(range(TOKENS)), 10000.0)
    results = run_on_ranks(_rank, WORLD, source_of(tp_attention, "tp_attention"), tp_attention.__name__, [case])
    outs = [None if r[0]["out"] is None else torch.from_numpy(r[0]["out"]) for r in results]
    return outs, attention(*case)


@check
def check_tp_attention(tp_attention) -> str:
    """``tp_attention(x, positions, wq, wk, wv, wo, num_heads, num_kv_heads, rope_theta, rank, world_size)
    -> [T, H]``."""
    source = source_of(tp_attention, "tp_attention")
    cases = [
        ("8 query heads over 4 K/V heads, positions 0-5 (2 ranks)", _case(11, 40, 8, 4, 8, [0, 1, 2, 3, 4, 5], 1e4)),
        ("6 query heads over 2 K/V heads, groups of 3, positions 3 4 5 7 8 9 (2 ranks)",
         _case(12, 40, 6, 2, 8, [3, 4, 5, 7, 8, 9], 100.0)),
        (f"{MODEL}'s first attention layer (2 ranks)", _model_case()),
    ]
    hints = {
        "shape": "wq, wk and wv are [heads × dim, H]: a rank keeps rows of them; wo is [H, heads × dim]: it keeps "
        "the matching columns, wo[:, lo:hi]",
        "invalid for input of size": "split the heads, not the hidden size: num_heads // world_size query heads and "
        "num_kv_heads // world_size K/V heads per rank, each of dim = wq.shape[0] // num_heads",
    }
    per_rank = run_on_ranks(_rank, WORLD, source, tp_attention.__name__, [c for _, c in cases], hints=hints)
    for k, (what, case) in enumerate(cases):
        _diagnose(what, case, [per_rank[r][k] for r in range(WORLD)])
    return (
        f"both ranks returned causal GQA attention with RoPE from half of the heads each and one all-reduce of the "
        f"[T, H] output — on hand-made weights (positions with a gap) and on {MODEL}'s first layer "
        f"({cases[-1][1][2].shape[0] // cases[-1][1][6]}-dim heads)"
    )
