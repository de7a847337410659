"""Paged decode attention on CPU: our C++ kernel (``attention_backend="cpu"``) against the
PyTorch reference the ``sdpa`` backend runs (gather each bucket's blocks, upcast where this
machine computes fp32 faster, SDPA), one layer's call, same pool, same run.

    python benchmarks/bench_cpu_attention.py --threads 2

Each case is a pure decode step of ``rows`` sequences whose context lengths are spread over
``context/2 .. context`` (ragged, as in serving), their blocks shuffled over a pool far larger
than the CPU's caches, with SmolLM2-135M's head layout (9 query heads over 3 KV heads of 64) in
bf16 by default. Both sides run through the backends' real step objects (K/V write included) and
are interleaved, medians reported. Prints a Markdown table; writes JSON to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import time
from pathlib import Path

import torch

from minillm.attention import get_backend
from minillm.attention.layout import KVPool, StepLayout
from minillm.attention.precision import decode_attention_dtype
from minillm.config import parse_dtype
from minillm.kvcache.addressing import padded_block_tables, slot_mapping
from minillm.machine import machine_description, machine_tag

RESULTS = Path(__file__).parent / "results"


def decode_layout(pool: KVPool, lens: list[int], gen: torch.Generator) -> StepLayout:
    """A pure decode step: row ``b`` holds ``lens[b]`` tokens (its newest one written this step)
    in blocks drawn at random from the pool."""
    bs = pool.block_size
    num_blocks = pool.k_slots[0].shape[0] // bs
    free = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()  # block 0: the null block
    tables = [[free.pop() for _ in range(-(-n // bs))] for n in lens]
    slots = [slot_mapping(t, n - 1, 1, bs)[0] for t, n in zip(tables, lens)]
    order = sorted(range(len(lens)), key=lambda i: lens[i])  # the runner sorts decodes by length
    width = max(len(t) for t in tables)
    return StepLayout(
        input_ids=torch.zeros(1, len(lens), dtype=torch.long),
        positions=torch.tensor([[lens[i] - 1 for i in order]]),
        slot_mapping=torch.tensor([slots[i] for i in order]),
        query_lens=[1] * len(lens),
        context_lens=[lens[i] for i in order],
        block_tables=torch.tensor(padded_block_tables([tables[i] for i in order], width, 0)),
        num_decodes=len(lens),
        logit_index=torch.zeros(0, dtype=torch.long),
        pool=pool,
    )


def run_case(rows: int, context: int, args, pool: KVPool, decode_dtype, gen) -> dict:
    lens = torch.randint(max(1, context // 2), context + 1, (rows,), generator=gen).tolist()
    layout = decode_layout(pool, lens, gen)
    heads, kv_heads, dim = args.heads, args.kv_heads, args.head_dim
    q = torch.randn(1, rows, heads, dim, generator=gen).to(args.dtype)
    k = torch.randn(1, rows, kv_heads, dim, generator=gen).to(args.dtype)
    v = torch.randn(1, rows, kv_heads, dim, generator=gen).to(args.dtype)
    steps = {
        "kernel": lambda: get_backend("cpu").paged_step(layout),
        "reference": lambda: get_backend("sdpa", decode_dtype).paged_step(layout),
    }
    samples: dict[str, list[float]] = {name: [] for name in steps}
    outputs = {}
    with torch.inference_mode():
        for name, make in steps.items():
            outputs[name] = make().attend(0, q, k, v, dim**-0.5)  # warm-up
        for _ in range(args.repeats):
            for name, make in steps.items():  # interleaved: noise hits both alike
                start = time.perf_counter()
                make().attend(0, q, k, v, dim**-0.5)  # the per-step set-up counts, once per layer here
                samples[name].append(1000 * (time.perf_counter() - start))
    kernel_ms, reference_ms = (statistics.median(samples[n]) for n in ("kernel", "reference"))
    diff = (outputs["kernel"].float() - outputs["reference"].float()).abs().max().item()
    kv_bytes = 2 * sum(lens) * kv_heads * dim * pool.k_slots[0].element_size()
    return {
        "rows": rows,
        "context": context,
        "mean_context": sum(lens) / rows,
        "kernel_ms": kernel_ms,
        "reference_ms": reference_ms,
        "speedup": reference_ms / kernel_ms,
        "kernel_read_gb_per_s": kv_bytes / kernel_ms / 1e6,
        "max_abs_diff": diff,
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 512, 2048])
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--pool-mib", type=int, default=512, help="one layer's K+V pool, MiB (beyond the caches)")
    parser.add_argument("--dtype", type=parse_dtype, default=torch.bfloat16)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    slot_bytes = 2 * args.kv_heads * args.head_dim * torch.empty(0, dtype=args.dtype).element_size()
    needed = max(args.rows) * -(-max(args.contexts) // args.block_size) + 1  # + the null block
    blocks = max(args.pool_mib * 2**20 // (slot_bytes * args.block_size), needed)
    slots = blocks * args.block_size
    pool = KVPool(
        [torch.randn(slots, args.kv_heads, args.head_dim, generator=gen).to(args.dtype)],
        [torch.randn(slots, args.kv_heads, args.head_dim, generator=gen).to(args.dtype)],
        args.block_size,
        0,
    )
    cpu = torch.device("cpu")
    decode_dtype = decode_attention_dtype(args.dtype, cpu, args.heads, args.kv_heads, args.head_dim)
    cases = []
    for rows in args.rows:
        for context in args.contexts:
            case = run_case(rows, context, args, pool, decode_dtype, gen)
            cases.append(case)
            print(
                f"rows {rows:3d} context {context:5d}: kernel {case['kernel_ms']:7.3f} ms, "
                f"reference {case['reference_ms']:7.3f} ms, x{case['speedup']:.2f}"
            )
    machine = machine_description(cpu)
    result = {
        "benchmark": "cpu_paged_decode_attention",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "args": {k: str(v) if isinstance(v, torch.dtype) else v for k, v in vars(args).items()},
        "reference_compute_dtype": str(decode_dtype).removeprefix("torch."),
        "machine": machine,
        "cases": cases,
    }
    print()
    print(format_table(result))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"cpu-attention-{result['date'][:10]}-{machine_tag(machine)}-{machine['torch_threads']}t.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {path}")
    return result


def format_table(result: dict) -> str:
    lines = [
        f"Reference computes in {result['reference_compute_dtype']}; one layer's decode attention, median ms.",
        "",
        "| rows | context (mean) | kernel ms | reference ms | kernel / reference speed | kernel K+V read GB/s |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for c in result["cases"]:
        lines.append(
            f"| {c['rows']} | {c['context']} ({c['mean_context']:.0f}) | {c['kernel_ms']:.3f} | {c['reference_ms']:.3f} "
            f"| {c['speedup']:.2f}x | {c['kernel_read_gb_per_s']:.1f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
