"""What the course's hook points cost the engine's hot path, next to a direct call, in one run.

    python benchmarks/bench_hook_overhead.py

A hook is a module global holding the current function (``minillm/hooks.py``): a call through
it is one attribute lookup more than a direct call. The engine's eager step calls
``decoder_layer``, ``apply_rope`` and (on the reference and CPU backends) ``paged_attention``
once per layer — 3 × 30 calls for SmolLM2 — the added cost per step is at most 90 Python calls
(the hook's own frame around the module it calls, and the global lookup). The script times 90
calls through the real hook globals (an upper bound of what they add), 90 direct calls of the
same trivial stand-ins (the lookup's share is the difference), and an eager decode step of
SmolLM2 (bf16, 2 threads) to compare them with, in one run. A
compiled decode graph traces through the hooks and pays nothing.
"""

from __future__ import annotations

import platform
import statistics
import subprocess
import time

import torch

import minillm.hooks as hooks


def per_step_overhead(calls: int = 90, repeats: int = 2000) -> tuple[float, float]:
    """Seconds for ``calls`` calls through hook globals, and for ``calls`` direct calls."""

    def stand_in(*args):
        return args

    names = ("decoder_layer", "apply_rope", "paged_attention")
    with hooks.override(**{n: stand_in for n in names}):
        through, direct = [], []
        for _ in range(repeats):
            start = time.perf_counter()
            for i in range(calls // 3):
                hooks.decoder_layer(i, i, i, i, i)
                hooks.apply_rope(i, i, i)
                hooks.paged_attention(i, i, i, i, i, i)
            through.append(time.perf_counter() - start)
            start = time.perf_counter()
            for i in range(calls // 3):
                stand_in(i, i, i, i, i)
                stand_in(i, i, i)
                stand_in(i, i, i, i, i, i)
            direct.append(time.perf_counter() - start)
    return statistics.median(through), statistics.median(direct)


def eager_decode_step() -> float:
    """Median seconds of one eager batch-1 decode step of SmolLM2 (bf16), from 64 tokens."""
    from minillm import LLM, SamplingParams

    llm = LLM("smollm2-135m", compile=False)
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=64, ignore_eos=True))[0]
    return statistics.median(out.metrics.inter_token_latencies)


def main() -> None:
    torch.set_num_threads(2)
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((line.split(":", 1)[1].strip() for line in cpu.splitlines() if line.startswith("Model name")), "?")
    through, direct = per_step_overhead()
    step = eager_decode_step()
    extra = through - direct
    print(f"machine: {model} ({platform.machine()}), torch {torch.__version__}, 2 threads")
    print(f"90 calls through hooks: {1e6 * through:.1f} us; 90 direct calls: {1e6 * direct:.1f} us; "
          f"the hooks' share: {1e6 * extra:.1f} us per step")
    print(f"SmolLM2 eager decode step (bf16, batch 1, median of 63): {1e3 * step:.2f} ms; "
          f"90 hook calls, an upper bound of what the hooks add, are {100 * through / step:.3f}% of it")


if __name__ == "__main__":
    main()
