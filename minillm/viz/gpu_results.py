"""GPU figures for the chapters that teach what a GPU changes (02, 05, 06): the committed run's
when this machine has no GPU, a live measurement when it has one — always labelled with the card
and the date, so a figure is never read as this laptop's.

The committed run is the newest ``benchmarks/bench_gpu.py`` result under ``benchmarks/results/``
(``gpu-<date>/`` folders, written by ``benchmarks/gpu_checks.sh``; an older run's JSON may sit
at the top level), with the step profile (``profile_gpu_step.py``) and the serving run
(``bench_serving.py``) from the same folder when they are there. Those runs used random weights
of SmolLM2-135M's shapes: speed depends on the shapes, not the values.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

RESULTS_DIR = Path(__file__).resolve().parents[2] / "benchmarks" / "results"  # in a checkout of the repository


def committed_gpu_run(folder: str | Path = RESULTS_DIR) -> dict | None:
    """The newest committed ``bench_gpu.py`` result, with its folder's step profile and serving
    run: ``{"card", "date", "source", "bench", "profile", "serving"}`` (None if there is none)."""
    folder = Path(folder)
    found = [p for p in (*folder.glob("gpu-*.json"), *folder.glob("gpu-*/gpu-*.json")) if "profile" not in p.name]
    runs = []
    for path in found:
        data = json.loads(path.read_text())
        if data.get("benchmark") == "gpu":
            runs.append((data.get("date", ""), path, data))
    if not runs:
        return None
    date, path, bench = max(runs, key=lambda r: r[0])
    beside = path.parent if path.parent != folder else None

    def sibling(pattern: str) -> dict | None:
        matches = sorted(beside.glob(pattern)) if beside else []
        return json.loads(matches[-1].read_text()) if matches else None

    return {
        "card": bench.get("machine", {}).get("gpu", "GPU"),
        "date": date[:10],
        "source": str(path.relative_to(folder.parent.parent)) if folder.parent.parent in path.parents else str(path),
        "bench": bench,
        "profile": sibling("gpu-step-profile-*.json"),
        "serving": sibling("serving-*.json"),
    }


WHAT_RAN = {  # what each kind of figure measured in the committed run
    "prefill": "random bf16 tensors, 32 query heads sharing 8 K/V heads of 128 (Llama-3-8B's attention)",
    "steps": "random bf16 tensors, 32 query heads sharing 8 K/V heads, head dims 64 and 128",
    "decode": "random bf16 tensors, 32 query heads sharing 8 K/V heads of 128 (Llama-3-8B's attention)",
    "step": "random bf16 weights of SmolLM2-135M's shapes",
    "kv": "random bf16 weights of SmolLM2-135M's shapes",
}


def label(run: dict, kind: str = "step") -> str:
    """Where a committed figure of ``kind`` comes from, in words."""
    return f"{run['card']}, committed run of {run['date']} ({run['source']}; {WHAT_RAN[kind]}) — not this machine"


def prefill_table(run: dict) -> list[dict]:
    """Prefill attention (causal, GQA 32/8, head dim 128, bf16): our kernel and SDPA, per length."""
    rows = []
    for r in run["bench"].get("prefill", []) if isinstance(run["bench"].get("prefill"), list) else []:
        rows.append({"tokens": r["tokens"], "ours_ms": r["triton"]["ms"], "ours_tflops": r["triton"]["tflops"],
                     "sdpa_ms": r["sdpa"]["ms"], "sdpa_tflops": r["sdpa"]["tflops"],
                     "ours_vs_sdpa": r["sdpa"]["ms"] / r["triton"]["ms"]})  # fmt: skip
    return rows


def decode_table(run: dict) -> list[dict]:
    """Paged decode attention (GQA 32/8, head dim 128, bf16): our kernel as shipped, the engine's
    measured choice and gather + SDPA, per batch and context, with the share of copy bandwidth."""
    rows = []
    for r in run["bench"].get("decode", []) if isinstance(run["bench"].get("decode"), list) else []:
        tuned = r.get("tuned", {})
        rows.append({"batch": r["batch"], "context": r["context"], "ours_ms": r["triton"]["ms"],
                     "ours_pct_bandwidth": r["triton"]["pct_peak_bandwidth"], "tuned_ms": tuned.get("ms"),
                     "tuned_choice": r.get("tuned_choice"), "gather_sdpa_ms": r["reference"]["ms"]})  # fmt: skip
    return rows


def steps_table(run: dict) -> list[dict]:
    """The prefill kernel's steps one by one (``bench_gpu.py``'s ladder, ``FlashConfig``): each
    step's time against SDPA, per length and head dim; empty for a run from before the ladder."""
    rows = []
    for r in run["bench"].get("flash_steps", []) if isinstance(run["bench"].get("flash_steps"), list) else []:
        for name, t in r["steps"].items():
            rows.append({"tokens": r["tokens"], "head_dim": r["head_dim"], "step": name, "ms": t["ms"],
                         "tflops": t["tflops"], "vs_sdpa": t["vs_sdpa"]})  # fmt: skip
    return rows


