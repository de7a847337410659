"""How the compiled decode graphs should take a batch's rows: measured, in one process.

    python benchmarks/bench_compiled_rows.py                 # SmolLM2-135M, bf16, 2 threads

Three engines of one model decode the same batches (``bench_decode_step.measure``: 64-token
prompts, 64 new tokens, median TPOT over the repeats):

- ``one graph``: the default, ``compile_batch_sizes=(256,)`` — one graph for every batch of
  1-256 rows, its row count free, each row attending in place through the C++ kernel (a single
  row is padded to two);
- ``1-row window graph``: ``(1, 256)`` — the same, plus a graph for exactly one row whose
  attention is plain PyTorch over the block window, fused by inductor (the 1-row graph of
  every release before this one);
- ``eager``: ``compile=False``.

Both compiled engines load the same 1-256-row package; the second compiles its 1-row graph
too. Prints a table; writes JSON to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
from pathlib import Path

import torch
from bench_decode_step import measure

from minillm import LLM
from minillm.machine import machine_description, machine_tag

RESULTS = Path(__file__).parent / "results"
ENGINES = {
    "one graph (default)": dict(compile=True, compile_batch_sizes=(256,)),
    "1-row window graph + the same": dict(compile=True, compile_batch_sizes=(1, 256)),
    "eager": dict(compile=False),
}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8, 32])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    for name, options in ENGINES.items():
        llm = LLM(args.model, dtype=args.dtype, enable_prefix_caching=False, **options)
        status = llm.wait_for_fast_path()
        print(f"{name}: {status}", flush=True)
        for row in measure(llm, args.batch_sizes, args.repeats):
            rows.append({"engine": name, **row})
            print(f"  batch {row['batch']}: TPOT {row['tpot_ms']:.2f} ms", flush=True)
        llm.close()
    tpot = {(r["engine"], r["batch"]): r["tpot_ms"] for r in rows}
    print("\n| batch | " + " | ".join(f"{name} TPOT ms" for name in ENGINES) + " | 1-row graph / one graph |")
    print("|---:|" + "---:|" * (len(ENGINES) + 1))
    for batch in args.batch_sizes:
        cells = " | ".join(f"{tpot[(name, batch)]:.2f}" for name in ENGINES)
        ratio = tpot[("1-row window graph + the same", batch)] / tpot[("one graph (default)", batch)]
        print(f"| {batch} | {cells} | {ratio:.2f}x |")
    machine = machine_description(torch.device("cpu"))
    result = {"benchmark": "compiled_rows", "model": args.model, "dtype": args.dtype, "threads": args.threads,
              "machine": machine, "rows": rows}  # fmt: skip
    out = Path(args.out) / f"compiled-rows-{dt.date.today()}-{machine_tag(machine)}-{args.threads}t.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {out}")
    return result


if __name__ == "__main__":
    main()
