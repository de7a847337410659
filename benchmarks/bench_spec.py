"""Speculative decoding, measured: speed-up against k and batch size, acceptance, and HF's own
assisted generation as the anchor — all in one run, so the machine's noise hits every row alike.

    python benchmarks/bench_spec.py --threads 2                       # SmolLM2 + its distilled draft
    python benchmarks/bench_spec.py --model tiny-shakespeare-8m --draft tiny-shakespeare-1m --quick

Two workloads, greedy decoding. In fp32 every speculative run gives the plain engine's tokens
exactly (the tests check it). In bf16 the verify pass computes a position in a chunk of k + 1
rows where the plain engine computes it alone, with different rounding, so a near-tie between
the two best tokens can flip: ``identical`` says whether every token matched, else the share of
tokens before the first difference is shown.

- **chat**: open questions; the answer is new text, only a model can guess it;
- **grounded**: summarise / extract / rewrite a passage given in the prompt; the answer copies
  from the input, where prompt lookup (``ngram``) should shine.

Proposers: prompt lookup (``ngram``), the distilled draft model (``draft``) and the feature-level
EAGLE head (``eagle``, ``--eagle``). Rows: the plain engine as shipped (compiled decode, the default: the baseline of its workload
and batch size) and the plain eager engine (``compile=False``), then each proposer (``ngram``,
``draft``) on the default engine — its verify steps compiled too — for k in ``--ks`` at batch 1,
and at k = 4 for every batch size in ``--batches``. Speed-up = output tokens/s of the row ÷ the
plain default engine's in the same workload and batch size; ``vs eager`` ÷ the eager one's.
``decode tok/s`` leaves each request's first token out (time from the first emitted token to
the last: the prompt's prefill, which speculation does not touch, is not in it), and ``decode
speed-up`` is its ratio to the plain default engine's — what a reader of a streamed answer
feels after the first token. Every configuration runs once untimed first (allocator, oneDNN
primitives for the new shapes), then ``--repeats`` timed runs (median). HF ``transformers``
``generate()`` plain, with ``assistant_model=`` (the same draft) and with
``prompt_lookup_num_tokens=`` at batch 1 is the outside anchor.
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
from minillm.machine import machine_description

QUESTIONS = [
    "What is the capital of France, and what is it famous for?",
    "Explain in a few sentences why the sky is blue.",
    "Give me three tips for writing clear emails.",
    "What is photosynthesis?",
    "How do vaccines work?",
    "Why do we have seasons on Earth?",
    "What are the benefits of regular exercise?",
    "Describe how a bicycle works.",
    "What is the difference between weather and climate?",
    "How does a refrigerator keep food cold?",
    "What causes earthquakes?",
    "Why is sleep important?",
    "How do airplanes stay in the air?",
    "What is a black hole?",
    "How do bees make honey?",
    "What is the water cycle?",
]
TASKS = [
    "Summarise the following text in two sentences.",
    "List the main terms defined in the following text.",
    "Rewrite the following text in simpler words.",
    "Copy the first paragraph of the following text, then explain it in one sentence.",
]


def passages(n: int) -> list[str]:
    """Reference-manual passages every Python installation carries (pydoc_data.topics)."""
    from pydoc_data.topics import topics

    chosen = []
    for key in sorted(topics):
        text = topics[key].strip()
        if 500 <= len(text) <= 1600:
            chosen.append(text)
        if len(chosen) == n:
            break
    return chosen


def workloads(tokenizer) -> dict[str, list]:
    chat = tokenizer.has_chat_template

    def prompt(content: str):
        return [{"role": "user", "content": content}] if chat else content

    grounded = [prompt(f"{TASKS[i % len(TASKS)]}\n\n{p}") for i, p in enumerate(passages(len(QUESTIONS)))]
    if not chat:  # a tiny Shakespeare model: continue its own kind of text, and repeat a given passage
        from minillm.assets import heldout_text

        lines = heldout_text().split("\n\n")
        return {
            "chat": [lines[3 * i + 1][:200] for i in range(len(QUESTIONS))],
            "grounded": [(lines[3 * i + 2][:300] + "\n\n") * 2 for i in range(len(QUESTIONS))],
        }
    return {"chat": [prompt(q) for q in QUESTIONS], "grounded": grounded}


def timed_run(llm: LLM, prompts: list, batch: int, max_tokens: int, repeats: int) -> dict:
    params = SamplingParams(max_tokens=max_tokens)
    groups = [prompts[i : i + batch] for i in range(0, len(prompts), batch)]

    def once():
        start, decode, outs = time.perf_counter(), 0.0, []
        for g in groups:
            got = llm.generate(g, params)
            # decode time: from the group's first emitted token to its last (prefill left out)
            decode += max(o.metrics.token_times[-1] for o in got) - min(o.metrics.token_times[0] for o in got)
            outs += got
        return time.perf_counter() - start, decode, outs

    once()  # untimed: every shape this configuration uses is seen once
    samples = [once() for _ in range(repeats)]
    seconds = statistics.median(s for s, _, _ in samples)
    outs = samples[0][2]
    tokens = sum(len(o.token_ids) for o in outs)
    decode_tokens = sum(len(o.token_ids) - 1 for o in outs)
    proposed = sum(o.metrics.spec_proposed for o in outs)
    accepted = sum(o.metrics.spec_accepted for o in outs)
    steps = sum(o.metrics.num_verify_steps for o in outs)
    passes = sum(o.metrics.num_forward_passes for o in outs)
    return {
        "seconds": seconds,
        "output_tokens": tokens,
        "tok_s": tokens / seconds,
        "decode_tok_s": decode_tokens / statistics.median(d for _, d, _ in samples),
        "acceptance_rate": accepted / proposed if proposed else None,
        "mean_accepted_length": accepted / steps if steps else None,
        "forward_passes_per_token": passes / tokens,
        "token_ids": [o.token_ids for o in outs],
    }


def agreement(runs: list[list[int]], reference: list[list[int]]) -> float:
    """Share of the reference's tokens each run reproduces before it first differs."""
    same = 0
    for a, b in zip(runs, reference):
        for x, y in zip(a, b):
            if x != y:
                break
            same += 1
    return same / sum(len(b) for b in reference)


