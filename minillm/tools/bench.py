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
import functools
import json
import statistics
import time
from pathlib import Path

import torch

from minillm.config import parse_dtype
from minillm.entrypoints import LLM
from minillm.kvcache.addressing import kv_bytes_per_token
from minillm.machine import machine_description, machine_tag
from minillm.sampling import SamplingParams
from minillm.tools.llamacpp import LlamaCpp


def _prompts(tokenizer, batch: int, prompt_len: int) -> list[list[int]]:
    """``batch`` different prompts of exactly ``prompt_len`` tokens (no padding for either engine)."""
    text = (
        "The history of computing is a story of machines that grew faster by moving less data. "
        "Early computers read their programs from punched cards; later ones kept them in memory. "
        "Caches, pipelines and parallel units followed, each hiding the slowness of memory a little. "
    ) * 40
    ids = tokenizer.encode(text)
    if 7 * (batch - 1) + prompt_len > len(ids):
        raise ValueError(f"prompt_len={prompt_len} x batch {batch}: the benchmark text has only {len(ids)} tokens")
    return [ids[7 * i : 7 * i + prompt_len] for i in range(batch)]


def _time(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _measure(runs: dict, batch: int, new_tokens: int, repeats: int, device: torch.device, between=None) -> dict:
    """Time every engine in ``runs`` (name → ``run(n_tokens)``), interleaving their repeats so
    that machine noise hits all of them alike; ``between()`` (an engine that times itself, such
    as llama.cpp's tools) runs once per repeat, after the others."""
    for run in runs.values():
        run(1), run(new_tokens)  # warm-up: allocator, kernels, caches
    ttfts = {name: [] for name in runs}
    totals = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            ttfts[name].append(_time(lambda run=run: (run(1), _sync(device))))
            totals[name].append(_time(lambda run=run: (run(new_tokens), _sync(device))))
        if between is not None:
            between()
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


def measure_read_bandwidth(megabytes: int = 512, repeats: int = 7) -> float:
    """Memory read bandwidth in GB/s as PyTorch sees it: the fastest of ``repeats`` sums of a
    tensor far larger than the caches, in fp32 and in bf16, with the current thread count — the
    ceiling for a decode step, which must read every weight once (MBU = achieved bytes/s over
    this). The fastest, not the median: on a shared machine a slow repeat measures the
    neighbours; both dtypes, because on few cores an fp32 sum can be partly bound by its
    arithmetic, and the faster of the two is the better estimate of the memory's limit."""
    best = 0.0
    for dtype in (torch.float32, torch.bfloat16):
        data = torch.ones(megabytes * (1 << 20) // dtype.itemsize, dtype=dtype)
        data.sum()  # fault the pages in
        best = max(best, megabytes * (1 << 20) / min(_time(data.sum) for _ in range(repeats)) / 1e9)
    return best


def decode_bytes_per_step(model_config, dtype: torch.dtype, context: int) -> int:
    """Bytes one batch-1 decode step must read: every linear weight once (a tied LM head is
    the embedding matrix, read once as the head; looking up one embedding row is negligible)
    and the K/V of ``context`` tokens."""
    c = model_config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    per_layer = c.hidden_size * (q + 2 * kv) + q * c.hidden_size + 3 * c.hidden_size * c.intermediate_size
    weights = c.num_layers * per_layer + c.vocab_size * c.hidden_size
    return weights * torch.tensor([], dtype=dtype).element_size() + context * kv_bytes_per_token(c, dtype)


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
    compile: bool = True,
    prefill_len: int = 512,
    llama_bench: str | None = None,
    gguf: str | None = None,
    quantization: str | None = None,
) -> dict:
    """Every engine on the same prompts, interleaved: minillm's paged engine eager
    (``compile=False``) and compiled (``compile=True``, the CPU default for such a model), HF
    ``generate`` and — for the dtype of the ``gguf`` file, when a ``llama_bench`` binary is
    given — llama.cpp. Per batch size: decode tok/s and
    TTFT; per dtype: prefill tok/s on one ``prefill_len``-token prompt; MBU of batch-1 decode
    against the measured read bandwidth. ``quantization``: minillm's engines quantize their
    linear layers (HF and llama.cpp run the unquantized model: the baselines stay the same)."""
    if threads:
        torch.set_num_threads(threads)
    if prefill_len < 1 or prompt_len < 1 or new_tokens < 2:
        raise ValueError(
            f"prefill_len={prefill_len}, prompt_len={prompt_len} must be >= 1 and new_tokens={new_tokens} >= 2"
        )
    llamacpp = LlamaCpp(llama_bench, gguf, torch.get_num_threads()) if llama_bench or gguf else None
    if llamacpp is not None and llamacpp.dtype not in [parse_dtype(d) for d in dtypes]:
        name = str(llamacpp.dtype).removeprefix("torch.")
        raise ValueError(f"--gguf {gguf} holds {name} weights, but --dtypes {' '.join(dtypes)} does not include it")
    rows, prefill_rows, starts = [], [], []
    machine = None
    bandwidth = measure_read_bandwidth()
    for dtype_name in dtypes:
        dtype = parse_dtype(dtype_name)
        # The default paged engine; no prefix caching: the repeats reuse the same prompts.
        clock = time.perf_counter()
        common = dict(dtype=dtype_name, device=device, enable_prefix_caching=False, quantization=quantization)
        engines = {"minillm": LLM(model, compile=False, **common)}
        start = {"dtype": dtype_name, "minillm_s": time.perf_counter() - clock}
        first = engines["minillm"]
        machine = machine or machine_description(first.device)
        if compile and first.device.type == "cpu":
            # Started twice: the first start compiles what is not on disk yet, the second is a
            # warm start (the graphs loaded from disk) — what every later run of the engine pays.
            for when in ("first", "warm"):
                engines.pop("minillm compiled", None)
                clock = time.perf_counter()
                engines["minillm compiled"] = llm = LLM(model, compile=True, **common)
                start[f"compiled_{when}_answers_s"] = time.perf_counter() - clock  # it decodes eagerly from here
                status = llm.wait_for_fast_path()  # the compiled step, built in the background
                if status.state != "ready":
                    raise RuntimeError(f"the compiled decode step of {model} ({dtype_name}) did not build: {status}")
                start[f"compiled_{when}_s"] = time.perf_counter() - clock
                graphs = llm.engine.graphs
                if when == "first":
                    start["compile_s"] = graphs.compile_seconds
                else:
                    start["load_s"] = graphs.load_seconds
        starts.append(start)
        hf = None
        if include_hf:
            # deferred: transformers takes 0.6 s to import; only the HF side of the benchmark needs it
            from transformers import AutoModelForCausalLM

            hf = AutoModelForCausalLM.from_pretrained(str(first.model_dir), dtype=dtype).to(first.device).eval()
        anchor = llamacpp if llamacpp is not None and llamacpp.dtype == dtype else None
        for batch in [*batch_sizes, "prefill"]:
            n_prompts, length = (1, prefill_len) if batch == "prefill" else (batch, prompt_len)
            prompts = _prompts(first.tokenizer, n_prompts, length)
            runs = {}
            for name, llm in engines.items():

                def run_minillm(n, prompts=prompts, llm=llm):
                    llm.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True))

                runs[name] = run_minillm
            if hf is not None:
                ids = torch.tensor(prompts, device=first.device)
                runs["hf"] = _hf_run(hf, ids)
            anchored: list[dict] = []
            between = None
            if anchor is not None and (batch == "prefill" or anchor.supports_batch(batch)):
                between = functools.partial(_anchor_once, anchored, anchor, batch, length, new_tokens)
            measured = _measure(
                runs, n_prompts, 2 if batch == "prefill" else new_tokens, repeats, first.device, between
            )
            if batch == "prefill":
                row = {"dtype": dtype_name, "prompt_len": length}
                for name, m in measured.items():
                    row[name] = {"ttft_ms": m["ttft_ms"], "prefill_tok_s": 1000 * length / m["ttft_ms"]}
            else:
                row = {"dtype": dtype_name, "batch": batch, **measured}
            if anchored:  # llama.cpp's own figures, the median of its runs between ours
                row["llama.cpp"] = {k: statistics.median(a[k] for a in anchored) for k in anchored[0]}
                row["llama.cpp"]["samples"] = anchored
            if batch == "prefill":
                prefill_rows.append(row)
            else:
                if batch == 1 and quantization is None:  # MBU once the bandwidth is final (bf16/fp32 bytes)
                    context = prompt_len + new_tokens // 2
                    row["decode_bytes_per_step"] = decode_bytes_per_step(first.engine.model_config, dtype, context)
                rows.append(row)
            print(_format_row(row), flush=True)
        del engines, first, hf, runs, llm  # free this dtype's weights (and compiled graph) before the next
    bandwidth = max(bandwidth, measure_read_bandwidth())  # again at the end: the machine's best moment
    for row in [r for r in rows if "decode_bytes_per_step" in r]:
        for name in [n for n in ENGINES if n in row]:
            row[name]["mbu"] = row[name]["decode_tok_s"] * row["decode_bytes_per_step"] / (bandwidth * 1e9)
    result = {
        "benchmark": "generate",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "model": model,
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "prefill_len": prefill_len,
        "quantization": quantization,
        "repeats": repeats,
        "machine": machine,
        "read_bandwidth_gb_s": bandwidth,
        "llama_cpp": llamacpp.describe() if llamacpp is not None else None,
        "rows": rows,
        "prefill": prefill_rows,
        "engine_start": starts,
    }
    print()
    print(format_table(result))
    if out_dir:
        path = Path(out_dir)
        path.mkdir(parents=True, exist_ok=True)
        # Other models and quantized runs get their own files: one run must not overwrite another's.
        what = "".join(f"-{part}" for part in (Path(model).name, quantization) if part and part != "smollm2-135m")
        name = f"generate{what}-{result['date'][:10]}-{machine_tag(machine)}-{machine['torch_threads']}t.json"
        (path / name).write_text(json.dumps(result, indent=2))
        (path / name.replace(".json", ".md")).write_text(format_table(result) + "\n")
        print(f"\nwrote {path / name}")
    return result


