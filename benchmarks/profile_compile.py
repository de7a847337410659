"""Where a decode-step compile's time goes: cProfile over one ``aoti_compile_and_package`` call.

    python benchmarks/profile_compile.py                      # SmolLM2-135M bf16, the 1-row step
    python benchmarks/profile_compile.py --cached-templates   # with the worker's template cache

Compiles into a temporary folder with a fresh inductor cache (a cold compile) and prints the
export time, the compile time and the 40 most expensive calls by cumulative time. The profile
behind ``compile_worker.cache_inductor_templates`` (SmolLM2-135M bf16, 1 row, Intel Xeon, 2 threads,
profiled: 140 s, 29.5 s of it in ``jinja2.Environment.from_string``). Profiling slows Python
down; compare runs of this script with each other, not with an unprofiled compile.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--cached-templates", action="store_true")
    args = parser.parse_args()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-")  # before minillm sets its own

    from minillm import LLM
    from minillm.runtime.compile_worker import cache_inductor_templates
    from minillm.runtime.compiled_decode import CompiledDecode

    if args.cached_templates:
        cache_inductor_templates()
    llm = LLM(args.model, compile=False, cpu_prepack=False)  # plain weights: what the compiler folds in
    engine = llm.engine
    compute_dtype = engine.model.attention_backend.decode_dtype or engine.kv_cache.dtype
    compiled = CompiledDecode(engine.model, engine.kv_cache, engine.sliding_window, compute_dtype, (args.batch,))
    with tempfile.TemporaryDirectory() as folder:
        start = time.perf_counter()
        profile = cProfile.Profile()
        profile.enable()
        compiled._compile(args.batch, Path(folder) / "step.pt2", progress=True)
        profile.disable()
        print(f"compile (export + inductor) under cProfile: {time.perf_counter() - start:.1f} s")
    pstats.Stats(profile).sort_stats("cumulative").print_stats(40)


if __name__ == "__main__":
    main()