def hf_runs(model_dir: Path, draft_dir: Path | None, prompts: list, tokenizer, max_tokens: int, repeats: int,
            k: int) -> dict:  # fmt: skip
    """HF transformers at batch 1: plain greedy, assisted by the same draft, prompt lookup."""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16).eval()
    assistant = None
    if draft_dir is not None:
        assistant = AutoModelForCausalLM.from_pretrained(str(draft_dir), dtype=torch.bfloat16).eval()
    ids = []
    for p in prompts:
        text = tokenizer.render_chat(p) if isinstance(p, list) else p
        ids.append(torch.tensor([tokenizer.encode(text, add_special_tokens=not isinstance(p, list))]))
    variants = {"hf": {}, "hf-prompt-lookup": {"prompt_lookup_num_tokens": k}}
    if assistant is not None:
        variants["hf-assisted"] = {"assistant_model": assistant}
    results = {}
    for name, extra in variants.items():

        def once(extra=extra):
            start, n = time.perf_counter(), 0
            with torch.inference_mode():
                for x in ids:
                    out = target.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens,
                                          do_sample=False, pad_token_id=0, **extra)  # fmt: skip
                    n += out.shape[1] - x.shape[1]
            return time.perf_counter() - start, n

        once()
        samples = [once() for _ in range(repeats)]
        seconds = statistics.median(s for s, _ in samples)
        results[name] = {"seconds": seconds, "output_tokens": samples[0][1], "tok_s": samples[0][1] / seconds}
    return results


