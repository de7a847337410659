"""Where an eager decode step of many sequences spends its time: median step time, then
``torch.profiler``'s table of operations by self CPU time.

    python benchmarks/profile_decode_step.py --rows 32 --attention-backend sdpa
    python benchmarks/profile_decode_step.py --rows 32 --attention-backend cpu

``rows`` sequences with seeded random prompts of 16-512 tokens are prefilled, then every step
is a pure decode step of all of them (the compiled graphs are off: they take at most 8 rows).
The C++ kernel's time does not appear as an operation of its own (it is called through ctypes):
compare the two backends' step times.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from minillm import LLMEngine, SamplingParams


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    engine = LLMEngine(
        args.model,
        dtype=args.dtype,
        compile=False,
        attention_backend=args.attention_backend,
        max_num_seqs=max(args.rows, 1),
        enable_prefix_caching=False,
    )
    rng = random.Random(0)
    params = SamplingParams(max_tokens=2 * args.steps + 16, ignore_eos=True)
    for i in range(args.rows):
        prompt = [rng.randint(100, 40000) for _ in range(rng.randint(16, 512))]
        engine.add_request(prompt, params, request_id=str(i))
    while True:  # until a step decodes every sequence
        engine.step()
        chunks = engine.step_records[-1].chunks
        if len(chunks) == args.rows and all(decode for *_, decode in chunks):
            break
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    print(f"{args.rows} rows, backend {engine.attention_backend}: median step {1000 * statistics.median(times):.1f} ms")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            engine.step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


if __name__ == "__main__":
    main()
