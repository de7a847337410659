"""Half-precision weights on a CPU without half-precision GEMM kernels: many rows in fp32.

oneDNN's bf16/fp16 GEMMs need AVX512 (BW/VL/DQ) or AVX-NE-CONVERT; without them — AMD Zen 2/3
EPYCs and Ryzens, most laptops — PyTorch multiplies half-precision matrices on a slow path, and
cannot prepack them (``cpu_prepack.py``). Measured on an AMD EPYC with AVX2 only, 2 threads
(``benchmarks/bench_cpu_upcast.py``): a 512-row bf16 ``F.linear`` of SmolLM2's fused gate/up
projection (576 → 3072) took 118 ms, converting the weight and the rows to fp32 and multiplying
there 21 ms; a whole 512-token prefill took 6.38 s, and 1.21 s with this method. For one row the
native kernel wins (0.25 ms against 1.27: converting the whole weight is then most of the work),
so the upcast starts at ``UPCAST_MIN_ROWS`` rows (``BIG_MATRIX_MIN_ROWS`` for an LM head): prefill
chunks, perplexity, speculative verification and decode batches.

The result is the product summed in fp32 and rounded to the model's dtype once; the native
kernel's differs from it in the last bits, as two CPUs' results do (``tests/test_cpu_upcast.py``:
the same greedy tokens, perplexity within 0.5%).
The weights stay in half precision (no extra memory); each call converts them again. A
compiled step (``torch.compile``, ``torch.export``) gets plain ``F.linear`` and lets the
compiler lower it its own way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minillm.layers.linear import PlainMethod

UPCAST_MIN_ROWS = 8  # SmolLM2's decoder projections at 2 threads: 3-7% faster at 8 rows, 2.0-2.3x at 16
# A matrix this big (an LM head over a 49k vocabulary: 28M) is converted through memory, not cache:
# at 2 threads SmolLM2's head lost 1.8x at 16 rows and won 1.7x at 64
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
