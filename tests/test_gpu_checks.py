"""The GPU check script and benchmark, checked without a GPU: a borrowed GPU's minutes must not be
spent finding that a section cannot fit its call or that a result cannot be printed."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_checks.sh"
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_gpu  # noqa: E402


def section_limits(quick: bool) -> dict[str, int]:
    """Each ``section NAME LIMIT`` the script runs in one mode (its if/else on ``$QUICK``)."""
    text = SCRIPT.read_text()
    head, branches = text.split('if [ "$QUICK" = 1 ]; then', 1)
    quick_part, full_part = branches.split("\nelse\n", 1)
    limits = {"random_weights": 20 if quick else 45}
    assert '$([ "$QUICK" = 1 ] && echo 20 || echo 45)' in head
    env = re.findall(r"^\s*timeout (\d+) ", head.split("{  # 10 s at most")[1].split("}")[0], re.M)
    limits["env"] = sum(map(int, env))
    assert limits["env"] <= 10
    for name, limit in re.findall(r"^\s*section (\w+) (\d+) ", quick_part if quick else full_part, re.M):
        limits[name] = int(limit)
    return limits


def test_the_script_parses_and_refuses_what_it_does_not_know(tmp_path):
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    done = subprocess.run(["bash", str(SCRIPT), "--quik"], env={"OUT": str(tmp_path), "MODEL_SHAPE": str(tmp_path),
                          "PATH": "/usr/bin:/bin"}, capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 2 and "usage" in done.stderr and not list(tmp_path.iterdir())


@pytest.mark.parametrize(("quick", "budget"), [(True, 200), (False, 600)])
def test_every_section_fits_one_call(quick, budget):
    """--quick in 200 s, the whole check in one 600 s call of the device tool (limits add up)."""
    limits = section_limits(quick)
    assert {"pytest_triton_cuda", "bench_kernels", "profile_step", "bench_e2e"} <= set(limits)
    assert sum(limits.values()) <= budget, limits


def test_the_flash_ladder_ends_at_the_shipped_kernel():
    from dataclasses import replace

    from minillm.attention.triton_kernels import flash_config

    steps = list(bench_gpu.flash_steps(128).values())
    shipped = flash_config(128, torch.bfloat16, torch.device("cuda"))
    assert steps[-1] == shipped and len(steps) == 5
    assert not (steps[0].input_dtype_dots or steps[0].skip_interior_masks or steps[0].exp2)
    # each step turns on one more switch than the one before
    assert [s.input_dtype_dots for s in steps] == [False, False, True, True, True]
    assert [s.skip_interior_masks for s in steps] == [False, False, False, True, True]
    assert [s.exp2 for s in steps] == [False, False, False, False, True]
    assert steps[1] == replace(shipped, input_dtype_dots=False, skip_interior_masks=False, exp2=False)


def test_tables_print_the_committed_run_and_the_new_sections():
    committed = json.loads((ROOT / "benchmarks" / "results" / "gpu-2026-12-04" / "gpu-2026-12-04-NVIDIA_H200.json").read_text())
    old = bench_gpu.format_tables(committed)
    assert "| smollm2-135m | 1 | int4 triton | 95 |" in old  # the flat rows of a run before the shape sets
    step = {"ms": 2.0, "tflops": 100.0, "vs_sdpa": 0.5, "max_abs_error_vs_sdpa": 0.01}
    new = dict(committed, flash_steps=[{"tokens": 2048, "head_dim": 64, "sdpa_ms": 1.0, "steps": {"+ exp2": step}}],
               quant_linears=[{"shapes": "llama3-8b", "layers": 2, "rows": committed["quant_linears"]}])  # fmt: skip
    text = bench_gpu.format_tables(new)
    assert "| 2048 | 64 | + exp2 | 2.000 | 100.0 | 0.50 |" in text
    assert "| llama3-8b | 1 | int4 triton |" in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU answer")
def test_without_a_gpu_the_benchmark_says_so(tmp_path, capsys):
    assert bench_gpu.main(["--out", str(tmp_path)]) == 1
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
