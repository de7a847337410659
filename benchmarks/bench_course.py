"""The course as a learner runs it: every chapter's notebook, top to bottom, with the defaults.

    python benchmarks/bench_course.py                                # every chapter, both kinds, cold + warm
    python benchmarks/bench_course.py --kinds solutions --chapters 00 09 10

Each notebook runs in a fresh Jupyter kernel (as "Restart kernel and run all cells" does) with
the environment a learner has: ``MINILLM_COMPILE`` unset (the default engine compiles its decode
step in the background), nothing else tuned. Per chapter and kind (``solutions`` = the solved
notebooks; ``notebooks`` = the student ones, whose unsolved exercise cells raise and whose
checks then fail fast, as on a learner's first run):

* **cold** — a fresh ``MINILLM_CACHE`` holding only the converted models (what ``make course``
  leaves: no compiled packages, no inductor cache, no machine measurements);
* **warm** — the same notebook again after the first start: on the cache the cold run left,
  once the course's compiled decode step is there (where the cold run started a compile,
  ``minillm warmup`` runs between the two and finishes it; its time is reported).
  That is a learner's second run, or any chapter after chapter 00's first start.

Times are wall clock from starting the kernel to the last cell's reply, with the three slowest
cells named; a run stopped by the per-cell time limit names the code cell that was running. Each
cell's time is kept twice — as the kernel stamped it, and as the client waited for it — with the
kernel's start and shutdown, so a wall time the cells do not explain (a kernel idling between
cells) shows where it went.
Error cells count unexpected errors only (a cell tagged ``raises-exception`` demonstrates one). The table says whether each meets the course's targets: ≤ 90 s warm on 2 cores,
and chapter 00 ≤ 120 s cold. Writes JSON and Markdown under ``benchmarks/results/`` named with
the date and the CPU. A benchmark, not a test: ``make test`` runs the notebooks' outputs; this
measures how long a learner waits.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from datetime import date, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results"
TARGET_WARM_S = 90.0
TARGET_COLD_00_S = 120.0


def cold_cache(into: Path) -> Path:
    """A cache as ``make course`` leaves it: links to the converted models, nothing else."""
    from minillm.assets import cache_dir

    into.mkdir(parents=True, exist_ok=True)
    for model in sorted(Path(cache_dir()).iterdir()):
        if (model / "config.json").is_file():
            (into / model.name).symlink_to(model)
    return into


def finish_first_start(cache: Path) -> float | None:
    """``minillm warmup`` on ``cache``: compiles what the cold run's background build left
    unfinished (nothing, if it finished); returns its wall time. None where the cold run
    started no compile (no decode package or its lock in ``compiled/``): that chapter's engines
    do not compile."""
    import subprocess

    if not any((cache / "compiled").glob("decode-*")):
        return None
    env = {**os.environ, "MINILLM_CACHE": str(cache)}
    env.pop("MINILLM_COMPILE", None)
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "minillm", "warmup"], env=env, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)  # fmt: skip
    return round(time.perf_counter() - start, 1)


def _stamp(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def run_notebook(path: Path, cache: Path, timeout: float) -> dict:
    """Execute one notebook in a fresh kernel with the learner's environment; time it."""
    import nbformat
    from nbclient.exceptions import CellTimeoutError, DeadKernelError

    from minillm.course.headless import HeadlessNotebookClient

    nb = nbformat.read(path, as_version=4)
    saved = dict(os.environ)
    os.environ["MINILLM_CACHE"] = str(cache)
    os.environ.pop("MINILLM_COMPILE", None)  # the default, as a learner gets it
    os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
    # headless: plain nbclient's widget emulation can leave a cell's reply unread until the timeout
    client = HeadlessNotebookClient(
        nb, timeout=timeout, allow_errors=True, kernel_name="python3", record_timing=True,
        resources={"metadata": {"path": str(path.parent)}},
    )  # fmt: skip
    start = time.perf_counter()
    stopped, running = None, None
    waits = {}  # as the client saw it: where a kernel that replied late (or idled) spent the time
    try:
        with client.setup_kernel():
            waits["kernel_start"] = time.perf_counter() - start
            for index, cell in enumerate(nb.cells):
                running, began = index, time.perf_counter()
                client.execute_cell(cell, index)
                waits[index] = time.perf_counter() - began
            running, began = None, time.perf_counter()
        waits["kernel_shutdown"] = time.perf_counter() - began
    except (CellTimeoutError, DeadKernelError) as err:
        stopped = f"{type(err).__name__} in cell {running}: {str(err).splitlines()[0][:200]}"
    finally:
        os.environ.clear()
        os.environ.update(saved)
    wall = time.perf_counter() - start
    cells, errors = [], 0
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        timing = cell.metadata.get("execution", {})
        if "iopub.execute_input" in timing and "shell.execute_reply" in timing:
            seconds = _stamp(timing["shell.execute_reply"]) - _stamp(timing["iopub.execute_input"])
            cells.append({"cell": index, "id": cell.get("id"), "s": round(seconds, 2),
                          "client_s": round(waits.get(index, 0.0), 2)})  # fmt: skip
        expected = "raises-exception" in cell.metadata.get("tags", [])  # a cell that demonstrates an error
        errors += not expected and any(o.get("output_type") == "error" for o in cell.get("outputs", []))
    if running is not None:
        source = "".join(nb.cells[running].source).splitlines()
        stopped += f" (cell {running} begins: {source[0][:80] if source else ''!r})"
    slowest = sorted(cells, key=lambda c: -c["s"])[:3]
    return {"wall_s": round(wall, 1), "cells_s": round(sum(c["s"] for c in cells), 1), "error_cells": errors,
            "stopped": stopped, "slowest": slowest, "cells": cells,
            "outside_cells_s": {k: round(v, 2) for k, v in waits.items() if isinstance(k, str)},
            "longest_client_wait": max(((i, round(w, 1)) for i, w in waits.items() if isinstance(i, int)),
                                       key=lambda x: x[1], default=None)}  # fmt: skip


