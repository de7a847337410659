"""Quantization, measured: quality, memory and speed of every weight method next to bf16.

    python benchmarks/bench_quant.py                    # SmolLM2-135M, writes results/quant-*.{json,md}
    python benchmarks/bench_quant.py --threads 2 --repeats 3 --methods bf16 int8 int4-g64 kv-int8

Methods: ``bf16`` (the reference, always measured first), ``int8``, ``int4-g<group>``,
``awq-g<group>``, ``w8a8`` (weights), ``int4-gguf`` (SmolLM2's own Q4_1 blocks, loaded as
int4 without re-quantizing), ``kv-int8``, ``kv-fp8`` (the KV cache), ``2:4``, ``2:4-wanda``
(pruning).

For each method, in one process and one run (so the machine's noise hits them alike):
- quality: perplexity on held-out text that ships offline (the course's held-out Shakespeare,
  and English prose from Python's own reference manual, ``pydoc_data.topics``); agreement of
  greedy tokens with bf16 over a fixed prompt set; the chat answer to "What is the capital of
  France?";
  perplexity through the paged engine too (``engine_perplexity``: prompts prefilled in chunks,
  keys and values read back from the pool), the only one a quantized KV cache changes;
- memory: the bytes of weights actually held (``model.weight_bytes()``), KV bytes per token,
  how many 1024-token sequences a fixed 64 MB KV pool holds (the engine's own block count),
  and how many fit in a fixed 512 MB budget for weights + KV together;
- speed: batch-1 and batch-8 decode tokens/s and TTFT of a 64-token prompt (medians of
  interleaved repeats, as ``minillm bench`` measures them), and prefill tokens/s of a
  512-token prompt; HF ``transformers`` ``generate()`` in bf16, interleaved with the bf16 row,
  as an outside anchor.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import date
from pathlib import Path

import torch

from minillm import LLM, SamplingParams
from minillm.tools.bench import _measure, _prompts, machine_description

PROMPTS = [
    "The history of the Roman Empire",
    "def fibonacci(n):",
    "Photosynthesis is the process by which",
    "Once upon a time, in a small village,",
    "The three laws of thermodynamics are",
    "To make a good cup of tea, first",
    "The largest planet in the solar system",
    "In 1969, the Apollo 11 mission",
]


def english_prose(limit_chars: int = 40_000) -> str:
    """Prose every Python installation carries: the reference manual's topic texts."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))[:limit_chars]


KV_POOL_BYTES = 64 * 10**6  # the same pool for every method: how many sequences does it hold?
BUDGET_BYTES = 512 * 10**6  # weights + KV in one budget: quantized weights leave room for more KV
SEQ_LEN = 1024


def method_kwargs(method: str) -> dict:
    if method == "bf16":
        return {}
    if method.startswith("kv-"):
        return {"kv_cache_dtype": method[3:]}
    if method.startswith("2:4"):
        return {"sparsity": method}
    if "-g" in method:  # int4-g64, awq-g64: a method and its group size
        name, group = method.split("-g")
        return {"quantization": name, "quantization_group_size": int(group)}
    return {"quantization": method}


def gguf_checkpoint(model: str) -> Path:
    """An int4 checkpoint of ``model``'s GGUF Q4_1 blocks as they are (``--from-gguf``)."""
    import tempfile

    from minillm.assets import REGISTRY, gguf_path, resolve_model
    from minillm.models.loader import load_model
    from minillm.quantization.checkpoint import save_quantized
    from minillm.quantization.gguf_int4 import gguf_int4_layers

    folder = resolve_model(model)
    plain = load_model(folder, torch.bfloat16)
    layers = gguf_int4_layers(gguf_path(REGISTRY[model]), plain)
    return save_quantized(plain, folder, Path(tempfile.mkdtemp()) / "int4-gguf", "int4", 32, "bf16", None, layers)


