"""What one call of the C++ paged decode kernel costs around the kernel, by how it is called.

    python benchmarks/bench_kernel_operator.py --threads 2

A compiled decode step calls ``minillm::paged_decode`` once per layer (30 times a step for
SmolLM2-135M), so the Python around each call is paid 30 times a token. This times, interleaved
in one run, one layer's call at batch 1 (padded to 2 rows, as the compiled step runs it) with
SmolLM2's head layout (9 query heads over 3 KV heads of 64, bf16 pool), context 128:

- ``kernel only``: the ``ctypes`` call with its inputs already prepared (the floor);
- ``minillm::paged_decode``: the operator as shipped — its C++ kernel registered with the
  dispatcher (``minillm/native_operators.cpp``, ``cpu_paged.operator_in_cpp``);
- ``its Python function through the dispatcher``: ``paged_decode_op`` registered the plain way
  (``torch.library.Library``; what the operator ran before its C++ kernel, and its fallback);
- ``same, as torch.library.custom_op``: the same function registered the convenient way
  (how the operator was registered before that);
- ``paged_decode_attention``: the checked Python entry the eager engine calls.

Prints microseconds per call (median of rounds) and what the difference means per token;
writes JSON to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import time
from pathlib import Path

import torch

from minillm import native_build
from minillm.attention import cpu_paged
from minillm.machine import machine_description, machine_tag

RESULTS = Path(__file__).parent / "results"


def per_call_us(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=500, help="calls per round")
    parser.add_argument("--layers", type=int, default=30, help="calls per token (SmolLM2-135M: 30)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows, heads, kv_heads, dim, block, context = 2, 9, 3, 64, 16, 128
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(rows, heads * dim * 3, dtype=torch.bfloat16, generator=gen)[:, : heads * dim]
    q = q.view(rows, heads, dim)  # a view of a fused projection, as in the model
    k_pool = torch.randn(64 * block, kv_heads, dim, dtype=torch.bfloat16, generator=gen)
    v_pool = torch.randn_like(k_pool)
    tables = torch.randperm(63, generator=gen)[: rows * 8].add(1).view(rows, 8)
    lens = torch.full((rows,), context)
    visible = torch.full((rows,), -1)  # plain causal rows
    call = (q, k_pool, v_pool, tables, lens, visible, block, dim**-0.5, 0)

    native_build.build_operators()
    in_cpp = cpu_paged.operator_in_cpp()
    baseline = torch.library.custom_op("minillm_bench::paged_decode", mutates_args=())(cpu_paged.paged_decode_op)
    baseline.register_fake(lambda q, *rest: q.new_empty(q.shape))
    python_op = torch.library.Library("minillm_bench", "FRAGMENT")
    python_op.define("paged_decode_py(Tensor q, Tensor k_pool, Tensor v_pool, Tensor block_tables, Tensor context_lens, "
                     "Tensor visible, int block_size, float scale, int window) -> Tensor")  # fmt: skip
    python_op.impl("paged_decode_py", cpu_paged.paged_decode_op, "CPU")
    q32, out = q.float().contiguous(), torch.empty(rows, heads, dim)
    kernel = cpu_paged._typed_kernel("bfloat16")
    raw = (q32.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), tables.data_ptr(), lens.data_ptr(),
           visible.data_ptr(), out.data_ptr(), rows, heads, kv_heads, dim, 8, block, 0, dim**-0.5)  # fmt: skip
    cases = {
        "kernel only (ctypes, inputs prepared)": lambda: kernel(*raw),
        f"minillm::paged_decode ({'C++ kernel' if in_cpp else 'its C++ kernel did not build: Python'}, as shipped)": lambda: torch.ops.minillm.paged_decode(*call),
        "its Python function through the dispatcher (torch.library.Library; the fallback)": lambda: torch.ops.minillm_bench.paged_decode_py(*call),
        "same, as torch.library.custom_op (before that)": lambda: torch.ops.minillm_bench.paged_decode(*call),
        "paged_decode_attention (checked, eager engine)": lambda: cpu_paged.paged_decode_attention(*call[:5], block, dim**-0.5, 0),
    }
    reference = torch.ops.minillm.paged_decode(*call)
    for name, fn in cases.items():  # the same answer from every entry (the kernel-only call writes `out`)
        got = fn()
        assert torch.equal(out.to(torch.bfloat16) if got is None else got, reference), name
    times = {name: [] for name in cases}
    with torch.no_grad():
        for _ in range(args.rounds):
            for name, fn in cases.items():  # interleaved: a slow moment of the machine hits every case
                times[name].append(per_call_us(fn, args.calls))
    medians = {name: statistics.median(t) for name, t in times.items()}
    machine = machine_description(torch.device("cpu"))
    floor = medians["kernel only (ctypes, inputs prepared)"]
    print(f"{machine['cpu']} ({', '.join(machine['cpu_flags'])}), {args.threads} threads, torch {torch.__version__}")
    print(f"one layer's call: {rows} rows, {heads} heads over {kv_heads} KV heads of {dim}, bf16 pool, context {context}")
    print(f"\n| entry | µs per call (median of {args.rounds}) | over the kernel | per token ({args.layers} calls) |")
    print("|---|---:|---:|---:|")
    for name, us in medians.items():
        print(f"| {name} | {us:.1f} | {us - floor:+.1f} | {(us - floor) * args.layers / 1000:.2f} ms |")
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"kernel-operator-{dt.date.today()}-{machine_tag(machine)}-{args.threads}t.json"
    path.write_text(json.dumps({"machine": machine, "threads": args.threads, "rows": rows, "context": context,
                                "us_per_call": times, "median_us": medians}, indent=1))  # fmt: skip
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
