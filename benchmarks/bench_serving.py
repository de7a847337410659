"""Serving benchmark: static, dynamic and continuous batching against HF ``generate()``.

One seeded mixed workload (Poisson arrivals, prompts and outputs of varied lengths) replayed
in real time against minillm under each scheduling policy, and served by HF ``transformers``
``generate()`` in padded static batches of 8 taken in arrival order (a batch starts when its
8th request has arrived and the previous batch is done; its rows are left-padded to the
longest prompt and run until the longest output). Then a shared-system-prompt workload with
prefix caching on and off. Everything runs in one process, one after the other, so the
ratios compare like with like on a noisy machine.

    python benchmarks/bench_serving.py                       # CPU: 64 requests
    python benchmarks/bench_serving.py --num-requests 512 --rate 40 --hf-batches 8   # a GPU

Prints a Markdown table and writes JSON to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import time
from pathlib import Path

import torch

from minillm import LLMEngine
from minillm.assets import resolve_model
from minillm.config import ModelConfig, parse_memory
from minillm.machine import machine_description, machine_tag
from minillm.metrics import SLO, run_report
from minillm.outputs import RequestMetrics, RequestOutput
from minillm.tools.workloads import poisson_workload, replay, shared_prefix_workload

RESULTS = Path(__file__).parent / "results"


class _TokenTimes:
    """A ``generate()`` streamer that only notes when each step's tokens appear."""

    def __init__(self):
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value):
        if not self._prompt_seen:  # the first call hands over the prompt
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self):
        pass


