"""Weight quantization: fewer bytes per weight, so a memory-bound decode step streams less.

A decode step reads every weight once to produce one token per sequence; at batch 1 its speed
is the memory bandwidth divided by the bytes of the weights. Storing a weight in 8 or 4 bits
instead of 16 cuts those bytes 2× or ~3.5×, at a small cost in accuracy that
``benchmarks/bench_quant.py`` measures. Each method is a ``LinearMethod`` (``layers/linear.py``):
the model code does not change, only the storage and the matmul of its linear layers.

- ``int8``: weight-only, one symmetric scale per output channel (``int8.py``);
- ``int4``: weight-only, group-wise asymmetric (a scale and a zero point per group of
  ``group_size`` input weights), two 4-bit values per byte (``int4.py``);
- ``w8a8``: int8 weights and int8 activations (per token, quantized on the fly), multiplied
  in integers, with SmoothQuant-style smoothing calibrated on the same text (``w8a8.py``);
- ``awq``: int4 with activation-aware per-channel scales calibrated on text that ships offline
  (``awq.py``) — chosen over GPTQ because it needs only activation statistics and a small
  search per layer (SmolLM2-135M: 90 s measured on 2 cores shared with another job), no
  Hessian inverses.

``sparsity.py`` prunes the same layers to the 2:4 pattern (by magnitude or Wanda scores).

What is quantized: every linear layer of the decoder blocks, and the LM head in int8
(weight-only) for every method — the head is 28% of SmolLM2-135M's parameters and is read
every step, but it decides every logit, so it gets the gentler 8 bits. A tied model's
embedding then reads its rows through that int8 head (``share_int8_head_as_embedding``)
instead of keeping a float copy of the same matrix; an untied model's embedding stays in the
model's dtype (a step reads only its tokens' rows, so shrinking it would save memory but no time).

Under tensor parallelism each rank quantizes its own slices, to exactly the values the
one-process model holds: per-row int8 scales of a column slice are its rows' own; a row slice
takes its rows' maxima over every rank (``Linear.full_row_absmax``); int4 groups of a row slice
must be whole groups of the full row (``Int4Method.validate`` says so by layer and slice).
"""

from __future__ import annotations

from minillm.config import QUANTIZATION_METHODS, check_quantization
from minillm.quantization.apply import (
    check_quantizable,
    default_group_size,
    prune,
    quantize_model,
)
from minillm.quantization.int4 import (
    INT4_GROUP_SIZES,
    Int4Method,
    dequantize_int4,
    pack_int4,
    quantize_int4,
    unpack_int4,
)
from minillm.quantization.int8 import Int8Method, dequantize_int8, quantize_int8

__all__ = [
    "INT4_GROUP_SIZES",
    "QUANTIZATION_METHODS",
    "Int4Method",
    "Int8Method",
    "check_quantizable",
    "check_quantization",
    "default_group_size",
    "prune",
    "dequantize_int4",
    "dequantize_int8",
    "pack_int4",
    "quantize_int4",
    "quantize_int8",
    "quantize_model",
    "unpack_int4",
]
