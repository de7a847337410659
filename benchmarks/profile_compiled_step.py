"""Where a compiled batch-1 decode step's time goes: inside the compiled graph, preparing its
inputs (the runner's block tables and tensors), and everything else per token (scheduler,
sampling, detokenisation, the prompt's share).

    python benchmarks/profile_compiled_step.py --threads 2

Wraps the engine's compiled decode (``engine.graphs``) with timers; prints one line per repeat.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from minillm import LLM, SamplingParams


class Timed:
    """A callable that records how long each call of ``fn`` took."""

    def __init__(self, fn, seconds: list[float]):
        self.fn, self.seconds = fn, seconds

    def __call__(self, *args):
        start = time.perf_counter()
        out = self.fn(*args)
        self.seconds.append(time.perf_counter() - start)
        return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--new-tokens", type=int, default=129)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    llm = LLM(args.model, dtype=args.dtype, compile=True, enable_prefix_caching=False)
    llm.wait_for_fast_path()
    compiled = llm.engine.graphs
    runner_calls: list[float] = []
    graph_calls: list[float] = []
    compiled.run = Timed(compiled.run, runner_calls)
    for batch in compiled.graphs:
        compiled.graphs[batch] = Timed(compiled.graphs[batch], graph_calls)
    prompt = "The history of computing is a story of machines that grew faster by moving less data."
    params = SamplingParams(max_tokens=args.new_tokens, ignore_eos=True)
    llm.generate(prompt, params)  # warm up
    for repeat in range(args.repeats):
        runner_calls.clear()
        graph_calls.clear()
        start = time.perf_counter()
        llm.generate(prompt, params)
        total = time.perf_counter() - start
        steps = len(runner_calls)
        print(
            f"repeat {repeat}: {steps} compiled decode steps; per token {1000 * total / steps:.2f} ms overall, "
            f"graph {1000 * statistics.median(graph_calls):.2f} ms (median), inputs "
            f"{1000 * (statistics.median(runner_calls) - statistics.median(graph_calls)):.2f} ms, everything else "
            f"{1000 * (total - sum(runner_calls)) / steps:.2f} ms"
        )


if __name__ == "__main__":
    main()
