"""int4 on CPU: PyTorch's ``_weight_int4pack_mm_for_cpu`` against dequantizing and multiplying
densely, by row count, for fp32 and bf16 activations, in one run.

What ``quantization/int4.py`` chose from it: the kernel for bf16 activations, dequantize-and-
multiply for fp32 ones. The shape is SmolLM2-135M's MLP up-projection (1536 x 576), groups of 32.

    python benchmarks/bench_int4_cpu.py [threads]
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from timing import median_ms

from minillm.machine import machine_description
from minillm.quantization.int4 import dequantize_int4, quantize_int4

OUT, IN, GROUP = 1536, 576, 32


def main() -> None:
    threads = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    torch.set_num_threads(threads)
    w = torch.randn(OUT, IN, generator=torch.Generator().manual_seed(0))
    q, scale, low = quantize_int4(w, GROUP)
    packed = torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 2)
    print(f"{machine_description(torch.device('cpu'))}, {threads} thread(s); median ms of 5 calls, {OUT}x{IN}, groups of {GROUP}")
    print(f"{'activations':>11} {'rows':>5} {'int4 kernel':>12} {'dequantize + F.linear':>22} {'kernel / dequantized':>21}")
    for dtype in (torch.float32, torch.bfloat16):
        table = torch.stack([scale, low + 8 * scale], -1).transpose(0, 1).contiguous().to(dtype)
        for rows in (1, 4, 8, 16, 64, 512):
            x = torch.randn(rows, IN).to(dtype)
            kernel = median_ms(lambda x=x, table=table: torch._weight_int4pack_mm_for_cpu(x, packed, GROUP, table), 5)
            dense = median_ms(lambda x=x, dtype=dtype: F.linear(x, dequantize_int4(q, scale, low, dtype)), 5)
            print(f"{str(dtype).removeprefix('torch.'):>11} {rows:>5} {kernel:>12.2f} {dense:>22.2f} {kernel / dense:>20.1f}x")


if __name__ == "__main__":
    main()
