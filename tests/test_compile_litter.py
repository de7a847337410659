"""The compile leaves no litter: job files named after their owner, removed when it is gone,
and a cache report with a clean command (issue 50, item 2)."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from minillm.runtime import compile_files
from minillm.runtime.compile_files import owned_prefix, owner, sweep_stale, temporary_files
from minillm.runtime.compile_worker import read_job
from minillm.tools import cache


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_owner_reads_the_process_id_of_each_kind_of_temporary_file():
    assert owner(Path("job-123-abcd.pkl")) == 123
    assert owner(Path("tensors-45-x_y.pt")) == 45
    assert owner(Path("decode-b4-0123456789abcdef0123.678.partial.pt2")) == 678
    assert owner(Path("decode-b4-0123456789abcdef0123.pt2.sha256.910.partial")) == 910
    assert owner(Path("decode-b4-0123456789abcdef0123.pt2")) is None
    assert owner(Path("decode-b4-0123456789abcdef0123.pt2.sha256")) is None
    assert owner(Path("compiler.lock")) is None
    assert owned_prefix("job") == f"job-{os.getpid()}-"


def test_sweep_removes_files_of_dead_and_reused_process_ids_and_keeps_the_living(tmp_path):
    dead = _dead_pid()
    gone = [tmp_path / f"job-{dead}-a.pkl", tmp_path / f"tensors-{dead}-b.pt", tmp_path / f"decode-b1-x.{dead}.partial.pt2",
            tmp_path / f"decode-b1-x.pt2.sha256.{dead}.partial"]  # fmt: skip
    reused = tmp_path / "job-1-c.pkl"  # pid 1 is alive, but started long before... the file's date is set older
    mine = [tmp_path / f"job-{os.getpid()}-d.pkl", tmp_path / f"decode-b1-y.{os.getpid()}.partial.pt2"]
    kept = [tmp_path / "decode-b1-z.pt2", tmp_path / "decode-b1-z.pt2.sha256", tmp_path / "decode-b1-z.lock"]
    for path in gone + [reused] + mine + kept:
        path.write_bytes(b"x")
    os.utime(reused, (1.0, 1.0))  # written in 1970: before process 1 started, so its owner is gone
    removed = sweep_stale(tmp_path)
    assert sorted(removed) == sorted(gone + [reused])
    assert all(p.exists() for p in mine + kept)
    assert temporary_files(tmp_path) == sorted(mine)


def test_a_worker_removes_its_job_files_as_it_reads_them(tmp_path):
    import torch

    tensors = tmp_path / f"tensors-{os.getpid()}-t.pt"
    torch.save({"w": torch.arange(3)}, tensors)
    job_file = tmp_path / f"job-{os.getpid()}-j.pkl"

    job_file.write_bytes(pickle.dumps(SimpleNamespace(tensors=str(tensors))))
    read, handle = read_job(str(job_file))
    assert not job_file.exists() and not tensors.exists()  # gone from the folder at once
    with handle:
        assert torch.load(handle, weights_only=True)["w"].tolist() == [0, 1, 2]  # still readable


def test_cache_report_and_clean(tmp_path):
    (tmp_path / "compiled").mkdir()
    (tmp_path / "compiled" / "decode-b1-a.pt2").write_bytes(b"x" * 1000)
    (tmp_path / "compiled" / "decode-b1-a.pt2.sha256").write_text("00\n")
    (tmp_path / "compiled" / f"job-{_dead_pid()}-a.pkl").write_bytes(b"x" * 10)
    running = tmp_path / "compiled" / f"tensors-{os.getpid()}-b.pt"
    running.write_bytes(b"x" * 10)
    (tmp_path / "compiled" / "trust.key").write_bytes(b"k" * 32)
    (tmp_path / "compiled" / "kernels" / "ab").mkdir(parents=True)
    (tmp_path / "compiled" / "kernels" / "ab" / "kernel.so").write_bytes(b"x" * 100)
    (tmp_path / "inductor" / "ab").mkdir(parents=True)
    (tmp_path / "inductor" / "ab" / "k.so").write_bytes(b"x" * 500)
    (tmp_path / "smollm2-135m").mkdir()
    (tmp_path / "smollm2-135m" / "model.safetensors").write_bytes(b"x" * 2000)
    entries = {e.name: e for e in cache.report(tmp_path)}
    assert entries["smollm2-135m"].bytes == 2000 and entries["smollm2-135m"].what == "a converted model"
    assert entries["compiled"].files == 6 and entries["inductor"].bytes == 500
    assert entries["compiled/ (temporary)"].files == 2 and "1 of them stale" in entries["compiled/ (temporary)"].what
    assert "in all" in cache.format_report(list(entries.values()), tmp_path)
    cache.clean(tmp_path)
    # a running compile's file stays, and the key its records are keyed by; the kernel's library goes
    assert sorted(p.name for p in (tmp_path / "compiled").iterdir()) == sorted([running.name, "trust.key", "minillm-tree.lock"])
    assert list((tmp_path / "inductor").iterdir()) == [tmp_path / "inductor" / "minillm-tree.lock"]  # emptied, lock kept
    assert (tmp_path / "smollm2-135m" / "model.safetensors").exists()
    (tmp_path / "inductor" / "cd").mkdir(parents=True)
    (tmp_path / "inductor" / "cd" / "k.so").write_bytes(b"x")
    from minillm import trusted_cache

    with trusted_cache.holding(tmp_path / "inductor"):  # a compile running there now (another process's, in life)
        import subprocess as sp

        sp.run([sys.executable, "-c", f"from minillm.tools import cache; cache.clean(__import__('pathlib').Path({str(tmp_path)!r}))"],
               check=True, env=dict(os.environ, MINILLM_CACHE=str(tmp_path)))  # fmt: skip
        assert (tmp_path / "inductor" / "cd" / "k.so").exists()  # left as it is
    cache.clean(tmp_path, everything=True)
    assert list(tmp_path.iterdir()) == []


def test_the_cache_command_reports_and_cleans(tmp_path, monkeypatch, capsys):
    from minillm.cli import main

    monkeypatch.setenv("MINILLM_CACHE", str(tmp_path))
    (tmp_path / "inductor").mkdir()
    (tmp_path / "inductor" / "k.so").write_bytes(b"x" * 100)
    assert main(["cache"]) == 0
    assert "inductor" in capsys.readouterr().out
    assert main(["cache", "clean"]) == 0
    assert "removed 1 entries" in capsys.readouterr().out and not (tmp_path / "inductor" / "k.so").exists()


def test_killing_an_engine_mid_compile_ten_times_leaves_no_job_files(tiny_model, tmp_path):
    """Start an engine whose step compiles in the background, SIGKILL it once its worker is
    compiling, ten times over: the cache holds no temporary compile files afterwards (each
    start sweeps the dead ones; each worker removes its own when its parent dies), and at most
    one package per name."""
    script = textwrap.dedent(f"""
        import time
        from pathlib import Path
        from minillm import LLM
        from minillm.runtime import compiled_decode
        compiled_decode.packages_dir = lambda: Path({str(tmp_path)!r})
        llm = LLM({str(tiny_model)!r}, compile=True, compile_batch_sizes=(1,), dtype="fp32")
        while "compiling the" not in llm.fast_path_status().detail:
            time.sleep(0.02)
        print("compiling", flush=True)
        time.sleep(600)
    """)
    left_by_a_killed_engine = [tmp_path / f"job-{_dead_pid()}-old.pkl", tmp_path / f"tensors-{_dead_pid()}-old.pt"]
    for path in left_by_a_killed_engine:  # as an engine killed between writing them and its worker reading them leaves them
        path.write_bytes(b"x" * 100)
    for _ in range(10):
        proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout.readline().strip() == "compiling"
        finally:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
    deadline = time.monotonic() + 20  # the last worker notices its parent has gone within a second
    while temporary_files(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert temporary_files(tmp_path) == [] and not any(p.exists() for p in left_by_a_killed_engine)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(("job-", "tensors-")) or ".partial" in p.name] == []
    packages = [p.name for p in tmp_path.glob("decode-*.pt2")]
    assert len(packages) == len(set(packages)) <= 1


def test_is_stale_needs_a_process_start_time(monkeypatch, tmp_path):
    """Where /proc cannot say when a process started, a living owner keeps its files."""
    path = tmp_path / f"job-{os.getpid()}-a.pkl"
    path.write_bytes(b"x")
    monkeypatch.setattr(compile_files, "_started", lambda pid: 0.0)
    assert not compile_files.is_stale(path)
    monkeypatch.setattr(compile_files, "_started", lambda pid: None)
    assert compile_files.is_stale(path)


@pytest.mark.parametrize("name", ["job-abc-1.pkl", "decode-b1-x.partial.pt2"])
def test_names_without_an_owner_are_never_swept(tmp_path, name):
    (tmp_path / name).write_bytes(b"x")
    assert sweep_stale(tmp_path) == [] and (tmp_path / name).exists()


def test_the_compile_worker_gets_an_inductor_folder_of_its_own(tmp_path, monkeypatch):
    """Never the engine process's (an in-process compile holds that one shared until it exits), even
    when this process inherited minillm's folder from its parent; a folder the user chose is kept."""
    from minillm.runtime.background_compile import worker_environment

    monkeypatch.setenv("MINILLM_CACHE", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    assert worker_environment(2) == {"OMP_NUM_THREADS": "2", "MINILLM_CPU_BF16_ROWS": "0",
                                     "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor-worker")}  # fmt: skip
    assert worker_environment(2, rows_kernel=True)["MINILLM_CPU_BF16_ROWS"] == "1"  # as the engine named its graphs
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # inherited from an engine's process
    assert worker_environment(1)["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor-worker")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert "TORCHINDUCTOR_CACHE_DIR" not in worker_environment(1)