def markdown(rows: list[dict], hf: dict) -> str:
    head = (
        "| workload | proposer | k | batch | tok/s | speed-up | vs eager | decode tok/s | decode speed-up | acceptance "
        "| accepted/step | passes/token | identical |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )

    def fmt(x, spec="{:.2f}"):
        return "–" if x is None else spec.format(x)

    lines = [
        f"| {r['workload']} | {r['proposer']} | {r['k'] or '–'} | {r['batch']} | {r['tok_s']:.1f} | "
        f"{r['speedup']:.2f}× | {r['vs_eager']:.2f}× | {r['decode_tok_s']:.1f} | {r['decode_speedup']:.2f}× | "
        f"{fmt(r['acceptance_rate'], '{:.0%}')} | {fmt(r['mean_accepted_length'])} | "
        f"{r['forward_passes_per_token']:.2f} | {'yes' if r['identical'] else format(r['agreement'], '.0%')} |"
        for r in rows
    ]
    for workload, runs in hf.items():
        base = runs["hf"]["tok_s"]
        lines.append(
            f"| {workload} | HF plain / " + " / ".join(n for n in runs if n != "hf") + " | | 1 | "
            + " / ".join(f"{v['tok_s']:.1f}" for v in runs.values())
            + " | " + " / ".join(f"{v['tok_s'] / base:.2f}×" for v in runs.values()) + " | | | | | | | |"
        )  # fmt: skip
    return head + "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--draft", default="smollm2-draft")
    parser.add_argument("--eagle", default="smollm2-eagle", help="EAGLE head ('' to leave it out)")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--prompts", type=int, default=4, help="prompts per workload at batch 1 (batch b: max(b, this))"
    )
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--no-hf", action="store_true")
    parser.add_argument("--quick", action="store_true", help="k 2 4, batches 1 4: a smoke run")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.ks, args.batches = [2, 4], [1, 4]
    plain = LLM(args.model, dtype=args.dtype, enable_prefix_caching=False)
    plain.wait_for_fast_path()  # the default's compiled decode step, built in the background
    eager = LLM(args.model, dtype=args.dtype, enable_prefix_caching=False, compile=False)
    loads = workloads(plain.tokenizer)
    engines = {"plain": plain}
    engines["ngram"] = LLM(args.model, dtype=args.dtype, enable_prefix_caching=False,
                           speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
                                               "prompt_lookup_scaled": False})  # the sweep's k: k guesses, not a cap  # fmt: skip
    engines["draft"] = LLM(args.model, dtype=args.dtype, enable_prefix_caching=False,
                           speculative_config={"method": "draft", "model": args.draft, "num_speculative_tokens": 4})  # fmt: skip
    if args.eagle:
        engines["eagle"] = LLM(args.model, dtype=args.dtype, enable_prefix_caching=False,
                               speculative_config={"method": "eagle", "model": args.eagle, "num_speculative_tokens": 4})  # fmt: skip
    for llm in engines.values():  # the same package: loaded, not compiled again
        print(f"{llm.resolved.decode_fast_path}: {llm.wait_for_fast_path()}", flush=True)
    rows = []
    for workload, prompts in loads.items():
        for batch in args.batches:
            subset = prompts[: max(batch, args.prompts)]
            base = timed_run(plain, subset, batch, args.max_tokens, args.repeats)
            rows.append({"workload": workload, "proposer": "none", "k": None, "batch": batch, **base})
            slow = timed_run(eager, subset, batch, args.max_tokens, args.repeats)
            rows.append({"workload": workload, "proposer": "none (eager)", "k": None, "batch": batch, **slow})
            ks = args.ks if batch == 1 else [4]
            proposers = [p for p in ("ngram", "draft", "eagle") if p in engines]
            for proposer in proposers:
                speculator = engines[proposer].engine.speculator
                for k in ks:
                    speculator.configure(k, adaptive=False)  # the sweep: same engine, always k proposals per step
                    run = timed_run(engines[proposer], subset, batch, args.max_tokens, args.repeats)
                    rows.append({"workload": workload, "proposer": proposer, "k": k, "batch": batch, **run})
                # the default: up to 4, as many as its own steps show pay (speculative/governor.py),
                # learnt afresh in this run's untimed pass and kept through the timed ones
                speculator.configure(4, adaptive=True)
                run = timed_run(engines[proposer], subset, batch, args.max_tokens, args.repeats)
                run["governor"] = engines[proposer].resolved.speculation
                rows.append({"workload": workload, "proposer": f"{proposer} (adaptive)", "k": 4, "batch": batch, **run})
            for r in rows[-2 - (len(ks) + 1) * len(proposers) :]:
                r["speedup"] = r["tok_s"] / base["tok_s"]
                r["decode_speedup"] = r["decode_tok_s"] / base["decode_tok_s"]
                r["vs_eager"] = r["tok_s"] / slow["tok_s"]
                r["identical"] = r["token_ids"] == base["token_ids"]
                r["agreement"] = agreement(r["token_ids"], base["token_ids"])
                print(
                    f"{workload:>8} {r['proposer']:>5} k={r['k'] or '-'} b={batch:<2} {r['tok_s']:7.1f} tok/s "
                    f"{r['speedup']:.2f}x (vs eager {r['vs_eager']:.2f}x)  accept {r['acceptance_rate'] or 0:.0%}  identical={r['identical']}"
                    + (f"\n      governor: {r['governor']}" if "governor" in r else ""),
                    flush=True,
                )
    hf = {}
    if not args.no_hf:
        from minillm.assets import resolve_model

        draft_dir = resolve_model(args.draft)
        for workload, prompts in loads.items():
            hf[workload] = hf_runs(plain.model_dir, draft_dir, prompts[: args.prompts], plain.tokenizer,
                                   args.max_tokens, args.repeats, 4)  # fmt: skip
            print(workload, {k: round(v["tok_s"], 1) for k, v in hf[workload].items()}, flush=True)
    for r in rows:
        r.pop("token_ids")
    table = markdown(rows, hf)
    print(table)
    machine = machine_description(plain.device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"spec-{Path(args.model).name}-{date.today()}-{machine['device']}-{torch.get_num_threads()}t"
    payload = {"command": " ".join(sys.argv), "machine": machine, "draft": args.draft, "rows": rows, "hf": hf}
    (out / f"{stem}.json").write_text(json.dumps(payload, indent=1) + "\n")
    (out / f"{stem}.md").write_text(f"Command: `python {' '.join(sys.argv)}`\n\nMachine: {machine}\n\n{table}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
