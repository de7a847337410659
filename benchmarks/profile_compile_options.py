"""Where a compile's time goes, by inductor option: compile seconds against decode step time.

    python benchmarks/profile_compile_options.py            # SmolLM2-135M bf16, 2 threads

Compiles the default decode graph (every batch of 1-256 rows) three ways, each into a
temporary folder, in this process: with the engine's options (weights frozen into the graph,
GEMMs autotuned); without freezing; without freezing or autotuning. Then times one step of
each at 1, 8 and 32 rows (1 row is padded to 2), with 100-token contexts, median of 20. It
answers whether a cheaper compile would cost decode speed — the question before compiling
one decoder layer and reusing it for every layer (regional compilation), which needs the
weights as inputs rather than frozen constants.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from minillm.assets import resolve_model
from minillm.config import EngineConfig, ModelConfig
from minillm.kvcache.paged import PagedKVCache
from minillm.machine import machine_description
from minillm.models import load_model
from minillm.runtime import compiled_decode
from minillm.runtime.compile_worker import cache_inductor_templates
from minillm.runtime.compiled_decode import CompiledDecode
from minillm.runtime.model_setup import configure_model
from minillm.runtime.runner import ChunkInput

VARIANTS = {
    "engine's options (frozen, autotuned)": {},
    "not frozen, autotuned": {"freezing": False},
    "not frozen, not autotuned": {"freezing": False, "max_autotune": False},
}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    cache_inductor_templates()  # as the compile worker does
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    folder = resolve_model(args.model)
    model = load_model(folder, dtype, torch.device("cpu"), max_positions=2048)
    configure_model(model, EngineConfig(), "cpu", None, None, None)
    cache = PagedKVCache(ModelConfig.from_folder(folder), 32 * 8, 16, dtype, torch.device("cpu"), "auto")
    results = []
    for name, change in VARIANTS.items():
        options = {**compiled_decode.INDUCTOR_OPTIONS, **change}
        saved, compiled_decode.INDUCTOR_OPTIONS = compiled_decode.INDUCTOR_OPTIONS, options
        try:
            compiled = CompiledDecode(model, cache, None, dtype)
            batch = compiled.batch_sizes[-1]
            with tempfile.TemporaryDirectory() as tmp:
                path = Path(tmp) / "decode.pt2"
                seconds = compiled.compile_package(batch, path, progress=False)
                graph = torch._inductor.aoti_load_package(str(path))
        finally:
            compiled_decode.INDUCTOR_OPTIONS = saved
        steps = {}
        for rows in (1, 8, 32):
            chunks = [ChunkInput(f"r{b}", [100 + b], 100, 1, list(range(b * 8, b * 8 + 7))) for b in range(rows)]
            tables = torch.tensor([c.block_table for c in chunks])
            inputs = compiled.inputs(chunks, tables, max(rows, compiled_decode.MIN_ROWS))
            times = []
            with torch.no_grad():
                for i in range(22):
                    start = time.perf_counter()
                    graph(*inputs)
                    if i >= 2:
                        times.append(time.perf_counter() - start)
            steps[rows] = statistics.median(times) * 1000
        results.append((name, seconds, steps))
        print(f"{name}: compiled in {seconds:.0f} s; step " + ", ".join(f"{r} rows {ms:.2f} ms" for r, ms in steps.items()),
              flush=True)  # fmt: skip
    machine = machine_description(torch.device("cpu"))
    print(f"\n{machine['cpu']} ({', '.join(machine['cpu_flags'])}), {args.threads} threads, {args.model} {args.dtype}\n")
    print("| options | compile s | 1 row ms | 8 rows ms | 32 rows ms |\n|---|---:|---:|---:|---:|")
    for name, seconds, steps in results:
        print(f"| {name} | {seconds:.0f} | {steps[1]:.2f} | {steps[8]:.2f} | {steps[32]:.2f} |")


if __name__ == "__main__":
    main()
