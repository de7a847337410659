"""Half-precision linears on a CPU without half-precision kernels (``minillm/layers/cpu_upcast.py``):
the native ``F.linear`` next to the fp32 upcast, per shape and row count, and SmolLM2-135M's
512-token bf16 prefill with the engine's choice against plain storage, in one run.

    python benchmarks/bench_cpu_upcast.py [--rows 1 8 16 64 512] [--repeats 5]

On a CPU *with* native kernels (AVX512-BF16, AMX) the engine never uses the upcast: the table
then says so, and still shows both paths.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from timing import median_ms

from minillm import LLM, SamplingParams
from minillm.layers.cpu_upcast import BIG_MATRIX_MIN_ROWS, UPCAST_MIN_ROWS, half_gemm_is_slow
from minillm.machine import machine_description

SHAPES = {"qkv 576→960": (576, 960), "gate/up 576→3072": (576, 3072), "down 1536→576": (1536, 576),
          "head 576→49152": (576, 49152)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 64, 512])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    args = parser.parse_args()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    print(machine_description(torch.device("cpu")), f"{torch.get_num_threads()} threads")
    print(f"{args.dtype} GEMM without native kernels here: {half_gemm_is_slow(dtype)} → the engine upcasts from "
          f"{UPCAST_MIN_ROWS} rows ({BIG_MATRIX_MIN_ROWS} for the head): {half_gemm_is_slow(dtype)}")
    print(f"{'shape':>18} {'rows':>5} {'native ms':>10} {'fp32 upcast ms':>15} {'upcast/native':>14}")
    g = torch.Generator().manual_seed(0)
    for name, (k, n) in SHAPES.items():
        w = (torch.randn(n, k, generator=g) * 0.05).to(dtype)
        for rows in args.rows:
            x = torch.randn(rows, k, generator=g).to(dtype)
            native = median_ms(lambda x=x, w=w: F.linear(x, w), args.repeats)
            upcast = median_ms(lambda x=x, w=w: F.linear(x.float(), w.float()).to(dtype), args.repeats)
            print(f"{name:>18} {rows:>5} {native:10.3f} {upcast:15.3f} {upcast / native:14.3f}")

    prompt = torch.randint(0, 49152, (512,), generator=g).tolist()
    params = SamplingParams(max_tokens=1)
    print(f"SmolLM2-135M {args.dtype}, one 512-token prefill (seconds, median of {args.repeats}):")
    for label, options in {"engine's choice": {}, "plain F.linear (cpu_prepack=False)": {"cpu_prepack": False}}.items():
        llm = LLM("smollm2-135m", dtype=args.dtype, compile=False, enable_prefix_caching=False, **options)
        method = type(llm.model.layers[0].mlp.down_proj.method).__name__
        seconds = median_ms(lambda llm=llm: llm.generate([prompt], params), args.repeats) / 1e3
        print(f"{label:>36} ({method}): {seconds:.2f} s")
        del llm


if __name__ == "__main__":
    main()