def run_hf(model_dir, requests, dtype, device, batch_size: int, max_batches: int | None) -> list[RequestOutput]:
    """HF ``generate()`` in padded static batches, arrival order, on a virtual arrival clock."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device).eval()
    order = sorted(requests, key=lambda r: r.arrival_time)
    if max_batches is not None:
        order = order[: max_batches * batch_size]
    outputs = []
    clock = 0.0  # virtual seconds since the first arrival; the server is idle until a batch is full
    for b in range(0, len(order), batch_size):
        batch = order[b : b + batch_size]
        clock = max(clock, batch[-1].arrival_time)
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(batch):  # left padding, as decoder-only generation needs
            ids[i, width - len(r.prompt_token_ids) :] = torch.tensor(r.prompt_token_ids)
            mask[i, width - len(r.prompt_token_ids) :] = 1
        new_tokens = max(r.max_tokens for r in batch)
        streamer = _TokenTimes()
        start = time.perf_counter()
        with torch.inference_mode():
            hf.generate(
                ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
                streamer=streamer,
            )
        # Each request is done when its own output length is reached (the rest is padding work).
        for r in batch:
            times = [clock + t - start for t in streamer.times[: r.max_tokens]]
            metrics = RequestMetrics(arrival_time=r.arrival_time, first_scheduled_time=clock, token_times=times)
            metrics.finished_time = times[-1]
            outputs.append(
                RequestOutput(r.request_id, "", r.prompt_token_ids, "", [0] * r.max_tokens, "length", metrics)
            )
        clock += streamer.times[-1] - start
    del hf
    return outputs


def step_kinds(records, compiled_rows: int) -> dict[str, dict]:
    """Steps and seconds by kind: pure decode steps the compiled graphs can take (at most
    ``compiled_rows`` sequences), larger pure decode steps, and steps carrying a prompt chunk."""
    kinds: dict[str, dict] = {}
    for r in records:
        if not all(decode for _, _, _, decode in r.chunks):
            kind = "with a prompt chunk"
        elif len(r.chunks) <= compiled_rows:
            kind = f"pure decode, <= {compiled_rows} sequences"
        else:
            kind = f"pure decode, > {compiled_rows} sequences"
        entry = kinds.setdefault(kind, {"steps": 0, "seconds": 0.0})
        entry["steps"] += 1
        entry["seconds"] += r.duration
    return kinds


def run_minillm(model, requests, policy: str, **engine_args):
    engine = LLMEngine(model, scheduling_policy=policy, **engine_args)
    engine.wait_for_fast_path()  # the default's compiled decode step, built in the background
    outputs = replay(engine, requests)
    return outputs, engine


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--rate", type=float, default=4.0, help="Poisson arrival rate, requests/s")
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(16, 512))
    parser.add_argument("--output-len", type=int, nargs=2, default=(16, 256))
    parser.add_argument("--prefix-requests", type=int, default=32)
    parser.add_argument("--prefix-len", type=int, default=384)
    parser.add_argument("--prefix-rate", type=float, default=2.0)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument(
        "--kv-cache-memory", type=parse_memory, default=None, help="bytes (2e9, 2GB) or a fraction of free memory (0.5)"
    )
    parser.add_argument("--hf-batch-size", type=int, default=8)
    parser.add_argument("--hf-batches", type=int, default=None, help="serve only the first N HF batches")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--slo-ttft", type=float, default=2.0)
    parser.add_argument("--slo-tpot", type=float, default=0.25)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument(
        "--compile",
        choices=("auto", "on", "off"),
        default="auto",
        help="the compiled CPU decode step: the engine's default (auto), forced on, or off (eager)",
    )
    parser.add_argument(
        "--compile-batch-sizes", type=int, nargs="+", default=None, help="compiled decode graphs' row counts"
    )
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    engine_args = dict(
        dtype=args.dtype, device=args.device, max_num_seqs=args.max_num_seqs, kv_cache_memory=args.kv_cache_memory
    )
    engine_args["compile"] = {"auto": None, "on": True, "off": False}[args.compile]
    if args.compile_batch_sizes:
        engine_args["compile_batch_sizes"] = tuple(args.compile_batch_sizes)
    slo = SLO(ttft=args.slo_ttft, tpot=args.slo_tpot)

    vocab = ModelConfig.from_folder(resolve_model(args.model)).vocab_size
    workload = poisson_workload(
        args.num_requests, args.rate, tuple(args.prompt_len), tuple(args.output_len), vocab, seed=args.seed
    )
    rows: dict[str, dict] = {}
    extra: dict[str, dict] = {}
    kinds: dict[str, dict] = {}
    engine = None
    for policy in ("static", "dynamic", "continuous"):
        outputs, engine = run_minillm(args.model, workload, policy, **engine_args)
        report = run_report(outputs, engine.step_records, slo, engine.memory_report())
        rows[f"minillm {policy}"] = report.summary()
        if policy == "continuous":  # which steps the compiled decode graphs (if any) could take
            compiled_rows = max(getattr(engine.graphs, "batch_sizes", None) or (0,))
            kinds = step_kinds(engine.step_records, compiled_rows)
            print(f"continuous steps by kind: {kinds}")
        print(
            f"minillm {policy:>10}: {report.output_throughput:7.1f} output tok/s, p99 TTFT {report.ttft['p99']:.2f} s"
        )
    device, dtype = engine.device, engine.dtype
    machine = machine_description(device)
    compiled = getattr(engine.graphs, "batch_sizes", None)  # the compiled CPU decode step's graphs, if any
    if not args.skip_hf:
        hf_requests = workload
        outputs = run_hf(engine.model_dir, hf_requests, dtype, device, args.hf_batch_size, args.hf_batches)
        report = run_report(outputs, None, slo)
        rows["HF generate, static batches of 8"] = report.summary()
        print(f"HF generate: {report.output_throughput:7.1f} output tok/s, p99 TTFT {report.ttft['p99']:.2f} s")
    del engine

    prefix = shared_prefix_workload(
        args.prefix_requests, args.prefix_rate, args.prefix_len, vocab_size=vocab, seed=args.seed + 1
    )
    for caching in (False, True):
        outputs, engine = run_minillm(args.model, prefix, "continuous", enable_prefix_caching=caching, **engine_args)
        report = run_report(outputs, engine.step_records, slo)
        name = f"shared prefix, prefix caching {'on' if caching else 'off'}"
        extra[name] = report.summary() | {"prefix_hit_rate": engine.block_manager.prefix_hit_rate}
        print(f"{name}: mean TTFT {report.ttft['mean'] * 1000:.0f} ms")
        del engine

    result = {
        "benchmark": "serving",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "model": args.model,
        "dtype": str(dtype).replace("torch.", ""),
        "args": vars(args),
        "machine": machine,
        "compiled_decode_batch_sizes": list(compiled) if compiled else None,
        "continuous_step_kinds": kinds,
        "mixed_workload": rows,
        "shared_prefix_workload": extra,
    }
    cont, static = rows["minillm continuous"], rows["minillm static"]
    on = extra["shared prefix, prefix caching on"]
    off = extra["shared prefix, prefix caching off"]
    result["targets"] = {
        "prefix_caching_ttft_cut": off["ttft_mean_s"] / on["ttft_mean_s"],
        "continuous_p99_ttft_below_static": cont["ttft_p99_s"] < static["ttft_p99_s"],
        "kv_waste_paged": cont["kv_waste_paged"],
        "kv_waste_contiguous": cont["kv_waste_contiguous"],
    }
    hf = rows.get("HF generate, static batches of 8")
    if hf:
        result["targets"]["continuous_vs_hf_output_throughput"] = cont["output_tok_per_s"] / hf["output_tok_per_s"]
    print()
    print(format_table(result))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"serving-{result['date'][:10]}-{machine_tag(machine)}-{machine['torch_threads']}t.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {path}")
    return result


def format_table(result: dict) -> str:
    lines = [
        "| run | output tok/s | req/s | TTFT mean s | TTFT p50 s | TTFT p99 s | TPOT p50 ms | TPOT p99 ms "
        "| max ITL s | SLO met | preemptions |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in {**result["mixed_workload"], **result["shared_prefix_workload"]}.items():
        lines.append(
            f"| {name} | {r['output_tok_per_s']:.1f} | {r['req_per_s']:.2f} | {r['ttft_mean_s']:.2f} "
            f"| {r['ttft_p50_s']:.2f} | {r['ttft_p99_s']:.2f} | {r['tpot_p50_s'] * 1000:.0f} | {r['tpot_p99_s'] * 1000:.0f} "
            f"| {r['itl_max_s']:.2f} | {r['slo_attainment']:.0%} | {r['preemptions']} |"
        )
    t = result["targets"]
    lines.append("")
    if "continuous_vs_hf_output_throughput" in t:
        lines.append(f"- continuous / HF output tokens/s: **{t['continuous_vs_hf_output_throughput']:.2f}x**")
    lines.append(f"- continuous p99 TTFT below static: **{t['continuous_p99_ttft_below_static']}**")
    lines.append(f"- prefix caching cuts mean TTFT by **{t['prefix_caching_ttft_cut']:.2f}x**")
    lines.append(
        f"- KV waste, continuous run (mean over steps): paged **{t['kv_waste_paged']:.1%}** of reserved slots, "
        f"contiguous max-length reservation **{t['kv_waste_contiguous']:.1%}**"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
