"""Chapter 07's int4 linear layer (``check_int4_linear``): right answers written independently, and
the wrong ones a learner writes, one slip each (``layer_class(...)``)."""

from __future__ import annotations

import torch
from check_catalogue import right, wrong

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
