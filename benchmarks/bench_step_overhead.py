"""The engine's own work per step, apart from the model's: µs per step and per running sequence.

    python benchmarks/bench_step_overhead.py                       # null model, 1-1,024 sequences
    python benchmarks/bench_step_overhead.py --real data/tiny-shakespeare-1m smollm2-135m

A **null model** sits behind the same runner seam as the real one: the paged runner still
builds every tensor of the step (token ids, positions, slots, block tables) and hands them to
``model(layout)``, which returns a fixed table of logits without computing anything. What is
left is the engine: scheduling, input building, sampling, output processing (appending tokens,
stop checks, deltas, committing blocks) and detokenization — each from the engine's own
counters (``StepRecord.phases``), detokenization on the step by timing the ``detokenize_step``
hook. A request without stop strings has its text made off the step, when its deltas are read
(``sequence.py``): the script reads every delta's text after each step, as a stream's reader
does, and prints that time apart ("text off step"; not in µs/step). An older checkout makes the
text on the step, so its column is ~0 and its detokenization is inside µs/step.

Every running sequence decodes (greedy, ``ignore_eos``, long ``max_tokens``), so each step is
one decode token per sequence and nobody joins or leaves while it is measured. ``--real`` adds
the same rows with a real model's forward in place of the null one (compile off in every row,
so the runner builds its inputs where the counters can see them; a compiled step builds them
inside its graph call). Medians over ``--steps`` steps after ``--warmup`` steps.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time
from pathlib import Path

import torch
from timing import median_ms

import minillm.hooks as hooks
from minillm import LLMEngine, SamplingParams
from minillm.machine import machine_description

PHASES = ("schedule", "inputs", "model", "sample", "output", "detokenize")


class NullModel:
    """``model(layout)`` → fixed logits for the rows the step wants: no compute at all. The
    table differs from row to row (so sequences draw different tokens) but not from step to
    step."""

    def __init__(self, vocab_size: int, rows: int, seed: int = 0):
        generator = torch.Generator().manual_seed(seed)
        self.table = torch.randn(rows, vocab_size, generator=generator)
        self.last_hidden = None

    def __call__(self, layout) -> torch.Tensor:
        return self.table[: len(layout.logit_index)]


def measure(model: str, running: int, steps: int, warmup: int, null: bool, threads: int, freeze_gc: bool = False) -> dict:
    """Median per-phase seconds per step with ``running`` sequences decoding."""
    prompt_len = 8
    engine = LLMEngine(
        model,
        compile=False,
        num_threads=threads,
        adapt_threads=False,  # the bench decides the threads; busy cores would change them mid-run
        max_num_seqs=running,
        max_num_batched_tokens=max(512, running * prompt_len),
        max_model_len=prompt_len + warmup + steps + 8,
        kv_cache_memory=None,
    )
    if null:
        engine.runner.model = NullModel(engine.model_config.vocab_size, running)
    if freeze_gc:  # what `minillm serve` does once its engines are built, before any request (server/heap.py)
        gc.collect()
        gc.freeze()
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=warmup + steps + 4, ignore_eos=True)
    for _ in range(running):
        engine.add_request([rng.randrange(1, 200) for _ in range(prompt_len)], params)
    while engine.scheduler.waiting or not all(s.is_decoding for s in engine.scheduler.running):
        engine.step()
    reference = hooks.default("detokenize_step")
    detokenize = [0.0]

    def timed_detokenize_step(*args):
        started = time.perf_counter()
        out = reference(*args)
        detokenize[0] += time.perf_counter() - started
        return out

    rows: dict[str, list[float]] = {phase: [] for phase in PHASES}
    rows["total"] = []
    rows["text_off_step"] = []
    with hooks.override(detokenize_step=timed_detokenize_step):
        for i in range(warmup + steps):
            detokenize[0] = 0.0
            started = time.perf_counter()
            deltas = engine.step()
            total = time.perf_counter() - started
            on_step = detokenize[0]
            started = time.perf_counter()
            for delta in deltas:  # what a stream's reader does: the text, made off the step
                delta.text  # noqa: B018
            off_step = time.perf_counter() - started
            if i < warmup:
                continue
            record = engine.step_records[-1]
            if len(record.chunks) != running:
                raise RuntimeError(f"step ran {len(record.chunks)} sequences, not {running}")
            rows["total"].append(total)
            p = getattr(record, "phases", None)
            if p is None:  # a checkout from before the engine kept its phases: the total only
                continue
            rows["schedule"].append(p.schedule)
            rows["inputs"].append(p.inputs)
            rows["model"].append(p.model)
            rows["sample"].append(p.sample)
            rows["output"].append(p.output - on_step)
            rows["detokenize"].append(on_step)
            rows["text_off_step"].append(off_step)
    engine.close()
    if freeze_gc:
        gc.unfreeze()
    out = {name: statistics.median(values) if values else float("nan") for name, values in rows.items()}
    out["total_mean"], out["total_max"] = statistics.fmean(rows["total"]), max(rows["total"])
    return out


def argmax_timings(rows: int = 256, vocabs=(4096, 49152), repeats: int = 20) -> list[dict]:
    """A greedy step's argmax over ``rows`` rows of logits: torch's CPU argmax beside NumPy's
    (what ``sampling.argmax_rows`` uses), median µs, on the same tensor."""
    out = []
    for vocab in vocabs:
        x = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0))
        torch_ms = median_ms(lambda x=x: x.argmax(dim=-1).tolist(), repeats)
        numpy_ms = median_ms(lambda x=x: x.numpy().argmax(axis=1).tolist(), repeats)
        out.append({"rows": rows, "vocab": vocab, "torch_us": torch_ms * 1e3, "numpy_us": numpy_ms * 1e3})
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="data/tiny-shakespeare-1m", help="whose tokenizer and shapes the null rows use")
    parser.add_argument("--running", nargs="+", type=int, default=[1, 16, 64, 256, 1024])
    parser.add_argument("--real", nargs="*", default=[], help="models whose real forward gets rows too")
    parser.add_argument("--real-running", nargs="+", type=int, default=[1, 64, 256])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    parser.add_argument("--freeze-gc", action="store_true",
                        help="freeze the heap before the steps, as `minillm serve` does (server/heap.py)")
    args = parser.parse_args(argv)

    cases = [("null", args.model, n, True) for n in args.running]
    cases += [(Path(m).name, m, n, False) for m in args.real for n in args.real_running]
    torch.set_num_threads(args.threads)
    machine = machine_description(torch.device("cpu"))
    print(f"# {machine['cpu']} ({' '.join(machine['cpu_flags'])}), torch {machine['torch']}, {args.threads} thread(s)")
    header = f"{'model':<22}{'seqs':>6}{'µs/step':>10}{'µs/seq':>8}  " + "".join(f"{p:>11}" for p in PHASES)
    print(header + f"{'host µs/seq':>13}{'text off step':>15}{'mean µs/step':>14}{'max':>8}")
    results = []
    for label, model, running, null in cases:
        row = measure(model, running, args.steps, args.warmup, null, args.threads, args.freeze_gc)
        host = row["total"] - row["model"]
        results.append({"model": label, "running": running, **row, "host": host})
        phases = "".join(f"{row[p] * 1e6:>11.0f}" for p in PHASES)
        print(
            f"{label:<22}{running:>6}{row['total'] * 1e6:>10.0f}{row['total'] * 1e6 / running:>8.1f}  {phases}"
            f"{host * 1e6 / running:>13.1f}{row['text_off_step'] * 1e6:>15.0f}"
            f"{row['total_mean'] * 1e6:>14.0f}{row['total_max'] * 1e6:>8.0f}",
            flush=True,
        )
    argmax = argmax_timings()
    for a in argmax:
        print(
            f"argmax of {a['rows']} rows x {a['vocab']}: torch {a['torch_us']:.0f} µs, NumPy {a['numpy_us']:.0f} µs "
            f"({a['torch_us'] / a['numpy_us']:.1f}x)"
        )
    if args.out:
        Path(args.out).write_text(json.dumps({"machine": machine, "rows": results, "argmax": argmax}, indent=1))
    return {"rows": results, "argmax": argmax}


if __name__ == "__main__":
    main()
