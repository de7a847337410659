"""Tensor parallelism on this machine, measured: compute vs communication of one decoder layer's
TP blocks (attention + SwiGLU at SmolLM2-135M's shapes, TP over gloo processes), and the bytes
all-reduced per token — counted at the call, next to the formula ``2 × hidden × bytes`` per layer.

    python benchmarks/bench_parallel.py                 # TP = 1 and 3 (SmolLM2: 9 heads, 3 K/V heads)

For each TP degree and a few token counts (1 = a decode step, 64 = a prefill chunk), every rank
runs the layer ``--repeats`` times; the time of the all-reduces is measured separately (the
same calls on tensors of the same size) and subtracted. On a 2-core CPU the honest result is
that splitting cannot speed anything up — the ranks share the same two cores and the gloo
all-reduce adds a fixed cost per call — which is what the table shows; on a multi-GPU node
the same code runs with NCCL. Prints a table; writes JSON to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from minillm.bench import machine_description
from minillm.parallel.launch import run_ranks
from minillm.parallel.planner import MODELS
from minillm.parallel.tensor import ParallelAttention, ParallelSwiGLU

RESULTS = Path(__file__).parent / "results"
SHAPE = MODELS["SmolLM2-135M"]


def _weights(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    h, d = SHAPE.hidden, SHAPE.head_dim

    def w(rows, cols):
        return torch.randn(rows, cols, generator=gen) / cols**0.5

    return dict(
        wq=w(SHAPE.heads * d, h), wk=w(SHAPE.kv_heads * d, h), wv=w(SHAPE.kv_heads * d, h), wo=w(h, SHAPE.heads * d),
        gate=w(SHAPE.intermediate, h), up=w(SHAPE.intermediate, h), down=w(h, SHAPE.intermediate),
    )  # fmt: skip


def _rank(rank: int, world_size: int, tokens_list: list[int], repeats: int) -> dict:
    w = _weights()
    attn = ParallelAttention(SHAPE.hidden, SHAPE.heads, SHAPE.kv_heads, SHAPE.head_dim, rank, world_size)
    attn.load(w["wq"], w["wk"], w["wv"], w["wo"])
    mlp = ParallelSwiGLU(SHAPE.hidden, SHAPE.intermediate, rank, world_size).load(w["gate"], w["up"], w["down"])
    sent = []  # bytes of every all-reduce this rank makes, counted at the call
    real_all_reduce = dist.all_reduce

    def counting_all_reduce(t, *args, **kwargs):
        sent.append(t.numel() * t.element_size())
        return real_all_reduce(t, *args, **kwargs)

    dist.all_reduce = counting_all_reduce
    out = {}
    try:
        for tokens in tokens_list:
            x = torch.randn(tokens, SHAPE.hidden)
            with torch.no_grad():
                for _ in range(3):
                    mlp(attn(x))
                sent.clear()
                layer, comm = [], []
                for _ in range(repeats):
                    dist.barrier()
                    t0 = time.perf_counter()
                    mlp(attn(x))
                    layer.append(time.perf_counter() - t0)
                per_layer_bytes = sum(sent) / repeats
                probe = torch.zeros(tokens, SHAPE.hidden)
                for _ in range(repeats):
                    dist.barrier()
                    t0 = time.perf_counter()
                    if world_size > 1:
                        real_all_reduce(probe)
                        real_all_reduce(probe)
                    comm.append(time.perf_counter() - t0)
            out[tokens] = {
                "layer_ms": 1e3 * statistics.median(layer),
                "allreduce_ms": 1e3 * statistics.median(comm),
                "allreduced_bytes_per_layer": per_layer_bytes,
            }
    finally:
        dist.all_reduce = real_all_reduce
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    rows = []
    for tp in args.tp:
        per_rank = run_ranks(_rank, tp, args.tokens, args.repeats, timeout=600)
        for tokens in args.tokens:
            r0 = per_rank[0][tokens]
            formula = 2 * SHAPE.hidden * 4 * tokens if tp > 1 else 0  # fp32 activations: 2 all-reduces per layer
            rows.append({
                "tp": tp, "tokens": tokens, "layer_ms": r0["layer_ms"], "allreduce_ms": r0["allreduce_ms"],
                "compute_ms": max(0.0, r0["layer_ms"] - r0["allreduce_ms"]),
                "allreduced_bytes_per_layer": r0["allreduced_bytes_per_layer"], "formula_bytes_per_layer": formula,
            })  # fmt: skip
    result = {
        "benchmark": "parallel",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "shape": SHAPE.name,
        "machine": machine_description(torch.device("cpu")),
        "args": vars(args),
        "rows": rows,
    }
    print("| TP | tokens | layer ms | of which all-reduce ms | compute ms | all-reduced bytes / layer (formula) |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['tp']} | {r['tokens']} | {r['layer_ms']:.3f} | {r['allreduce_ms']:.3f} | {r['compute_ms']:.3f} | "
              f"{r['allreduced_bytes_per_layer']:.0f} ({r['formula_bytes_per_layer']}) |")  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"parallel-{result['date'][:10]}-cpu.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {path}")
    return result


if __name__ == "__main__":
    main()
