"""Chapter 07, quantization: the answers its exercises' checks are tested against (see
``catalogue/__init__.py``)."""

from __future__ import annotations

import torch

from catalogue.answers import Answers

ANSWERS = Answers()
right, wrong = ANSWERS.right, ANSWERS.wrong


# ---- 07: quantization -------------------------------------------------------------------------


def quantize_per_channel(weight):
    w = weight.float()
    scale = w.abs().amax(dim=1) / 127
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def quantize_rows_loop(weight):
    """Independent: one row at a time, the magnitude as max(max, -min)."""
    qs, scales = [], []
    for row in weight.to(torch.float32):
        s = torch.maximum(row.max(), -row.min()) / 127.0
        qs.append(torch.clamp(torch.round(row / s), min=-127, max=127).to(torch.int8))
        scales.append(s)
    return torch.stack(qs), torch.stack(scales)


def quantize_floor_half(weight):
    """Independent: the infinity norm with keepdim, rounding as floor(x + 0.5)."""
    w = weight.double()
    s = torch.linalg.vector_norm(w, ord=float("inf"), dim=1, keepdim=True) / 127
    q = torch.floor(w / s + 0.5).clamp(-127, 127).to(torch.int8)
    return q, s.squeeze(1).float()


def _int8_variant(weight, reduce=lambda w: w.abs().amax(dim=1), divisor=127, keepdim=False, rounding=torch.round,
                  clamp=True, cast=True, transpose=False, upcast=True):  # fmt: skip
    w = weight.float() if upcast else weight  # without it a bf16 weight is quantized in bf16
    s = reduce(w) / divisor
    expand = s if s.dim() == 0 else (s[None, :] if transpose else s[:, None])
    q = rounding(w / expand)
    if clamp:
        q = q.clamp(-127, 127)
    if cast:
        q = q.to(torch.int8)
    return q, (s[:, None] if keepdim else s)


CH = "check_quantize_per_channel"
right(CH, quantize_per_channel)
right(CH, quantize_rows_loop)
right(CH, quantize_floor_half)
wrong(CH, "per-tensor", lambda w: _int8_variant(w, reduce=lambda w: w.abs().max()))
wrong(CH, "every row has the same scale", lambda w: _int8_variant(w, reduce=lambda w: w.abs().max().expand(w.shape[0])))
wrong(CH, "largest *value*", lambda w: _int8_variant(w, reduce=lambda w: w.amax(dim=1)))
wrong(CH, "max|w| / 128", lambda w: _int8_variant(w, divisor=128))
wrong(CH, "wrapped around", lambda w: _int8_variant(w, divisor=128, clamp=False))
wrong(CH, "max|w| / 255", lambda w: _int8_variant(w, divisor=255))
wrong(CH, "truncated toward zero", lambda w: _int8_variant(w, rounding=lambda t: t))
wrong(CH, "one per input column", lambda w: _int8_variant(w, reduce=lambda w: w.abs().amax(dim=0), transpose=True))
wrong(CH, "q is torch.float32", lambda w: _int8_variant(w, cast=False))
wrong(CH, "shape (48, 1)", lambda w: _int8_variant(w, keepdim=True))
wrong(CH, "scale is torch.bfloat16: compute in float32", lambda w: _int8_variant(w, upcast=False))


def pack_int4(q):
    return (q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8)


def unpack_int4(packed):
    low, high = packed & 0xF, packed >> 4
    return torch.stack([low, high], dim=-1).reshape(packed.shape[0], -1)


def pack_int4_arithmetic(q):
    """Independent: pairs as a trailing axis, base-16 arithmetic in int64."""
    pairs = q.reshape(q.shape[0], -1, 2).long()
    return (pairs[..., 0] + 16 * pairs[..., 1]).to(torch.uint8)


def unpack_int4_arithmetic(packed):
    out = torch.empty(packed.shape[0], 2 * packed.shape[1], dtype=torch.uint8)
    out[:, 0::2] = packed % 16
    out[:, 1::2] = packed // 16
    return out