def meets(chapter: str, start: str, seconds: float) -> bool | None:
    if start == "warm":
        return seconds <= TARGET_WARM_S
    if chapter.startswith("00"):
        return seconds <= TARGET_COLD_00_S
    return None  # no cold target for the other chapters


def markdown(result: dict) -> str:
    m = result["machine"]
    lines = [
        f"Every chapter with the defaults, fresh kernel each ({m['cpu']}, {m['torch_threads']} threads, "
        f"flags {' '.join(m['cpu_flags'])}; {result['date']}). Targets: ≤ {TARGET_WARM_S:.0f} s warm, "
        f"chapter 00 ≤ {TARGET_COLD_00_S:.0f} s cold.",
        "",
        "| chapter | kind | cold | warmup between | warm | errors (cold / warm) | slowest cells (warm) | target met |",
        "|---|---|---:|---:|---:|---|---|---|",
    ]
    for row in result["rows"]:
        cold, warm = row.get("cold"), row.get("warm")
        verdicts = [v for v in (row.get("cold_meets"), row.get("warm_meets")) if v is not None]
        warmup = f"{row['warmup_s']:.0f} s" if row.get("warmup_s") is not None else "-"
        slow = ", ".join(f"cell {c['cell']} {c['s']:.0f} s" for c in (warm or cold or {}).get("slowest", []))
        lines.append(
            f"| {row['chapter']} | {row['kind']} | {_fmt(cold)} | {warmup} | {_fmt(warm)} | "
            f"{(cold or {}).get('error_cells', '-')} / {(warm or {}).get('error_cells', '-')} | {slow} | "
            f"{'yes' if verdicts and all(verdicts) else 'no' if verdicts else '-'} |"
        )
    return "\n".join(lines) + "\n"


def _fmt(run: dict | None) -> str:
    if not run:
        return "-"
    return f"{run['wall_s']:.0f} s" + (" (stopped)" if run["stopped"] else "")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chapters", nargs="*", default=None, help="chapter prefixes, e.g. 00 07 (default: all)")
    parser.add_argument("--kinds", nargs="+", default=["solutions", "notebooks"], choices=["solutions", "notebooks"])
    parser.add_argument("--starts", nargs="+", default=["cold", "warm"], choices=["cold", "warm"])
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per cell before the run is stopped")
    parser.add_argument("--tag", default="", help="suffix for the result files")
    args = parser.parse_args()

    import torch

    from minillm.machine import machine_description

    machine = machine_description(torch.device("cpu"))
    rows = []
    for kind in args.kinds:
        for path in sorted((ROOT / kind).glob("[0-9][0-9]_*.ipynb")):
            if args.chapters and not any(path.stem.startswith(c) for c in args.chapters):
                continue
            row = {"chapter": path.stem, "kind": kind}
            scratch = Path(tempfile.mkdtemp(prefix="minillm-course-cache-"))
            try:
                cache = cold_cache(scratch / "cache")
                for start in ("cold", "warm"):
                    if start == "warm":
                        row["warmup_s"] = finish_first_start(cache)
                    run = run_notebook(path, cache, args.timeout)  # warm alone: the cold run still fills the cache
                    if start not in args.starts:
                        continue
                    row[start], row[f"{start}_meets"] = run, meets(path.stem, start, run["wall_s"])
                    print(f"{kind}/{path.name} {start}: {run['wall_s']:.1f} s, {run['error_cells']} error cells"
                          + (f", {run['stopped']}" if run["stopped"] else ""), flush=True)  # fmt: skip
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
            rows.append(row)
            write(args, machine, rows, final=False)  # a table so far, should the run be cut short
    write(args, machine, rows, final=True)
    return 0


def write(args, machine: dict, rows: list, final: bool) -> None:
    from minillm.machine import machine_tag

    result = {"date": str(date.today()), "command": " ".join(["benchmarks/bench_course.py", *sys.argv[1:]]),
              "machine": machine, "targets": {"warm_s": TARGET_WARM_S, "cold_00_s": TARGET_COLD_00_S},
              "rows": rows}  # fmt: skip
    text = markdown(result)
    if final:
        print(text)
    RESULTS.mkdir(exist_ok=True)
    stem = f"course-{result['date']}-{machine_tag(machine)}-{machine['torch_threads']}t{args.tag}"
    (RESULTS / f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
    (RESULTS / f"{stem}.md").write_text(f"Command: `python {result['command']}`\n\n" + text)
    if final:
        print(f"wrote {RESULTS / stem}.json/.md")


if __name__ == "__main__":
    raise SystemExit(main())
