"""Greedy tokens of every rung of the ladder on two checkouts: a refactor must not change one.

    git worktree add /tmp/before <commit>
    python benchmarks/compare_tokens.py /tmp/before . --model smollm2-135m

Each checkout runs in its own process importing its own ``minillm`` (``PYTHONPATH``), fp32, three
prompts (text, a chat, code) × 16 greedy tokens per rung: the default engine (compiled decode
steps on a CPU, as a learner gets it; the first run on a machine compiles), then the eager
rungs (``compile=False``): naive, contiguous, paged with each CPU attention backend, int8 and
int4 weights, an int8 KV pool, prompt-lookup speculation. Prints each rung as
identical or not and writes ``compare-tokens-<date>.json``. Not a test: it needs two checkouts.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROMPTS = ["The capital of France is", [{"role": "user", "content": "Name three colours."}], "def fib(n):"]
EAGER = {"compile": False}  # the ladder below the compiled step
RUNGS = {
    "default (compiled)": {},
    "naive": {"mode": "naive", **EAGER},
    "contiguous": {"mode": "contiguous", **EAGER},
    "paged sdpa": {"attention_backend": "sdpa", **EAGER},
    "paged cpu kernel": {"attention_backend": "cpu", **EAGER},
    "paged torch": {"attention_backend": "torch", **EAGER},
    "int8": {"quantization": "int8", **EAGER},
    "int4 g32": {"quantization": "int4", "quantization_group_size": 32, **EAGER},
    "int8 KV pool": {"kv_cache_dtype": "int8", **EAGER},
    "ngram k=3": {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}},
}

# Run inside each checkout's process: only the public API, so any checkout can run it.
WORKER = """
import json, sys
import torch
torch.set_num_threads(2)
from minillm import LLM, SamplingParams
model, prompts, rungs = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
greedy = SamplingParams(max_tokens=16, ignore_eos=True)

def ready(llm):  # a compiled step built in the background (checkouts from issue 27 on): use it
    getattr(llm, "wait_for_fast_path", lambda: None)()
    return llm

print(json.dumps({name: [o.token_ids for o in ready(LLM(model, dtype="fp32", **options)).generate(prompts, greedy)]
                  for name, options in rungs.items()}))
"""


def tokens(checkout: Path, model: str) -> dict[str, list[list[int]]]:
    env = dict(os.environ, PYTHONPATH=str(checkout))
    env.setdefault("MINILLM_CACHE", str(HERE.parent / ".cache" / "minillm"))
    cmd = [sys.executable, "-c", WORKER, model, json.dumps(PROMPTS), json.dumps(RUNGS)]
    proc = subprocess.run(cmd, cwd=checkout, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{checkout} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("baseline", type=Path)
    parser.add_argument("candidate", type=Path, nargs="?", default=HERE.parent)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args(argv)
    base, cand = tokens(args.baseline.resolve(), args.model), tokens(args.candidate.resolve(), args.model)
    rows = {name: {"identical": base[name] == cand[name], "baseline": base[name], "candidate": cand[name]}
            for name in RUNGS}  # fmt: skip
    for name, row in rows.items():
        print(f"{name:18s} {'identical' if row['identical'] else 'DIFFERENT'}")
    import torch

    from minillm.machine import machine_description, machine_tag

    commits = {}
    for key, path in (("baseline", args.baseline), ("candidate", args.candidate)):
        proc = subprocess.run(["git", "-C", str(path), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        commits[key] = proc.stdout.strip() or "unknown"
    result = {"benchmark": "compare_tokens", "date": time.strftime("%Y-%m-%d"), "model": args.model,
              "commits": commits, "machine": machine_description(torch.device("cpu")), "rungs": rows}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"compare-tokens-{result['date']}-{machine_tag(result['machine'])}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"{sum(r['identical'] for r in rows.values())}/{len(rows)} rungs identical; wrote {path}")
    return result


if __name__ == "__main__":
    main()
