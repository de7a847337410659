"""Where chain drafting loses its proposals: acceptance per draft position and the accepted length
per verify step, for each proposer, on held-out chat prompts.

    python benchmarks/eval_spec_positions.py [--k 4] [--max-tokens 64] [--threads 2] [--out FILE.json]

SmolLM2-135M (bf16, the engine a user gets, decode eager: acceptance does not depend on the
compiled step) answers the 8 held-out prompts of the draft recipes (none trained on) greedily,
with each proposer at a fixed k (``"adaptive": false``: every decoding step verifies k
proposals). A recorder on hook ``verify`` (``viz/spec.py``'s ``trace_speculation``) sees every
verify step. Position i's acceptance is the share of steps that reached proposal i (all before
it accepted) and accepted it too — a chain's i-th guess is scored only when the i - 1 before it
were right, so these are the conditional rates a tree's branches at depth i would need to beat.
Issue 48 asks for exactly these before and after a new head.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import torch

from minillm import LLM, SamplingParams
from minillm.machine import machine_description
from minillm.viz.spec import trace_speculation

RECIPES = Path(__file__).resolve().parents[1] / "data" / "recipes"
PROPOSERS = {
    "ngram": {"method": "ngram", "prompt_lookup_max": 4, "prompt_lookup_scaled": False},  # k proposals a step
    "draft": {"method": "draft", "model": "smollm2-draft"},
    "eagle": {"method": "eagle", "model": "smollm2-eagle"},
}


def position_stats(trace, k: int) -> dict:
    """Per position i (1..k): steps that reached it and accepted it; the accepted-length histogram."""
    reached, accepted, lengths, steps = [0] * k, [0] * k, [0] * (k + 1), 0
    for rows in trace.steps.values():
        for step in rows:
            if not step.drafts:
                continue
            steps += 1
            n = step.accepted
            lengths[n] += 1
            for i in range(min(len(step.drafts), n + 1)):
                reached[i] += 1
                accepted[i] += i < n
    return {
        "verify_steps": steps,
        "acceptance_by_position": [a / r if r else None for a, r in zip(accepted, reached)],
        "reached_by_position": reached,
        "accepted_length_histogram": lengths,
        "mean_accepted_length": sum(i * c for i, c in enumerate(lengths)) / steps if steps else None,
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    spec = importlib.util.spec_from_file_location("distill", RECIPES / "distill_smollm2_draft.py")
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    prompts = [[{"role": "user", "content": p}] for p in recipe.EVAL_PROMPTS]
    params = SamplingParams(max_tokens=args.max_tokens)
    machine = machine_description(torch.device("cpu"))
    print(f"SmolLM2-135M bf16, k = {args.k} fixed, {len(prompts)} held-out chat prompts, {args.max_tokens} tokens, greedy; "
          f"{machine['cpu']}, {args.threads} threads")  # fmt: skip
    header = "".join(f"{'pos ' + str(i + 1):>9}" for i in range(args.k))
    print(f"{'proposer':>9}{'steps':>7}{header}{'accepted/step':>15}  accepted-length histogram 0..k")
    results = {}
    for name, config in PROPOSERS.items():
        llm = LLM("smollm2-135m", compile=False,
                  speculative_config={**config, "num_speculative_tokens": args.k, "adaptive": False})  # fmt: skip
        # the chats as token ids, as the engine encodes a chat (the trace decodes its prompts back)
        ids = [llm.tokenizer.encode(llm.tokenizer.render_chat(p), add_special_tokens=False) for p in prompts]
        stats = results[name] = position_stats(trace_speculation(llm, ids, params), args.k)
        rates = "".join(f"{'–' if r is None else f'{r:.0%}':>9}" for r in stats["acceptance_by_position"])
        print(f"{name:>9}{stats['verify_steps']:>7}{rates}{stats['mean_accepted_length']:>15.2f}  "
              f"{stats['accepted_length_histogram']}", flush=True)  # fmt: skip
        del llm
    if args.out:
        Path(args.out).write_text(json.dumps({"command": "python benchmarks/eval_spec_positions.py", "k": args.k,
                                              "max_tokens": args.max_tokens, "machine": machine,
                                              "results": results}, indent=1) + "\n")  # fmt: skip
    return results


if __name__ == "__main__":
    main()
