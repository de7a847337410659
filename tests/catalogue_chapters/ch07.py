"""Chapter 07: more wrong answers a learner writes (see ``check_catalogue``)."""

from __future__ import annotations

import torch
from check_catalogue import right, wrong  # noqa: F401

# ---- quantize_per_channel --------------------------------------------------------------------

CH = "check_quantize_per_channel"


def quantize_in_weight_dtype(weight):
    """No .float(): fine on a float32 weight, but a bf16 one is quantized in bf16 (bf16 scales too)."""
    scale = weight.abs().amax(dim=1) / 127
    return torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


def quantize_scale_rounded_in_bf16(weight):
    """The scale computed in the weight's dtype, then cast: float32 in name only."""
    scale = (weight.abs().amax(dim=1) / 127).float()
    return torch.round(weight.float() / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


def quantize_in_place(weight):
    w = weight.float()  # the same tensor when the weight is already float32
    scale = w.abs().amax(dim=1) / 127
    w /= scale[:, None]
    return w.round_().clamp_(-127, 127).to(torch.int8), scale


def quantize_floor(weight):
    w = weight.float()
    scale = w.abs().amax(dim=1) / 127
    return torch.floor(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


def quantize_uint8(weight):
    w = weight.float()
    scale = w.abs().amax(dim=1) / 127
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.uint8), scale


def quantize_returns_scale_first(weight):
    w = weight.float()
    scale = w.abs().amax(dim=1) / 127
    return scale, torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)


def quantize_inverse_scale(weight):
    """The multiplier that maps w onto the levels, returned in place of the scale that maps back."""
    w = weight.float()
    inv = 127 / w.abs().amax(dim=1)
    return torch.round(w * inv[:, None]).clamp(-127, 127).to(torch.int8), inv


wrong(CH, "with a torch.bfloat16 weight, scale is torch.bfloat16", quantize_in_weight_dtype)
wrong(CH, "With a torch.bfloat16 weight, compute in float32", quantize_scale_rounded_in_bf16)
wrong(CH, "changed the weight it was given", quantize_in_place)
wrong(CH, "rounded down (torch.floor)", quantize_floor)
wrong(CH, "q is torch.uint8, an unsigned byte", quantize_uint8)
wrong(CH, "returned (scale, q)", quantize_returns_scale_first)
wrong(CH, "127 / max|w| per row, the inverse", quantize_inverse_scale)

# ---- pack_int4 / unpack_int4 -----------------------------------------------------------------

CP = "check_pack_int4"


def pack_plus_precedence(q):
    return q[:, 0::2] + q[:, 1::2] << 4  # (a + b) << 4: << binds more loosely than +


def pack_signed(q):
    return (q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.int8)


def pack_flat(q):
    pairs = q.reshape(-1, 2)  # every pair of the matrix, the rows forgotten
    return (pairs[:, 0] | (pairs[:, 1] << 4)).to(torch.uint8)


def unpack(p, low, high):
    return torch.stack([low(p), high(p)], dim=-1).reshape(p.shape[0], -1)


def _pack_int4(q):
    return (q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8)


wrong(
    CP,
    "`a + b << 4` reads as `(a + b) << 4`",
    pack_plus_precedence,
    lambda p: unpack(p, lambda p: p & 0xF, lambda p: p >> 4),
)
wrong(CP, "pack_int4 returned torch.int8: a packed byte is a torch.uint8", pack_signed, lambda p: p)
wrong(CP, "the right bytes, but not in q's rows", pack_flat, lambda p: p)
wrong(CP, "the low nibble is packed & 0x0F", _pack_int4, lambda p: unpack(p, lambda p: p & 0xF0, lambda p: p >> 4))
wrong(CP, "shift it down: packed >> 4", _pack_int4, lambda p: unpack(p, lambda p: p & 0xF, lambda p: p & 0xF0))

# ---- quantize_int4_groups ----------------------------------------------------------------------

CI = "check_quantize_int4"


