"""The committed ``benchmarks/bench_parallel.py`` results, for chapter 09 and the benchmark itself:
the newest JSON and its tables (one formatting for both)."""

from __future__ import annotations

import json
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent.parent.parent / "benchmarks" / "results"
PARTS = ("tp", "bubble", "disagg", "offload")


def committed_parallel_result(folder: str | Path = RESULTS_DIR) -> dict | None:
    """The newest ``parallel-<date>-cpu.json`` (None if there is none)."""
    found = sorted(Path(folder).glob("parallel-[0-9]*-cpu.json"))
    return json.loads(found[-1].read_text()) if found else None


def parallel_table(result: dict, part: str) -> str:
    """One part's table of a ``bench_parallel.py`` result, as Markdown."""
    rows = result[part]
    if part == "tp":
        lines = ["| setup | batch | decode tok/s | step ms | compute ms | comm ms | all-reduced B/token (formula) |",
                 "|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
        for r in rows:
            # A pipeline's spans are per micro-batch of one stage, and its sends are not collectives.
            split = f"{r['compute_ms']:.1f} | {r['comm_ms']:.1f}" if r["setup"].startswith("TP") else "– | –"
            measured = f"{r['all_reduce_bytes_per_token']:.0f}" if r["setup"].startswith("TP") else "–"
            formula = r.get("formula_all_reduce_bytes_per_token", "–")
            lines.append(f"| {r['setup']} | {r['batch']} | {r['tok_s']:.1f} | {r['step_ms']:.1f} | {split} | {measured} ({formula}) |")  # fmt: skip
    elif part == "bubble":
        lines = ["| PP=2 micro-batches | batch-8 tok/s | bubble |", "|---:|---:|---:|"]
        lines += [f"| {r['microbatches']} | {r['tok_s']:.1f} | {r['bubble']:.0%} |" for r in rows]
    elif part == "disagg":
        lines = ["| serving | chat TTFT p50 ms | chat TPOT p50 ms | chat token gap p99 ms | max gap ms | long TTFT p50 ms |",
                 "|---|---:|---:|---:|---:|---:|"]  # fmt: skip
        for name in ("colocated", "disaggregated"):
            r = rows[name]
            lines.append(f"| {name} | {r['chat_ttft_p50_ms']:.0f} | {r['chat_tpot_p50_ms']:.0f} | "
                         f"{r['chat_token_gap_p99_ms']:.0f} | {r['chat_token_gap_max_ms']:.0f} | {r['long_ttft_p50_ms']:.0f} |")  # fmt: skip
    elif part == "offload":
        lines = ["| weights | batch-1 decode tok/s | step ms |", "|---|---:|---:|"]
        lines += [f"| {r['weights']} | {r['tok_s']:.1f} | {r['step_ms']:.1f} |" for r in rows]
    else:
        raise ValueError(f"part={part!r}: expected one of {PARTS}")
    return "\n".join(lines)


def parallel_tables(result: dict) -> str:
    """Every part the result has, one table each."""
    return "\n\n".join(parallel_table(result, part) for part in PARTS if part in result)
