"""Server benchmark: what HTTP costs. One seeded Poisson workload, replayed in real time twice
per repeat — through the live OpenAI-compatible server (``minillm serve`` in its own process,
an asyncio client streaming every request) and through ``LLMEngine`` directly in this process
— with repeats interleaved so the machine's noise hits both alike.

    python benchmarks/bench_server.py --threads 2                  # SmolLM2-135M, CPU
    python benchmarks/bench_server.py --model tiny-shakespeare-8m --num-requests 32 --quick

The client sends each request at its arrival time (``/v1/completions`` with the workload's
token ids, greedy, ``ignore_eos``) and notes when each streamed chunk arrives; the server
sends one chunk per engine step, so chunk times are token times. TTFT counts from the
scheduled arrival, as the direct replay does. Reported for both paths: output tok/s, req/s,
TTFT / TPOT / end-to-end p50, p95, p99, goodput at an SLO; then the overhead of HTTP: the
throughput lost (%) and the p50 TTFT added (ms). "Nothing lost": every HTTP request must come
back 200 with exactly its ``max_tokens`` tokens, or the run fails.

The client shares the machine with the server: on 2 cores its JSON parsing competes with the
engine's threads, so the overhead measured here is an upper bound for a separate client host.
Prints a Markdown table; writes JSON to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import statistics
import time
from pathlib import Path

import httpx
import torch

from minillm import LLMEngine
from minillm.assets import resolve_model
from minillm.config import ModelConfig
from minillm.machine import machine_description
from minillm.metrics import SLO, run_report
from minillm.outputs import RequestMetrics, RequestOutput
from minillm.server import ServerProcess
from minillm.tools.workloads import poisson_workload, replay

RESULTS = Path(__file__).parent / "results"


async def http_replay(url: str, model: str, workload) -> list[RequestOutput]:
    """Each request sent at its arrival time, streamed; token times from the chunks' arrival."""
    start = time.perf_counter()

    async def one(r, http: httpx.AsyncClient) -> RequestOutput:
        await asyncio.sleep(max(0.0, r.arrival_time - (time.perf_counter() - start)))
        body = {"model": model, "prompt": r.prompt_token_ids, "max_tokens": r.max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
        times, tokens, finish = [], None, None
        async with http.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                raise RuntimeError(f"request {r.request_id}: HTTP {resp.status_code} {await resp.aread()!r}")
            async for line in resp.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if chunk["choices"]:
                    times.append(time.perf_counter())
                    finish = chunk["choices"][0]["finish_reason"] or finish
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
        if tokens != r.max_tokens or finish != "length":
            raise RuntimeError(f"request {r.request_id}: {tokens} tokens, finish {finish}; wanted {r.max_tokens}")
        metrics = RequestMetrics(arrival_time=start + r.arrival_time, token_times=times)
        metrics.finished_time = times[-1]
        return RequestOutput(r.request_id, "", r.prompt_token_ids, "", [0] * tokens, finish, metrics)

    limits = httpx.Limits(max_connections=len(workload) + 8, max_keepalive_connections=len(workload) + 8)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        return list(await asyncio.gather(*(one(r, http) for r in workload)))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument("--rate", type=float, default=2.0, help="Poisson arrival rate, requests/s")
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(16, 256))
    parser.add_argument("--output-len", type=int, nargs=2, default=(16, 128))
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--slo-ttft", type=float, default=2.0)
    parser.add_argument("--slo-tpot", type=float, default=0.25)
    parser.add_argument("--quick", action="store_true", help="one repeat")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    repeats = 1 if args.quick else args.repeats
    vocab = ModelConfig.from_folder(resolve_model(args.model)).vocab_size
    workload = poisson_workload(
        args.num_requests, args.rate, tuple(args.prompt_len), tuple(args.output_len), vocab, seed=args.seed
    )
    slo = SLO(ttft=args.slo_ttft, tpot=args.slo_tpot)
    cli = ["--dtype", args.dtype, "--max-num-seqs", str(args.max_num_seqs)]
    server = ServerProcess([args.model], cli + (["--threads", str(args.threads)] if args.threads else [])).start()
    runs: dict[str, list[dict]] = {"direct": [], "http": []}
    try:
        engine = LLMEngine(args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs)
        engine.wait_for_fast_path()  # the default's compiled decode step, built in the background
        # Warm both paths up first (untimed): the first use of each matmul shape builds oneDNN
        # primitives, which would otherwise land in whichever path runs first.
        warm = poisson_workload(16, None, tuple(args.prompt_len), (8, 16), vocab, seed=args.seed + 99)
        replay(engine, warm)
        asyncio.run(http_replay(server.url, args.model, warm))
        engine.step_records.clear()
        for repeat in range(repeats):
            for path in ("direct", "http"):
                if path == "direct":
                    outputs = replay(engine, workload)
                    engine.step_records.clear()
                else:
                    outputs = asyncio.run(http_replay(server.url, args.model, workload))
                summary = run_report(outputs, None, slo).summary()
                runs[path].append(summary)
                print(
                    f"repeat {repeat} {path:>6}: {summary['output_tok_per_s']:6.1f} output tok/s, "
                    f"TTFT p50 {summary['ttft_p50_s'] * 1000:6.0f} ms, TPOT p50 {summary['tpot_p50_s'] * 1000:5.1f} ms",
                    flush=True,
                )
        device = engine.device
    finally:
        server.stop()

    def median_summary(summaries: list[dict]) -> dict:
        """Each numeric figure's median over the repeats (figures some repeat lacks are left out)."""
        keys = [k for k, v in summaries[0].items() if isinstance(v, (int, float))]
        return {
            k: statistics.median(s[k] for s in summaries) for k in keys if all(s.get(k) is not None for s in summaries)
        }

    medians = {path: median_summary(summaries) for path, summaries in runs.items()}
    d, h = medians["direct"], medians["http"]
    overhead = {
        "throughput_loss_pct": 100 * (1 - h["output_tok_per_s"] / d["output_tok_per_s"]),
        "ttft_p50_added_ms": 1000 * (h["ttft_p50_s"] - d["ttft_p50_s"]),
        "tpot_p50_added_ms": 1000 * (h["tpot_p50_s"] - d["tpot_p50_s"]),
        "targets_met": {
            "throughput_loss_below_10pct": h["output_tok_per_s"] >= 0.9 * d["output_tok_per_s"],
            "ttft_p50_added_below_20ms": h["ttft_p50_s"] - d["ttft_p50_s"] < 0.020,
        },
    }
    result = {
        "benchmark": "server",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "model": args.model,
        "args": vars(args),
        "machine": machine_description(device),
        "env": {k: os.environ[k] for k in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS", "GOMP_SPINCOUNT") if k in os.environ},
        "runs": runs,
        "medians": medians,
        "http_overhead": overhead,
    }
    print()
    print(format_table(result))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"server-{result['date'][:10]}-{device.type}-{result['machine']['torch_threads']}t.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {path}")
    return result