CP = "check_pack_int4"
right(CP, pack_int4, unpack_int4)
right(CP, pack_int4_arithmetic, unpack_int4_arithmetic)
wrong(CP, "high nibble", lambda q: ((q[:, 0::2] << 4) | q[:, 1::2]).to(torch.uint8), unpack_int4)
wrong(CP, "two halves of a row", lambda q: q[:, : q.shape[1] // 2] | (q[:, q.shape[1] // 2 :] << 4), unpack_int4)
wrong(CP, "neighbouring *rows*", lambda q: (q[0::2] | (q[1::2] << 4)).to(torch.uint8), unpack_int4)
wrong(CP, "only its low nibble", lambda q: (q[:, 0::2] | (q[:, 1::2] << 8)).to(torch.uint8), unpack_int4)
wrong(CP, "pack_int4 returned torch.int64", lambda q: q[:, 0::2].long() | (q[:, 1::2].long() << 4), unpack_int4)
wrong(
    CP,
    "needs a mask",
    pack_int4,
    lambda p: torch.stack([p, p >> 4], dim=-1).reshape(p.shape[0], -1),
)
wrong(CP, "swaps each pair", pack_int4, lambda p: torch.stack([p >> 4, p & 0xF], dim=-1).reshape(p.shape[0], -1))
wrong(
    CP,
    "every odd column came back 0",
    pack_int4,
    lambda p: torch.stack([p & 0xF, p >> 8], dim=-1).reshape(p.shape[0], -1),
)
wrong(CP, "unpack_int4 returned torch.int64", pack_int4, lambda p: unpack_int4(p).long())
wrong(CP, "all low nibbles first", pack_int4, lambda p: torch.cat([p & 0xF, p >> 4], dim=-1))


def quantize_kv_on_write(x):
    scale = x.float().abs().amax(dim=-1) / 127
    q = torch.round(x.float() / scale[..., None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def quantize_kv_inf_norm(x):
    """Independent: the infinity norm with keepdim, squeezed at the end."""
    xf = x.to(torch.float32)
    s = torch.linalg.vector_norm(xf, ord=float("inf"), dim=-1, keepdim=True) / 127.0
    q = (xf / s).round().clamp(min=-127, max=127).to(torch.int8)
    return q, s.squeeze(-1)


def _kv_variant(x, reduce=lambda x: x.abs().amax(dim=-1), divisor=127, rounding=torch.round, cast=True,
                upcast=True, keepdim=False, scale_as_float=False):  # fmt: skip
    xf = x.float() if upcast else x
    s = reduce(xf) / divisor
    full = s.reshape(s.shape + (1,) * (3 - s.dim())) if s.dim() < 3 else s
    if s.dim() == 1 and s.shape[0] == x.shape[1] and s.shape[0] != x.shape[0]:  # one per head: [1, heads, 1]
        full = s[None, :, None]
    q = rounding(xf / full).clamp(-127, 127)
    if cast:
        q = q.to(torch.int8)
    if keepdim:
        s = s[..., None]
    return q, (s.float() if scale_as_float else s)


CK = "check_quantize_kv"
right(CK, quantize_kv_on_write)
right(CK, quantize_kv_inf_norm)
wrong(CK, "one scale per token", lambda x: _kv_variant(x, reduce=lambda x: x.abs().amax(dim=(1, 2))))
wrong(
    CK,
    "one scale per token",
    lambda x: _kv_variant(
        x, reduce=lambda x: x.abs().amax(dim=(1, 2), keepdim=True).squeeze(-1).expand(-1, x.shape[1])
    ),
)
wrong(CK, "per-tensor", lambda x: _kv_variant(x, reduce=lambda x: x.abs().max()))
wrong(CK, "one scale per head over all the tokens", lambda x: _kv_variant(x, reduce=lambda x: x.abs().amax(dim=(0, 2))))
wrong(CK, "max|x| / 255", lambda x: _kv_variant(x, divisor=255))
wrong(CK, "truncated toward zero", lambda x: _kv_variant(x, rounding=lambda t: t))
wrong(CK, "largest *value*", lambda x: _kv_variant(x, reduce=lambda x: x.amax(dim=-1)))
wrong(CK, "q is torch.float32", lambda x: _kv_variant(x, cast=False))
wrong(CK, "(6, 3, 1)", lambda x: _kv_variant(x, keepdim=True))
wrong(CK, "the pool stores float32 scales", lambda x: _kv_variant(x, upcast=False))
wrong(CK, "compute in float32", lambda x: _kv_variant(x, upcast=False, scale_as_float=True))
wrong(
    CK,
    "a floor (or epsilon) on max|x|",
    lambda x: _kv_variant(x, reduce=lambda x: x.abs().amax(dim=-1).clamp(min=1e-2)),
)
wrong(CK, "a floor (or epsilon) on max|x|", lambda x: _kv_variant(x, reduce=lambda x: x.abs().amax(dim=-1) + 1e-3))


# ---- ch07: more wrong answers a learner writes


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


# ---- Chapter 07's int4 linear layer (``check_int4_linear``): right answers written independently, and
# the wrong ones a learner writes, one slip each (``layer_class(...)``).


IL = "check_int4_linear"


def layer_class(**slip):
    class Int4Linear:
        def __init__(self, weight, group_size, bias=None):
            out, cols = weight.shape
            if slip.get("asserts"):
                assert cols % group_size == 0 and cols % 2 == 0, "bad shape"
            elif slip.get("groups_only"):
                if cols % group_size:
                    raise ValueError(f"in_features {cols} is not a multiple of group_size {group_size}")
            elif slip.get("vague_refusal"):
                if group_size < 1 or cols % group_size or cols % 2:
                    raise ValueError("this weight cannot be stored in int4")
            elif slip.get("refuses_one"):  # "a group of one is no group"
                if group_size <= 1 or cols % group_size or cols % 2:
                    raise ValueError(f"in_features {cols}: not whole groups of {group_size} (> 1), or odd")
            elif slip.get("zero_group"):  # the old refusal: a group of 0 reaches cols % 0
                if cols % group_size or cols % 2:
                    raise ValueError(f"in_features {cols}: not whole groups of {group_size}, or odd")
            elif not slip.get("no_check") and (group_size < 1 or cols % group_size or cols % 2):
                raise ValueError(f"in_features {cols}: not whole groups of {group_size}, or odd")
            self.bias = None if bias is None else bias.clone()
            g = cols if slip.get("per_row") else group_size
            w = weight.detach().float().reshape(out, cols // g, g)
            self.minimum = w.amin(-1)
            self.scale = ((w.amax(-1) - self.minimum) / (16 if slip.get("sixteen") else 15)).clamp(min=1e-12)
            ratio = (w - self.minimum[..., None]) / self.scale[..., None]
            q = (ratio if slip.get("truncate") else torch.round(ratio)).clamp(0, 15).to(torch.uint8).reshape(out, cols)
            if slip.get("unpacked"):
                self.packed = q
            elif slip.get("high_first"):
                self.packed = (q[:, 0::2] << 4) | q[:, 1::2]
            else:
                self.packed = q[:, 0::2] | (q[:, 1::2] << 4)
            self.g, self.out, self.cols = g, out, cols
            self.weight = weight if slip.get("keeps_weight") else None
            if slip.get("in_place"):
                weight.sub_(weight.mean())  # "centres" the caller's weight after quantizing it

        def tensors(self):
            kept = [self.packed, self.scale, self.minimum]
            if self.bias is not None and not slip.get("bias_unlisted"):
                kept.append(self.bias)
            return kept + [self.weight] if self.weight is not None else kept

        def __call__(self, x):
            if slip.get("x_assert"):
                assert x.shape[-1] == self.cols
            elif not slip.get("no_x_check") and x.shape[-1] != self.cols:
                raise ValueError(f"x has {x.shape[-1]} features; the layer takes {self.cols}")
            if slip.get("unpacked"):
                q = self.packed
            else:
                q = torch.stack([self.packed & 0x0F, self.packed >> 4], dim=-1).reshape(self.out, -1)
            w = q.float().reshape(self.out, -1, self.g) * self.scale[..., None]
            if not slip.get("no_minimum"):
                w = w + self.minimum[..., None]
            w = w.reshape(self.out, self.cols)
            if slip.get("fp32_out"):
                return x.float() @ w.T
            y = x @ w.to(x.dtype).T
            if self.bias is None or slip.get("ignores_bias"):
                return y
            if slip.get("bias_fp32"):
                return y + self.bias
            return y + (2 if slip.get("bias_twice") else 1) * self.bias.to(x.dtype)

    return Int4Linear


class Int4Grouped:
    """Groups as a 3-D view throughout; unpacking with a bit-shift table and a gather."""

    def __init__(self, weight, group_size, bias=None):
        self.rows, self.cols = weight.shape
        if group_size <= 0 or self.cols % (2 * group_size if group_size % 2 else group_size):  # whole groups that pair up
            raise ValueError(f"{self.cols} inputs cannot be packed in groups of {group_size}")
        self.offset = bias
        w = weight.detach().float().view(self.rows, -1, group_size)
        lo, hi = w.min(dim=-1).values, w.max(dim=-1).values
        self.step = torch.clamp((hi - lo) / 15.0, min=1e-12)
        self.low = lo
        q = ((w - lo.unsqueeze(-1)) / self.step.unsqueeze(-1)).round().clamp_(0, 15).to(torch.uint8).view(self.rows, -1)
        self.data = (q[:, 1::2] << 4) + q[:, ::2]

    def tensors(self):
        return [self.data, self.step, self.low, *([] if self.offset is None else [self.offset])]

    def __call__(self, x):
        if x.size(-1) - self.cols:
            raise ValueError(f"activations of width {x.size(-1)} for a layer of {self.cols} inputs")
        shifts = torch.tensor([0, 4], dtype=torch.uint8)
        q = ((self.data.unsqueeze(-1) >> shifts) & 15).flatten(1)  # [rows, cols]
        w = (q.view(self.rows, self.step.shape[1], -1).float() * self.step[..., None] + self.low[..., None])
        bias = None if self.offset is None else self.offset.to(x.dtype)
        return torch.nn.functional.linear(x, w.view(self.rows, self.cols).to(x.dtype), bias)


right(IL, layer_class())
right(IL, Int4Grouped)

for slip, message in (
    ({"per_row": True}, "every row has one scale and minimum"),
    ({"sixteen": True}, "the scale divides the range by 16"),
    ({"truncate": True}, "the levels were truncated"),
    ({"high_first": True}, "each pair of neighbours swapped"),
    ({"no_minimum": True}, "without the group's minimum"),
    ({"unpacked": True}, "a byte (or more) per weight"),
    ({"keeps_weight": True}, "at least the float weight itself"),
    ({"in_place": True}, "changed the weight it was given in place"),
    ({"fp32_out": True}, "return the activations' dtype"),
    ({"no_check": True}, "raised RuntimeError"),
    ({"asserts": True}, "raised AssertionError: bad shape. 20 inputs are not whole groups of 16"),
    ({"groups_only": True}, "15 inputs are whole groups of 5, but an odd count"),
    ({"ignores_bias": True}, "the bias was not added"),
    ({"bias_twice": True}, "the bias was added twice"),
    ({"bias_unlisted": True}, "does not list the bias"),
    ({"bias_fp32": True}, "add the bias in the activations' dtype"),
    ({"zero_group": True}, "raised ZeroDivisionError: integer modulo by zero. a group of 0 inputs"),
    ({"no_x_check": True}, "on x[3, 32] raised RuntimeError"),
    ({"x_assert": True}, "on x[3, 32] raised AssertionError"),
    ({"vague_refusal": True}, "name both numbers, 20 and 16, in the message"),
    ({"refuses_one": True}, "A group of 1 input is allowed"),
):
    wrong(IL, message, layer_class(**slip))


class NoTensors(layer_class()):
    def tensors(self):
        return {"packed": self.packed}


class KeepsFloat16(layer_class()):
    """Keeps a "small" fp16 copy of the dequantized weight for speed: 2 bytes per weight."""

    def __init__(self, weight, group_size, bias=None):
        super().__init__(weight, group_size, bias)
        self.cache = weight.half()

    def tensors(self):
        return super().tensors() + [self.cache]


class WrongGroupAxis(layer_class()):
    """Groups taken down the output rows instead of along the inputs."""

    def __init__(self, weight, group_size, bias=None):
        super().__init__(weight.T.contiguous(), group_size, bias)
        self.transposed = True

    def __call__(self, x):
        q = torch.stack([self.packed & 0x0F, self.packed >> 4], dim=-1).reshape(self.out, -1)
        w = q.float().reshape(self.out, -1, self.g) * self.scale[..., None] + self.minimum[..., None]
        return x @ w.reshape(self.out, self.cols).to(x.dtype)


wrong(IL, "tensors() should return a list", NoTensors)
wrong(IL, "a byte (or more) per weight", KeepsFloat16)
wrong(IL, "the weight your Int4Linear multiplies by", WrongGroupAxis)


class NoBiasParameter(layer_class()):
    """The layer as it was before the bias: (weight, group_size) only."""

    def __init__(self, weight, group_size):
        super().__init__(weight, group_size)


wrong(IL, "add the parameter bias=None", NoBiasParameter)
