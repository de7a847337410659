"""A learner's first start, measured as they meet it: cold cache, default engine, fresh process.

    python benchmarks/bench_first_start.py                  # SmolLM2-135M, default settings
    python benchmarks/bench_first_start.py --think 5 --max-wait 900

Each scenario runs in a fresh Python process (a new notebook kernel), timed from before
``import minillm``:

* **cold** — a fresh ``MINILLM_CACHE`` holding only the converted model (no compiled packages,
  no inductor cache, no machine measurements): ``LLM(model)`` with the defaults, a first chat
  answer, then a "learner" who runs a 32-token generation every ``--think`` seconds until the
  compiled decode step (built in the background) is ready and measured;
* **warm** — the same again, now that the packages are on disk;
* **eager** — ``compile=False`` on the warm cache: the reference the background build must not
  slow down much while it runs.

Reported: the first answer's time; when decode reached the compiled rate (the first generation
within 10% of the final compiled TPOT); the eager TPOT while the compiler runs next to it vs the
eager engine alone; the compiled TPOT. Writes JSON and a Markdown table under
``benchmarks/results/`` named with the date and the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path
from statistics import median

RESULTS = Path(__file__).parent / "results"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "The three primary colours are"


def scenario(model: str, compile_default: bool, think: float, max_wait: float) -> dict:
    """One fresh process's start (run with --scenario): JSON on stdout's last line."""
    started = time.perf_counter()
    from minillm import LLM, SamplingParams

    imported = time.perf_counter() - started
    llm = LLM(model) if compile_default else LLM(model, compile=False)
    constructed = time.perf_counter() - started
    first = llm.generate(CHAT, SamplingParams(max_tokens=32))[0]
    out = {
        "import_s": imported,
        "engine_s": constructed,
        "first_answer_s": time.perf_counter() - started,
        "first_answer_text": first.text,
        "status_at_first_answer": str(llm.fast_path_status()),
        "resolved": str(llm.resolved),
        "runs": [],
    }
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    after_ready = 0
    while time.perf_counter() - started < max_wait:
        status = llm.fast_path_status()
        o = llm.generate(PROMPT, params)[0]
        out["runs"].append({"t": time.perf_counter() - started, "tpot_ms": 1000 * o.metrics.tpot,
                            "state": status.state, "ready": list(status.ready)})  # fmt: skip
        if status.state in ("ready", "failed", "off"):
            after_ready += 1
            if after_ready == 3:
                break
        time.sleep(think)
    final = llm.fast_path_status()
    out["final_status"] = str(final)
    out["build_s"] = final.seconds
    return out


def run_scenario(args, cache: Path, compile_default: bool) -> dict:
    env = {**os.environ, "MINILLM_CACHE": str(cache)}
    env.pop("MINILLM_COMPILE", None)  # the default, as a learner gets it
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)  # minillm's own, under the cache
    command = [sys.executable, __file__, "--scenario", "on" if compile_default else "off", "--model", args.model,
               "--think", str(args.think), "--max-wait", str(args.max_wait)]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"scenario failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def summarize(name: str, r: dict) -> dict:
    runs = r["runs"]
    compiled = [x["tpot_ms"] for x in runs if x["state"] == "ready"]
    eager_while_building = [x["tpot_ms"] for x in runs if x["state"] == "building"]
    rate = median(compiled[-2:]) if compiled else None
    reached = next((x["t"] for x in runs if rate and x["state"] == "ready" and x["tpot_ms"] <= 1.1 * rate), None)
    return {
        "scenario": name,
        "first_answer_s": round(r["first_answer_s"], 1),
        "engine_s": round(r["engine_s"], 1),
        "compiled_rate_reached_s": round(reached, 1) if reached else None,
        "build_s": round(r["build_s"], 1),
        "tpot_eager_while_building_ms": round(median(eager_while_building), 1) if eager_while_building else None,
        "tpot_final_ms": round(median([x["tpot_ms"] for x in runs[-2:]]), 1),
        "final_status": r["final_status"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--think", type=float, default=5.0, help="seconds between a learner's generations")
    parser.add_argument("--max-wait", type=float, default=1200.0, help="give up waiting for the compiled step")
    parser.add_argument("--scenario", choices=["on", "off"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.scenario:
        print(json.dumps(scenario(args.model, args.scenario == "on", args.think, args.max_wait)))
        return 0

    from minillm.assets import cache_dir, resolve_model
    from minillm.machine import machine_description, machine_tag

    source = resolve_model(args.model)  # converted once into the developer's cache
    with tempfile.TemporaryDirectory(prefix="minillm-cold-") as tmp:
        cache = Path(tmp)
        (cache / source.name).symlink_to(source)  # the converted model only
        raw = {}
        for name, compile_default in (("cold", True), ("warm", True), ("eager", False)):
            print(f"{name} ...", file=sys.stderr, flush=True)
            raw[name] = run_scenario(args, cache, compile_default)
    rows = [summarize(name, r) for name, r in raw.items()]
    machine = machine_description(__import__("torch").device("cpu"))
    result = {"date": str(date.today()), "model": args.model, "think_s": args.think, "machine": machine,
              "cache": str(cache_dir()), "rows": rows, "raw": raw}  # fmt: skip
    table = [
        f"First start of `LLM({args.model!r})`, fresh process each, a generation every {args.think:.0f} s "
        f"({machine['cpu']}, {machine['torch_threads']} threads, flags {' '.join(machine['cpu_flags'])})",
        "",
        "| start | first answer | compiled rate reached | background build | TPOT eager while building | TPOT at the end |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        reached = f"{r['compiled_rate_reached_s']:.0f} s" if r["compiled_rate_reached_s"] else "-"
        building = f"{r['tpot_eager_while_building_ms']:.1f} ms" if r["tpot_eager_while_building_ms"] else "-"
        table.append(f"| {r['scenario']} | {r['first_answer_s']:.1f} s | {reached} | {r['build_s']:.0f} s "
                     f"| {building} | {r['tpot_final_ms']:.1f} ms |")  # fmt: skip
    text = "\n".join(table)
    print(text)
    RESULTS.mkdir(exist_ok=True)
    stem = f"first-start-{args.model}-{result['date']}-{machine_tag(machine)}-{machine['torch_threads']}t"
    (RESULTS / f"{stem}.json").write_text(json.dumps(result, indent=1))
    (RESULTS / f"{stem}.md").write_text(text + "\n")
    print(f"wrote {RESULTS / stem}.json/.md", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
