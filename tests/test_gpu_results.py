"""Chapters 02, 05 and 06 show a GPU's figures on a machine without one: the committed run's,
labelled with its card and date — never passed off as this machine's."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from minillm.viz import gpu_results
from minillm.viz.gpu_results import committed_gpu_run, gpu_figures, print_gpu_figures

COMMITTED = gpu_results.RESULTS_DIR / "gpu-2026-12-04"
no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU, prefill and decode are measured live")


def test_the_newest_committed_run_with_its_profile_and_serving_run():
    run = committed_gpu_run()
    assert run["card"] == "NVIDIA H200" and run["date"] >= "2026-12-04"
    assert run["source"].startswith("benchmarks/results/gpu-")
    assert run["profile"] is not None and run["serving"] is not None


def committed_copy(tmp_path: Path) -> Path:
    folder = tmp_path / "results"
    shutil.copytree(COMMITTED, folder / COMMITTED.name)
    return folder


def test_tables_hold_the_committed_figures(tmp_path):
    run = committed_gpu_run(committed_copy(tmp_path))
    prefill = gpu_results.prefill_table(run)
    assert [r["tokens"] for r in prefill] == [2048, 8192, 16384]
    assert 0.12 < prefill[0]["ours_vs_sdpa"] < 0.14  # 0.828 ms against SDPA's 0.110
    decode = {(r["batch"], r["context"]): r for r in gpu_results.decode_table(run)}
    assert decode[(64, 4096)]["tuned_choice"] == "gather+sdpa" and round(decode[(64, 4096)]["ours_pct_bandwidth"]) == 12
    step = {r["setup"]: r for r in gpu_results.step_table(run)}
    assert round(step["eager, fused on"]["kernels"]) == 469 and 4.0 < step["graphs, fused on"]["wall_ms"] < 4.1
    assert [round(r["wasted"], 3) for r in gpu_results.kv_table(run)] == [0.955, 0.020]
    assert gpu_results.steps_table(run) == []  # that run is older than the kernel's steps


def test_a_newer_run_wins_and_brings_its_steps(tmp_path):
    folder = committed_copy(tmp_path)
    bench = json.loads((folder / COMMITTED.name / "gpu-2026-12-04-NVIDIA_H200.json").read_text())
    step = {"ms": 1.0, "tflops": 300.0, "vs_sdpa": 0.6, "max_abs_error_vs_sdpa": 0.01}
    bench |= {"date": "2026-12-09T10:00:00+00:00", "flash_steps": [{"tokens": 2048, "head_dim": 64, "sdpa_ms": 0.6,
                                                                     "steps": {"+ exp2 (as shipped)": step}}]}  # fmt: skip
    bench["machine"]["gpu"] = "NVIDIA H100"
    (folder / "gpu-2026-12-09").mkdir()
    (folder / "gpu-2026-12-09" / "gpu-2026-12-09-NVIDIA_H100.json").write_text(json.dumps(bench))
    run = committed_gpu_run(folder)
    assert (run["card"], run["date"]) == ("NVIDIA H100", "2026-12-09")
    assert run["profile"] is None  # only what sits beside that run's JSON
    assert gpu_results.steps_table(run)[0]["vs_sdpa"] == 0.6


@no_gpu
def test_the_figures_say_whose_they_are(tmp_path, capsys):
    folder = committed_copy(tmp_path)
    source, rows = gpu_figures("decode", folder)
    assert "NVIDIA H200" in source and "2026-12-04" in source and "not this machine" in source and rows
    print_gpu_figures("prefill", folder)
    out = capsys.readouterr().out
    assert out.startswith("NVIDIA H200, committed run of 2026-12-04") and "0.13x SDPA's speed" in out
    print_gpu_figures("steps", folder)
    assert "older than the kernel's steps" in capsys.readouterr().out


@no_gpu
def test_no_committed_run_says_how_to_get_one(tmp_path):
    assert committed_gpu_run(tmp_path) is None
    source, rows = gpu_figures("prefill", tmp_path)
    assert rows == [] and "gpu_checks.sh" in source


def test_an_unknown_kind_is_refused():
    with pytest.raises(ValueError, match="kind='memory' is not one of"):
        gpu_figures("memory")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_gpu_measures_live():
    source, rows = gpu_figures("prefill")
    assert "measured now" in source and [r["tokens"] for r in rows] == [2048, 8192]
    source, rows = gpu_figures("decode")
    assert "measured now" in source and all(r["ours_ms"] > 0 for r in rows)
