"""Half-precision weights on a CPU without half-precision GEMM kernels: many rows in fp32.

oneDNN's bf16/fp16 GEMMs need AVX512 (BW/VL/DQ) or AVX-NE-CONVERT; without them — AMD Zen 2/3
EPYCs and Ryzens, most laptops — PyTorch multiplies half-precision matrices on a slow path, and
cannot prepack them (``cpu_prepack.py``). Measured on an AMD EPYC with AVX2 only, one thread,
SmolLM2's 576 → 1536 projection (``benchmarks/bench_cpu_upcast.py``): a 512-row bf16
``F.linear`` took 92 ms, converting the weight and the rows to fp32 and multiplying there 12 ms.
For one row the native kernel wins (0.19 ms against 0.34: the conversion of the whole weight
is then most of the work), so the upcast starts at ``UPCAST_MIN_ROWS`` rows (``BIG_MATRIX_MIN_ROWS``
for an LM head): prefill chunks, perplexity, speculative verification of many sequences and big
decode batches.

The result is the same product summed in fp32 and rounded to the model's dtype once, as the
native kernel does, in another order: logits move in the last bits, like those of two CPUs.
The weights stay in half precision (no extra memory); each call converts them again. A
compiled step (``torch.compile``, ``torch.export``) gets plain ``F.linear`` and lets the
compiler lower it its own way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minillm.layers.linear import PlainMethod

UPCAST_MIN_ROWS = 16  # every decoder projection of SmolLM2 wins from 16 rows (2.3-2.6x), most from 8
# A matrix this big (an LM head over a 49k vocabulary: 28M) is converted through memory, not cache:
# at 2 threads SmolLM2's head lost 1.5x at 16 rows and won 1.9x at 64
BIG_MATRIX = 8 * 2**20
BIG_MATRIX_MIN_ROWS = 64


def half_gemm_is_slow(dtype: torch.dtype) -> bool:
    """Whether PyTorch's CPU GEMM for ``dtype`` lacks native kernels on this machine (oneDNN's
    own check: the same one that refuses to prepack the weights)."""
    if dtype == torch.bfloat16:
        return not torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if dtype == torch.float16:
        return not torch.ops.mkldnn._is_mkldnn_fp16_supported()
    return False


class CPUUpcastMethod(PlainMethod):
    """The plain half-precision matrix; ``UPCAST_MIN_ROWS`` rows or more multiply in fp32."""

    name = "cpu_upcast"

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // layer.in_features
        least = BIG_MATRIX_MIN_ROWS if layer.weight.numel() >= BIG_MATRIX else UPCAST_MIN_ROWS
        if torch.compiler.is_compiling() or rows < least:
            return F.linear(x, layer.weight, layer.bias)
        bias = None if layer.bias is None else layer.bias.float()
        return F.linear(x.float(), layer.weight.float(), bias).to(x.dtype)
