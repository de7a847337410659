"""The sampler on real next-token logits: the package's filter against a whole-row sort.

    python benchmarks/bench_sampler.py                    # SmolLM2-135M's 49,152-token logits
    python benchmarks/bench_sampler.py --model tiny-shakespeare-8m

Top-k and top-p used to sort every row of the vocabulary; ``sampling.apply_top_k`` now takes
``topk`` of the largest k, and ``apply_top_p`` looks for the nucleus among each row's 1,024 most
likely tokens first (a row whose head holds less than ``top_p`` is still sorted whole). Both
give the same tokens (``tests/test_sampling.py``). This script times ``sampling.sample`` — the
engine's sampler, filter and draw — with the package's filter and with the whole-row sort
(``whole_sort_filter``, the rule as it was written before), on the same rows, in one run.

The rows are real: the model's logits at every position of a text (its next-token
distributions: peaked where the text is predictable, flat where it is not), repeated to fill
the larger batches. Greedy rows are timed too, for scale (they never filter). One thread unless
``--threads``; medians of ``--repeats`` calls after one.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from timing import median_ms

import minillm.hooks as hooks
from minillm.assets import resolve_model
from minillm.machine import machine_description
from minillm.sampling import NEG_INF, SamplingParams, sample
from minillm.tokenizer import Tokenizer

TEXT = (
    "The capital of France is Paris. It lies on the Seine, and its museums hold paintings from every "
    "century. Tell me a story about a dragon who learns to bake bread: once upon a time, in a village "
    "at the edge of a forest, there lived"
)


def whole_sort_filter(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Temperature, top-k, top-p, each filter sorting whole rows (the baseline)."""
    logits = (logits - logits.max(dim=-1, keepdim=True).values) / temperature
    if top_k > 0:
        kth = logits.sort(dim=-1, descending=True).values[..., top_k - 1 : top_k]
        logits = logits.masked_fill(logits < kth, NEG_INF)
    if top_p < 1.0:
        probs, order = logits.softmax(dim=-1).sort(dim=-1, descending=True)
        drop_sorted = probs.cumsum(dim=-1) - probs >= top_p
        drop_sorted[..., 0] = False
        logits = logits.masked_fill(torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted), NEG_INF)
    return logits


def real_logits(model: str) -> torch.Tensor:
    """The model's fp32 logits at every position of ``TEXT`` (a row per position), from
    transformers (the sampler's input is all this script is about)."""
    from transformers import AutoModelForCausalLM

    folder = resolve_model(model)
    ids = torch.tensor([Tokenizer(folder).encode(TEXT)])
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        return hf(ids).logits[0].float()


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 16, 64, 256])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    machine = machine_description(torch.device("cpu"))
    table = real_logits(args.model)
    print(f"# {machine['cpu']} ({' '.join(machine['cpu_flags'])}), torch {machine['torch']}, {args.threads} thread(s); "
          f"{args.model}: {table.shape[0]} rows of real logits, vocabulary {table.shape[1]}")  # fmt: skip
    settings = {
        "temperature 0.7, top_p 0.95": SamplingParams(temperature=0.7, top_p=0.95),
        "temperature 1.0, top_k 50": SamplingParams(temperature=1.0, top_k=50),
        "temperature 1.0, top_k 50, top_p 0.9": SamplingParams(temperature=1.0, top_k=50, top_p=0.9),
        "greedy": SamplingParams(temperature=0.0),
    }
    print(f"{'settings':<38}{'rows':>6}{'whole sort ms':>15}{'package ms':>12}{'speed-up':>10}")
    results = []
    for name, params in settings.items():
        for rows in args.rows:
            logits = table.repeat(-(-rows // table.shape[0]), 1)[:rows].contiguous()
            batch = [params] * rows

            def run(logits=logits, batch=batch, rows=rows):
                generators = [torch.Generator().manual_seed(i) for i in range(rows)]
                return sample(logits, batch, generators)

            package = median_ms(run, args.repeats)
            with hooks.override(filter_logits=whole_sort_filter):
                baseline = median_ms(run, args.repeats)
                same = run()
            assert same == run(), f"{name}, {rows} rows: the two filters drew different tokens"
            results.append({"settings": name, "rows": rows, "whole_sort_ms": baseline, "package_ms": package})
            print(f"{name:<38}{rows:>6}{baseline:>15.2f}{package:>12.2f}{baseline / package:>9.1f}x", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"machine": machine, "model": args.model, "rows": results}, indent=1))
    return {"rows": results}


if __name__ == "__main__":
    main()