def evaluate(model: str, method: str, reference_tokens: list[list[int]] | None, repeats: int, hf: bool) -> dict:
    from minillm.assets import heldout_text
    from minillm.kvcache.addressing import kv_bytes_per_token
    from minillm.tools.evaluation import engine_perplexity, perplexity

    kwargs = {} if method == "int4-gguf" else method_kwargs(method)
    source = gguf_checkpoint(model) if method == "int4-gguf" else model
    llm = LLM(source, dtype="bf16", enable_prefix_caching=False, kv_cache_memory=KV_POOL_BYTES, **kwargs)
    llm.wait_for_fast_path()  # int8/int4 compile by default, in the background: measure what they settle on
    row: dict = {"method": method, "weight_bytes": llm.model.weight_bytes()}
    for name, text in (("shakespeare", heldout_text()), ("english", english_prose())):
        ids = llm.tokenizer.encode(text)[:4096]
        row[f"ppl_{name}"] = perplexity(llm.model, ids, window=512)
    row["ppl_english_pool"] = engine_perplexity(llm.engine, llm.tokenizer.encode(english_prose())[:2049], 512, 128)
    per_token = kv_bytes_per_token(llm.model_config, llm.dtype, kwargs.get("kv_cache_dtype", "auto"))
    blocks = llm.engine.memory_report()["kv_pool_blocks"]
    row["kv_bytes_per_token"] = per_token
    row["kv_pool_blocks"] = blocks
    row["seqs_fit_pool"] = blocks * llm.engine_config.block_size // SEQ_LEN
    row["seqs_fit_budget"] = max(0, (BUDGET_BYTES - row["weight_bytes"]) // (per_token * SEQ_LEN))
    greedy = llm.generate(PROMPTS, SamplingParams(max_tokens=32, ignore_eos=True))
    row["tokens"] = [o.token_ids for o in greedy]
    if reference_tokens is not None:
        same = [sum(1 for _ in _prefix(a, b)) for a, b in zip(row["tokens"], reference_tokens)]
        row["greedy_agreement"] = sum(same) / sum(len(t) for t in reference_tokens)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    answer = llm.generate([chat], SamplingParams(max_tokens=24))[0].text
    # Right only if the first sentence names Paris: a derailed answer can still end on "Paris,".
    row["chat_answer"], row["chat_right"] = answer, "Paris" in answer.split(".")[0]
    hf_model = None
    if hf:
        from transformers import AutoModelForCausalLM

        hf_model = AutoModelForCausalLM.from_pretrained(str(llm.model_dir), dtype=torch.bfloat16).eval()
    for batch in (1, 8):
        prompts = _prompts(llm.tokenizer, batch, 64)

        def run(n, prompts=prompts):
            llm.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True))

        runs = {method: run}
        if hf_model is not None:
            runs["hf"] = _hf_runner(hf_model, prompts)
        timings = _measure(runs, batch, 64, repeats, llm.device)
        row[f"decode_tok_s_b{batch}"] = timings[method]["decode_tok_s"]
        row[f"ttft_ms_b{batch}"] = timings[method]["ttft_ms"]
        if hf_model is not None:
            row[f"hf_decode_tok_s_b{batch}"] = timings["hf"]["decode_tok_s"]
    long_prompt = _prompts(llm.tokenizer, 1, 512)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        llm.generate(long_prompt, SamplingParams(max_tokens=1))
        samples.append(time.perf_counter() - start)
    row["prefill_tok_s_512"] = 512 / statistics.median(samples)
    row["machine"] = machine_description(llm.device)
    return row


def _hf_runner(hf_model, prompts: list[list[int]]):
    ids = torch.tensor(prompts)

    def run(n):
        with torch.inference_mode():
            hf_model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                pad_token_id=0,
            )  # fmt: skip

    return run


def _prefix(a: list[int], b: list[int]):
    for x, y in zip(a, b):
        if x != y:
            return
        yield x


def markdown(rows: list[dict]) -> str:
    base = rows[0]
    head = (
        "| method | weights MB (× bf16) | ppl Shakespeare | ppl English | ppl English, paged | greedy agreement "
        "| Paris? | KV B/token | 1k-token seqs in 64 MB KV | in 512 MB total "
        "| decode b1 tok/s (× bf16) | decode b8 tok/s (× bf16) | prefill 512 tok/s (× bf16) |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in rows:
        lines.append(
            f"| {r['method']} | {r['weight_bytes'] / 1e6:.0f} ({r['weight_bytes'] / base['weight_bytes']:.2f}) "
            f"| {r['ppl_shakespeare']:.2f} | {r['ppl_english']:.2f} | {r['ppl_english_pool']:.2f} "
            f"| {r.get('greedy_agreement', 1.0):.0%} | {'yes' if r['chat_right'] else 'no'} "
            f"| {r['kv_bytes_per_token']} | {r['seqs_fit_pool']} | {r['seqs_fit_budget']} "
            f"| {r['decode_tok_s_b1']:.1f} ({r['decode_tok_s_b1'] / base['decode_tok_s_b1']:.2f}) "
            f"| {r['decode_tok_s_b8']:.1f} ({r['decode_tok_s_b8'] / base['decode_tok_s_b8']:.2f}) "
            f"| {r['prefill_tok_s_512']:.0f} ({r['prefill_tok_s_512'] / base['prefill_tok_s_512']:.2f}) |"
        )
    if "hf_decode_tok_s_b1" in base:
        lines.append(
            f"\nHF `transformers` bf16 `generate()`, interleaved with the bf16 row: decode b1 "
            f"{base['hf_decode_tok_s_b1']:.1f} tok/s, b8 {base['hf_decode_tok_s_b8']:.1f} tok/s."
        )
    return head + "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--methods", nargs="+", default=["bf16", "int8", "int4-g64", "int4-g32"])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    parser.add_argument("--no-hf", action="store_true", help="skip the HF transformers anchor")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.methods[0] != "bf16":
        args.methods.insert(0, "bf16")  # every figure is read against bf16, measured in the same run
    rows, reference = [], None
    for method in args.methods:
        row = evaluate(args.model, method, reference, args.repeats, hf=method == "bf16" and not args.no_hf)
        reference = reference or row["tokens"]
        rows.append(row)
        print(
            f"{method:>9}: {row['weight_bytes'] / 1e6:6.0f} MB  ppl {row['ppl_shakespeare']:.2f}/{row['ppl_english']:.2f}  "
            f"b1 {row['decode_tok_s_b1']:.1f} tok/s  b8 {row['decode_tok_s_b8']:.1f} tok/s  "
            f"prefill {row['prefill_tok_s_512']:.0f} tok/s",
            flush=True,
        )
    table = markdown(rows)
    print(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = Path(args.model).name
    stem = f"quant-{model}-{date.today()}-{rows[0]['machine']['device']}-{torch.get_num_threads()}t"
    for r in rows:
        r.pop("tokens")
    (out / f"{stem}.json").write_text(json.dumps({"command": " ".join(sys.argv), "rows": rows}, indent=1) + "\n")
    (out / f"{stem}.md").write_text(
        f"Command: `python {' '.join(sys.argv)}`\n\nMachine: {rows[0]['machine']}\n\n{table}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
