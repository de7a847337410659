"""What the speculation governor chooses at batch 1 against what each choice really makes.

    python benchmarks/probe_governor.py [--chats 12] [--runs 3] [--replays 40] [--save F | --steps-from F]

One engine: SmolLM2-135M as it ships (bf16 where the CPU has fast bf16 kernels, its decode step
compiled and settled) with the EAGLE head's 6-node trees (``topk`` 4, ``depth`` 2, prompt
lookup's branch grafted on) and the governor on, decoding the EAGLE recipe's held-out chats one
at a time (64 tokens), ``--runs`` times. Every pure decode step the governor records is kept:
per candidate number of proposals, how often it ran and the tokens per second its steps made
(mean of per-step rates, ratio of sums, spread). Then the governor is replayed offline
``--replays`` times, 1,200 steps each, on those recorded steps (each step a random draw from the
chosen candidate's own steps): the rate it reaches, against always choosing the best candidate
— the share lost to choosing by noisy estimates and to trying the others — for the rule as
shipped (the slower candidates together 2% of the time; a plain mean over a candidate's first 20
steps, then a moving average of weight 0.05), the rule before stop 69 (each slower candidate its
own 2%; a moving average of weight 0.25 from the first step), and the shipped rule with the old
estimate. ``--save`` keeps the recorded steps, ``--steps-from``
replays them again (another rule, no engine).
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import random
import statistics
from pathlib import Path

from minillm.speculative.governor import SpeculationGovernor

RECIPE = Path(__file__).resolve().parents[1] / "data" / "recipes" / "train_eagle_smollm2.py"
CONFIG = {"method": "eagle", "model": "smollm2-eagle", "num_speculative_tokens": 6, "topk": 4, "depth": 2}


def record_steps(num_chats: int, runs: int) -> tuple[list[tuple[int, int, float]], str]:
    from minillm import LLM, SamplingParams

    spec = importlib.util.spec_from_file_location("train_eagle_smollm2", RECIPE)
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    held = recipe.held_out_chats()
    chats = [[{"role": "user", "content": q}] for q in held[:: max(1, len(held) // num_chats)][:num_chats]]
    llm = LLM("smollm2-135m", speculative_config=CONFIG)
    llm.wait_for_fast_path()
    steps, record = [], SpeculationGovernor.record

    def recording(self, batch, k, tokens, seconds, text=None):
        steps.append((k, tokens, seconds))
        record(self, batch, k, tokens, seconds, text)

    SpeculationGovernor.record = recording  # the engine's governor may be rebuilt (a clock change): patch the class
    try:
        for _ in range(runs):
            for chat in chats:
                llm.generate([chat], SamplingParams(max_tokens=64))
    finally:
        SpeculationGovernor.record = record
    return steps, llm.resolved.speculation


class Stop69(SpeculationGovernor):
    """The rule of stop 69: an average of each step's rate (a plain mean over the first 20 steps,
    then weight 0.05), a try costing ``1/r - 1`` step-times at ``r`` of the best's rate, the
    slower candidates sharing 2% of the time, no back-off."""

    def first_weight(self, steps: int) -> float:
        return max(0.05, 1 / (steps + 1))

    def record(self, batch, k, tokens, seconds, text=None):
        candidate = self.sizes.get((self.size_class(batch), text), {}).get(k)
        if candidate is None or seconds <= 0:
            return
        rate = tokens / seconds  # kept as `tokens` over 1 s, so that `tokens_per_second` is the rate
        candidate.tokens += self.first_weight(candidate.steps) * (rate - candidate.tokens)
        candidate.seconds = 1.0
        candidate.steps += 1

    def _gap(self, candidates, best, c):
        cand = candidates[c]
        if not cand.steps:
            return 0 if cand.last_tried < 0 else self.MIN_GAP
        extra = candidates[best].tokens_per_second / cand.tokens_per_second - 1
        return max(self.MIN_GAP, extra * self.share() / self.EXPLORE_BUDGET)

    def share(self) -> int:
        return len(self.candidates) - 1  # the slower candidates share the budget


class BeforeStop69(Stop69):
    """The rule before stop 69: a moving average of weight 0.25 from the first step, and each
    slower candidate its own 2% of the time."""

    def first_weight(self, steps: int) -> float:
        return 1.0 if steps == 0 else 0.25

    def share(self) -> int:
        return 1


def replay(make, by_k: dict, replays: int, steps: int = 1200) -> tuple[float, float]:
    rates = []
    for seed in range(replays):
        draw, governor, tokens, seconds = random.Random(seed), make(), 0, 0.0
        for _ in range(steps):
            k = governor.choose(1)
            t, s = draw.choice(by_k[k])
            governor.record(1, k, t, s)
            tokens, seconds = tokens + t, seconds + s
        rates.append(tokens / seconds)
    return statistics.mean(rates), min(rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--chats", type=int, default=12)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--replays", type=int, default=40)
    parser.add_argument("--save", help="write the recorded steps to this JSON file")
    parser.add_argument("--steps-from", help="replay the steps a --save wrote instead of recording")
    args = parser.parse_args()
    import torch

    from minillm.machine import machine_description

    machine = machine_description(torch.device("cpu"))
    print(f"probe_governor: {machine['cpu']}, {machine['torch_threads']} threads; {CONFIG}")
    if args.steps_from:
        saved = json.loads(Path(args.steps_from).read_text())
        steps, resolved = [tuple(step) for step in saved["steps"]], saved["resolved"]
        print(f"steps from {args.steps_from} ({saved['machine']})")
    else:
        steps, resolved = record_steps(args.chats, args.runs)
    if args.save:
        Path(args.save).write_text(json.dumps({"machine": machine["cpu"], "config": CONFIG, "resolved": resolved,
                                               "steps": steps}) + "\n")  # fmt: skip
    by_k = collections.defaultdict(list)
    for k, t, s in steps:
        by_k[k].append((t, s))
    print(f"{'k':>3} {'steps':>6} {'mean tok/s':>11} {'sum/sum':>8} {'sd':>6} {'tokens':>7} {'ms':>6}")
    for k in sorted(by_k):
        rates = [t / s for t, s in by_k[k]]
        print(f"{k:>3} {len(rates):>6} {statistics.mean(rates):>11.1f} "
              f"{sum(t for t, _ in by_k[k]) / sum(s for _, s in by_k[k]):>8.1f} {statistics.pstdev(rates):>6.1f} "
              f"{statistics.mean(t for t, _ in by_k[k]):>7.2f} {1000 * statistics.mean(s for _, s in by_k[k]):>6.1f}")  # fmt: skip
    print(f"the engine's governor at the end: {resolved}")
    best = max(by_k, key=lambda k: sum(t for t, _ in by_k[k]) / sum(s for _, s in by_k[k]))
    oracle = sum(t for t, _ in by_k[best]) / sum(s for _, s in by_k[best])
    k = max(by_k)
    rules = {
        "the governor as shipped": SpeculationGovernor,
        "as shipped without the back-off": type("NoBackoff", (SpeculationGovernor,), {"BACKOFF": 1}),
        "stop 69's (an average of step rates, a try's cost 1/r - 1)": Stop69,
        "before stop 69 (each candidate its own 2%, a moving average of 0.25)": BeforeStop69,
    }
    print(f"replayed on these steps ({args.replays} x 1,200 steps): always k={best} {oracle:.1f} tok/s")
    for name, rule in rules.items():
        rate, worst = replay(lambda rule=rule: rule(k), by_k, args.replays)
        print(f"  {name}: {rate:.1f} tok/s ({rate / oracle:.1%}, worst {worst:.1f})")


if __name__ == "__main__":
    main()
