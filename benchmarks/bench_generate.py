"""Decode and TTFT benchmark: minillm vs HF transformers generate() on SmolLM2-135M.

    python benchmarks/bench_generate.py                 # fp32 + bf16, batch 1 + 8, writes results/
    python benchmarks/bench_generate.py --threads 2 --repeats 5

Prints a row per (dtype, batch) and a Markdown table; writes JSON under benchmarks/results/.
"""

from __future__ import annotations

import sys
from pathlib import Path

from minillm.cli import main

if __name__ == "__main__":
    args = sys.argv[1:]
    if "--out" not in args:
        args += ["--out", str(Path(__file__).parent / "results")]
    raise SystemExit(main(["bench", *args]))
