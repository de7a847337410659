"""The runner's per-step block-table work: rebuilding the padded tensor from the block manager's
lists every step (what the runner did before ``runtime/block_table_rows.py``) against updating
persistent rows by what changed, for a pure decode step of many long sequences.

    python benchmarks/bench_block_tables.py

Per case: ``rows`` sequences of ``blocks`` blocks each decode one token per step (a new block
every ``block_size`` steps); both ways produce the step's ``[rows, blocks]`` tensor, checked
equal; median microseconds per step over ``steps`` steps. Prints a Markdown table; writes JSON
to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import time
from pathlib import Path

import torch

from minillm.kvcache.addressing import blocks_for, padded_block_tables
from minillm.machine import machine_description, machine_tag
from minillm.runtime.block_table_rows import BlockTableRows
from minillm.runtime.runner import ChunkInput

RESULTS = Path(__file__).parent / "results"


def rebuilt(chunks: list[ChunkInput], width: int, null: int) -> torch.Tensor:
    """The former way: pad every list in Python, then convert."""
    return torch.tensor(padded_block_tables([c.block_table for c in chunks], width, null), dtype=torch.long)


def run_case(rows: int, blocks: int, block_size: int, steps: int) -> dict:
    null = 0
    tables = [list(range(1 + r * (blocks + steps), 1 + r * (blocks + steps) + blocks)) for r in range(rows)]
    lengths = [blocks * block_size - block_size // 2] * rows
    persistent = BlockTableRows(null, block_size)
    times: dict[str, list[float]] = {"rebuilt": [], "rows": []}
    for step in range(steps):
        chunks = [ChunkInput(r, [1], lengths[r] - 1, 1, t) for r, t in enumerate(tables)]
        width = blocks_for(max(lengths), block_size)
        start = time.perf_counter()
        old = rebuilt(chunks, width, null)
        times["rebuilt"].append(time.perf_counter() - start)
        start = time.perf_counter()
        new = persistent.gather(chunks, width)
        if step:  # the first step writes every row whole
            times["rows"].append(time.perf_counter() - start)
        if not torch.equal(old, new):
            raise AssertionError("the two ways disagree")
        for r, t in enumerate(tables):
            lengths[r] += 1
            if lengths[r] > len(t) * block_size:
                t.append(t[-1] + 1)
    rebuilt_us = 1e6 * statistics.median(times["rebuilt"])
    rows_us = 1e6 * statistics.median(times["rows"])
    return {"rows": rows, "blocks": blocks, "rebuilt_us": rebuilt_us, "rows_us": rows_us, "ratio": rebuilt_us / rows_us}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--blocks", type=int, nargs="+", default=[8, 32, 128, 512])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    cases = [run_case(r, b, args.block_size, args.steps) for r in args.rows for b in args.blocks]
    machine = machine_description(torch.device("cpu"))
    result = {
        "benchmark": "block_tables",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "args": vars(args),
        "machine": machine,
        "cases": cases,
    }
    lines = [
        "| rows | blocks each | rebuilt from lists µs/step | persistent rows µs/step | ratio |",
        "|---:|---:|---:|---:|---:|",
    ]
    for c in cases:
        lines.append(
            f"| {c['rows']} | {c['blocks']} | {c['rebuilt_us']:.0f} | {c['rows_us']:.0f} | {c['ratio']:.1f}x |"
        )
    print("\n".join(lines))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"block-tables-{result['date'][:10]}-{machine_tag(machine)}.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {path}")
    return result


if __name__ == "__main__":
    main()