def step_table(run: dict) -> list[dict]:
    """One batch-1 decode token of SmolLM2-135M's shapes: kernels launched, their time, the wall
    time, with and without CUDA graphs (``profile_gpu_step.py``)."""
    runs = (run.get("profile") or {}).get("runs", {})
    return [{"setup": name, "kernels": r["kernels_per_token"], "kernel_ms": r["kernel_ms_per_token"],
             "wall_ms": r["wall_ms_per_token"], "tok_s": 1000 / r["wall_ms_per_token"]}
            for name, r in runs.items()]  # fmt: skip


def kv_table(run: dict) -> list[dict]:
    """KV-cache memory reserved but never written, contiguous vs paged, serving 512 requests of
    16-512 prompt and 16-256 output tokens (``bench_serving.py``)."""
    targets = (run.get("serving") or {}).get("targets", {})
    return [{"cache": name, "wasted": targets[key]} for name, key in
            (("contiguous (max length per sequence)", "kv_waste_contiguous"), ("paged (16-token blocks)", "kv_waste_paged"))
            if key in targets]  # fmt: skip


def measure_prefill(lengths=(2048, 8192), heads: int = 32, kv_heads: int = 8, dim: int = 128) -> list[dict]:
    """``prefill_table``'s columns, measured on this machine's GPU."""
    import torch.nn.functional as F

    from minillm.attention.decode_tuning import cuda_timer
    from minillm.attention.triton_kernels import flash_attention

    rows = []
    for n in lengths:
        q = torch.randn(n, heads, dim, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(n, kv_heads, dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        cu, lens = torch.tensor([0, n], device="cuda", dtype=torch.int32), torch.tensor([n], device="cuda", dtype=torch.int32)
        qb, kb, vb = (t.transpose(0, 1)[None] for t in (q, k, v))
        ours = 1000 * cuda_timer(lambda: flash_attention(q, k, v, cu, lens, n, dim**-0.5, True, cu))  # noqa: B023
        sdpa = 1000 * cuda_timer(lambda: F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, enable_gqa=True))  # noqa: B023
        flops = 2 * n * n * heads * dim  # causal: half of 4·n²·h·d
        rows.append({"tokens": n, "ours_ms": ours, "ours_tflops": flops / ours / 1e9, "sdpa_ms": sdpa,
                     "sdpa_tflops": flops / sdpa / 1e9, "ours_vs_sdpa": sdpa / ours})  # fmt: skip
    return rows


def measure_decode(batches=(1, 64), context: int = 4096, heads: int = 32, kv_heads: int = 8, dim: int = 128,
                   block_size: int = 16) -> list[dict]:  # fmt: skip
    """``decode_table``'s columns (our kernel as shipped and gather + SDPA), on this machine's GPU."""
    from minillm.attention.decode_tuning import cuda_timer, gather_sdpa_decode
    from minillm.attention.triton_kernels import paged_decode
    from minillm.viz.roofline import measure_machine

    peak = measure_machine(torch.device("cuda"), torch.bfloat16).bandwidth_gbs
    rows = []
    for b in batches:
        blocks = b * context // block_size
        k_pool = torch.randn(blocks * block_size, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
        v_pool = torch.randn_like(k_pool)
        tables = torch.randperm(blocks, device="cuda").view(b, -1)
        lens = torch.full((b,), context, device="cuda", dtype=torch.int32)
        q = torch.randn(b, heads, dim, device="cuda", dtype=torch.bfloat16)
        ours = 1000 * cuda_timer(lambda: paged_decode(q, k_pool, v_pool, tables, lens, dim**-0.5, block_size, context))  # noqa: B023
        ref = 1000 * cuda_timer(lambda: gather_sdpa_decode(q, k_pool, v_pool, tables, lens, dim**-0.5, block_size))  # noqa: B023
        gbs = 2 * b * context * kv_heads * dim * 2 / ours / 1e6
        rows.append({"batch": b, "context": context, "ours_ms": ours, "ours_pct_bandwidth": 100 * gbs / peak,
                     "tuned_ms": None, "tuned_choice": None, "gather_sdpa_ms": ref})  # fmt: skip
    return rows


KINDS = ("prefill", "steps", "decode", "step", "kv")


def gpu_figures(kind: str, folder: str | Path = RESULTS_DIR) -> tuple[str, list[dict]]:
    """``(label, rows)`` for ``kind`` — one of ``KINDS``: measured here when this machine has a
    CUDA GPU (prefill and decode; the others need a whole benchmark run, so they stay the
    committed ones), else the committed run's."""
    if kind not in KINDS:
        raise ValueError(f"gpu_figures: kind={kind!r} is not one of {', '.join(map(repr, KINDS))}")
    if torch.cuda.is_available() and kind in ("prefill", "decode"):
        rows = measure_prefill() if kind == "prefill" else measure_decode()
        return f"{torch.cuda.get_device_name()}, measured now on this machine", rows
    run = committed_gpu_run(folder)
    if run is None:
        return "no GPU here and no committed GPU run in benchmarks/results/ (run benchmarks/gpu_checks.sh on one)", []
    table = {"prefill": prefill_table, "steps": steps_table, "decode": decode_table, "step": step_table,
             "kv": kv_table}[kind](run)  # fmt: skip
    return label(run, kind), table


def print_gpu_figures(kind: str, folder: str | Path = RESULTS_DIR) -> None:
    """``gpu_figures`` as a small printed table, its label first."""
    source, rows = gpu_figures(kind, folder)
    print(source)
    formats = {
        "prefill": ("{tokens:>7} tokens: ours {ours_ms:8.3f} ms ({ours_tflops:5.0f} TFLOP/s), SDPA {sdpa_ms:7.3f} ms "
                    "({sdpa_tflops:5.0f} TFLOP/s): ours at {ours_vs_sdpa:.2f}x SDPA's speed"),
        "steps": "{tokens:>6} tokens, head dim {head_dim:>3}: {step:<62} {ms:8.3f} ms ({vs_sdpa:.2f}x SDPA)",
        "decode": "batch {batch:>3} x {context:>5} keys: ours {ours_ms:6.3f} ms ({ours_pct_bandwidth:3.0f}% of copy "
                  "bandwidth), gather + SDPA {gather_sdpa_ms:6.3f} ms",
        "step": "{setup:>18}: {kernels:5.0f} kernels a token, {kernel_ms:5.2f} ms in them, {wall_ms:6.2f} ms a token "
                "({tok_s:5.0f} tok/s)",
        "kv": "{cache:>38}: {wasted:6.1%} of the reserved KV memory never written",
    }  # fmt: skip
    for row in rows:
        print("  " + formats[kind].format(**row))
    if not rows and kind == "steps":
        print("  (this run is older than the kernel's steps: `bash benchmarks/gpu_checks.sh --quick` on a GPU measures them)")
