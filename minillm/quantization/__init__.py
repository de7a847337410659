"""Weight quantization: fewer bytes per weight, so a memory-bound decode step streams less.

A decode step reads every weight once to produce one token per sequence; at batch 1 its speed
is the memory bandwidth divided by the bytes of the weights. Storing a weight in 8 or 4 bits
instead of 16 cuts those bytes 2× or ~3.5×, at a small cost in accuracy that
``benchmarks/bench_quant.py`` measures. Each method is a ``LinearMethod`` (``layers/linear.py``):
the model code does not change, only the storage and the matmul of its linear layers.

- ``int8``: weight-only, one symmetric scale per output channel (``int8.py``);
- ``int4``: weight-only, group-wise asymmetric (a scale and a zero point per group of
  ``group_size`` input weights), two 4-bit values per byte (``int4.py``);
- ``awq``: int4 with activation-aware per-channel scales calibrated on text that ships offline
  (``awq.py``) — chosen over GPTQ because it needs only activation statistics and a small
  search per layer (SmolLM2-135M: 90 s measured on 2 cores shared with another job), no
  Hessian inverses.

What is quantized: every linear layer of the decoder blocks, and the LM head in int8 for both
methods — the head is 28% of SmolLM2-135M's parameters and is read every step, but it decides
every logit, so it gets the gentler 8 bits. The embedding table stays in the model's dtype: a
step reads only the rows of its tokens, so shrinking it saves memory but no time.
"""

from __future__ import annotations

from minillm.config import INT4_METHODS, QUANTIZATION_METHODS, check_quantization
from minillm.quantization.int4 import (
    INT4_GROUP_SIZES,
    Int4Method,
    dequantize_int4,
    pack_int4,
    quantize_int4,
    unpack_int4,
)
from minillm.quantization.int8 import Int8Method, dequantize_int8, quantize_int8


def default_group_size(model) -> int:
    """The largest int4 group (at most 128) that divides every decoder layer's input features:
    SmolLM2's 576 = 9 × 64 takes 64."""
    sizes = {m.in_features for name, m in _decoder_linears(model)}
    for group in (128, 64, 32):
        if all(size % group == 0 for size in sizes):
            return group
    raise ValueError(f"no int4 group size in (128, 64, 32) divides every layer's input features {sorted(sizes)}")


def _decoder_linears(model):
    from minillm.layers.linear import Linear

    return [(name, m) for name, m in model.named_modules() if isinstance(m, Linear) and name != "lm_head"]


def quantize_model(model, method: str, group_size: int | None = None, calibration_ids=None, tokenizer=None) -> None:
    """Quantize ``model``'s linear layers in place: the decoder's with ``method``, the LM head
    with int8. Every layer is checked first, so a shape the method cannot take raises
    ``ValueError`` naming the layer before anything changed. ``group_size`` (int4, awq): None
    picks ``default_group_size``. ``awq`` calibrates on ``calibration_ids`` (default: the
    shipped calibration text, tokenized with ``tokenizer``)."""

    check_quantization(method, group_size)
    if method == "awq" and calibration_ids is None and tokenizer is None:
        raise ValueError("quantization='awq' needs calibration_ids or a tokenizer to tokenize its calibration text")
    decoder = _decoder_linears(model)
    if method in INT4_METHODS and group_size is None:
        group_size = default_group_size(model)
    make = (lambda: Int8Method()) if method == "int8" else (lambda: Int4Method(group_size))
    for name, layer in decoder:
        make().validate(layer, name)
    if method == "awq":  # calibrate on the unquantized model first, then convert
        from minillm.quantization.awq import awq_quantize, calibration_text

        ids = calibration_ids if calibration_ids is not None else tokenizer.encode(calibration_text())
        awq_quantize(model, [layer for _, layer in decoder], group_size, ids)
    else:
        for _, layer in decoder:
            layer.set_method(make())
    model.lm_head.set_method(Int8Method())


__all__ = [
    "INT4_GROUP_SIZES",
    "QUANTIZATION_METHODS",
    "Int4Method",
    "Int8Method",
    "check_quantization",
    "default_group_size",
    "dequantize_int4",
    "dequantize_int8",
    "pack_int4",
    "quantize_int4",
    "quantize_int8",
    "quantize_model",
    "unpack_int4",
]
