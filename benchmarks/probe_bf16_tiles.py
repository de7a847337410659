"""Two versions of the few-row bf16 kernel (``minillm/layers/cpu_bf16_rows.cpp``), interleaved in one run.

    python benchmarks/probe_bf16_tiles.py                      # c1af19b (stop 73) against the working tree
    python benchmarks/probe_bf16_tiles.py --before <rev> --after <rev>

Each version's source is taken from git (``git show REV:path``; ``--after`` defaults to the file as
it is now), compiled with ``g++ -O3 -march=native -fopenmp`` into a temporary folder (not the engine's
cache: nothing here is loaded by minillm) and called through ``ctypes`` on one decode step's products of
SmolLM2-135M (30 layers' q/k/v, o, gate/up and down, and the 49152-row head: distinct random weights,
streamed from memory as a model's are) for M = 1 … 16 rows. Each repeat times both versions back to
back, so a slow moment of a shared machine hits both; prints the medians and their ratio with the CPU.
Needs a CPU with AVX-512 BF16 and ``g++``.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from minillm.layers import cpu_bf16_rows
from minillm.machine import machine_description

ROOT = Path(__file__).resolve().parents[1]
SOURCE = "minillm/layers/cpu_bf16_rows.cpp"
LAYER_SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # (in, out) per SmolLM2-135M layer


def build(rev: str | None, folder: Path, name: str):
    text = (ROOT / SOURCE).read_text() if rev is None else subprocess.check_output(["git", "-C", str(ROOT), "show", f"{rev}:{SOURCE}"], text=True)
    src, lib = folder / f"{name}.cpp", folder / f"{name}.so"
    src.write_text(text)
    subprocess.check_call(["g++", "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", str(src), "-o", str(lib)])
    kernel = ctypes.CDLL(str(lib)).linear_bf16_rows
    kernel.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3
    kernel.restype = None
    return kernel


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", default="c1af19b")
    parser.add_argument("--after", default=None, help="a git revision (default: the file in the working tree)")
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 16])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    machine = machine_description(torch.device("cpu"))
    print(f"probe_bf16_tiles: {machine['cpu']}, {args.threads} threads; flags {' '.join(machine['cpu_flags'])}")
    with tempfile.TemporaryDirectory() as tmp:
        kernels = {"before": build(args.before, Path(tmp), "before"), "after": build(args.after, Path(tmp), "after")}
        torch.manual_seed(0)
        weights = [torch.randn(n, k).to(torch.bfloat16) for _ in range(30) for k, n in LAYER_SHAPES]
        weights.append(torch.randn(49152, 576).to(torch.bfloat16))
        packed = [cpu_bf16_rows.pack(w) for w in weights]
        print(f"one step's products, {args.before} → {args.after or 'working tree'} (median of {args.repeats}):")
        for m in args.rows:
            xs = {k: torch.randn(m, k).to(torch.bfloat16) for k in (576, 1536)}
            outs = [torch.empty(m, p.shape[0] * 16, dtype=torch.bfloat16) for p in packed]
            calls = [(xs[p.shape[1] * 2].data_ptr(), p.data_ptr(), o.data_ptr(), m, p.shape[1] * 2, p.shape[0] * 16)
                     for p, o in zip(packed, outs)]  # fmt: skip
            times = {name: [] for name in kernels}
            for _ in range(args.repeats):
                for name, kernel in kernels.items():
                    start = time.perf_counter()
                    for call in calls:
                        kernel(*call)
                    times[name].append((time.perf_counter() - start) * 1e3)
            before, after = (statistics.median(times[n]) for n in ("before", "after"))
            print(f"  M = {m:3d}: {before:6.2f} → {after:6.2f} ms   {before / after:.2f}x", flush=True)


if __name__ == "__main__":
    main()
