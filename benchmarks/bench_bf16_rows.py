"""Our few-row bf16 GEMM (``minillm/layers/cpu_bf16_rows.py``) against what it replaces, in one run.

    python benchmarks/bench_bf16_rows.py                 # SmolLM2-135M's shapes and engine, 2 threads
    python benchmarks/bench_bf16_rows.py --skip-engines  # the matrix products only (a minute)

Three parts, each printed next to its baseline:

0. **The operator's own cost**: a call on a tiny product through the dispatcher to its C++ kernel
   (as shipped, ``minillm/native_operators.cpp``) and to its Python function (the fallback, and
   how it ran before), against the kernel through ``ctypes`` alone.
1. **The matrix products of one decode step** of SmolLM2-135M (30 layers of q/k/v 576→960,
   o 576→576, gate/up 576→3072, down 1536→576, distinct random weights so that they stream from
   memory as a model's do, and the 576→49152 head), for M = 1 … 256 rows: our operator on
   packed weights against oneDNN's bf16 linear on its own prepacked weights (what the eager
   engine and the compiler's ATen choice call). Median of ``--repeats`` passes.
   Then one pass of the EAGLE head's six products (SmolLM2's head) at 1-16 rows, the same two ways.
2. **The compiled engine**: ``bench_decode_step.measure`` (64-token prompts, 64 new tokens,
   median TPOT) at batch 1, 2, 4, 8, 12, 16 for the default engine with
   ``MINILLM_CPU_BF16_ROWS=0`` (the compiler's own GEMMs) and with it as shipped (``auto``; the
   kernel on a CPU with AVX-512 BF16 and no AMX), both loaded, in ``--rounds`` alternating rounds.
   Batch 1 runs in the 1-row graph, which the kernel does not touch: it is the control. Each
   setting compiles its own packages the first time.

Prints both tables and the CPU (model and flags); writes JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from datetime import date
from pathlib import Path

import torch
from bench_decode_step import measure
from timing import median_ms

from minillm import LLM, native_build
from minillm.config import environment
from minillm.layers import cpu_bf16_rows
from minillm.machine import machine_description, machine_tag

RESULTS = Path(__file__).parent / "results"
LAYER_SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # (in, out) per SmolLM2-135M layer
LAYERS, HEAD = 30, (576, 49152)


def call_cost(calls: int = 5000) -> dict:
    """One call of the operator on a tiny product (2 rows, 64 → 32), through PyTorch's dispatcher
    to its C++ kernel and to its Python function, against the same kernel called through
    ``ctypes`` alone: what each of a graph's ~121 calls a step pays before any arithmetic."""
    x = torch.randn(2, 64).to(torch.bfloat16)
    packed = cpu_bf16_rows.pack(torch.randn(32, 64).to(torch.bfloat16))
    out = torch.empty(2, 32, dtype=torch.bfloat16)
    kernel = cpu_bf16_rows._kernel()
    native_build.build_operators()
    in_cpp = cpu_bf16_rows.operator_in_cpp()
    python_op = torch.library.Library("minillm_bench", "FRAGMENT")
    python_op.define("linear_bf16_rows_py(Tensor x, Tensor packed) -> Tensor")
    python_op.impl("linear_bf16_rows_py", cpu_bf16_rows.linear_bf16_rows, "CPU")

    def through_the_operator():
        for _ in range(calls):
            torch.ops.minillm.linear_bf16_rows(x, packed)

    def through_its_python_function():
        for _ in range(calls):
            torch.ops.minillm_bench.linear_bf16_rows_py(x, packed)

    def ctypes_only():
        for _ in range(calls):
            kernel(x.data_ptr(), packed.data_ptr(), out.data_ptr(), 2, 64, 32)

    row = {"operator_in_cpp": in_cpp, "operator_us": 1000 * median_ms(through_the_operator, 5) / calls,
           "python_function_us": 1000 * median_ms(through_its_python_function, 5) / calls,
           "ctypes_us": 1000 * median_ms(ctypes_only, 5) / calls}  # fmt: skip
    print(f"  a call on a tiny product: the operator {row['operator_us']:.1f} us ({'C++ kernel' if in_cpp else 'Python: its C++ kernel did not build'}), "
          f"its Python function {row['python_function_us']:.1f} us, the kernel through ctypes alone {row['ctypes_us']:.1f} us", flush=True)  # fmt: skip
    return row


def products(rows: list[int], repeats: int) -> list[dict]:
    torch.manual_seed(0)
    weights = [[torch.randn(n, k).to(torch.bfloat16) for k, n in LAYER_SHAPES] for _ in range(LAYERS)]
    weights.append([torch.randn(HEAD[1], HEAD[0]).to(torch.bfloat16)])
    ours = [[cpu_bf16_rows.pack(w) for w in layer] for layer in weights]
    onednn = [[torch.ops.mkldnn._reorder_linear_weight(w, 8) for w in layer] for layer in weights]
    out = []
    for m in rows:
        inputs = {k: torch.randn(m, k).to(torch.bfloat16) for k in {576, 1536}}

        def run_ours(inputs=inputs):
            for layer in ours:
                for packed in layer:
                    torch.ops.minillm.linear_bf16_rows(inputs[packed.shape[1] * 2], packed)

        def run_onednn(inputs=inputs):
            for layer, plain in zip(onednn, weights):
                for packed, w in zip(layer, plain):
                    torch.ops.mkldnn._linear_pointwise(inputs[w.shape[1]], packed, None, "none", [], "")

        row = {"rows": m, "ours_ms": median_ms(run_ours, repeats), "onednn_ms": median_ms(run_onednn, repeats)}
        print(f"  M = {m:3d}: ours {row['ours_ms']:7.2f} ms   oneDNN {row['onednn_ms']:7.2f} ms   "
              f"{row['onednn_ms'] / row['ours_ms']:.2f}x", flush=True)  # fmt: skip
        out.append(row)
    return out


