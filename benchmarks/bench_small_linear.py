"""What one bf16 linear layer costs on CPU at a few rows, by size: oneDNN's prepacked kernel (what
the eager engine runs, ``layers/cpu_prepack.py``) beside fp32 ``F.linear`` on an fp32 copy of
the weight (the rows converted in and the result out again), on the same tensors.

    python benchmarks/bench_small_linear.py [--threads 1] [--out results/small-linear-....json]

Why: at one sequence the 1M-parameter course model's eager step is its forward (4 layers, 17
linear layers a token), and the packed kernel has a fixed cost per call that dwarfs the work of a
128×128 matrix; for SmolLM2's matrices it does not matter. Medians of 5 batches of calls.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from minillm.machine import machine_description

SHAPES = [(128, 128), (128, 256), (128, 768), (384, 128), (128, 4096), (576, 576), (576, 3072), (1536, 576)]


def median_us(fn, calls: int) -> float:
    for _ in range(20):
        fn()
    batches = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        batches.append((time.perf_counter() - start) / calls * 1e6)
    return sorted(batches)[2]


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    machine = machine_description(torch.device("cpu"))
    print(f"# {machine['cpu']} ({' '.join(machine['cpu_flags'])}), torch {machine['torch']}, {args.threads} thread(s)")
    print(f"{'in':>6}{'out':>7}{'rows':>6}{'bf16 packed µs':>16}{'fp32 µs':>10}{'packed / fp32':>15}")
    generator = torch.Generator().manual_seed(0)
    rows_out = []
    for k, n in SHAPES:
        weight = torch.randn(n, k, generator=generator).bfloat16()
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
        weight32 = weight.float()
        calls = 300 if n * k < 2**20 else 100
        for m in args.rows:
            x = torch.randn(m, k, generator=generator).bfloat16()
            bf16 = median_us(lambda x=x, p=packed: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], ""), calls)
            fp32 = median_us(lambda x=x, w=weight32: F.linear(x.float(), w).to(torch.bfloat16), calls)
            print(f"{k:>6}{n:>7}{m:>6}{bf16:>16.1f}{fp32:>10.1f}{bf16 / fp32:>15.2f}", flush=True)
            rows_out.append({"in": k, "out": n, "rows": m, "bf16_packed_us": bf16, "fp32_us": fp32})
    if args.out:
        Path(args.out).write_text(json.dumps({"machine": machine, "rows": rows_out}, indent=1))
    return rows_out


if __name__ == "__main__":
    main()
