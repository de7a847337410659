"""The CPU decode kernel's cold build, and the first answer it sits in front of, against the old way.

    python benchmarks/bench_cold_kernel.py                # 3 rounds, SmolLM2-135M
    python benchmarks/bench_cold_kernel.py --rounds 5

A learner's first ``LLM(...)`` on a fresh cache builds the C++ paged-decode kernel
(``minillm/attention/cpu_paged.py``) before the engine can answer. Each round runs four fresh
processes, each on its own empty cache (only the converted model linked in), one after another:

* ``kernel, as shipped`` — ``cpu_paged.kernel_unavailable_reason()`` alone: the instruction set
  named from PyTorch's CPU detection;
* ``kernel, inductor's pick`` — the same with inductor's ``pick_vec_isa`` (a probe build per
  instruction set, the way it was built before);
* ``first answer, as shipped`` — ``LLM(model)`` with the defaults and a 16-token chat answer, timed
  from before ``import minillm`` (the build starts in a thread while the tokenizer and weights load);
* ``first answer, before`` — the same with inductor's pick and the build started only when the
  backend is resolved.

Prints the median, min and max of each over the rounds and the ratios of the medians, with the
CPU's model and flags. Nothing else should run meanwhile (2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

ROOT = Path(__file__).resolve().parents[1]

KERNEL = """
import time; start = time.perf_counter()
from minillm import native_build
from minillm.attention import cpu_paged
if {before}:
    native_build._isa_from_cpu_flags = lambda cpu_vec_isa: None
assert cpu_paged.kernel_unavailable_reason() is None, cpu_paged.kernel_unavailable_reason()
print(time.perf_counter() - start)
"""

FIRST_ANSWER = """
import time; start = time.perf_counter()
from minillm import native_build
from minillm.attention import cpu_paged
from minillm.engine import builder
if {before}:
    native_build._isa_from_cpu_flags = lambda cpu_vec_isa: None
    builder.start_building = lambda: None
from minillm import LLM, SamplingParams
llm = LLM({model!r})
out = llm.generate([{{"role": "user", "content": "What is the capital of France?"}}], SamplingParams(max_tokens=16))[0]
assert "Paris" in out.text, out.text
assert llm.resolved.attention_backend == "cpu", llm.resolved
print(time.perf_counter() - start)
"""


def cold_run(code: str, model_dir: Path) -> float:
    """Seconds printed by ``code`` run in a fresh process on a fresh cache."""
    with tempfile.TemporaryDirectory() as cache:
        (Path(cache) / model_dir.name).symlink_to(model_dir)
        env = {k: v for k, v in os.environ.items() if k not in ("MINILLM_COMPILE", "TORCHINDUCTOR_CACHE_DIR")}
        env["MINILLM_CACHE"] = cache
        env["TORCHINDUCTOR_CACHE_DIR"] = str(Path(cache) / "inductor")  # cold too: an engine would set it so
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT)
        if done.returncode:
            raise SystemExit(f"a cold run failed:\n{done.stderr[-3000:]}")
        return float(done.stdout.strip().splitlines()[-1])


def cpu_description() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        return "unknown CPU"
    model = next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), "?")
    flags = next((line.split(":", 1)[1].split() for line in out.splitlines() if line.startswith("Flags")), [])
    wanted = [f for f in flags if f.startswith(("amx", "avx512_bf16", "avx512f", "avx2"))]
    return f"{model} (flags: {' '.join(wanted)}), {os.cpu_count()} CPUs"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    from minillm.assets import cache_dir

    model_dir = (cache_dir() / args.model).resolve()
    if not model_dir.is_dir():
        raise SystemExit(f"{model_dir} is missing: run `minillm download {args.model}` first")
    cases = {
        "kernel, as shipped": KERNEL.format(before=False),
        "kernel, inductor's pick": KERNEL.format(before=True),
        "first answer, as shipped": FIRST_ANSWER.format(before=False, model=args.model),
        "first answer, before": FIRST_ANSWER.format(before=True, model=args.model),
    }
    seconds: dict[str, list[float]] = {name: [] for name in cases}
    print(cpu_description())
    for round_ in range(args.rounds):
        for name, code in cases.items():
            seconds[name].append(cold_run(code, model_dir))
            print(f"round {round_ + 1}: {name}: {seconds[name][-1]:.1f} s", flush=True)
    print()
    for name, values in seconds.items():
        print(f"{name:26s} median {median(values):6.1f} s  (min {min(values):.1f}, max {max(values):.1f})")
    for new, old in (("kernel, as shipped", "kernel, inductor's pick"), ("first answer, as shipped", "first answer, before")):
        print(f"{new} / {old}: {median(seconds[new]) / median(seconds[old]):.2f}x")
    print(json.dumps({"cpu": cpu_description(), "seconds": seconds, "measured_at": time.strftime("%Y-%m-%d %H:%M")}))


if __name__ == "__main__":
    main()
