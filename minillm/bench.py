"""Generation benchmark: minillm against HF ``transformers`` ``generate()``, same run, same settings.

For each dtype and batch size both engines generate ``new_tokens`` tokens (EOS ignored, greedy)
after a ``prompt_len``-token prompt. Each engine is timed twice per repeat: generating one
token (that wall time is TTFT: prefill + the first sample) and generating all of them. The
decode rate is ``batch × (new_tokens − 1) / (t_all − t_one)``: only the one-token steps, and
measured identically for both engines. The engines' repeats are interleaved and we report
medians; the ratio minillm/HF comes from the same run, since this machine is shared and noisy.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from minillm.config import parse_dtype


def machine_description(device: torch.device) -> dict:
    cpu = platform.processor() or platform.machine()
    flags: list[str] = []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and cpu == (platform.processor() or platform.machine()):
                cpu = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                present = set(line.split(":", 1)[1].split())
                flags = [
                    f for f in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8") if f in present
                ]
    except OSError:
        pass
    info = {
        "cpu": cpu,
        "cpu_flags": flags,  # what decides the fast paths: bf16 dot products, AMX tiles
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": str(device),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def _prompts(tokenizer, batch: int, prompt_len: int) -> list[list[int]]:
    """``batch`` different prompts of exactly ``prompt_len`` tokens (no padding for either engine)."""
    text = (
        "The history of computing is a story of machines that grew faster by moving less data. "
        "Early computers read their programs from punched cards; later ones kept them in memory. "
        "Caches, pipelines and parallel units followed, each hiding the slowness of memory a little. "
    ) * 40
    ids = tokenizer.encode(text)
    return [ids[7 * i : 7 * i + prompt_len] for i in range(batch)]


def _time(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _measure(runs: dict, batch: int, new_tokens: int, repeats: int, device: torch.device) -> dict:
    """Time every engine in ``runs`` (name → ``run(n_tokens)``), interleaving their repeats so
    that machine noise hits all of them alike."""
    for run in runs.values():
        run(1), run(new_tokens)  # warm-up: allocator, kernels, caches
    ttfts = {name: [] for name in runs}
    totals = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            ttfts[name].append(_time(lambda run=run: (run(1), _sync(device))))
            totals[name].append(_time(lambda run=run: (run(new_tokens), _sync(device))))
    results = {}
    for name in runs:
        ttft, total = statistics.median(ttfts[name]), statistics.median(totals[name])
        decode_s = max(total - ttft, 1e-9)
        results[name] = {
            "ttft_ms": 1000 * ttft,
            "total_s": total,
            "decode_tok_s": batch * (new_tokens - 1) / decode_s,
            "tpot_ms": 1000 * decode_s / (new_tokens - 1),
            "ttft_samples_ms": [1000 * t for t in ttfts[name]],
            "total_samples_s": totals[name],
        }
    return results


def run_generate_benchmark(
    model: str = "smollm2-135m",
    dtypes=("fp32", "bf16"),
    batch_sizes=(1, 8),
    prompt_len: int = 64,
    new_tokens: int = 64,
    repeats: int = 3,
    threads: int | None = None,
    device: str = "auto",
    include_hf: bool = True,
    out_dir: str | None = None,
    compile: bool = False,
) -> dict:
    from minillm.engine import LLM
    from minillm.sampling import SamplingParams

    if threads:
        torch.set_num_threads(threads)
    rows = []
    machine = None
    for dtype_name in dtypes:
        dtype = parse_dtype(dtype_name)
        if compile:  # the compiled decode step belongs to the contiguous-cache engine
            llm = LLM(model, dtype=dtype_name, device=device, mode="contiguous", compile=True)
        else:  # the default paged engine; no prefix caching: the repeats reuse the same prompts
            llm = LLM(model, dtype=dtype_name, device=device, enable_prefix_caching=False)
        machine = machine or machine_description(llm.device)
        hf = None
        if include_hf:
            from transformers import AutoModelForCausalLM

            hf = AutoModelForCausalLM.from_pretrained(str(llm.model_dir), dtype=dtype).to(llm.device).eval()
        for batch in batch_sizes:
            prompts = _prompts(llm.tokenizer, batch, prompt_len)

            def run_minillm(n, prompts=prompts, llm=llm):
                llm.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True))

            runs = {"minillm": run_minillm}
            if hf is not None:
                ids = torch.tensor(prompts, device=llm.device)
                mask = torch.ones_like(ids)

                def run_hf(n, ids=ids, mask=mask, hf=hf):
                    with torch.inference_mode():
                        hf.generate(
                            ids,
                            attention_mask=mask,
                            max_new_tokens=n,
                            min_new_tokens=n,
                            do_sample=False,
                            pad_token_id=0,
                        )

                runs["hf"] = run_hf
            row = {"dtype": dtype_name, "batch": batch, **_measure(runs, batch, new_tokens, repeats, llm.device)}
            if hf is not None:
                row["decode_ratio"] = row["minillm"]["decode_tok_s"] / row["hf"]["decode_tok_s"]
                row["ttft_ratio"] = row["hf"]["ttft_ms"] / row["minillm"]["ttft_ms"]
            rows.append(row)
            print(_format_row(row), flush=True)
        del llm, hf  # free this dtype's weights before loading the next
    result = {
        "benchmark": "generate",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "model": model,
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "repeats": repeats,
        "compile": compile,
        "machine": machine,
        "rows": rows,
    }
    print()
    print(format_table(result))
    if out_dir:
        path = Path(out_dir)
        path.mkdir(parents=True, exist_ok=True)
        tag = (machine or {}).get("gpu") or "cpu"
        suffix = "-compile" if compile else ""
        name = f"generate-{result['date'][:10]}-{tag.replace(' ', '_')}-{machine['torch_threads']}t{suffix}.json"
        (path / name).write_text(json.dumps(result, indent=2))
        print(f"\nwrote {path / name}")
    return result


def _format_row(row: dict) -> str:
    m = row["minillm"]
    line = f"{row['dtype']:>5} batch {row['batch']:>2}: minillm {m['decode_tok_s']:7.1f} tok/s, TTFT {m['ttft_ms']:7.1f} ms"
    if "hf" in row:
        h = row["hf"]
        line += f" | HF {h['decode_tok_s']:7.1f} tok/s, TTFT {h['ttft_ms']:7.1f} ms | decode x{row['decode_ratio']:.2f}"
    return line


def format_table(result: dict) -> str:
    """A Markdown table of the result, as pasted into the README."""
    lines = [
        "| dtype | batch | minillm decode tok/s | HF decode tok/s | ratio | minillm TTFT ms | HF TTFT ms |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        m, h = r["minillm"], r.get("hf")
        hf_tok = f"{h['decode_tok_s']:.1f}" if h else "-"
        hf_ttft = f"{h['ttft_ms']:.1f}" if h else "-"
        ratio = f"{r['decode_ratio']:.2f}x" if h else "-"
        lines.append(
            f"| {r['dtype']} | {r['batch']} | {m['decode_tok_s']:.1f} | {hf_tok} | {ratio} | {m['ttft_ms']:.1f} | {hf_ttft} |"
        )
    return "\n".join(lines)