def int4_group_by_group(weight, group_size):
    """Independent: one column of groups at a time in a Python loop (every row at once); a
    constant group gets scale 1. (Row by row too, it took 40 s over the model's layers.)"""
    if weight.shape[1] % group_size:
        raise ValueError(f"group_size {group_size} does not divide {weight.shape[1]} input features")
    out, cols = weight.shape
    q = torch.empty(out, cols, dtype=torch.uint8)
    scales = torch.empty(out, cols // group_size)
    minima = torch.empty(out, cols // group_size)
    for j in range(cols // group_size):
        block = weight[:, j * group_size : (j + 1) * group_size].to(torch.float32)
        lo, hi = block.min(dim=1).values, block.max(dim=1).values
        s = torch.where(hi > lo, (hi - lo) / 15, torch.tensor(1.0))
        q[:, j * group_size : (j + 1) * group_size] = torch.round((block - lo[:, None]) / s[:, None]).to(torch.uint8)
        scales[:, j], minima[:, j] = s, lo
    return q, scales, minima


def int4_aminmax_where(weight, group_size):
    """Independent: unflatten + aminmax, the guard as a where, rounding as floor(x + 0.5)."""
    if weight.shape[1] % group_size:
        raise ValueError(f"group_size {group_size} does not divide {weight.shape[1]} input features")
    w = weight.to(torch.float32).unflatten(1, (-1, group_size))
    lo, hi = torch.aminmax(w, dim=2)
    scale = torch.where(hi > lo, (hi - lo) / 15.0, torch.ones_like(lo))
    q = torch.floor((w - lo.unsqueeze(2)) / scale.unsqueeze(2) + 0.5).clamp(0, 15)
    return q.flatten(1).to(torch.uint8), scale, lo


def int4_in_float64(weight, group_size):
    """Independent: the arithmetic in float64, the guard by adding 1 where the range is 0."""
    if weight.shape[1] % group_size:
        raise ValueError(f"group_size {group_size} does not divide {weight.shape[1]} input features")
    w = weight.double().view(weight.shape[0], weight.shape[1] // group_size, group_size)
    lo = w.min(dim=-1, keepdim=True).values
    span = w.max(dim=-1, keepdim=True).values - lo
    scale = (span + (span == 0)) / 15
    q = ((w - lo) / scale).round().clamp(0, 15).to(torch.uint8).view(weight.shape)
    return q, scale.squeeze(-1).float(), lo.squeeze(-1).float()


def _int4(weight, group_size, *, upcast=True, reduce_dim=-1, divisor=15, floor=1e-12, rounding=torch.round,
          subtract=True, swap_minmax=False, keepdim=False, reshape_back=True, q_dtype=torch.uint8, strided=False,
          scale_from_max=False, no_divisibility_check=False):  # fmt: skip
    """The solution with one mistake switched on."""
    if weight.shape[1] % group_size and not no_divisibility_check:
        raise ValueError(f"int4: group_size={group_size} does not divide the {weight.shape[1]} input features")
    w = weight.float() if upcast else weight
    out, cols = w.shape
    g = w.reshape(out, group_size, cols // group_size).transpose(1, 2) if strided else w.reshape(out, -1, group_size)
    low, high = g.amin(reduce_dim), g.amax(reduce_dim)
    if swap_minmax:
        low, high = high, low
    scale = ((high if scale_from_max else high - low) / divisor).clamp(min=floor)
    if reduce_dim != -1:  # the ranges broadcast only if they are put back where the groups are
        low_b, scale_b = low.unsqueeze(reduce_dim), scale.unsqueeze(reduce_dim)
    else:
        low_b, scale_b = low[..., None], scale[..., None]
    q = rounding(((g - low_b) if subtract else g) / scale_b).clamp(0, 15).to(q_dtype)
    if strided:
        q = q.transpose(1, 2)
    if reshape_back:
        q = q.reshape(out, cols)
    if keepdim:
        scale, low = scale[..., None], low[..., None]
    return q, scale, low


def int4_no_guard(weight, group_size):
    w = weight.float().reshape(weight.shape[0], -1, group_size)
    low = w.amin(-1)
    scale = (w.amax(-1) - low) / 15
    return (
        torch.round((w - low[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8).reshape(weight.shape),
        scale,
        low,
    )


def int4_along_outputs(weight, group_size):
    """Takes W as [in, out]: groups of consecutive rows of a column."""
    return _int4(weight.t().contiguous(), group_size)


def int4_per_row(weight, group_size):
    """group_size ignored: one range per row."""
    return _int4(weight, weight.shape[1])[0], *(t[:, 0] for t in _int4(weight, weight.shape[1])[1:])


def int4_fixed_32(weight, group_size):
    return _int4(weight, 32)


def int4_in_place(weight, group_size):
    w = weight.float()  # the same tensor when the weight is already float32
    groups = w.view(w.shape[0], -1, group_size)
    low = groups.amin(-1)
    scale = ((groups.amax(-1) - low) / 15).clamp(min=1e-12)
    groups -= low[..., None]
    return torch.round(groups / scale[..., None]).clamp(0, 15).to(torch.uint8).reshape(weight.shape), scale, low


def int4_symmetric(weight, group_size):
    """Symmetric int4 shifted by 8: a zero point of -8 scales, not the group's min."""
    w = weight.float().reshape(weight.shape[0], -1, group_size)
    scale = w.abs().amax(-1) / 7
    q = (torch.round(w / scale[..., None]) + 8).clamp(0, 15).to(torch.uint8)
    return q.reshape(weight.shape), scale, -8 * scale


def int4_bf16_scale(weight, group_size):
    """The ranges in the weight's dtype, cast to float32 at the end."""
    g = weight.reshape(weight.shape[0], -1, group_size)
    low = g.amin(-1)
    scale = ((g.amax(-1) - low) / 15).clamp(min=1e-12)
    q = torch.round((g.float() - low.float()[..., None]) / scale.float()[..., None]).clamp(0, 15)
    return q.to(torch.uint8).reshape(weight.shape), scale.float(), low.float()


right(CI, int4_group_by_group)
right(CI, int4_aminmax_where)
right(CI, int4_in_float64)
wrong(CI, "rounded down (torch.floor", lambda w, g: _int4(w, g, rounding=torch.floor))
wrong(CI, "a cast to uint8 without torch.round", lambda w, g: _int4(w, g, rounding=lambda t: t))
wrong(CI, "rounded up (torch.ceil)", lambda w, g: _int4(w, g, rounding=torch.ceil))
wrong(CI, "(max − min) / 16 per group", lambda w, g: _int4(w, g, divisor=16))
wrong(CI, "(max − min) / 255 per group", lambda w, g: _int4(w, g, divisor=255))
wrong(CI, "is constant (all its weights 0.37) and its scale is 0", int4_no_guard)
wrong(CI, "a floor (or epsilon)", lambda w, g: _int4(w, g, floor=1e-4))
wrong(CI, "your groups are strided", lambda w, g: _int4(w, g, strided=True))
wrong(CI, "your groups run down the columns", int4_along_outputs)
wrong(CI, "one per row, not one per group of 32", int4_per_row)
wrong(CI, "not a fixed 32", int4_fixed_32)
wrong(CI, "one per position *within* a group", lambda w, g: _int4(w, g, reduce_dim=1))
wrong(CI, "changed the weight it was given", int4_in_place)
wrong(CI, "that is symmetric int4", int4_symmetric)
wrong(CI, "minimum is each group's *max*", lambda w, g: _int4(w, g, swap_minmax=True))
wrong(CI, "from the group's largest value alone", lambda w, g: _int4(w, g, scale_from_max=True))
wrong(CI, "q is round(w / scale): subtract the group's minimum", lambda w, g: _int4(w, g, subtract=False))
wrong(CI, "scale is torch.bfloat16: compute in float32", lambda w, g: _int4(w, g, upcast=False))
wrong(CI, "With a torch.bfloat16 weight, compute in float32", int4_bf16_scale)
wrong(CI, "drop the kept dim", lambda w, g: _int4(w, g, keepdim=True))
wrong(CI, "reshape it back", lambda w, g: _int4(w, g, reshape_back=False))
wrong(CI, "q is torch.int8: the engine's int4 levels are unsigned", lambda w, g: _int4(w, g, q_dtype=torch.int8))
wrong(CI, "returned (q, minimum, scale)", lambda w, g: (lambda q, s, m: (q, m, s))(*_int4(w, g)))
wrong(CI, "returned 2 values", lambda w, g: _int4(w, g)[:2])
wrong(CI, "raised RuntimeError", lambda w, g: _int4(w, g, no_divisibility_check=True))


def int4_vague_error(weight, group_size):
    if weight.shape[1] % group_size:
        raise ValueError("bad group size")  # names neither number
    return _int4(weight, group_size)


wrong(CI, "name both numbers", int4_vague_error)
