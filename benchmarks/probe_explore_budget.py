"""The speculation governor's exploring budget and back-off, tried on ``bench_eagle_tree.py``'s batch-8 run.

    python benchmarks/probe_explore_budget.py BUDGET BACKOFF OUT_DIR [--engines default "ngram k4"]

Sets ``SpeculationGovernor.EXPLORE_BUDGET`` (the share of time tries of slower candidates may
cost; shipped 0.02) and ``BACKOFF`` (shipped 4) for this process, then runs ``bench_eagle_tree.py
--batch 8 --chats 16 --runs 10`` with the engines given, writing its JSON and log to OUT_DIR.
Run it once with the shipped values and once with others to compare them in like conditions
(docs/benchmarks.md, "2026-12-07 (stop 72)").
"""

from __future__ import annotations

import argparse

import bench_eagle_tree as bench

from minillm.speculative.governor import SpeculationGovernor


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("budget", type=float)
    parser.add_argument("backoff", type=int)
    parser.add_argument("out")
    parser.add_argument("--engines", nargs="+", default=["default", "ngram k4"])
    args = parser.parse_args()
    SpeculationGovernor.EXPLORE_BUDGET, SpeculationGovernor.BACKOFF = args.budget, args.backoff
    print(f"EXPLORE_BUDGET={args.budget} BACKOFF={args.backoff}", flush=True)
    bench.main(["--batch", "8", "--chats", "16", "--runs", "10", "--engines", *args.engines, "--out", args.out])


if __name__ == "__main__":
    main()
