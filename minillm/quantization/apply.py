"""Quantizing a whole model: which layers take which method, checked before anything changes,
calibrated where the method needs it (AWQ, W8A8), and 2:4 pruning. The methods themselves —
how one layer stores and multiplies its weights — live in ``int8.py``, ``int4.py``, ``awq.py``
and ``w8a8.py``; ``__init__.py`` says what each is for.
"""

from __future__ import annotations

from minillm.config import INT4_METHODS, check_quantization
from minillm.layers.linear import Linear
from minillm.quantization.awq import awq_quantize
from minillm.quantization.calibration import calibration_ids as calibration_tokens
from minillm.quantization.int4 import Int4Method
from minillm.quantization.int8 import Int8Method, share_int8_head_as_embedding
from minillm.quantization.sparsity import prune_model
from minillm.quantization.w8a8 import W8A8Method, w8a8_quantize

DEFAULT_INT4_GROUP_SIZE = 32  # see default_group_size


def default_group_size(model) -> int:
    """int4's default group: 32 weights per scale and minimum, the smallest group the CPU kernel
    takes, and llama.cpp's Q4 block. Quality first: on SmolLM2-135M, groups of 64 cost +28%
    perplexity on held-out Shakespeare and groups of 32 +0.1% (``bench_quant.py``) — its
    checkpoint was itself dequantized from 4-bit groups of 32, so a larger group straddles two
    of the original grids — and on a model trained in fp32 smaller groups still err less.
    Larger groups (fewer scale bytes) are a choice: ``quantization_group_size``. The check
    reads the full layers' features, so every tensor-parallel rank and the one-process model
    agree."""
    for name, m in _decoder_linears(model):
        if m.full_in % DEFAULT_INT4_GROUP_SIZE:
            raise ValueError(
                f"{name}: int4's default groups of {DEFAULT_INT4_GROUP_SIZE} do not divide its {m.full_in} input "
                "features; no int4 group size can (they are multiples of 32)"
            )
    return DEFAULT_INT4_GROUP_SIZE


def prune(model, method: str, calibration_ids=None, tokenizer=None) -> dict:
    """Prune every decoder linear layer of ``model`` to 2:4 in place (``sparsity.py``); the LM
    head stays dense. ``2:4-wanda`` calibrates on ``calibration_ids`` (default: the shipped
    text, tokenized with ``tokenizer``). Returns the fraction of weight norm² removed per layer."""
    layers = [layer for _, layer in _decoder_linears(model)]
    ids = calibration_tokens(tokenizer, calibration_ids) if method == "2:4-wanda" else None
    return prune_model(model, method, layers, ids)


def _decoder_linears(model):
    return [(name, m) for name, m in model.named_modules() if isinstance(m, Linear) and name != "lm_head"]


def _decoder_method(method: str, group_size: int | None):
    """A maker of ``method``'s LinearMethod for one decoder layer (``group_size`` resolved)."""
    return {"int8": Int8Method, "w8a8": W8A8Method}.get(method, lambda: Int4Method(group_size))


def check_quantizable(model, method: str, group_size: int | None = None) -> int | None:
    """Raise ``ValueError`` naming the first decoder layer of ``model`` (or of a tensor-parallel
    shard of it, even one built on the meta device) that ``method`` cannot take; change nothing.
    Returns the int4 group size used (``group_size``, or the default), else None."""
    check_quantization(method, group_size)
    if method in INT4_METHODS and group_size is None:
        group_size = default_group_size(model)
    make = _decoder_method(method, group_size)
    for name, layer in _decoder_linears(model):
        make().validate(layer, name)
    return group_size if method in INT4_METHODS else None


def quantize_model(model, method: str, group_size: int | None = None, calibration_ids=None, tokenizer=None) -> None:
    """Quantize ``model``'s linear layers in place: the decoder's with ``method``, the LM head
    with int8. Every layer is checked first, so a shape the method cannot take raises
    ``ValueError`` naming the layer before anything changed. ``group_size`` (int4, awq): None
    picks ``default_group_size``. ``awq`` calibrates on ``calibration_ids`` (default: the
    shipped calibration text, tokenized with ``tokenizer``). A pipeline stage without the LM
    head quantizes its decoder layers only."""
    check_quantization(method, group_size)
    calibrated = method in ("awq", "w8a8")
    if calibrated and calibration_ids is None and tokenizer is None:
        raise ValueError(
            f"quantization={method!r} needs calibration_ids or a tokenizer to tokenize its calibration text"
        )
    group_size = check_quantizable(model, method, group_size)
    decoder = _decoder_linears(model)
    if calibrated:  # calibrate on the unquantized model first, then convert
        ids = calibration_tokens(tokenizer, calibration_ids)
        layers = [layer for _, layer in decoder]
        awq_quantize(model, layers, group_size, ids) if method == "awq" else w8a8_quantize(model, layers, ids)
    else:
        make = _decoder_method(method, group_size)
        for _, layer in decoder:
            layer.set_method(make())
    if model.lm_head is not None:
        model.lm_head.set_method(Int8Method())
    share_int8_head_as_embedding(model)