def _anchor_once(samples: list, anchor, batch, prompt_len: int, new_tokens: int) -> None:
    samples.append(anchor.measure(batch, prompt_len, new_tokens))


def _hf_run(hf, ids: torch.Tensor):
    mask = torch.ones_like(ids)

    def run_hf(n):
        with torch.inference_mode():
            hf.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)

    return run_hf


ENGINES = ("minillm", "minillm compiled", "hf", "llama.cpp")


def _format_row(row: dict) -> str:
    if "prompt_len" in row:
        parts = [f"{n} {row[n]['prefill_tok_s']:.0f}" for n in ENGINES if n in row]
        return f"{row['dtype']:>5} prefill {row['prompt_len']}: " + ", ".join(parts) + " tok/s"
    parts = [f"{n} {row[n]['decode_tok_s']:.1f}" for n in ENGINES if n in row]
    return f"{row['dtype']:>5} batch {row['batch']:>2}: decode " + ", ".join(parts) + " tok/s"


def format_table(result: dict) -> str:
    """Markdown tables of the result, as pasted into the README (decode, then prefill)."""
    m = result.get("machine") or {}
    head = f"Machine: {m.get('cpu')} ({', '.join(m.get('cpu_flags', []))}), {m.get('torch_threads')} threads"
    if result.get("quantization"):
        head = f"minillm with {result['quantization']} weights (HF/llama.cpp unquantized). " + head
    if result.get("read_bandwidth_gb_s"):
        head += f"; measured read bandwidth {result['read_bandwidth_gb_s']:.1f} GB/s"
    present = [n for n in ENGINES if any(n in r for r in result["rows"] + result.get("prefill", []))]
    lines = [head, "", "| dtype | batch | " + " | ".join(f"{n} tok/s" for n in present) + " | MBU (batch 1) |"]
    lines.append("|---|---:|" + "---:|" * (len(present) + 1))
    for r in result["rows"]:
        cells = [f"{r[n]['decode_tok_s']:.1f}" if n in r else "-" for n in present]
        mbu = ", ".join(f"{n} {r[n]['mbu']:.0%}" for n in present if n in r and "mbu" in r[n]) or "-"
        lines.append(f"| {r['dtype']} | {r['batch']} | " + " | ".join(cells) + f" | {mbu} |")
    if result.get("prefill"):
        lines += ["", "| dtype | prefill tokens | " + " | ".join(f"{n} tok/s" for n in present) + " |"]
        lines.append("|---|---:|" + "---:|" * len(present))
        for r in result["prefill"]:
            cells = [f"{r[n]['prefill_tok_s']:.0f}" if n in r else "-" for n in present]
            lines.append(f"| {r['dtype']} | {r['prompt_len']} | " + " | ".join(cells) + " |")
    starts = [s for s in result.get("engine_start", []) if "compiled_warm_s" in s]
    if starts:
        lines += ["", "| dtype | engine start: eager | compiled, first start: answers / compiled step ready "
                  "(compiling in the background) | compiled, warm start: answers / ready |"]  # fmt: skip
        lines.append("|---|---:|---:|---:|")
        for s in starts:
            compiled = ", ".join(f"batch {b}: {t:.0f} s" for b, t in s["compile_s"].items()) or "on disk already"
            first_answer = f"{s['compiled_first_answers_s']:.1f} s / " if "compiled_first_answers_s" in s else ""
            warm_answer = f"{s['compiled_warm_answers_s']:.1f} s / " if "compiled_warm_answers_s" in s else ""
            lines.append(
                f"| {s['dtype']} | {s['minillm_s']:.1f} s | {first_answer}{s['compiled_first_s']:.1f} s ({compiled}) "
                f"| {warm_answer}{s['compiled_warm_s']:.1f} s (graphs loaded in {sum(s['load_s'].values()):.1f} s) |"
            )
    return "\n".join(lines)
