"""The check of chapter 02's rotary-position exercise: ``rope_tables``.

Why RoPE belongs to the KV-cache chapter: a cached key was rotated by *its own* position's angle
when it was written, and it is never touched again. That is only right because a rotation by
``m·θ`` of the query and by ``n·θ`` of the key leave ``q·k`` depending on ``m - n`` alone — and
it is why every decode step must be told its token's absolute position: the query is rotated
by the row of the table that position names.

The check goes from the contract to the engine: the tables' type, dtype and shape on a small
hand-made case (``P`` rows of ``D`` columns, chosen so that every axis mistake has its own
shape), then the mistakes a learner makes recomputed and named (cos and sin swapped, the
interleaved pairing, positions from 1, ...), then the properties RoPE needs (no rotation at
position 0, a rotation keeps lengths, ``i`` pairs with ``i + D/2``, ``q·k`` depends on the
distance only), then the values; last, an engine on the tiny model is built with the learner's
tables (the hook ``rope_tables``) and must generate the package's greedy tokens with its
contiguous KV cache — the very tokens the no-cache engine produces.
"""

from __future__ import annotations

import functools

import torch

import minillm.hooks as hooks
from minillm.course.checks.common import DEFAULT_MODEL, PROMPT, STEPS
from minillm.course.compare import compare_tensors, compare_tokens
from minillm.course.results import CheckError, CheckFailed, check
from minillm.models.rope import rotate_half

#: The hand-made case: 4 frequencies (head_dim 8) of base 100, not the usual 10000, so that a
#: function that ignores ``inv_freq`` and recomputes its own is seen; 7 positions, so that
#: [P, D/2], [D/2, 2P], [2P, D/2], [P±1, D] and [D, P] are all different shapes.
_D, _P = 8, 7
_INV_FREQ = 1.0 / (100.0 ** (torch.arange(0, _D, 2, dtype=torch.float64) / _D))
_ATOL = 1e-5


