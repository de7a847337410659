"""Median decode step time (TPOT) of the default engine on SmolLM2-135M, per dtype and batch.

    python benchmarks/bench_decode_step.py --dtypes fp32 bf16 --batch-sizes 1 8

Uses only the public API (``LLM``, ``SamplingParams``, request metrics), so it runs against any
checkout of minillm — ``compare_checkouts.py`` runs it on two, interleaved. 64-token prompts,
64 new tokens, prefix caching off (the repeats reuse prompts), the median over ``--repeats``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from minillm import LLM, SamplingParams


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"])
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None, help="folder for decode-step-*.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    for dtype in args.dtypes:
        llm = LLM(args.model, dtype=dtype, enable_prefix_caching=False)
        getattr(llm, "wait_for_fast_path", lambda: None)()  # the compiled step, built in the background (issue 27 on)
        for row in measure(llm, args.batch_sizes, args.repeats):
            rows.append({"dtype": dtype, **row})
            print(f"{dtype} batch {row['batch']}: TPOT {row['tpot_ms']:.2f} ms (runs {row['samples_ms']})", flush=True)
    result = {"benchmark": "decode_step", "date": time.strftime("%Y-%m-%d"), "rows": rows}
    if args.out:
        path = Path(args.out) / f"decode-step-{result['date']}.json"
        path.write_text(json.dumps(result, indent=2))
    return result


def measure(llm: LLM, batch_sizes: list[int], repeats: int) -> list[dict]:
    """Median TPOT of ``llm`` per batch size: 64-token prompts, 64 new tokens, ``repeats`` runs
    after one that warms the shape up."""
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    rows = []
    for batch in batch_sizes:
        prompts = [[(7 * i + j) % 30000 + 100 for j in range(64)] for i in range(batch)]
        llm.generate(prompts, params)  # warm up this shape
        samples = []
        for _ in range(repeats):
            outs = llm.generate(prompts, params)
            samples.append(statistics.median(o.metrics.tpot for o in outs) * 1000)
        rows.append({"batch": batch, "tpot_ms": statistics.median(samples), "samples_ms": samples})
    return rows


if __name__ == "__main__":
    main()
