"""What deciding bf16 near-ties in fp32 costs (``minillm/layers/exact_top.py``), next to its baselines.

    python benchmarks/bench_exact_top.py [--rows 1 8] [--repeats 40]

Prints, per batch size, the median time of SmolLM2-135M's LM head (576 → 49,152, random weights)
in bf16, the same plus the refinement, and the whole head in fp32 (the fix not taken), in one run.
"""

from __future__ import annotations

import argparse

import torch
from timing import median_ms

from minillm.layers import Linear
from minillm.layers.exact_top import refine_top_logits
from minillm.machine import machine_description


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=40)
    args = parser.parse_args()
    head = Linear(576, 49152).to(torch.bfloat16).requires_grad_(False)
    torch.nn.init.normal_(head.weight, std=0.05)
    head32 = Linear(576, 49152).requires_grad_(False)
    head32.weight.copy_(head.weight.float())
    print(machine_description(torch.device("cpu")), f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    with torch.inference_mode():
        for rows in args.rows:
            h = torch.randn(rows, 576, dtype=torch.bfloat16)
            bf16 = median_ms(lambda h=h: head(h).float(), args.repeats)
            refined = median_ms(lambda h=h: refine_top_logits(head(h).float(), h, head), args.repeats)
            fp32 = median_ms(lambda h=h: head32(h.float()), args.repeats)
            print(f"{rows} rows: bf16 head {bf16:.2f} ms, + refinement {refined:.2f} ms ({refined / bf16:.2f}x), "
                  f"fp32 head {fp32:.2f} ms ({fp32 / bf16:.2f}x)")


if __name__ == "__main__":
    main()