EAGLE_HEAD = {"fc": (1152, 576), "qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576),
              "head": (576, 4096)}  # (in, out): SmolLM2's EAGLE head (data/smollm2-eagle), q/k/v and gate/up fused


def head_products(rows: list[int], repeats: int) -> list[dict]:
    """One pass of the EAGLE head's six products (``speculative/eagle.py``, ``_mm``) at the few
    rows a proposal runs: our operator on its packed weights against oneDNN's prepacked linear,
    which it used before (its 13 MB of weights stay in the CPU's cache between passes, as
    between a step's proposals)."""
    torch.manual_seed(0)
    weights = {name: torch.randn(n, k).to(torch.bfloat16) for name, (k, n) in EAGLE_HEAD.items()}
    ours = {name: cpu_bf16_rows.pack(w) for name, w in weights.items()}
    onednn = {name: torch.ops.mkldnn._reorder_linear_weight(w, 1) for name, w in weights.items()}
    out = []
    for m in rows:
        inputs = {name: torch.randn(m, w.shape[1]).to(torch.bfloat16) for name, w in weights.items()}

        def run_ours(inputs=inputs):
            for name, packed in ours.items():
                torch.ops.minillm.linear_bf16_rows(inputs[name], packed)

        def run_onednn(inputs=inputs):
            for name, packed in onednn.items():
                torch.ops.mkldnn._linear_pointwise(inputs[name], packed, None, "none", [], "")

        row = {"rows": m, "ours_ms": median_ms(run_ours, repeats), "onednn_ms": median_ms(run_onednn, repeats)}
        print(f"  M = {m:3d}: ours {row['ours_ms']:6.3f} ms   oneDNN {row['onednn_ms']:6.3f} ms   "
              f"{row['onednn_ms'] / row['ours_ms']:.2f}x", flush=True)  # fmt: skip
        out.append(row)
    return out


def engines(model: str, batches: list[int], repeats: int, rounds: int) -> list[dict]:
    """Both engines loaded at once, measured in alternating rounds (a slower spell of a shared
    machine then slows both sides of a round's ratio)."""
    llms = {}
    for setting in ("0", "auto"):
        # Read when the engine names its graphs and by the compile worker it starts: kept until ready.
        with environment.scoped("MINILLM_CPU_BF16_ROWS", setting):
            llm = LLM(model, dtype="bf16", enable_prefix_caching=False)
            print(f"MINILLM_CPU_BF16_ROWS={setting}: {llm.wait_for_fast_path(timeout=900)}", flush=True)
        llms[setting] = llm
    out = []
    for round_ in range(rounds):
        for setting, llm in llms.items():
            for row in measure(llm, batches, repeats):
                out.append({"setting": setting, "round": round_, **row})
                print(f"  round {round_}, ={setting}, batch {row['batch']:2d}: TPOT {row['tpot_ms']:6.2f} ms", flush=True)
    for llm in llms.values():
        llm.close()
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 2, 4, 8, 11, 16, 32, 64, 256])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 2, 4, 8, 12, 16])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of the two engines")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip-engines", action="store_true")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    machine = machine_description(torch.device("cpu"))
    print(f"bench_bf16_rows, {date.today()}: {machine['cpu']}, {args.threads} threads; flags "
          f"{' '.join(machine['cpu_flags'])}; kernel: {cpu_bf16_rows.unavailable_reason() or 'available'}, "
          f"used by default here: {cpu_bf16_rows.cpu_supports()}")  # fmt: skip
    if cpu_bf16_rows.unavailable_reason() is not None:
        return {}
    print("The operator's own cost:")
    result = {"benchmark": "bf16_rows", "machine": machine, "args": vars(args), "call": call_cost()}
    print("One decode step's matrix products (SmolLM2-135M shapes, bf16):")
    result["products"] = products(args.rows, args.repeats)
    print("One pass of the EAGLE head's products (SmolLM2's head, bf16):")
    result["eagle_head"] = head_products([1, 2, 4, 8, 16], 51)
    if not args.skip_engines:
        print("The compiled engine (TPOT, 64-token prompts, 64 new tokens):")
        result["engines"] = engines(args.model, args.batches, args.repeats, args.rounds)
        tpot = {(r["setting"], r["round"], r["batch"]): r["tpot_ms"] for r in result["engines"]}
        print("\nmedians over rounds; speed-up: the median of each round's ratio")
        print("| batch | compiler's GEMMs (=0) ms | our kernel (auto) ms | speed-up |\n|---:|---:|---:|---:|")
        for b in args.batches:
            off = [tpot[("0", r, b)] for r in range(args.rounds)]
            on = [tpot[("auto", r, b)] for r in range(args.rounds)]
            ratio = statistics.median(x / y for x, y in zip(off, on))
            print(f"| {b} | {statistics.median(off):.2f} | {statistics.median(on):.2f} | {ratio:.2f}x |")
    out = Path(args.out) / f"bf16-rows-{date.today()}-{machine_tag(machine)}-{args.threads}t.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
