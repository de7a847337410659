"""Parallelism on this machine, measured with the engine itself (SmolLM2-135M by default):

1. **Tensor / pipeline parallel decode** — batch-1 and batch-8 decode tok/s for one process and
   for TP = 2, TP = 3, PP = 2 (the same total threads), each step split into compute and
   communication from every rank's recorded spans, and the bytes all-reduced per token counted
   at the call next to the formula ``(2 x layers + 1) x hidden x bytes`` (two all-reduces per
   layer and one for the vocabulary-parallel embedding).
2. **The pipeline bubble** — PP = 2 at batch 8 with 1, 2 and 4 micro-batches: the fraction of
   stage-time left idle, ``1 - busy / (stages x step span)``.
3. **Disaggregated vs colocated** — short chat requests decoding while long prompts arrive: one
   engine (2 threads) against a prefill worker + a decode worker (1 thread each): TTFT and the
   decodes' TPOT (the interference of long prefills on decodes).
4. **Offload** — batch-1 decode with weights resident, memory-mapped from a file (warm), and
   memory-mapped with the pages dropped before every step (cold: every step reads the weights
   from disk, what offloading costs when memory cannot hold them).

    python benchmarks/bench_parallel.py                  # all parts, ~5 minutes on 2 cores
    python benchmarks/bench_parallel.py --parts tp bubble

On a 2-core CPU the honest result is that splitting cannot speed anything up: the ranks share the
same two cores and every collective adds a fixed cost. Prints tables; writes JSON to
benchmarks/results/.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from minillm import LLM, SamplingParams
from minillm.config import ModelConfig
from minillm.machine import machine_description
from minillm.tools.workloads import WorkloadRequest, replay
from minillm.viz.parallel_results import parallel_tables
from minillm.viz.pipeline import bubble_fraction

RESULTS = Path(__file__).parent / "results"


def _decode_run(llm: LLM, batch: int, tokens: int, prompt_len: int = 16) -> dict:
    """Decode ``tokens`` tokens for ``batch`` prompts; tok/s over the decode steps only, and the
    median per-step spans of a parallel engine."""
    engine = llm.engine
    runner = engine.runner
    timed = hasattr(runner, "record_timings")
    if timed:
        runner.record_timings = True
    for i in range(batch):
        engine.add_request([100 + i] * prompt_len, SamplingParams(max_tokens=tokens, ignore_eos=True))
    steps = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        wall = time.perf_counter() - start
        if engine.num_steps > 1 and timed and runner.last_timings:  # decode steps (the first is the prefill)
            steps.append((wall, runner.last_timings))
        elif engine.num_steps > 1:
            steps.append((wall, None))
    if timed:
        runner.record_timings = False
    walls = [w for w, _ in steps]
    out = {"batch": batch, "tok_s": batch / statistics.median(walls), "step_ms": 1e3 * statistics.median(walls)}
    if timed:
        spans = [s for _, t in steps for s in t]
        rank0 = [s for s in spans if s["rank"] == 0]  # one span per step, or per micro-batch in a pipeline
        out["comm_ms"] = 1e3 * statistics.median(s["comm_s"] for s in rank0)
        out["compute_ms"] = 1e3 * statistics.median(s["end"] - s["start"] - s["comm_s"] for s in rank0)
        out["all_reduce_bytes_per_token"] = statistics.median(s["all_reduce_bytes"] for s in rank0) / batch
        out["all_gather_bytes_per_token"] = statistics.median(s["all_gather_bytes"] for s in rank0) / batch
        out["bubble"] = statistics.median(bubble_fraction(t) for _, t in steps)
    return out


def part_tp(model: str, dtype: str, tokens: int) -> list[dict]:
    config = ModelConfig.from_folder(_folder(model))
    bytes_per = torch.finfo(getattr(torch, dtype)).bits // 8
    rows = []
    for name, kwargs in [
        ("1 process, 2 threads", dict(num_threads=2)),
        ("TP=2", dict(tensor_parallel_size=2, num_threads=1)),
        ("TP=3", dict(tensor_parallel_size=3, num_threads=1)),
        ("PP=2", dict(pipeline_parallel_size=2, num_threads=1)),
    ]:
        with LLM(model, dtype=dtype, max_num_seqs=8, **kwargs) as llm:
            for batch in (1, 8):
                row = {"setup": name, **_decode_run(llm, batch, tokens)}
                if "TP" in name:
                    row["formula_all_reduce_bytes_per_token"] = (
                        (2 * config.num_layers + 1) * config.hidden_size * bytes_per
                    )
                rows.append(row)
                print(row, flush=True)
    return rows


def part_bubble(model: str, dtype: str, tokens: int) -> list[dict]:
    rows = []
    for micro in (1, 2, 4):
        with LLM(model, dtype=dtype, max_num_seqs=8, pipeline_parallel_size=2, pipeline_microbatches=micro,
                 num_threads=1) as llm:  # fmt: skip
            row = {"microbatches": micro, **_decode_run(llm, 8, tokens)}
            llm.engine.runner.record_timings = True
            llm.generate([[7] * 16] * 8, SamplingParams(max_tokens=3, ignore_eos=True))
            row["example_spans"] = llm.engine.runner.last_timings  # one decode step, for a Gantt chart
            rows.append(row)
            print({k: v for k, v in row.items() if k != "example_spans"}, flush=True)
    return rows


def _interference_workload(short: int, long: int, short_tokens: int) -> list[WorkloadRequest]:
    """Short chats arriving early and decoding long, and long prompts arriving while they decode."""
    reqs = [WorkloadRequest(f"chat{i}", 0.05 * i, [200 + i] * 24, short_tokens) for i in range(short)]
    reqs += [
        WorkloadRequest(f"long{i}", 0.8 + 0.6 * i, [(300 + i + j) % 4000 for j in range(448)], 8) for i in range(long)
    ]
    return reqs


def part_disagg(model: str, dtype: str, short_tokens: int) -> dict:
    from minillm.cluster.disagg import DisaggregatedLLM

    work = _interference_workload(6, 3, short_tokens)
    result = {}
    with LLM(model, dtype=dtype, num_threads=2) as llm:
        outs = replay(llm.engine, work)
        result["colocated"] = _latencies(
            work, [o.metrics.ttft for o in outs], [o.metrics.tpot for o in outs], [o.metrics.token_times for o in outs]
        )
    with DisaggregatedLLM(model, prefill_threads=1, decode_threads=1, dtype=dtype) as llm:
        outs = llm.generate(
            [r.prompt_token_ids for r in work], [r.sampling_params() for r in work], [r.arrival_time for r in work]
        )
        result["disaggregated"] = _latencies(
            work, [o.ttft for o in outs], [o.tpot for o in outs], [o.token_times for o in outs]
        )
        longs = [o for r, o in zip(work, outs) if r.request_id.startswith("long")]
        result["disaggregated"]["transfer_mb_long"] = statistics.median(o.transfer_bytes / 1e6 for o in longs)
        result["disaggregated"]["transfer_ms_long"] = statistics.median(1e3 * o.transfer_seconds for o in longs)
    print(json.dumps(result, indent=1), flush=True)
    return result


def _latencies(work, ttfts, tpots, token_times) -> dict:
    chat = [i for i, r in enumerate(work) if r.request_id.startswith("chat")]
    longs = [i for i, r in enumerate(work) if r.request_id.startswith("long")]
    gaps = [b - a for i in chat for a, b in zip(token_times[i], token_times[i][1:])]
    gaps.sort()
    return {
        "chat_ttft_p50_ms": 1e3 * statistics.median(ttfts[i] for i in chat),
        "chat_tpot_p50_ms": 1e3 * statistics.median(tpots[i] for i in chat),
        "chat_token_gap_p99_ms": 1e3 * gaps[int(0.99 * (len(gaps) - 1))],
        "chat_token_gap_max_ms": 1e3 * gaps[-1],
        "long_ttft_p50_ms": 1e3 * statistics.median(ttfts[i] for i in longs),
    }


def part_offload(model: str, dtype: str, tokens: int, device: str = "cpu") -> list[dict]:
    from minillm.layers.offload import evict_page_cache, memory_map_weights

    rows = []
    if device != "cpu":  # a GPU: resident against every layer copied in from (pinned) host memory
        for name, offload in (("resident", None), ("host memory, copied in per layer", "host")):
            with LLM(model, dtype=dtype, device=device, max_num_seqs=1, weight_offload=offload) as llm:
                rows.append({"weights": name, **_decode_run(llm, 1, tokens)})
                print(rows[-1], flush=True)
        return rows
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("resident", "memory-mapped, warm", "memory-mapped, evicted every step"):
            with LLM(model, dtype=dtype, num_threads=2, cpu_prepack=False, max_num_seqs=1) as llm:
                path = Path(tmp) / "weights.pt"
                if name != "resident":
                    mapped = memory_map_weights(llm.engine.model, path)
                if name.endswith("every step"):
                    execute = llm.engine.runner.execute

                    def cold(inputs, execute=execute, model=llm.engine.model, path=path):
                        evict_page_cache(model, path)
                        return execute(inputs)

                    llm.engine.runner.execute = cold
                row = {"weights": name, **_decode_run(llm, 1, tokens)}
                if name != "resident":
                    row["mapped_mb"] = mapped / 1e6
                rows.append(row)
                print(row, flush=True)
    return rows


def _folder(model: str):
    from minillm.assets import resolve_model

    return resolve_model(model)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tokens", type=int, default=32, help="decode tokens per measurement")
    parser.add_argument("--parts", nargs="+", default=["tp", "bubble", "disagg", "offload"])
    parser.add_argument("--device", default="cpu", help="for the offload part: cpu, or cuda (host → GPU per layer)")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    result = {
        "benchmark": "parallel",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "model": args.model,
        "dtype": args.dtype,
        "machine": machine_description(torch.device(args.device)),
        "args": vars(args),
    }
    if "tp" in args.parts:
        result["tp"] = part_tp(args.model, args.dtype, args.tokens)
    if "bubble" in args.parts:
        result["bubble"] = part_bubble(args.model, args.dtype, args.tokens)
    if "disagg" in args.parts:
        result["disagg"] = part_disagg(args.model, args.dtype, 48)
    if "offload" in args.parts:
        result["offload"] = part_offload(args.model, args.dtype, args.tokens, args.device)
    print(parallel_tables(result))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"parallel-{result['date'][:10]}-{'cpu' if args.device == 'cpu' else 'gpu'}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"\nwrote {path}")
    return result


if __name__ == "__main__":
    main()
