"""Batch-1 decode on a busy machine: quiet vs one competing CPU-bound process, per thread policy.

    python benchmarks/bench_contention.py                    # SmolLM2-135M, default engine (compiled) + eager
    python benchmarks/bench_contention.py --tokens 64 --repeats 3

A laptop is rarely idle. The competitor is a plain Python busy loop at normal priority (one
core's worth of CPU-bound work). For each engine — the default (its compiled decode step,
waited for) and ``compile=False`` — and each policy:

* ``fixed, all threads``: what the engine did before ``adapt_threads`` (2 threads on 2 cores);
* ``fixed, 1 thread``;
* ``adaptive`` (the default, ``runtime/thread_governor.py``): fewer threads while others are busy;

it measures the decode rate quiet and with the competitor, in the same run, and reports the
contended rate as a share of the engine's quiet default rate (a fair share of 2 cores is 50%).
Writes JSON and a Markdown table under ``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from datetime import date
from pathlib import Path
from statistics import median

RESULTS = Path(__file__).parent / "results"


def competitor() -> subprocess.Popen:
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    time.sleep(1.0)  # let it take its core
    return busy


def decode_rate(llm, tokens: int, repeats: int) -> float:
    from minillm import SamplingParams

    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    rates = []
    for _ in range(repeats):
        out = llm.generate("The history of the printing press", params)[0]
        rates.append(1 / out.metrics.tpot)
    return median(rates)


def set_policy(llm, policy: str, threads: int) -> None:
    import torch

    governor = llm.engine.threads
    governor.enabled = policy == "adaptive"
    governor.threads = 1 if policy == "fixed, 1 thread" else threads
    torch.set_num_threads(governor.threads)
    if governor.enabled:
        governor._last = governor._sample()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import torch

    from minillm import LLM
    from minillm.machine import machine_description, machine_tag

    threads = torch.get_num_threads()
    policies = ("fixed, all threads", "fixed, 1 thread", "adaptive")
    rows = []
    for engine_name, options in (("default (compiled)", {}), ("eager (compile=False)", {"compile": False})):
        llm = LLM(args.model, **options)
        status = llm.wait_for_fast_path()
        print(f"{engine_name}: fast path {status}", file=sys.stderr)
        set_policy(llm, "adaptive", threads)
        quiet_default = decode_rate(llm, args.tokens, args.repeats)
        for policy in policies:
            set_policy(llm, policy, threads)
            quiet = decode_rate(llm, args.tokens, args.repeats)
            busy = competitor()
            try:
                set_policy(llm, policy, threads)
                decode_rate(llm, 8, 1)  # the governor's first look
                contended = decode_rate(llm, args.tokens, args.repeats)
                used = llm.engine.threads.threads
            finally:
                busy.kill()
                busy.wait()
            row = {"engine": engine_name, "policy": policy, "quiet_tok_s": round(quiet, 1),
                   "contended_tok_s": round(contended, 1), "threads_contended": used,
                   "share_of_quiet_default": round(contended / quiet_default, 3),
                   "quiet_default_tok_s": round(quiet_default, 1)}  # fmt: skip
            rows.append(row)
            print(row, file=sys.stderr, flush=True)
        llm.close()
    machine = machine_description(torch.device("cpu"))
    table = [
        f"Batch-1 decode of {args.model} ({args.tokens} tokens, median of {args.repeats}), quiet vs one competing "
        f"busy process; {machine['cpu']}, {threads} threads, flags {' '.join(machine['cpu_flags'])}",
        "",
        "| engine | thread policy | quiet tok/s | with a competitor tok/s (threads) | share of the quiet default |",
        "|---|---|---:|---:|---:|",
    ]
    for r in rows:
        table.append(f"| {r['engine']} | {r['policy']} | {r['quiet_tok_s']:.1f} | {r['contended_tok_s']:.1f} "
                     f"({r['threads_contended']}) | {100 * r['share_of_quiet_default']:.0f}% |")  # fmt: skip
    text = "\n".join(table)
    print(text)
    RESULTS.mkdir(exist_ok=True)
    stem = f"contention-{args.model}-{date.today()}-{machine_tag(machine)}-{threads}t"
    (RESULTS / f"{stem}.json").write_text(json.dumps({"date": str(date.today()), "machine": machine, "rows": rows},
                                                     indent=1))  # fmt: skip
    (RESULTS / f"{stem}.md").write_text(text + "\n")
    print(f"wrote {RESULTS / stem}.json/.md", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
