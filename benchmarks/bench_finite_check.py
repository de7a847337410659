"""The load's NaN/inf check: ``torch.isfinite(t).all()`` (before) vs ``torch.aminmax`` (shipped).

    python benchmarks/bench_finite_check.py                 # SmolLM2-135M's tensors, 5 repeats
    python benchmarks/bench_finite_check.py --threads 2

``minillm/models/loader.py`` refuses a checkpoint holding a NaN or an infinity, checking every
floating-point tensor as it loads. For each dtype, every tensor of SmolLM2-135M's checkpoint
(its 30 layers, embedding table, norms) is cast once to that dtype, then checked both ways; the
median over the repeats of the whole checkpoint's check is printed for each, with their ratio,
and both ways must agree (all finite here; ``tests/test_hardening.py`` plants bad values).
"""

from __future__ import annotations

import argparse
import time
from statistics import median

import torch
from safetensors.torch import load_file

from minillm.assets import resolve_model
from minillm.machine import machine_description
from minillm.models.loader import _all_finite


def cpu() -> str:
    """The CPU's model, cores and the flags that decide the fast paths (``minillm.machine``)."""
    m = machine_description(torch.device("cpu"))
    return f"{m['cpu']}, {m['cpu_count']} CPUs, flags {' '.join(m['cpu_flags']) or '-'}"


def timed(check, tensors, repeats: int) -> tuple[float, bool]:
    times, verdict = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        verdict = all(check(t) for t in tensors)
        times.append(time.perf_counter() - start)
    return median(times), verdict


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a load runs on the engine's)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    folder = resolve_model(args.model)
    checkpoint = {}
    for path in sorted(folder.glob("*.safetensors")):
        checkpoint |= load_file(str(path))
    print(f"{cpu()}; torch {torch.__version__}, {args.threads} thread(s); {args.model}: {len(checkpoint)} tensors, "
          f"{sum(t.numel() for t in checkpoint.values()) / 1e6:.0f} M values; median of {args.repeats}")
    print(f"{'dtype':>10} {'isfinite(t).all() (before)':>28} {'aminmax (shipped)':>19} {'ratio':>7}")
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        tensors = [t.to(dtype) for t in checkpoint.values()]
        before, v1 = timed(lambda t: bool(torch.isfinite(t).all()), tensors, args.repeats)
        after, v2 = timed(_all_finite, tensors, args.repeats)
        assert v1 == v2, "the two checks disagree"
        print(f"{str(dtype).removeprefix('torch.'):>10} {before * 1e3:>25.0f} ms {after * 1e3:>16.0f} ms "
              f"{before / after:>6.1f}x")


if __name__ == "__main__":
    main()
