"""Run this repository's benchmarks on two checkouts, interleaved, and compare their ratios vs HF.

    git worktree add /tmp/before <commit>
    python benchmarks/compare_checkouts.py /tmp/before . --rounds 2

Each round runs ``bench_generate.py`` and ``bench_serving.py`` of both checkouts, alternating
which goes first, each in its own process importing its own ``minillm`` (``PYTHONPATH``). Both
benchmarks measure minillm against HF ``generate()`` inside the same process, so the ratios —
not absolute speeds — are what a change should not lower; the machine's drift between runs
cancels in them. Prints every round's ratios and the median per checkout, and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def generate_ratios(result: dict) -> dict[str, float]:
    """Decode tok/s and TTFT of minillm vs HF, per (dtype, batch) row."""
    out = {}
    for row in result["rows"]:
        key = f"{row['dtype']} b{row['batch']}"
        out[f"generate {key} decode vs HF"] = row["minillm"]["decode_tok_s"] / row["hf"]["decode_tok_s"]
        out[f"generate {key} TTFT HF/minillm"] = row["hf"]["ttft_ms"] / row["minillm"]["ttft_ms"]
    return out


def decode_step_ratios(result: dict) -> dict[str, float]:
    """Decode step speed relative to nothing: 1000 / TPOT, so that higher is better here too."""
    return {f"decode steps/s {r['dtype']} b{r['batch']}": 1000 / r["tpot_ms"] for r in result["rows"]}


def serving_ratios(result: dict) -> dict[str, float]:
    targets = result["targets"]
    return {
        "serving continuous vs HF output tok/s": targets["continuous_vs_hf_output_throughput"],
        "serving prefix caching TTFT cut": targets["prefix_caching_ttft_cut"],
    }


BENCHES = {
    "generate": ("bench_generate.py", "generate-*.json", generate_ratios),
    "serving": ("bench_serving.py", "serving-*.json", serving_ratios),
    # Absolute, not vs HF: meaningful only because the two checkouts alternate in one run.
    "decode": ("bench_decode_step.py", "decode-step-*.json", decode_step_ratios),
}


def run_one(checkout: Path, bench: str, extra: list[str], log) -> dict[str, float]:
    script, pattern, ratios = BENCHES[bench]
    with tempfile.TemporaryDirectory() as out:
        env = dict(os.environ, PYTHONPATH=str(checkout))
        env.setdefault("MINILLM_CACHE", str(HERE.parent / ".cache" / "minillm"))
        # Each checkout's own script (it matches its API); one it lacks runs from here (public API only).
        own = checkout / "benchmarks" / script
        cmd = [sys.executable, str(own if own.is_file() else HERE / script), "--out", out, *extra]
        started = time.perf_counter()
        proc = subprocess.run(cmd, cwd=checkout, env=env, capture_output=True, text=True)
        log.write(f"$ {' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}\n")
        if proc.returncode != 0:
            raise SystemExit(f"{script} in {checkout} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
        (path,) = Path(out).glob(pattern)
        figures = ratios(json.loads(path.read_text()))
        print(f"  {checkout.name or checkout}: {bench} took {time.perf_counter() - started:.0f} s", flush=True)
        return figures


def _commit(checkout: Path) -> str:
    """The checkout's commit (recorded instead of its path, which means nothing elsewhere)."""
    proc = subprocess.run(["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return proc.stdout.strip() or "unknown"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("baseline", type=Path)
    parser.add_argument("candidate", type=Path, nargs="?", default=HERE.parent)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--bench", nargs="+", choices=sorted(BENCHES), default=["generate", "serving"])
    parser.add_argument("--generate-args", default="--repeats 3", help="extra arguments for bench_generate.py")
    parser.add_argument("--serving-args", default="", help="extra arguments for bench_serving.py")
    parser.add_argument("--decode-args", default="", help="extra arguments for bench_decode_step.py")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args(argv)
    checkouts = {"baseline": args.baseline.resolve(), "candidate": args.candidate.resolve()}
    figures: dict[str, dict[str, list[float]]] = {name: {} for name in checkouts}
    args.out.mkdir(parents=True, exist_ok=True)
    log_path = args.out / "compare-checkouts.log"
    with log_path.open("w") as log:
        for r in range(args.rounds):
            order = list(checkouts) if r % 2 == 0 else list(reversed(checkouts))
            for bench in args.bench:
                extra = {"generate": args.generate_args, "serving": args.serving_args, "decode": args.decode_args}[bench].split()
                for name in order:
                    print(f"round {r + 1}, {bench}, {name}", flush=True)
                    for key, value in run_one(checkouts[name], bench, extra, log).items():
                        figures[name].setdefault(key, []).append(value)
    print(f"\n{'figure (higher is better for minillm)':44s} {'baseline':>22s} {'candidate':>22s} {'cand/base':>9s}")
    summary = {}
    for key in figures["baseline"]:
        base, cand = figures["baseline"][key], figures["candidate"][key]
        mb, mc = statistics.median(base), statistics.median(cand)
        summary[key] = {"baseline": base, "candidate": cand, "median_ratio": mc / mb}
        runs = lambda xs: "/".join(f"{x:.2f}" for x in xs)  # noqa: E731
        print(f"{key:44s} {runs(base) + f' ({mb:.2f})':>22s} {runs(cand) + f' ({mc:.2f})':>22s} {mc / mb:9.3f}")
    import torch

    from minillm.machine import machine_description

    machine = machine_description(torch.device("cpu"))
    commits = {k: _commit(v) for k, v in checkouts.items()}
    result = {"commits": commits, "rounds": args.rounds, "machine": machine, **summary}
    (args.out / "compare-checkouts.json").write_text(json.dumps(result, indent=2))
    print(f"\nwrote {args.out / 'compare-checkouts.json'} (full output in {log_path})")
    return result


if __name__ == "__main__":
    main()
