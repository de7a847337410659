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
