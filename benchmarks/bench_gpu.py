"""GPU benchmark: our Triton attention kernels and the CUDA fast path, one prepared script.

    python benchmarks/bench_gpu.py            # on a CUDA machine; ~3-5 minutes

1. The device's peaks, measured: copy bandwidth and bf16 matmul rate.
2. Prefill attention at several lengths (bf16, GQA 32/8, head_dim 128, causal): our FlashAttention
   kernel vs PyTorch SDPA vs the materialising reference — time, achieved TFLOP/s.
   Then the kernel's steps one by one (``--flash-step-lengths``, head dims 64 and 128): the first
   kernel, then tiles per head dim, bf16 dots, unmasked interior tiles and ``exp2`` in turn
   (``triton_kernels.FlashConfig``) — chapter 06's ladder.
3. Paged decode attention, batch 1/8/64 × contexts 1k/4k/16k: our kernel with its default
   settings, the engine's measured choice (``decode_tuning.py``: the search space and gather +
   SDPA, fastest kept — the timings of each candidate go to the JSON), and the reference (gather
   the blocks, then SDPA) — time, achieved GB/s and % of the measured bandwidth.
   Target: >= 60% of peak at batch 64 x 4k, and the choice never slower than the reference.
4. Weight-only quantized linear layers: one forward's worth of SmolLM2-135M's projections (30 ×
   qkv 576→960, o 576→576, gate_up 576→3072, down 1536→576, and the 576→49152 head), and two
   layers of Llama-3-8B's (qkv 4096→6144, o, gate_up 4096→28672, down 14336→4096: 872 MB, where
   weight bytes dominate), at 1 and 512 rows — bf16 ``F.linear`` vs our int8 and int4 (group 64) Triton kernels (the head in int8 for
   both, as the engine does) vs int8 dequantize + ``F.linear`` (the reference path); eager and
   replayed as one CUDA graph (no launch overhead), median ms, ratio to bf16, weight GB/s.
5. End-to-end SmolLM2-135M decode tokens/s at batch 1/8/64: minillm with and without CUDA graphs
   and HF ``generate()``, same run, interleaved repeats, medians. Target: batch 1 >= 3x HF.

Prints Markdown tables and writes ``benchmarks/results/gpu-DATE-GPU.json`` — after every row, so a
section cut off by a time limit keeps what it measured; ``--sections`` runs some of the parts. Without CUDA it
says so and exits (the kernels' correctness is tested on CPU by pytest).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import sys
from pathlib import Path

import torch

import minillm  # noqa: F401  (before triton)

RESULTS = Path(__file__).parent / "results"


def cuda_time(fn, repeats: int = 10, warmup: int = 3) -> float:
    """Median seconds of ``fn()`` measured with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return statistics.median(times)


def bench_prefill(lengths, heads=32, kv_heads=8, dim=128, rows: list | None = None, save=lambda: None) -> list[dict]:
    rows = [] if rows is None else rows
    for n in lengths:
        row = _prefill_row(n, heads, kv_heads, dim)
        rows.append(row)
        save()
        timings = ", ".join(
            f"{k} {v['ms']:.3f} ms ({v['tflops']:.1f} TFLOP/s)" for k, v in row.items() if isinstance(v, dict)
        )
        print(f"prefill {n:>6}: {timings}", flush=True)
    return rows


