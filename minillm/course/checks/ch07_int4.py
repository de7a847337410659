"""Chapter 07 (quantization): group-wise int4 weights, and two int4 values per byte."""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

import torch

import minillm.hooks as hooks
from minillm.course.checks.ch07_common import PROMPTS, QUANT_MODEL, STEPS, greedy_tokens, tensors_near
from minillm.course.compare import compare_tokens
from minillm.course.results import CheckFailed, check, learner_cause

# Exercise 2: group-wise asymmetric int4
# ---------------------------------------------------------------------------------------------

GRID_MODEL, GRID_LAYER = "smollm2-135m", "model.layers.10.mlp.down_proj.weight"  # the chapter's grid lesson


def _int4_test_weight() -> torch.Tensor:
    """64 output rows × 96 inputs, cut into groups of 32: three groups a row — not 32, so a
    reduction over the wrong axis changes the shape, and 64 rows, not 96, so a transposed weight
    does too."""
    gen = torch.Generator().manual_seed(11)
    w = torch.randn(64, 96, generator=gen) * 0.05
    w[2, :32] *= 0.02  # a quiet group next to ...
    w[2, 64:] *= 20  # ... a loud one in the same row: one range per row would leave the quiet one a level or two
    w[4, 32:64] = w[4, 32:64].abs() + 0.3  # far from zero: its minimum, not 0, is what maps to level 0
    w[7, :32] = -w[7, :32].abs() - 0.2  # negative weights only
    w[9, 32:64] = torch.randn(32, generator=gen) * 1e-6  # near-silent: a floor on the scale would flatten it
    w[13, 64:] = 0.37  # constant: max = min, nothing to divide by
    return w