def format_table(result: dict) -> str:
    rows = [
        "| path | output tok/s | req/s | TTFT p50 / p95 / p99 ms | TPOT p50 / p99 ms | e2e p50 / p99 s | goodput req/s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, m in result["medians"].items():
        rows.append(
            f"| {name} | {m['output_tok_per_s']:.1f} | {m['req_per_s']:.2f} | "
            f"{m['ttft_p50_s'] * 1e3:.0f} / {m['ttft_p95_s'] * 1e3:.0f} / {m['ttft_p99_s'] * 1e3:.0f} | "
            f"{m['tpot_p50_s'] * 1e3:.1f} / {m['tpot_p99_s'] * 1e3:.1f} | {m['e2e_p50_s']:.2f} / {m['e2e_p99_s']:.2f} | "
            f"{m['goodput_req_per_s']:.2f} |"
        )
    o = result["http_overhead"]
    rows.append("")
    rows.append(
        f"HTTP overhead (medians of {len(result['runs']['http'])} interleaved repeats): throughput "
        f"{o['throughput_loss_pct']:+.1f}% lost, p50 TTFT {o['ttft_p50_added_ms']:+.1f} ms, "
        f"p50 TPOT {o['tpot_p50_added_ms']:+.1f} ms. Targets: < 10% and < 20 ms — "
        f"{'met' if all(o['targets_met'].values()) else 'missed'}."
    )
    return "\n".join(rows)


if __name__ == "__main__":
    main()