def _tables(angles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of ``angles[P, D/2]`` in the rotate_half layout, computed in float64."""
    both = torch.cat([angles, angles], dim=-1)
    return both.cos(), both.sin()


def _close(got: torch.Tensor, expected: torch.Tensor) -> bool:
    return got.shape == expected.shape and bool(torch.allclose(got.double(), expected.double(), atol=1e-4))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The textbook rotation the model applies: ``x·cos + rotate_half(x)·sin``."""
    return x * cos + rotate_half(x) * sin


def _diagnose_shape(shape: tuple, p: int, d: int) -> None:
    half = d // 2
    expected = (p, d)
    if shape == expected:
        return
    why = {
        (p, half): "it has one column per frequency: each angle turns two dimensions, i and i + D/2, so write the "
        "angles twice along the row, torch.cat([angles, angles], dim=-1)",
        (half, 2 * p): "positions run along the columns: rows are positions, torch.outer(positions, inv_freq) "
        "(not outer(inv_freq, positions))",
        (d, p): "positions run along the columns: rows are positions (transpose it back, or build it as "
        "outer(positions, inv_freq))",
        (2 * p, half): "the angles were written twice along the positions (dim 0): write them twice along the "
        "last dimension, torch.cat([angles, angles], dim=-1)",
        (p - 1, d): "one row short: positions are 0 .. max_positions-1, torch.arange(max_positions)",
        (p + 1, d): "one row too many: positions are 0 .. max_positions-1, torch.arange(max_positions)",
        ((p + 1) // 2, d): "every other position only: torch.arange(max_positions) counts every position (the "
        "step 2 belongs to the frequencies' arange(0, D, 2))",
    }.get(shape, "one row per position 0 .. max_positions-1 and D = 2·len(inv_freq) columns")
    raise CheckFailed(
        f"rope_tables(inv_freq[{half}], max_positions={p}) returned tables of shape {shape}, expected {expected}: {why}"
    )


def _diagnose_values(cos: torch.Tensor, sin: torch.Tensor, inv_freq: torch.Tensor, p: int) -> None:
    """Name the mistake whose tables the learner's equal: each recomputed as that mistake would."""
    positions = torch.arange(p, dtype=torch.float64)
    angles = torch.outer(positions, inv_freq)
    ref_cos, ref_sin = _tables(angles)
    if _close(cos, ref_cos) and _close(sin, ref_sin):
        return
    if _close(cos, ref_sin) and _close(sin, ref_cos):
        raise CheckFailed("the two tables are swapped: return (cos, sin), the cosines first")
    inter = angles.repeat_interleave(2, dim=-1)
    if _close(cos, inter.cos()) and _close(sin, inter.sin()):
        raise CheckFailed(
            "your tables pair neighbouring dimensions (2i, 2i+1) — the interleaved layout of the RoPE paper and "
            "of GGML files. This engine loads Hugging Face checkpoints, whose rotate_half pairs dimension i with "
            "i + D/2: write the D/2 angles twice one after the other, torch.cat([angles, angles], dim=-1)"
        )
    if all(_close(g, e) for g, e in zip((cos, sin), _tables(torch.outer(positions + 1, inv_freq)))):
        raise CheckFailed(
            "row p of your tables holds position p+1's angles: positions start at 0 (row 0 is no rotation at "
            "all). Shifting every position changes no q·k — only distances count — but the engine reads row p "
            "for the token at position p: torch.arange(max_positions)"
        )
    if all(_close(g, e) for g, e in zip((cos, sin), _tables(positions[:, None] / inv_freq))):
        raise CheckFailed(
            "your angles are position / inv_freq: inv_freq is already a frequency (radians per position), so "
            "the angle is position * inv_freq"
        )
    if all(_close(g, e) for g, e in zip((cos, sin), _tables(angles * (180 / torch.pi)))):
        raise CheckFailed(
            "your angles are in degrees (× 180/π): torch.cos and torch.sin take radians, and p * inv_freq[i] "
            "already is one"
        )
    if all(_close(g, e) for g, e in zip((cos, sin), _tables(inv_freq.expand(p, -1)))):
        raise CheckFailed(
            "every row of your tables holds the same angles, inv_freq itself: the angle grows with the position, "
            "row p holds p * inv_freq"
        )
    flat = torch.cat([angles, angles], dim=-1)
    if _close(cos, flat):
        raise CheckFailed("the cos table holds the angles themselves: return their cosines, angles.cos()")
    if _close(sin, flat):
        raise CheckFailed("the sin table holds the angles themselves: return their sines, angles.sin()")
    half = inv_freq.shape[0]
    if _close(cos, ref_cos) and _close(sin, torch.cat([-ref_sin[:, :half], ref_sin[:, half:]], dim=-1)):
        raise CheckFailed(
            "the first half of your sin table is negated: that is rotate_half's minus sign, which the engine "
            "folds into its own copy of the table. Return the plain sines, the same angle for i and i + D/2"
        )
    if _close(cos, ref_cos) and _close(sin, torch.cat([ref_sin[:, :half], -ref_sin[:, half:]], dim=-1)):
        raise CheckFailed(
            "the second half of your sin table is negated (-sin): the two dimensions of a pair turn by one "
            "angle, so both halves hold the same sines"
        )
    d = 2 * half
    theta_10000 = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    if all(_close(g, e) for g, e in zip((cos, sin), _tables(torch.outer(positions, theta_10000)))):
        raise CheckFailed(
            "your tables use inv_freq = 10000 ** (-2i/D), not the inv_freq they were given: the engine passes "
            "each model's own frequencies (its rope_theta, and the scaled ones of the linear and llama3 "
            "variants). Use the argument"
        )


def _check_properties(cos: torch.Tensor, sin: torch.Tensor, p: int, d: int) -> None:
    """What RoPE needs of any pair of tables, each named: the catch-all after the named mistakes."""
    cos64, sin64 = cos.double(), sin.double()
    if not (torch.allclose(cos64[0], torch.ones(d, dtype=torch.float64), atol=_ATOL) and sin64[0].abs().max() < _ATOL):
        raise CheckFailed(
            f"row 0 (position 0) should be no rotation, cos 1 and sin 0; yours holds cos {cos64[0].tolist()} and "
            f"sin {sin64[0].tolist()}. Row p is position p, and positions start at 0"
        )
    unit = cos64**2 + sin64**2
    if not torch.allclose(unit, torch.ones_like(unit), atol=1e-4):
        where = tuple(int(i) for i in torch.nonzero((unit - 1).abs() > 1e-4)[0])
        raise CheckFailed(
            f"cos² + sin² at {where} is {float(unit[where]):.5g}, not 1: a rotation keeps a vector's length, so "
            "the two tables must hold the cosine and the sine of one angle each (the same angle in both)"
        )
    half = d // 2
    for name, table in (("cos", cos64), ("sin", sin64)):
        if not torch.allclose(table[:, :half], table[:, half:], atol=_ATOL):
            raise CheckFailed(
                f"{name}[:, i] and {name}[:, i + {half}] differ: dimension i pairs with i + D/2 (rotate_half), and "
                "the two dimensions of a pair turn by the same angle"
            )
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(d, dtype=torch.float64, generator=gen), torch.randn(d, dtype=torch.float64, generator=gen)
    scores = _rotate(q, cos64, sin64) @ _rotate(k, cos64, sin64).T  # [P, P]: q at position m · k at position n
    for shift in range(1, p):
        moved, still = scores[shift:, shift:], scores[:-shift, :-shift]
        if not torch.allclose(moved, still, atol=1e-4):
            m, n = (int(i) for i in torch.nonzero((moved - still).abs() > 1e-4)[0])
            raise CheckFailed(
                f"with your tables q·k changes when both tokens move by {shift} (positions {m}, {n} give "
                f"{float(still[m, n]):.5g}, positions {m + shift}, {n + shift} give {float(moved[m, n]):.5g}): RoPE "
                "must make q·k depend on the distance only, which holds when row p turns pair i by p * inv_freq[i]"
            )


def _hand_made(rope_tables) -> None:
    given = _INV_FREQ.float()
    inv_freq = given.clone()
    got = rope_tables(inv_freq, _P)
    if not torch.equal(inv_freq, given):
        raise CheckFailed(
            "rope_tables changed inv_freq, the tensor it was given (an in-place op such as unsqueeze_, mul_ or "
            "+=): the engine computes inv_freq once per model, so compute into new tensors and leave it as it is"
        )
    if not isinstance(got, (tuple, list)) or len(got) != 2 or not all(isinstance(t, torch.Tensor) for t in got):
        what = type(got).__name__ if not isinstance(got, (tuple, list)) else f"{type(got).__name__} of {len(got)}"
        raise CheckFailed(f"rope_tables should return a pair of tensors (cos, sin), got {what}")
    cos, sin = got
    for name, table in (("cos", cos), ("sin", sin)):
        if table.dtype != torch.float32:
            raise CheckFailed(
                f"the {name} table has dtype {table.dtype}, expected torch.float32: the engine keeps its tables in "
                "float32 and casts the rows it looks up to the model's dtype (compute in float64 if you like, "
                "then .float())"
            )
        _diagnose_shape(tuple(table.shape), _P, _D)
    _diagnose_values(cos, sin, _INV_FREQ, _P)
    _check_properties(cos, sin, _P, _D)
    ref_cos, ref_sin = _tables(torch.outer(torch.arange(_P, dtype=torch.float64), _INV_FREQ))
    compare_tensors(cos, ref_cos.float(), f"cos from rope_tables(inv_freq[{_D // 2}], {_P})", atol=_ATOL)
    compare_tensors(sin, ref_sin.float(), f"sin from rope_tables(inv_freq[{_D // 2}], {_P})", atol=_ATOL)


@functools.lru_cache(maxsize=4)
def _reference_tokens(model: str) -> list[int]:
    """The package's greedy tokens, from the engine that recomputes everything (no KV cache)."""
    from minillm import LLM, SamplingParams

    llm = LLM(model, dtype="fp32", mode="naive", attention_backend="torch", seed=0)
    ids = llm.tokenizer.encode(PROMPT)
    return llm.generate([ids], SamplingParams(max_tokens=STEPS, ignore_eos=True))[0].token_ids


@check
def check_rope_tables(rope_tables, model: str = DEFAULT_MODEL) -> str:
    """``rope_tables(inv_freq, max_positions) -> (cos, sin)``: the rotary tables the model looks up."""
    from minillm import LLM, SamplingParams

    _hand_made(rope_tables)
    calls = []

    def recorded(inv_freq, max_positions):
        out = rope_tables(inv_freq, max_positions)
        calls.append((inv_freq.clone(), max_positions, out))
        return out

    with hooks.override(rope_tables=recorded):  # the model's tables are built once, as it loads
        llm = LLM(model, dtype="fp32", mode="contiguous", attention_backend="torch", seed=0)
    if len(calls) != 1:
        raise CheckError(f"the engine built its rotary tables {len(calls)} times, expected once")
    inv_freq, positions, (cos, sin) = calls[0]
    head_dim = 2 * inv_freq.shape[0]
    ref_cos, ref_sin = hooks.default("rope_tables")(inv_freq, positions)
    what = f"the engine's tables (head_dim {head_dim}, {positions} positions)"
    compare_tensors(cos, ref_cos, f"cos of {what}", atol=1e-4)
    compare_tensors(sin, ref_sin, f"sin of {what}", atol=1e-4)
    ids = llm.tokenizer.encode(PROMPT)
    got = llm.generate([ids], SamplingParams(max_tokens=STEPS, ignore_eos=True))[0].token_ids
    compare_tokens(
        got,
        _reference_tokens(model),
        "the engine rotating queries and keys with your tables",
        "each token's query and key are rotated by the row of its absolute position",
    )
    return (
        f"the model now rotates every query and key with your tables ({positions} positions × {head_dim}): with "
        f"its KV cache it generated the {STEPS} tokens the no-cache engine does"
    )
