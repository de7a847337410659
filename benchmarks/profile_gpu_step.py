"""Where a batch-1 decode token goes on the GPU: kernels per token, their time, and the gaps.

    python benchmarks/profile_gpu_step.py --model /tmp/smollm2-135m-random      # on a CUDA machine
    python benchmarks/profile_gpu_step.py --model tiny-shakespeare-1m --device cpu --tokens 4   # a smoke run

The fused-kernel question of the GPU roofline issue: one measured SmolLM2-135M decode token took
2.8 ms for ~270 MB of weights, ~65 µs of HBM traffic, so the step is bound by launches and the
host, not bytes. This profiles ``--tokens`` greedy tokens at batch 1 with ``torch.profiler``,
for the engine as it ships (Triton backend, fused element-wise kernels) and with the fused
kernels off, both without CUDA graphs (to see every launch) and — on a GPU — with them, and
prints per token: kernels launched, summed kernel time, wall time, and the gap (wall − kernels:
launch overhead and host work), plus the ten costliest kernels. JSON to ``--out``.

On a CPU (``--device cpu``) the same code runs with CPU activities only: a check that the script
works before a borrowed GPU's minutes are spent on it, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from pathlib import Path

import torch

import minillm  # noqa: F401  (before triton)
from minillm import LLM, SamplingParams

RESULTS = Path(__file__).parent / "results"


def profile(llm: LLM, prompt: list[int], tokens: int, cuda: bool) -> dict:
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    llm.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True))  # warm: compiles, tunes, captures
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=activities) as prof:
        start = time.perf_counter()
        llm.generate([prompt], params)
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    events = [e for e in prof.events() if (e.device_type.name == "CUDA") == cuda and (cuda or e.name.startswith("aten::"))]
    busy_us = sum(e.device_time if cuda else e.cpu_time for e in events)
    by_name = Counter()
    for e in events:
        by_name[e.name] += e.device_time if cuda else e.cpu_time
    return {
        "tokens": tokens,
        "kernels_per_token": len(events) / tokens,
        "kernel_ms_per_token": busy_us / 1000 / tokens,
        "wall_ms_per_token": 1000 * wall / tokens,
        "gap_ms_per_token": 1000 * wall / tokens - busy_us / 1000 / tokens,
        "top_kernels_ms": {name: us / 1000 for name, us in by_name.most_common(10)},
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    from minillm.machine import machine_description, machine_tag

    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("no CUDA device: run with --device cpu for a smoke run")
        return 1
    common = dict(device=args.device, attention_backend="triton", enable_prefix_caching=False)
    common |= dict(dtype="bf16", kv_cache_memory=2 << 30) if cuda else dict(dtype="fp32", kv_cache_memory=16 << 20)
    result = {"machine": machine_description(torch.device(args.device)), "args": vars(args), "runs": {}}
    # (CUDA graphs, fused kernels): graphs replay what they captured at start, so only as shipped.
    runs = [(False, True), (False, False), (True, True)] if cuda else [(False, False)]
    for use_graphs, fused in runs:
        llm = LLM(args.model, cuda_graphs=use_graphs, **common) if cuda else LLM(args.model, **common)
        llm.engine.model.set_fused_kernels(fused)
        name = f"{'graphs' if use_graphs else 'eager'}, fused {'on' if fused else 'off'}"
        row = profile(llm, list(range(5, 5 + 32)), args.tokens, cuda)
        result["runs"][name] = row
        print(f"{name}: {row['kernels_per_token']:.0f} kernels/token, kernels {row['kernel_ms_per_token']:.3f} ms, "
              f"wall {row['wall_ms_per_token']:.3f} ms, gap {row['gap_ms_per_token']:.3f} ms per token", flush=True)  # fmt: skip
        del llm
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"gpu-step-profile-{machine_tag(result['machine'])}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
