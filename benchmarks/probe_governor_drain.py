"""What the speculation governor should count when no request waits: static batches of held-out chats.

    python benchmarks/probe_governor_drain.py [--engine "ngram k4"] [--rounds 10] [--batch 8] [--chats 16]

``generate`` of ``--batch`` chats at a time (64 tokens each) has nobody waiting for a place: it is
done when its furthest-behind sequence is. Three copies of one speculative engine (SmolLM2-135M as
it ships, its step compiled and settled; ``--engine`` from ``bench_eagle_tree.ENGINES``) decode
the same chats, each round after the default engine, so every figure is a ratio to the default
engine's run just before it: as shipped (a step weighed by what it moved the sequences with the
most tokens left, ``Speculator.step_done``); weighed by every token it made (as while requests
wait); and never proposing at 2 or more running (the governor's choice at batch 1 kept).
Printed: each round's ratios, their median and mean, and what each governor decided.
The log goes to ``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import statistics
from datetime import date
from pathlib import Path

import bench_eagle_tree as bench
import torch

from minillm import LLM
from minillm.speculative.governor import SpeculationGovernor
from minillm.speculative.speculator import Speculator


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", default="ngram k4", choices=[n for n in bench.ENGINES if n != "default"])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--chats", type=int, default=16)
    args = parser.parse_args()
    from minillm.machine import machine_description
    from minillm.viz.spec import machine_words

    chats = bench.workloads(args.chats)["chat (held out)"]
    choose, propose = SpeculationGovernor.choose, Speculator.propose

    def every_token(self, running, waiting=0):
        return propose(self, running, max(waiting, 1))  # as if a request waited: every token counts

    def plain_above_1(self, batch, text=None):
        k = choose(self, batch, text)
        return k if batch <= 1 else 0

    variants = {"as shipped": {}, "every token": {"propose": every_token}, "plain at 2+": {"choose": plain_above_1}}
    engines = {"default": LLM("smollm2-135m")} | {
        name: bench.build(args.engine) for name in variants
    }
    for llm in engines.values():
        llm.wait_for_fast_path()

    def rate(name: str) -> float:
        patch = variants.get(name, {})
        SpeculationGovernor.choose = patch.get("choose", choose)
        Speculator.propose = patch.get("propose", propose)
        try:
            seconds, outs = bench.run_once(engines[name], chats, 64, args.batch)
        finally:
            SpeculationGovernor.choose, Speculator.propose = choose, propose
        return sum(len(o.token_ids) for o in outs) / seconds

    lines: list[str] = []

    def say(msg: str) -> None:
        print(msg, flush=True)
        lines.append(msg)

    machine = machine_description(torch.device("cpu"))
    say(f"probe_governor_drain, {date.today()}: {machine_words(machine)}; {args.engine}, "
        f"{args.chats} held-out chats, {args.batch} at a time, 64 tokens; ratio to the default engine's run before")  # fmt: skip
    for name in engines:  # settle: shapes seen, the governors' first measurements
        rate(name)
        rate(name)
    ratios: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(args.rounds):
        for name in variants:
            base = rate("default")
            ratios[name].append(rate(name) / base)
        say(f"round {r}: " + "  ".join(f"{name} {v[-1]:.3f}" for name, v in ratios.items()))
    for name, v in ratios.items():
        say(f"{name:>12}: median {statistics.median(v):.3f}x, mean {statistics.mean(v):.3f}x, "
            f"{min(v):.3f}-{max(v):.3f}; {engines[name].resolved.speculation}")  # fmt: skip
    out = Path(__file__).parent / "results"
    stem = f"probe-governor-drain-{date.today()}-{machine['cpu'].split()[0].replace('(R)', '')}-{torch.get_num_threads()}t"
    (out / f"{stem}.log").write_text("\n".join(lines) + "\n")
    for llm in engines.values():
        llm.close()


if __name__ == "__main__":
    main()
