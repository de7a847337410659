"""W8A8's int8 GEMM on this CPU: ``torch._int_mm`` next to the exact fp32 path
(``minillm/quantization/w8a8.py``) and a plain fp32 GEMM of the same shape, in one run.

    python benchmarks/bench_int8_gemm.py [--rows 1 8 512] [--repeats 10]

Shapes: SmolLM2-135M's q/o (576 → 576), gate/up (576 → 1536) and down (1536 → 576) projections.
Prints whether this CPU has int8 dot products (VNNI/AMX: then the engine calls ``_int_mm``) and,
per shape and row count, each path's median milliseconds and the ratio to ``_int_mm``; the two
int8 paths' results are compared for equality as they run.
"""

from __future__ import annotations

import argparse

import torch
from timing import median_ms

from minillm.machine import machine_description
from minillm.quantization.w8a8 import CPU_INT8_DOT, exact_float_int8_matmul

SHAPES = {"q/o 576→576": (576, 576), "gate/up 576→1536": (576, 1536), "down 1536→576": (1536, 576)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 512])
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    print(machine_description(torch.device("cpu")), f"{torch.get_num_threads()} threads")
    print(
        f"int8 dot products (VNNI/AMX): {CPU_INT8_DOT} → the engine uses "
        f"{'torch._int_mm' if CPU_INT8_DOT else 'the exact fp32 path'}"
    )
    print(
        f"{'shape':>18} {'rows':>5} {'_int_mm ms':>11} {'exact fp32 ms':>14} {'fp32 GEMM ms':>13} "
        f"{'exact/_int_mm':>14} {'equal':>6}"
    )
    g = torch.Generator().manual_seed(0)
    for name, (k, n) in SHAPES.items():
        for rows in args.rows:
            a = torch.randint(-127, 128, (rows, k), dtype=torch.int8, generator=g)
            q_t = torch.randint(-127, 128, (k, n), dtype=torch.int8, generator=g)
            af, qf = a.float(), q_t.float()
            native = median_ms(lambda a=a, q_t=q_t: torch._int_mm(a, q_t), args.repeats)
            exact = median_ms(lambda a=a, q_t=q_t: exact_float_int8_matmul(a, q_t), args.repeats)
            plain = median_ms(lambda af=af, qf=qf: af @ qf, args.repeats)
            same = torch.equal(torch._int_mm(a, q_t), exact_float_int8_matmul(a, q_t))
            print(
                f"{name:>18} {rows:>5} {native:11.3f} {exact:14.3f} {plain:13.3f} {exact / native:14.3f} {str(same):>6}"
            )


if __name__ == "__main__":
    main()