def _int4_shape_mistake(label: str, name: str, shape: tuple, w: torch.Tensor, group_size: int) -> str | None:
    """What a wrong ``scale``/``minimum`` shape says about how the groups were cut, or None."""
    out, cols = w.shape
    groups = cols // group_size
    cut = f"reshape to [out, in // group_size, group_size] = [{out}, {groups}, {group_size}] and reduce the last axis"
    if shape == (out, groups, 1):
        return (
            f"{label}: {name} has shape {shape}: drop the kept dim (amin(-1) without keepdim) — shape ({out}, {groups})"
        )
    if shape in ((out,), (out, 1)):
        return (
            f"{label}: {name} has shape {shape}: one per row, not one per group of {group_size} — a row's loudest "
            f"group then sets the step of its quiet ones (row 2 of the test weight). {cut}"
        )
    if len(shape) < 2 and math.prod(shape) == 1:
        return f"{label}: {name} has shape {shape}: one for the whole matrix; int4 needs one per group. {cut}"
    if group_size != 32 and shape == (out, cols // 32):
        return (
            f"{label}: called with group_size={group_size}, {name} has {cols // 32} groups a row, groups of 32: use "
            "the group_size argument, not a fixed 32"
        )
    if shape == (out, group_size) and group_size != groups:
        return (
            f"{label}: {name} has shape {shape}, one per position *within* a group: either the reduction ran over the "
            f"groups axis, or the reshape made {group_size} groups of {groups} (reshape(out, group_size, -1)). {cut}"
        )
    if shape == (groups, out):
        return f"{label}: {name} has shape {shape}, [groups, out]: the engine wants [out, groups] = ({out}, {groups})"
    if shape == (out * groups,):
        return f"{label}: {name} has shape {shape}, flat: the engine wants one row per output row, ({out}, {groups})"
    if shape == (cols, out // group_size):
        return (
            f"{label}: {name} has shape {shape}: your groups run down the columns (consecutive *output* features, "
            f"as if the weight were [in, out]). W is [out, in] and a group is {group_size} consecutive *input* "
            f"weights of one row: {cut}"
        )
    if shape != (out, groups):
        return f"{label}: {name} has shape {shape}, expected ({out}, {groups}): one per row and group of {group_size}"
    return None


def _int4_ranges(w: torch.Tensor, group_size: int, consecutive: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Each group's exact (min, max), [out, groups] in float64; ``consecutive=False``: the groups a
    strided reshape makes (every groups-th weight of a row)."""
    out, cols = w.shape
    wd = w.double()
    if consecutive:
        grouped = wd.reshape(out, cols // group_size, group_size)
    else:
        grouped = wd.reshape(out, group_size, cols // group_size).transpose(1, 2)
    return grouped.amin(-1), grouped.amax(-1)


def _check_int4_scale(label: str, scale: torch.Tensor, low: torch.Tensor, hi: torch.Tensor, extra: str) -> None:
    """``scale`` must be (max - min) / 15 on every group that has a range, and positive on a
    constant one; ``low``, ``hi``: the exact ranges."""
    const = hi == low
    s = scale.double()
    if bool((~torch.isfinite(s)).any()):
        raise CheckFailed(f"{label}: scale holds NaN or inf — every group needs a finite scale")
    if bool((s[const] <= 0).any()):
        r, j = (int(i) for i in torch.nonzero(const & (s <= 0))[0])
        raise CheckFailed(
            f"{label}: group {j} of row {r} is constant (all its weights {float(low[r, j]):.4g}) and its scale is "
            f"{float(s[r, j]):.3g}: (w − min) / scale is then 0 / 0 = NaN, which becomes level 0 only by an accident "
            "of the float → uint8 conversion (its result is undefined). Keep a constant group's scale positive: a "
            "floor far below any real step, ((max − min) / 15).clamp(min=1e-12)"
        )
    ranged = ~const
    expected = (hi - low) / 15

    def near(candidate: torch.Tensor, where: torch.Tensor | None = None) -> bool:
        keep = ranged if where is None else ranged & where
        return tensors_near(s[keep], candidate[keep])

    if bool((s[ranged] < 0).any()) and near(-expected):
        raise CheckFailed(f"{label}: scale is negative, (min − max) / 15: the step is (max − min) / 15")
    for divisor, why in (
        (16, "16 levels have 15 steps between them: with / 16 the group's max maps to 15 × 16/15 and is clamped"),
        (255, "255 is int8's number of steps; int4 has 15"),
        (7, "7 is the top of *symmetric* int4 (−7..7); this format is asymmetric, levels 0..15"),
        (1, "then every weight of the group lands on level 0 or 1"),
    ):
        if near((hi - low) / divisor):
            raise CheckFailed(f"{label}: scale is (max − min) / {divisor} per group: {why}. Divide by 15")
    absmax = torch.maximum(hi.abs(), low.abs())
    if near(hi / 15, where=hi > 0) or near(absmax / 15) or near(absmax / 7):  # (a clamp may hide hi <= 0)
        raise CheckFailed(
            f"{label}: scale is computed from the group's largest value alone, not from its range: the format is "
            "asymmetric — the group's min maps to level 0 and its max to 15, so scale = (max − min) / 15 (group 1 of "
            "row 4 lies between 0.3 and 0.45: from 0 up its first levels would go unused)"
        )
    wrong = ranged & ~torch.isclose(s, expected, rtol=1e-4, atol=1e-15)
    if bool(wrong.any()) and bool((s[wrong] > expected[wrong]).all()) and bool((expected[wrong] < 1e-5).all()):
        r, j = (int(i) for i in torch.nonzero(wrong)[0])
        raise CheckFailed(
            f"{label}: group {j} of row {r}, whose weights span only {float(hi[r, j] - low[r, j]):.1e}, has scale "
            f"{float(s[r, j]):.3g}, expected (max − min) / 15 = {float(expected[r, j]):.3g}: a floor (or epsilon) "
            "on the scale that large puts the whole group on a level or two. Guard only against max = min, with a "
            "floor far below any real step (such as 1e-12)"
        )
    if bool(wrong.any()):
        r, j = (int(i) for i in torch.nonzero(wrong)[0])
        raise CheckFailed(
            f"{label}: group {j} of row {r} has scale {float(s[r, j]):.6g}, expected (max − min) / 15 = "
            f"{float(expected[r, j]):.6g}{extra}"
        )


def _check_int4_levels(label: str, q: torch.Tensor, w: torch.Tensor, scale, low, group_size: int, extra: str) -> None:
    """``q`` must be ``(w - minimum) / scale`` rounded to the nearest level (with the learner's own
    scale and minimum, already checked)."""
    out, cols = w.shape
    s = scale.double().repeat_interleave(group_size, dim=1)
    m = low.double().repeat_interleave(group_size, dim=1)
    exact = (w.double() - m) / s  # in [0, 15]
    qd = q.double()
    if bool((qd > 15).any()):
        r, c = (int(i) for i in torch.nonzero(qd > 15)[0])
        raise CheckFailed(f"{label}: q[{r}, {c}] = {int(q[r, c])}: 4 bits hold the levels 0..15 (clamp(0, 15))")
    if torch.equal(qd, (15 - exact).round().clamp(0, 15)):
        raise CheckFailed(
            f"{label}: every level is reversed, 15 − what it should be: the group's min maps to level 0 and its max "
            "to 15, q = round((w − min) / scale)"
        )
    if torch.equal(qd, (w.double() / s).round().clamp(0, 15)) or torch.equal(qd, (w.double() / s).clamp(0, 15).floor()):
        raise CheckFailed(
            f"{label}: q is round(w / scale): subtract the group's minimum first, q = round((w − min) / scale) — "
            "without it every negative weight is clamped to level 0"
        )
    diff = qd - exact
    near_level = diff.abs() <= 0.5 + 1e-3
    for sign, name in ((-1, "down (torch.floor — or a cast to uint8 without torch.round, which truncates)"),
                       (1, "up (torch.ceil)")):  # fmt: skip
        if bool((diff * sign >= -1e-4).all()) and bool((diff.abs() < 1 + 1e-3).all()) and not bool(near_level.all()):
            raise CheckFailed(
                f"{label}: q is (w − min) / scale rounded {name}: every weight moves the same way, by up to a whole "
                "step — round to the nearest level (torch.round), an error of at most half a step"
            )
    if not bool(near_level.all()):
        off = diff.abs()
        r, c = (int(i) for i in torch.nonzero(off == off.max())[0])
        raise CheckFailed(
            f"{label}: q[{r}, {c}] = {int(q[r, c])} but (w − min) / scale = {float(exact[r, c]):.3f} there "
            f"(group {c // group_size} of row {r}): q must be that rounded to the nearest level (torch.round)" + extra
        )


def _check_int4_values(fn, w: torch.Tensor, group_size: int, label: str) -> tuple[torch.Tensor, ...]:
    out, cols = w.shape
    given = w.clone()
    result = fn(given, group_size)
    if not torch.equal(given, w):
        raise CheckFailed(
            f"{label}: your function changed the weight it was given (an in-place operation such as w -= "
            "minimum or w.sub_(...)): the caller's weight must stay as it was — and weight.float() is no copy when "
            "the weight is already float32. Compute out of place: (w - minimum) / scale"
        )
    if isinstance(result, tuple) and len(result) == 2:
        raise CheckFailed(
            f"{label}: quantize_int4_groups returned 2 values: return (q, scale, minimum) — without each group's "
            "minimum (its zero point) the engine cannot dequantize, w ≈ q · scale + minimum"
        )
    if not isinstance(result, tuple) or len(result) != 3:
        raise CheckFailed(
            f"{label}: quantize_int4_groups should return a tuple (q, scale, minimum), got {result!r:.60}"
        )
    for part, name in zip(result, ("q", "scale", "minimum")):
        if not isinstance(part, torch.Tensor):
            raise CheckFailed(f"{label}: {name} should be a torch.Tensor, got {type(part).__name__}")
    q, scale, low = result
    if tuple(q.shape) != tuple(w.shape) and tuple(w.shape) in (tuple(scale.shape), tuple(low.shape)):
        raise CheckFailed(f"{label}: return (q, scale, minimum) in that order: q is the one shaped like the weight")
    if q.is_floating_point():
        raise CheckFailed(f"{label}: q is {q.dtype}: store the levels as torch.uint8 (.to(torch.uint8))")
    if q.dtype != torch.uint8:
        raise CheckFailed(
            f"{label}: q is {q.dtype}: the engine's int4 levels are unsigned, 0..15, held as torch.uint8 (what "
            "pack_int4 takes, two to a byte)"
        )
    for part, name in ((scale, "scale"), (low, "minimum")):
        mistake = _int4_shape_mistake(label, name, tuple(part.shape), w, group_size)
        if mistake:
            raise CheckFailed(mistake)
    if tuple(q.shape) != tuple(w.shape):
        raise CheckFailed(
            f"{label}: q has shape {tuple(q.shape)}, expected {tuple(w.shape)} (the weight's): reshape it back, "
            "q.reshape(out, in)"
        )
    for part, name in ((scale, "scale"), (low, "minimum")):
        if not part.is_floating_point():
            raise CheckFailed(f"{label}: {name} is {part.dtype}: it is a real number per group (float32)")
        if part.dtype != torch.float32:
            raise CheckFailed(
                f"{label}: {name} is {part.dtype}: compute in float32 (w = weight.float()) and return float32 — "
                f"{part.dtype} rounds the arithmetic itself, and many weights land on the wrong level"
            )
    low_x, hi_x = _int4_ranges(w, group_size)
    extra = f". With a {w.dtype} weight, compute in float32 (weight.float())" if w.dtype != torch.float32 else ""
    if tensors_near(scale, low_x) and tensors_near(low, (hi_x - low_x) / 15):
        raise CheckFailed(f"{label}: returned (q, minimum, scale): return them in the order (q, scale, minimum)")
    if tensors_near(low, _int4_ranges(w, group_size, consecutive=False)[0]) and not tensors_near(low, low_x):
        raise CheckFailed(
            f"{label}: your groups are strided, one weight in every {cols // group_size} of a row "
            f"(reshape(out, group_size, -1) reduced over axis 1): a group is {group_size} *consecutive* input weights, "
            "w.reshape(out, in // group_size, group_size) reduced over its last axis"
        )
    if tensors_near(low, hi_x) and not tensors_near(low, low_x):
        raise CheckFailed(
            f"{label}: minimum is each group's *max* (amin and amax swapped): the group's min maps to level 0"
        )
    if tensors_near(low, low_x.amin(dim=1, keepdim=True).expand_as(low_x)):
        raise CheckFailed(
            f"{label}: minimum is the whole row's min, repeated in every group: each group has its own, "
            "w.reshape(out, -1, group_size).amin(-1)"
        )
    if tensors_near(low, -8 * scale.double()):
        raise CheckFailed(
            f"{label}: minimum is −8 × scale: that is symmetric int4 (levels −7..7 shifted by 8), whose step is set "
            "by the group's largest magnitude. This format is asymmetric: each group's own min maps to level 0 and "
            "its max to 15 — minimum = the group's min, scale = (max − min) / 15"
        )
    if not bool(low.any()):
        raise CheckFailed(
            f"{label}: minimum is 0 everywhere: the zero point of this asymmetric format is each group's own min "
            "(group 1 of row 4 lies between 0.3 and 0.45 — from 0 up its first levels would go unused)"
        )
    if not tensors_near(low, low_x, rtol=1e-6):
        r, j = (int(i) for i in torch.nonzero(~torch.isclose(low.double(), low_x, rtol=1e-6, atol=1e-15))[0])
        raise CheckFailed(
            f"{label}: group {j} of row {r} has minimum {float(low[r, j]):.6g}, expected its smallest weight, "
            f"{float(low_x[r, j]):.6g}{extra}"
        )
    _check_int4_scale(label, scale, low_x, hi_x, extra)
    _check_int4_levels(label, q, w, scale, low, group_size, extra)
    return q, scale, low


def _relative_error(w: torch.Tensor, parts) -> float:
    from minillm.quantization.int4 import dequantize_int4

    q, scale, low = parts
    back = dequantize_int4(q, scale.float(), low.float())
    return float((back - w.float()).norm() / w.float().norm())


def _check_group_mismatch(quantize_int4_groups) -> None:
    """A group size that does not divide the input features is bad input: a ValueError naming it.
    (Without a check, reshape either raises about shapes, naming neither number, or — reshaping
    the whole matrix flat — makes groups that span two rows.)"""
    weight = torch.randn(4, 40, generator=torch.Generator().manual_seed(13))
    try:
        quantize_int4_groups(weight, 32)
    except Exception as err:
        raised = learner_cause(err) or err
        if not isinstance(raised, ValueError):
            raise CheckFailed(
                f"quantize_int4_groups on a [4, 40] weight in groups of 32 raised {type(raised).__name__}: {raised}. "
                "40 inputs do not split into groups of 32: check cols % group_size first and raise ValueError "
                "naming group_size and the input features"
            ) from None
        if "32" not in str(raised) or "40" not in str(raised):
            raise CheckFailed(
                f"quantize_int4_groups raised ValueError({str(raised)!r}) for groups of 32 over 40 inputs: name both "
                "numbers, so the caller sees which layer and which setting clash"
            ) from None
        return
    raise CheckFailed(
        "quantize_int4_groups quantized a [4, 40] weight in groups of 32 without complaint: 40 inputs do not split "
        "into groups of 32 (the last 8 belong to no group, or a group spans two rows) — raise ValueError naming "
        "group_size and the input features"
    )


@check
def check_quantize_int4(quantize_int4_groups, model: str = QUANT_MODEL) -> str:
    """``quantize_int4_groups(weight[out, in], group_size) -> (q uint8 [out, in], scale [out, groups],
    minimum [out, groups])``, ``w ≈ q * scale + minimum`` per group of consecutive input weights."""
    from safetensors import safe_open

    from minillm import LLM
    from minillm.assets import resolve_model
    from minillm.quantization.int4 import quantize_int4

    w = _int4_test_weight()
    _check_int4_values(quantize_int4_groups, w, 32, "quantize_int4_groups")
    _check_int4_values(quantize_int4_groups, w.to(torch.bfloat16), 32, "with a bfloat16 weight")
    wide = torch.randn(32, 128, generator=torch.Generator().manual_seed(12)) * 0.02
    _check_int4_values(quantize_int4_groups, wide, 64, "with group_size=64")

    # The chapter's grid: SmolLM2's checkpoint was dequantized from 4-bit groups of 32.
    with safe_open(str(resolve_model(GRID_MODEL) / "model.safetensors"), "pt") as f:
        grid = f.get_tensor(GRID_LAYER)
    errors = {}
    for group in (32, 64):
        errors[group] = yours, ours = (
            _relative_error(grid, quantize_int4_groups(grid, group)),
            _relative_error(grid, quantize_int4(grid, group)),
        )
        if yours > ours * 1.01 + 1e-6:
            raise CheckFailed(
                f"on SmolLM2's {GRID_LAYER} in groups of {group}, your int4 weights are {yours:.2%} off the original, "
                f"the package's {ours:.2%}: compare your levels with quantize_int4's"
            )

    calls = []

    def learner_quantize(weight, group_size):  # hook quantize_int4: what Int4Method.process_weights calls
        calls.append(group_size)
        return quantize_int4_groups(weight, group_size)

    with hooks.override(quantize_int4=learner_quantize):
        learner = LLM(model, dtype="bf16", quantization="int4")
    if not calls:
        raise RuntimeError("the engine's int4 layers no longer call hook quantize_int4")
    reference = LLM(model, dtype="bf16", quantization="int4")
    for n, (got, ref) in enumerate(zip(greedy_tokens(learner), greedy_tokens(reference))):
        compare_tokens(
            got, ref, f"prompt {n} on your int4 weights", "compare q, scale and minimum with quantize_int4's"
        )
    _check_group_mismatch(quantize_int4_groups)
    return (
        f"your quantizer ran on the {len(calls)} decoder linear layers of the {model.split('-')[-1].upper()} model "
        f"in groups of {calls[0]} ({learner.model.weight_bytes() / 1e6:.1f} MB of weights held): "
        f"{len(PROMPTS)}×{STEPS} greedy tokens identical to the package's int4 engine. On SmolLM2's layer-10 down_proj it finds the "
        f"checkpoint's grid again: {errors[32][0]:.2%} off in groups of 32, {errors[64][0]:.1%} in groups of 64"
    )


# ---------------------------------------------------------------------------------------------
# Exercise 3: two int4 values per byte
# ---------------------------------------------------------------------------------------------


def _reference_pack(q: torch.Tensor) -> torch.Tensor:
    return (q[..., 0::2] | (q[..., 1::2] << 4)).to(torch.uint8)


def _reference_unpack(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def _nibble_diagram(q: torch.Tensor, got: torch.Tensor, r: int, j: int) -> str:
    """Byte [r, j] in binary: the two values it packs, where the layout puts each (the even column
    in the low nibble, the odd one in the high nibble) and where the learner's byte has them."""
    first, second = int(q[r, 2 * j]), int(q[r, 2 * j + 1])
    spec, yours = first | (second << 4), int(got[r, j])
    return "\n".join(
        [
            f"values (q[{r}, {2 * j}], q[{r}, {2 * j + 1}]) = ({first}, {second})      byte = high nibble | low nibble",
            f"spec:  {spec >> 4:04b} | {spec & 0xF:04b}  = 0x{spec:02X}   (high = q[{r}, {2 * j + 1}], low = q[{r}, {2 * j}])",
            f"yours: {yours >> 4:04b} | {yours & 0xF:04b}  = 0x{yours:02X}",
        ]
    )


def _check_pack(pack_int4, q: torch.Tensor) -> None:
    out, cols = q.shape
    expected = _reference_pack(q)
    got = pack_int4(q.clone())
    if not isinstance(got, torch.Tensor):
        raise CheckFailed(f"pack_int4 should return a torch.Tensor, got {type(got).__name__}")
    if tuple(got.shape) == (out // 2, cols):
        raise CheckFailed(
            f"pack_int4 returned shape {tuple(got.shape)}: it paired neighbouring *rows*. Two neighbouring input "
            f"features (columns 2j and 2j+1 of a row) share a byte: [{out}, {cols}] → [{out}, {cols // 2}]"
        )
    if tuple(got.shape) != tuple(expected.shape) and got.numel() == expected.numel():
        if torch.equal(got.reshape(expected.shape).long(), expected.long()):
            raise CheckFailed(
                f"pack_int4 returned shape {tuple(got.shape)}: the right bytes, but not in q's rows — keep one row "
                f"per output row, [{out}, {cols}] → [{out}, {cols // 2}] (reshape(q.shape[0], -1))"
            )
    if tuple(got.shape) != tuple(expected.shape):
        raise CheckFailed(f"pack_int4 returned shape {tuple(got.shape)}, expected {tuple(expected.shape)}")
    if got.dtype != torch.uint8 and got.element_size() == 1 and not got.is_floating_point():
        raise CheckFailed(
            f"pack_int4 returned {got.dtype}: a packed byte is a torch.uint8 (.to(torch.uint8)). In a signed "
            "byte every value whose high nibble is 8 or more is negative, and unpacking it with >> 4 drags the sign "
            "bit in (-128 >> 4 is -8, not 8)"
        )
    if got.dtype != torch.uint8:
        raise CheckFailed(
            f"pack_int4 returned {got.dtype}: a packed byte is a torch.uint8 (.to(torch.uint8)); in "
            f"{got.dtype} each pair of values takes {got.element_size()} bytes and nothing is saved"
        )
    if torch.equal(got, expected):
        return
    r, j = (int(i) for i in torch.nonzero(got != expected)[0])  # the first wrong byte
    diagram = _nibble_diagram(q, got, r, j)
    g = got.long()
    if torch.equal(g, (q[:, 0::2].long() << 4) | q[:, 1::2].long()):
        raise CheckFailed(
            "pack_int4 puts the even column in the high nibble: the layout (the package's and its checkpoints') "
            "is low nibble first — byte j = q[:, 2j] | (q[:, 2j+1] << 4)",
            diagram=diagram,
        )
    if torch.equal(g, q[:, : cols // 2].long() | (q[:, cols // 2 :].long() << 4)):
        raise CheckFailed(
            f"pack_int4 pairs column j with column j + {cols // 2} (the two halves of a row): the layout pairs "
            "neighbours — byte j holds columns 2j (low nibble) and 2j+1 (high nibble): q[:, 0::2], q[:, 1::2]",
            diagram=diagram,
        )
    if torch.equal(g, ((q[:, 0::2].long() + q[:, 1::2].long()) << 4) & 0xFF):
        raise CheckFailed(
            "every byte's low nibble is 0: `a + b << 4` reads as `(a + b) << 4` — in Python, << binds more "
            "loosely than +. Put the shift in parentheses: q[:, 0::2] + (q[:, 1::2] << 4), or use | (which binds "
            "more loosely than <<)",
            diagram=diagram,
        )
    if torch.equal(g, q[:, 0::2].long()):
        raise CheckFailed(
            "every byte holds only its low nibble: the odd column's value was lost. Shifting a uint8 left by 8 "
            "pushes it out of the byte; a nibble is 4 bits: q[:, 1::2] << 4",
            diagram=diagram,
        )
    raise CheckFailed(
        f"packed byte [{r}, {j}] is {int(got[r, j])} (0b{int(got[r, j]):08b}), expected {int(expected[r, j])} "
        f"(0b{int(expected[r, j]):08b}): q[{r}, {2 * j}] = {int(q[r, 2 * j])} in the low 4 bits, "
        f"q[{r}, {2 * j + 1}] = {int(q[r, 2 * j + 1])} in the high 4",
        diagram=diagram,
    )


def _check_unpack(unpack_int4, q: torch.Tensor) -> None:
    out, cols = q.shape
    packed = _reference_pack(q)
    got = unpack_int4(packed.clone())
    if not isinstance(got, torch.Tensor):
        raise CheckFailed(f"unpack_int4 should return a torch.Tensor, got {type(got).__name__}")
    if tuple(got.shape) == (out * 2, cols // 2):
        raise CheckFailed(
            f"unpack_int4 returned shape {tuple(got.shape)}: the two values of a byte are neighbouring *columns* "
            f"of the same row: [{out}, {cols // 2}] → [{out}, {cols}]"
        )
    if tuple(got.shape) != tuple(q.shape):
        raise CheckFailed(f"unpack_int4 returned shape {tuple(got.shape)}, expected {tuple(q.shape)}")
    if got.dtype != torch.uint8:
        raise CheckFailed(
            f"unpack_int4 returned {got.dtype}: return the values 0..15 as torch.uint8, like quantize_int4's q "
            f"(a {got.dtype} copy of a large layer takes {got.element_size()}× the bytes)"
        )
    if torch.equal(got, q):
        return
    g = got.long()
    even, odd = g[:, 0::2], g[:, 1::2]
    if torch.equal(even, q[:, 1::2].long() << 4):
        raise CheckFailed(
            "the even columns came back as packed & 0xF0, the *high* nibble (16 × the odd column's value): the low "
            "nibble is packed & 0x0F — 0xF0 keeps the top 4 bits, 0x0F the bottom 4"
        )
    if torch.equal(even, q[:, 0::2].long()) and torch.equal(odd, q[:, 1::2].long() << 4):
        raise CheckFailed(
            "the odd columns came back 16× too large (0..240 in steps of 16): packed & 0xF0 picks the high nibble "
            "but leaves it in the top 4 bits — shift it down: packed >> 4"
        )
    if bool((g > 15).any()):
        raise CheckFailed(
            f"unpack_int4 returned values up to {int(g.max())}: the low nibble needs a mask — packed & 0xF — "
            "or the high nibble comes along with it"
        )
    if torch.equal(even, q[:, 1::2].long()) and torch.equal(odd, q[:, 0::2].long()):
        raise CheckFailed(
            "unpack_int4 swaps each pair: the low nibble (packed & 0xF) is the even column 2j, the high nibble "
            "(packed >> 4) the odd column 2j+1"
        )
    if torch.equal(even, q[:, 0::2].long()) and not bool(odd.any()):
        raise CheckFailed("every odd column came back 0: the high nibble is packed >> 4 (shifting by 8 empties a byte)")
    if torch.equal(g[:, : cols // 2], q[:, 0::2].long()) and torch.equal(g[:, cols // 2 :], q[:, 1::2].long()):
        raise CheckFailed(
            "unpack_int4 puts all low nibbles first and all high nibbles after them: interleave them — column 2j "
            "from byte j's low nibble, column 2j+1 from its high nibble (torch.stack([low, high], dim=-1), then "
            "reshape)"
        )
    r, c = (int(i) for i in torch.nonzero(got != q)[0])
    raise CheckFailed(
        f"unpack_int4 gives {int(got[r, c])} at [{r}, {c}], expected {int(q[r, c])} (from byte [{r}, {c // 2}] = "
        f"{int(packed[r, c // 2])}, its {'low' if c % 2 == 0 else 'high'} nibble)"
    )


@check
def check_pack_int4(pack_int4, unpack_int4, model: str = QUANT_MODEL) -> str:
    """``pack_int4(q uint8 [out, in]) -> uint8 [out, in/2]`` (low nibble first) and its inverse."""
    from minillm import LLM
    from minillm.assets import resolve_model
    from minillm.models import load_model
    from minillm.quantization import checkpoint as ckpt

    gen = torch.Generator().manual_seed(3)
    q = torch.randint(0, 16, (6, 10), dtype=torch.uint8, generator=gen)
    q[0, :4] = torch.tensor([1, 2, 15, 0], dtype=torch.uint8)
    q[1, :2] = torch.tensor([15, 15], dtype=torch.uint8)
    _check_pack(pack_int4, q)
    _check_unpack(unpack_int4, q)
    big = torch.randint(0, 16, (32, 128), dtype=torch.uint8, generator=gen)
    _check_pack(pack_int4, big)
    round_trip = unpack_int4(pack_int4(big.clone()))
    if not isinstance(round_trip, torch.Tensor) or not torch.equal(round_trip, big):
        raise CheckFailed("unpack_int4(pack_int4(q)) is not q for a random 32×128 matrix")

    folder = resolve_model(model)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "int4"
        with hooks.override(pack_int4=pack_int4):  # write the checkpoint with your packing
            ckpt.save_quantized(load_model(folder, torch.bfloat16), folder, out, "int4", dtype="bf16")
        with hooks.override(unpack_int4=unpack_int4):  # and read it back with your unpacking
            learner = LLM(str(out), dtype="bf16")
        size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    reference = LLM(model, dtype="bf16", quantization="int4")
    for n, (got, ref) in enumerate(zip(greedy_tokens(learner), greedy_tokens(reference))):
        compare_tokens(got, ref, f"prompt {n} on the checkpoint you packed", "compare pack/unpack with the layout")
    full = (folder / "model.safetensors").stat().st_size
    return (
        f"an int4 checkpoint of the {model.split('-')[-1].upper()} model written with your pack_int4 and read back "
        f"with your unpack_int4 ({size / 1e6:.1f} MB on disk, the bf16 original {full / 1e6:.1f} MB) generates "
        f"{len(PROMPTS)}×{STEPS} greedy tokens identical to the package's int4 engine"
    )


# ---------------------------------------------------------------------------------------------