def _prefill_row(n: int, heads: int, kv_heads: int, dim: int) -> dict:
    import torch.nn.functional as F

    from minillm.attention.torch_ref import attention, causal_mask
    from minillm.attention.triton_kernels import flash_attention

    q = torch.randn(n, heads, dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(n, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(n, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    cu = torch.tensor([0, n], device="cuda", dtype=torch.int32)
    lens = torch.tensor([n], device="cuda", dtype=torch.int32)
    qb, kb, vb = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    flops = 4 * n * n * heads * dim / 2  # causal: half the score matrix
    runs = {
        "triton": lambda: flash_attention(q, k, v, cu, lens, n, dim**-0.5, True, cu),  # as the engine runs it
        "sdpa": lambda: F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, enable_gqa=True),
    }
    if n <= 8192:  # the reference materialises [heads, n, n] fp32 scores
        mask = causal_mask(torch.arange(n, device="cuda")[None], n)
        runs["reference"] = lambda: attention(qb, kb, vb, mask, dim**-0.5)
    error = (runs["triton"]().float() - runs["sdpa"]()[0].transpose(0, 1).float()).abs().max().item()
    row = {"tokens": n, "max_abs_error_vs_sdpa": error}
    for name, fn in runs.items():
        t = cuda_time(fn)
        row[name] = {"ms": 1000 * t, "tflops": flops / t / 1e12}
    return row


def flash_steps(head_dim: int) -> dict:
    """Chapter 06's ladder: the first kernel (the interpreter's 32 × 32 tiles, fp32 dots, every
    tile masked, ``exp``), then each step of ``FlashConfig`` added in turn, ending at the
    kernel as the engine runs it (``flash_config``)."""
    from dataclasses import replace

    from minillm.attention.triton_kernels import FlashConfig, flash_config

    shipped = flash_config(head_dim, torch.bfloat16, torch.device("cuda"))
    first = FlashConfig(input_dtype_dots=False, skip_interior_masks=False, exp2=False)
    tiles = replace(shipped, input_dtype_dots=False, skip_interior_masks=False, exp2=False)
    return {
        "first kernel (32x32 tiles, fp32 dots, every tile masked, exp)": first,
        "+ tiles, warps and stages per head dim": tiles,
        "+ bf16 dots with fp32 sums": replace(tiles, input_dtype_dots=True),
        "+ interior tiles without masks": replace(tiles, input_dtype_dots=True, skip_interior_masks=True),
        "+ exp2, log2 e folded into the scale (as shipped)": shipped,
    }


def bench_flash_steps(lengths, rows: list, save, heads=32, kv_heads=8, dims=(64, 128)) -> list[dict]:
    """Each step of the prefill kernel measured on its own (``flash_steps``), against SDPA, at
    head dims 64 (SmolLM2's) and 128 (Llama's); one row per length and head dim, saved as it
    finishes."""
    import torch.nn.functional as F

    from minillm.attention.triton_kernels import flash_attention

    for dim in dims:
        for n in lengths:
            q = torch.randn(n, heads, dim, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(n, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
            v = torch.randn(n, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
            cu = torch.tensor([0, n], device="cuda", dtype=torch.int32)
            lens = torch.tensor([n], device="cuda", dtype=torch.int32)
            flops = 4 * n * n * heads * dim / 2
            qb, kb, vb = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
            def reference(qb=qb, kb=kb, vb=vb):
                return F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, enable_gqa=True)

            sdpa = cuda_time(reference)
            expected = reference()[0].transpose(0, 1)
            row = {"tokens": n, "head_dim": dim, "sdpa_ms": 1000 * sdpa, "steps": {}}
            for name, config in flash_steps(dim).items():

                def run(config=config, q=q, k=k, v=v, cu=cu, lens=lens, n=n, dim=dim):
                    return flash_attention(q, k, v, cu, lens, n, dim**-0.5, True, cu, config=config)

                error = (run().float() - expected.float()).abs().max().item()
                t = cuda_time(run, repeats=5)
                row["steps"][name] = {"ms": 1000 * t, "tflops": flops / t / 1e12, "vs_sdpa": sdpa / t,
                                      "max_abs_error_vs_sdpa": error}  # fmt: skip
            rows.append(row)
            save()
            print(f"flash steps, {n:>6} tokens, head dim {dim}: SDPA {1000 * sdpa:.3f} ms; "
                  + "; ".join(f"{name.split(' (')[0]} {r['ms']:.3f} ms ({r['vs_sdpa']:.2f}x SDPA)"
                              for name, r in row["steps"].items()), flush=True)  # fmt: skip
    return rows


def bench_decode(batches, contexts, peak_gbs: float, heads=32, kv_heads=8, dim=128, block_size=16,
                 rows: list | None = None, save=lambda: None) -> list[dict]:  # fmt: skip
    rows = [] if rows is None else rows
    for b in batches:
        for ctx in contexts:
            row = _decode_row(b, ctx, peak_gbs, heads, kv_heads, dim, block_size)
            rows.append(row)
            save()
            print(
                f"decode b{b:>3} ctx {ctx:>6}: triton default {row['triton']['ms']:.3f} ms "
                f"({row['triton']['pct_peak_bandwidth']:.0f}% of peak; broadcast "
                f"{row['triton broadcast']['pct_peak_bandwidth']:.0f}%), tuned {row['tuned']['ms']:.3f} ms "
                f"({row['tuned']['pct_peak_bandwidth']:.0f}%, {row['tuned_choice']}), reference {row['reference']['ms']:.3f} ms",
                flush=True,
            )
    return rows


def _decode_row(b: int, ctx: int, peak_gbs: float, heads: int, kv_heads: int, dim: int, block_size: int) -> dict:
    import torch.nn.functional as F

    from minillm.attention.triton_kernels import paged_decode

    blocks_per_seq = ctx // block_size
    num_blocks = b * blocks_per_seq
    k_pool = torch.randn(num_blocks * block_size, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    v_pool = torch.randn_like(k_pool)
    tables = torch.randperm(num_blocks, device="cuda").view(b, blocks_per_seq)  # scattered blocks
    lens = torch.full((b,), ctx, device="cuda", dtype=torch.int32)
    q = torch.randn(b, heads, dim, device="cuda", dtype=torch.bfloat16)
    kv_bytes = 2 * b * ctx * kv_heads * dim * 2

    def reference():  # gather the blocks into a padded batch, then SDPA
        flat = tables.flatten()
        kk = k_pool.view(num_blocks, block_size, kv_heads, dim).index_select(0, flat).view(b, ctx, kv_heads, dim)
        vv = v_pool.view(num_blocks, block_size, kv_heads, dim).index_select(0, flat).view(b, ctx, kv_heads, dim)
        return F.scaled_dot_product_attention(q[:, :, None], kk.transpose(1, 2), vv.transpose(1, 2), enable_gqa=True)

    def ours():
        return paged_decode(q, k_pool, v_pool, tables, lens, dim**-0.5, block_size, ctx)

    def broadcast():  # the kernel before it used the tensor cores (the 2026-12-04 run's "triton")
        from minillm.attention.decode_tuning import DecodeConfig

        config = DecodeConfig(tensor_cores=False)
        return paged_decode(q, k_pool, v_pool, tables, lens, dim**-0.5, block_size, ctx, config=config)

    # The engine's choice (minillm/attention/decode_tuning.py): every setting in the search space
    # and gather + SDPA, timed once, the fastest kept.
    from minillm.attention.decode_tuning import (
        GATHER_SDPA,
        SEARCH_SPACE,
        MeasuredChoice,
        cuda_timer,
        gather_sdpa_decode,
    )

    def run(candidate):
        if candidate == GATHER_SDPA:
            return gather_sdpa_decode(q, k_pool, v_pool, tables, lens, dim**-0.5, block_size)
        return paged_decode(q, k_pool, v_pool, tables, lens, dim**-0.5, block_size, ctx, config=candidate)

    choice = MeasuredChoice((*SEARCH_SPACE, GATHER_SDPA), cuda_timer)
    best = choice.pick("bench", run)

    def tuned():
        return run(best)

    error = (ours().float() - reference()[:, :, 0].float()).abs().max().item()
    tuned_error = (tuned().float() - reference()[:, :, 0].float()).abs().max().item()
    row = {"batch": b, "context": ctx, "max_abs_error_vs_reference": error, "tuned_max_abs_error": tuned_error,
           "tuned_choice": str(best), "space_ms": {str(c): 1000 * t for c, t in choice.timings["bench"].items()}}  # fmt: skip
    for name, fn in (("triton", ours), ("triton broadcast", broadcast), ("tuned", tuned), ("reference", reference)):
        t = cuda_time(fn)
        gbs = kv_bytes / t / 1e9
        row[name] = {"ms": 1000 * t, "gbs": gbs, "pct_peak_bandwidth": 100 * gbs / peak_gbs}
    return row


SMOLLM2_LINEARS = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in): qkv, o, gate_up, down
# Llama-3-8B's (out, in): qkv 4096 + 2 × 1024, o, gate_up 2 × 14336, down — 218 M weights a layer,
# 436 MB in bf16: far past any L2, so weight bytes, not launches, set the time.
LLAMA3_8B_LINEARS = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
QUANT_SHAPES = {  # name: (linears, layers, vocab of the head, or None for no head)
    "smollm2-135m": (SMOLLM2_LINEARS, 30, 49152),
    "llama3-8b": (LLAMA3_8B_LINEARS, 2, None),  # two layers' worth: 872 MB of bf16 weights
}


def bench_quant_linears(
    rows_list, peak_gbs: float, layers: int = 30, vocab: int | None = 49152, group: int = 64,
    linears=SMOLLM2_LINEARS, rows: list | None = None, save=lambda: None,
) -> list[dict]:  # fmt: skip
    """One forward's worth of ``layers`` layers of ``linears`` (SmolLM2-135M's by default, with
    its ``vocab`` head), bf16 vs int8 / int4 Triton kernels."""
    import torch.nn.functional as F

    from minillm.quantization import dequantize_int8, pack_int4, quantize_int4, quantize_int8
    from minillm.quantization.triton_matmul import int4_matmul, int8_matmul

    gen = torch.Generator(device="cuda").manual_seed(0)
    shapes = list(linears) * layers
    bf16 = [torch.randn(shape, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.02 for shape in shapes]
    hidden = shapes[0][1]
    head = torch.randn(vocab or 16, hidden, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.02
    int8 = [quantize_int8(w) for w in bf16]
    int8 = [(q, s.to(torch.bfloat16)) for q, s in int8]  # what Int8Method holds for bf16 activations
    head8 = quantize_int8(head)
    head8 = (head8[0], head8[1].to(torch.bfloat16))
    if vocab is None:  # no head: the output is the last linear's, and its bytes are not counted
        head = None
    int4 = []
    for w in bf16:
        q, s, low = quantize_int4(w, group)
        int4.append((pack_int4(q), s, low))
    heads8 = [head8] if head is not None else []
    params = sum(w.numel() for w in bf16) + (head.numel() if head is not None else 0)
    weight_bytes = {
        "bf16": 2 * params,
        "int8 triton": sum(q.numel() + 2 * s.numel() for q, s in [*int8, *heads8]),
        "int4 triton": sum(p.numel() + s.numel() * 8 for p, s, _ in int4) + sum(q.numel() + 2 * s.numel() for q, s in heads8),
    }
    weight_bytes["int8 dequantize + F.linear"] = weight_bytes["int8 triton"]  # read once, plus the bf16 copy
    rows_out = [] if rows is None else rows
    for m in rows_list:
        xs = {k: torch.randn(m, k, device="cuda", generator=gen, dtype=torch.bfloat16) for k in {k for _, k in shapes}}

        def run_bf16(xs=xs):
            out = [F.linear(xs[w.shape[1]], w) for w in bf16][-1]
            return F.linear(xs[hidden], head) if head is not None else out

        def run_int8(xs=xs):
            out = [int8_matmul(xs[q.shape[1]], q, s) for q, s in int8][-1]
            return int8_matmul(xs[hidden], *head8) if head is not None else out

        def run_int4(xs=xs):
            out = [int4_matmul(xs[2 * p.shape[1]], p, s, low, group) for p, s, low in int4][-1]
            return int8_matmul(xs[hidden], *head8) if head is not None else out

        def run_dequantize(xs=xs):
            out = [F.linear(xs[q.shape[1]], dequantize_int8(q, s.float(), torch.bfloat16)) for q, s in int8][-1]
            if head is None:
                return out
            return F.linear(xs[hidden], dequantize_int8(head8[0], head8[1].float(), torch.bfloat16))

        runs = {
            "bf16": run_bf16,
            "int8 triton": run_int8,
            "int4 triton": run_int4,
            "int8 dequantize + F.linear": run_dequantize,
        }
        reference = run_bf16().float()
        row = {"rows": m, "weight_mb": {k: v / 1e6 for k, v in weight_bytes.items()}}
        for name, fn in runs.items():
            error = ((fn().float() - reference).abs().max() / reference.abs().max()).item()
            eager = cuda_time(fn)
            graphed = cuda_time(_as_cuda_graph(fn))
            row[name] = {
                "eager_ms": 1000 * eager,
                "graph_ms": 1000 * graphed,
                "weight_gbs": weight_bytes[name] / graphed / 1e9,
                "pct_peak_bandwidth": 100 * weight_bytes[name] / graphed / 1e9 / peak_gbs,
                "head_max_rel_error_vs_bf16": error,
            }
        for name in runs:
            for kind in ("eager", "graph"):
                row[name][f"{kind}_vs_bf16"] = row[name][f"{kind}_ms"] / row["bf16"][f"{kind}_ms"]
        rows_out.append(row)
        save()
        print(
            f"quantized linears, {m:>4} rows (graph ms, ratio to bf16): "
            + ", ".join(f"{k} {row[k]['graph_ms']:.3f} ({row[k]['graph_vs_bf16']:.2f}x)" for k in runs),
            flush=True,
        )
    return rows_out


def _as_cuda_graph(fn):
    """``fn`` captured once as a CUDA graph: its replay times the kernels without launch overhead."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (compiles the Triton kernels) outside the capture
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def bench_end_to_end(model: str, batches, prompt_len: int, new_tokens: int, repeats: int, rows: list | None = None,
                     save=lambda: None) -> list[dict]:  # fmt: skip
    from transformers import AutoModelForCausalLM

    from minillm import LLM, SamplingParams
    from minillm.tools.bench import _measure, _prompts

    common = dict(dtype="bf16", enable_prefix_caching=False, kv_cache_memory=4 << 30)  # two engines + HF share the GPU
    engines = {
        "minillm (CUDA graphs)": LLM(model, cuda_graphs=True, **common),
        "minillm (no graphs)": LLM(model, cuda_graphs=False, **common),
    }
    any_llm = next(iter(engines.values()))
    hf = AutoModelForCausalLM.from_pretrained(str(any_llm.model_dir), dtype=torch.bfloat16).cuda().eval()
    rows = [] if rows is None else rows
    for b in batches:
        prompts = _prompts(any_llm.tokenizer, b, prompt_len)
        runs = {}
        for name, llm in engines.items():
            runs[name] = lambda n, llm=llm, prompts=prompts: llm.generate(
                prompts, SamplingParams(max_tokens=n, ignore_eos=True)
            )
        ids = torch.tensor(prompts, device="cuda")

        def run_hf(n, ids=ids):
            with torch.inference_mode():
                hf.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=n,
                    min_new_tokens=n,
                    do_sample=False,
                    pad_token_id=0,
                )

        runs["HF generate"] = run_hf
        measured = _measure(runs, b, new_tokens, repeats, torch.device("cuda"))
        row = {"batch": b} | {
            name: {"decode_tok_s": m["decode_tok_s"], "ttft_ms": m["ttft_ms"]} for name, m in measured.items()
        }
        row["graphs_vs_hf"] = row["minillm (CUDA graphs)"]["decode_tok_s"] / row["HF generate"]["decode_tok_s"]
        rows.append(row)
        save()
        print(
            f"e2e batch {b:>3}: "
            + ", ".join(f"{k} {v['decode_tok_s']:.0f} tok/s" for k, v in row.items() if isinstance(v, dict)),
            flush=True,
        )
    memory = engines["minillm (CUDA graphs)"].engine.memory_report()
    rows.append({"memory": memory})
    return rows


SECTIONS = ("prefill", "flash_steps", "decode", "quant_linears", "end_to_end")


def _rows(result: dict, section: str) -> list:
    """A section's rows, or none where it failed (its error is in the JSON)."""
    rows = result.get(section)
    return rows if isinstance(rows, list) else []


def format_tables(result: dict) -> str:
    lines = [
        "| prefill tokens | triton ms | TFLOP/s | SDPA ms | TFLOP/s | reference ms | max error |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in _rows(result, "prefill"):
        ref = r.get("reference", {}).get("ms")
        lines.append(
            f"| {r['tokens']} | {r['triton']['ms']:.3f} | {r['triton']['tflops']:.1f} | {r['sdpa']['ms']:.3f} | "
            f"{r['sdpa']['tflops']:.1f} | {'-' if ref is None else f'{ref:.3f}'} | {r['max_abs_error_vs_sdpa']:.1e} |"
        )
    lines += [
        "",
        "| decode batch | context | default ms | % of peak | tuned ms | GB/s | % of peak | tuned choice | reference ms |",
        "|---:|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for r in _rows(result, "decode"):
        t, u = r["triton"], r.get("tuned", {})
        lines.append(
            f"| {r['batch']} | {r['context']} | {t['ms']:.3f} | {t['pct_peak_bandwidth']:.0f}% | {u.get('ms', float('nan')):.3f} | "
            f"{u.get('gbs', float('nan')):.0f} | {u.get('pct_peak_bandwidth', float('nan')):.0f}% | {r.get('tuned_choice', '-')} | "
            f"{r['reference']['ms']:.3f} |"
        )
    lines += ["", "| tokens | head dim | step | ms | TFLOP/s | × SDPA |", "|---:|---:|---|---:|---:|---:|"]
    for r in _rows(result, "flash_steps"):
        for name, t in r["steps"].items():
            lines.append(f"| {r['tokens']} | {r['head_dim']} | {name} | {t['ms']:.3f} | {t['tflops']:.1f} | {t['vs_sdpa']:.2f} |")
    lines += [
        "",
        "| shapes | rows | layers | weight MB | eager ms | × bf16 | graph ms | × bf16 | weight GB/s (graph) | % of peak |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    groups = _rows(result, "quant_linears")  # per shape set; a run before 2026-12-07 has SmolLM2's rows alone
    groups = groups if groups and "shapes" in groups[0] else [{"shapes": "smollm2-135m", "rows": groups}]
    for r in (dict(row, shapes=g["shapes"]) for g in groups for row in g["rows"]):
        for name, t in r.items():
            if isinstance(t, dict) and "graph_ms" in t:
                lines.append(
                    f"| {r['shapes']} | {r['rows']} | {name} | {r['weight_mb'][name]:.0f} | {t['eager_ms']:.3f} | "
                    f"{t['eager_vs_bf16']:.2f} | {t['graph_ms']:.3f} | {t['graph_vs_bf16']:.2f} | "
                    f"{t['weight_gbs']:.0f} | {t['pct_peak_bandwidth']:.0f}% |"
                )
    lines += [
        "",
        "| batch | minillm + graphs tok/s | minillm eager tok/s | HF tok/s | graphs / HF |",
        "|---:|---:|---:|---:|---:|",
    ]
    for r in _rows(result, "end_to_end"):
        if "batch" in r:
            lines.append(
                f"| {r['batch']} | {r['minillm (CUDA graphs)']['decode_tok_s']:.0f} | {r['minillm (no graphs)']['decode_tok_s']:.0f} | "
                f"{r['HF generate']['decode_tok_s']:.0f} | {r['graphs_vs_hf']:.2f}x |"
            )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prefill-lengths", type=int, nargs="+", default=[512, 2048, 8192, 16384])
    parser.add_argument("--decode-batches", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--decode-contexts", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--quant-rows", type=int, nargs="+", default=[1, 512])
    parser.add_argument("--quant-shapes", nargs="+", default=["smollm2-135m", "llama3-8b"], choices=list(QUANT_SHAPES))
    parser.add_argument("--flash-step-lengths", type=int, nargs="+", default=[2048, 16384])
    parser.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=list(SECTIONS),
                        help="which parts to run (gpu_checks.sh --quick runs fewer)")
    parser.add_argument("--e2e-batches", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gpu.py needs a CUDA GPU; none is available here.", file=sys.stderr)
        return 1
    from minillm.machine import machine_description
    from minillm.viz.roofline import measure_machine

    device = torch.device("cuda")
    peaks = measure_machine(device, torch.bfloat16)
    print(
        f"{torch.cuda.get_device_name()}: {peaks.bandwidth_gbs:.0f} GB/s copy, {peaks.flops_tflops:.0f} bf16 TFLOP/s",
        flush=True,
    )
    result = {
        "benchmark": "gpu",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_description(device),
        "peaks": {"bandwidth_gbs": peaks.bandwidth_gbs, "bf16_tflops": peaks.flops_tflops},
        "args": vars(args),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"gpu-{result['date'][:10]}-{torch.cuda.get_device_name().replace(' ', '_')}.json"
    if path.exists():  # another call of this script today (gpu_checks.sh runs its sections apart): keep its parts
        try:
            earlier = json.loads(path.read_text())
        except json.JSONDecodeError as err:  # a file cut off mid-write by an older version: start afresh
            print(f"ignoring {path}: {err}", file=sys.stderr)
            earlier = {}
        kept = {k: v for k, v in earlier.items() if k.split("_args")[0].split("_error")[0] in SECTIONS}
        result = kept | result

    def save() -> None:  # whole or not at all: a time limit may kill the process mid-write
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(result, indent=2))
        os.replace(tmp, path)

    def quant(rows: list) -> list:
        for shapes in args.quant_shapes:
            linears, layers, vocab = QUANT_SHAPES[shapes]
            print(f"quantized linears at {shapes}'s shapes ({layers} layers)", flush=True)
            part: list = []
            rows.append({"shapes": shapes, "layers": layers, "rows": part})
            bench_quant_linears(args.quant_rows, peaks.bandwidth_gbs, layers, vocab, linears=linears, rows=part, save=save)
        return rows

    sections = {
        "prefill": lambda rows: bench_prefill(args.prefill_lengths, rows=rows, save=save),
        "flash_steps": lambda rows: bench_flash_steps(args.flash_step_lengths, rows, save),
        "decode": lambda rows: bench_decode(args.decode_batches, args.decode_contexts, peaks.bandwidth_gbs, rows=rows,
                                            save=save),
        "quant_linears": quant,
        "end_to_end": lambda rows: bench_end_to_end(
            args.model, args.e2e_batches, args.prompt_len, args.new_tokens, args.repeats, rows=rows, save=save
        ),
    }  # fmt: skip
    assert set(sections) == set(SECTIONS)
    failed = []
    for name in args.sections:
        # A lent GPU is scarce: one failing section must not cost the others' figures, so each
        # row is written to the JSON as it finishes (a section cut off by a time limit keeps the
        # rows it had), and a failure is written down rather than raised.
        result[name] = []
        result[f"{name}_args"] = vars(args)  # each section with the arguments it ran with
        result[f"{name}_error"] = "incomplete: cut off before the section finished"  # until it does
        try:
            sections[name](result[name])
            result.pop(f"{name}_error")
        except Exception as exc:  # noqa: BLE001
            import traceback

            traceback.print_exc()
            result[f"{name}_error"] = f"{type(exc).__name__}: {exc}"
            failed.append(name)
        save()
    print()
    print(format_tables(result))
    print(f"\nwrote {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
