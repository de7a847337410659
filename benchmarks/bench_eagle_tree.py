"""Chain against tree drafting in the serving engine, batch 1 (or ``--batch``), against the default engine.

    python benchmarks/bench_eagle_tree.py [--chats 12] [--max-tokens 64] [--runs 3] [--batch 1]

Every engine is SmolLM2-135M as it ships (bf16 where this CPU has fast bf16 kernels, its
decode step compiled — each engine waits for its compiled step, then runs every workload once
untimed, so it is *settled*): the default engine, prompt lookup and the EAGLE head as chapter 08
shows them (k = 4, the governor on), and the head's EAGLE-2 trees (``topk`` children per
expanded node, ``depth`` levels, the ``k`` most likely nodes verified per pass, and by default
prompt lookup's guess grafted on as a branch of up to 4 more) with the governor on and off, and
without the grafted branch. ``--engines`` picks others (``ENGINES``). Workloads: held-out chats (the EAGLE recipe's evaluation prompts, whole
topics no training chat mentions) and grounded requests (copy a passage, then explain it; 4, or
``--batch`` of them); with ``--copy`` also edits whose answer is the given text again (fix a
passage's spelling, comment a function). For each workload the default engine's own answers
give prompt lookup's *ceiling*: the tokens a verify step would make if its guesses cost nothing
(``copy_ceiling``) — SmolLM2-135M, asked to copy a paragraph and explain it, mostly explains.

The default engine stays loaded; each other engine in turn is built, settled, and timed in
``--runs`` rounds that alternate with the default engine's runs, so that a slower spell of the
shared machine slows both sides of a ratio. Printed per engine and workload: tokens per second
(median of its runs), the ratio to the default engine (the median of each run's ratio to the
default engine's run just before it), proposals accepted per verify step, a decode step's median
time split into proposing (with scheduling) and the target's pass, and whether the tokens
are the default engine's (bf16: a verify row can round differently from a one-token step where
two candidates are nearly tied). Results go to ``benchmarks/results/`` as JSON and a log.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
from datetime import date
from pathlib import Path

import torch

RECIPE = Path(__file__).resolve().parents[1] / "data" / "recipes" / "train_eagle_smollm2.py"
HEAD = {"method": "eagle", "model": "smollm2-eagle"}


def tree(topk: int, depth: int, k: int, adaptive: bool = True, branch: bool = True) -> dict:
    """An EAGLE-2 tree configuration; ``branch`` False: without prompt lookup's grafted branch."""
    spec = {**HEAD, "num_speculative_tokens": k, "topk": topk, "depth": depth}
    return spec | ({} if adaptive else {"adaptive": False}) | ({} if branch else {"ngram_branch": 0})


ENGINES = {
    "default": None,
    "ngram k4": {"method": "ngram", "num_speculative_tokens": 4},
    "ngram k8": {"method": "ngram", "num_speculative_tokens": 8},
    "ngram k4 fixed": {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False},
    "ngram k8 fixed": {"method": "ngram", "num_speculative_tokens": 8, "adaptive": False},
    "ngram k4 unscaled": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_scaled": False},
    "ngram k8 unscaled": {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_scaled": False},
    "ngram k8 fixed, unscaled": {"method": "ngram", "num_speculative_tokens": 8, "adaptive": False,
                                 "prompt_lookup_scaled": False},
    "ngram k4 one table": {"method": "ngram", "num_speculative_tokens": 4},  # see one_table()
    "ngram k8 one table": {"method": "ngram", "num_speculative_tokens": 8},
    "ngram k4 min1": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1},
    "ngram k4 min2": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2},
    "ngram k8 min2": {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 2},
    "eagle chain k4": {**HEAD, "num_speculative_tokens": 4},
    "eagle chain k4 fixed": {**HEAD, "num_speculative_tokens": 4, "adaptive": False},
    "eagle tree 4x2 k6": tree(4, 2, 6),
    "eagle tree 4x2 k6 fixed": tree(4, 2, 6, adaptive=False),
    "eagle tree 4x2 k6 trees only": tree(4, 2, 6),  # see build(): copying text gets trees too (before stop 77)
    "eagle tree 4x2 k8 branch8": tree(4, 2, 8) | {"ngram_branch": 8},
    "eagle tree 4x2 k6 min1": tree(4, 2, 6) | {"prompt_lookup_min": 1},
    "eagle tree 4x2 k6 min2": tree(4, 2, 6) | {"prompt_lookup_min": 2},
    "eagle tree 4x2 k6 fixed, no branch": tree(4, 2, 6, adaptive=False, branch=False),
    "eagle tree 3x3 k6": tree(3, 3, 6),
    "eagle tree 3x3 k6 fixed": tree(3, 3, 6, adaptive=False),
    "eagle tree 3x3 k6 fixed, no branch": tree(3, 3, 6, adaptive=False, branch=False),
    "eagle tree 3x2 k6 fixed": tree(3, 2, 6, adaptive=False),
    "eagle tree 2x3 k4 fixed": tree(2, 3, 4, adaptive=False),
    "eagle tree 3x4 k8": tree(3, 4, 8),
    "eagle tree 3x4 k8 fixed": tree(3, 4, 8, adaptive=False),
}
DEFAULT_ENGINES = ["default", "ngram k4", "eagle chain k4", "eagle tree 4x2 k6", "eagle tree 4x2 k6 fixed",
                   "eagle tree 4x2 k6 fixed, no branch", "eagle tree 3x3 k6", "eagle tree 3x3 k6 fixed, no branch"]  # fmt: skip


def copy_ceiling(prompt_ids: list[int], token_ids: list[int], k: int) -> float:
    """Tokens per verify step that prompt lookup (``propose_ngram``, up to ``k`` guesses) would
    make on exactly these tokens: its guesses checked against the answer itself, one target
    token added per step. What the text allows the proposer, before any cost — no engine of
    prompt lookup at ``k`` can beat this ratio of steps to the default engine's."""
    from minillm.speculative.ngram import propose_ngram

    steps, i = 0, 0
    while i < len(token_ids):
        guess = propose_ngram(prompt_ids + token_ids[:i], k)
        accepted = 0
        while accepted < len(guess) and i + accepted < len(token_ids) and guess[accepted] == token_ids[i + accepted]:
            accepted += 1
        i += accepted + 1
        steps += 1
    return len(token_ids) / steps if steps else 0.0


def with_typos(text: str, every: int = 9) -> str:
    """``text`` with every ``every``-th word of 4+ letters misspelt (two letters swapped)."""
    words = text.split(" ")
    for i in range(every - 1, len(words), every):
        w = words[i]
        if len(w) >= 4 and w.isalpha():
            words[i] = w[0] + w[2] + w[1] + w[3:]
    return " ".join(words)


def workloads(num_chats: int, num_grounded: int = 4, copy: bool = False) -> dict[str, list]:
    spec = importlib.util.spec_from_file_location("train_eagle_smollm2", RECIPE)
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    from pydoc_data.topics import topics

    held = recipe.held_out_chats()
    chats = held[:: max(1, len(held) // num_chats)][:num_chats]  # spread over the evaluation prompts and topics
    passages = [t.strip() for t in (topics[k] for k in sorted(topics)) if 500 <= len(t.strip()) <= 1600][:num_grounded]
    grounded = [f"Copy the first paragraph of the following text, then explain it in one sentence.\n\n{p}" for p in passages]
    loads = {
        "chat (held out)": [[{"role": "user", "content": c}] for c in chats],
        "grounded": [[{"role": "user", "content": g}] for g in grounded],
    }
    if copy:  # requests whose answer is the given text again, edited: where prompt lookup is made for
        import inspect
        import textwrap

        typos = [f"Fix the spelling and return the whole corrected text.\n\n{with_typos(p)}" for p in passages]
        functions = (textwrap.dedent, textwrap.indent, inspect.cleandoc, inspect.getmodulename)
        code = [f"Add a comment above each line of this code and return the whole code.\n\n```python\n"
                f"{inspect.getsource(f)}```" for f in functions]  # fmt: skip
        edits = [e for pair in zip(typos, code) for e in pair][:num_grounded]  # a spelling fix, a function, ...
        loads["edit (copies)"] = [[{"role": "user", "content": e}] for e in edits]
    return loads


def build(name: str):
    """SmolLM2-135M as it ships with engine ``name``'s ``speculative_config`` (``ENGINES``) —
    a "one table" engine with its governor made to measure as before (``one_table``); a "trees
    only" engine proposing trees for sequences that copy their text too (``Speculator.copies``)."""
    from minillm import LLM

    llm = LLM("smollm2-135m", speculative_config=ENGINES[name])
    if name.endswith(" one table"):
        one_table(llm)
    if name.endswith(" trees only"):  # a tree for every sequence, copying or not, and one governor table
        llm.engine.speculator.copies = False
    return llm


def one_table(llm) -> None:
    """Make ``llm``'s prompt-lookup governor measure as it did before it told copying from free
    text (stop 77): one measurement per batch size whatever the text, a step in which nothing
    matched counted too — by telling it every step's text is of one kind. The speculator reads
    ``ngram.kind_of_text`` while it proposes; this engine's calls see the one kind, others the
    real one (the benchmark runs one engine at a time)."""
    from minillm.speculative import ngram

    speculator = llm.engine.speculator
    propose, kind = speculator.propose, ngram.kind_of_text

    def propose_one_kind(running, waiting=0):
        ngram.kind_of_text = lambda matches: "any text"
        try:
            return propose(running, waiting)
        finally:
            ngram.kind_of_text = kind

    speculator.propose = propose_one_kind


def run_once(llm, prompts, max_tokens: int, batch: int = 1):
    from minillm import SamplingParams

    start = time.perf_counter()
    outs = []
    for i in range(0, len(prompts), batch):  # `batch` requests at a time
        outs += llm.generate(prompts[i : i + batch], SamplingParams(max_tokens=max_tokens))
    return time.perf_counter() - start, outs


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chats", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--batch", type=int, default=1, help="requests generated together (the governor's batch size)")
    parser.add_argument("--engines", nargs="+", default=DEFAULT_ENGINES, choices=list(ENGINES))
    parser.add_argument("--copy", action="store_true", help="also requests that copy their prompt (edit a given text)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args(argv)

    from minillm.machine import machine_description
    from minillm.viz.spec import machine_words

    names = ["default"] + [n for n in args.engines if n != "default"]
    loads = workloads(args.chats, max(4, args.batch), copy=args.copy)
    machine = machine_description(torch.device("cpu"))
    lines: list[str] = []

    def say(msg: str) -> None:
        print(msg, flush=True)
        lines.append(msg)

    say(f"bench_eagle_tree, {date.today()}: {machine_words(machine)}; batch {args.batch}")
    say(f"cpu flags: {' '.join(f for f in machine.get('cpu_flags', []) if 'amx' in f or 'avx512' in f)}")
    results: dict = {"machine": machine, "max_tokens": args.max_tokens, "runs": args.runs, "batch": args.batch, "engines": {}}
    def settled(name: str):
        llm = build(name)
        llm.wait_for_fast_path()
        for prompts in loads.values():
            run_once(llm, prompts, args.max_tokens, args.batch)  # settle: shapes seen once, the governor's first measurements
        return llm

    def timed(llm, name: str, workload: str) -> None:
        llm.engine.step_records.clear()
        seconds, outs = run_once(llm, loads[workload], args.max_tokens, args.batch)
        runs[(name, workload)].append((seconds, outs, list(llm.engine.step_records)))

    # The default engine stays loaded; each other engine in turn is built, settled and then timed in
    # rounds that alternate with the default engine's, so a slower spell of the shared machine hits
    # both sides of a ratio (and two engines, not all of them, share the memory).
    runs: dict[tuple[str, str], list] = {(n, w): [] for n in names for w in loads}  # (seconds, outputs, steps) per run
    pairs: dict[tuple[str, str], list] = {(n, w): [] for n in names for w in loads}  # the default's run before each
    base_llm, engines = settled("default"), {}
    for name in names[1:]:
        llm = settled(name)
        for _ in range(args.runs):
            for workload in loads:
                timed(base_llm, "default", workload)
                pairs[(name, workload)].append(runs[("default", workload)][-1])
                timed(llm, name, workload)
        engines[name] = llm.resolved.speculation
        llm.close()
    if len(names) == 1:
        for _ in range(args.runs):
            for workload in loads:
                timed(base_llm, "default", workload)
    for name in names:
        row = results["engines"][name] = {"config": ENGINES[name]}
        for workload in loads:
            rounds = runs[(name, workload)]
            base_rounds = pairs[(name, workload)] if name != "default" else rounds
            rates = [sum(len(o.token_ids) for o in outs) / sec for sec, outs, _ in rounds]
            ratios = [r / (sum(len(o.token_ids) for o in b[1]) / b[0]) for r, b in zip(rates, base_rounds)]
            outs, base_ids = rounds[-1][1], [o.token_ids for o in base_rounds[-1][1]]
            # Where a decode (or verify) step's time went: proposing (with scheduling), the target's pass.
            steps_kept = [r for _, _, recs in rounds for r in recs if r.phases is not None and max(c[2] for c in r.chunks) <= 17]
            propose_ms = statistics.median(r.phases.schedule for r in steps_kept) * 1e3
            model_ms = statistics.median(r.phases.model for r in steps_kept) * 1e3
            step_ms = statistics.median(r.end - r.start for r in steps_kept) * 1e3
            ids = [o.token_ids for o in outs]
            steps = sum(o.metrics.num_verify_steps for o in outs)
            accepted = sum(o.metrics.spec_accepted for o in outs)
            same = sum(a == b for a, b in zip(ids, base_ids))
            rate, speedup = statistics.median(rates), statistics.median(ratios)
            row[workload] = {
                "tok_s": rate, "speedup": speedup, "speedups": ratios, "times": [sec for sec, _, _ in rounds],
                "tokens": sum(map(len, ids)), "verify_steps": steps,
                "accepted_per_verify": accepted / steps if steps else 0.0,
                "passes_per_token": sum(o.metrics.num_forward_passes for o in outs) / sum(map(len, ids)),
                "same_tokens": f"{same}/{len(ids)}", "step_ms": step_ms, "propose_ms": propose_ms,
                "target_pass_ms": model_ms,
            }  # fmt: skip
            if name == "default":  # what the text allows prompt lookup, on the default engine's own answers
                row[workload]["ngram_ceiling"] = {
                    k: sum(len(o.token_ids) for o in outs)
                    / sum(len(o.token_ids) / copy_ceiling(o.prompt_token_ids, o.token_ids, k) for o in outs if o.token_ids)
                    for k in (4, 8)
                }  # fmt: skip
                say(f"{workload:>16} prompt lookup's ceiling on these answers: "
                    + ", ".join(f"{c:.2f} tokens a step at k={k}" for k, c in row[workload]["ngram_ceiling"].items()))
            say(f"{workload:>16} {name:>34} {rate:7.1f} tok/s {speedup:6.2f}x  accepted/verify "
                f"{row[workload]['accepted_per_verify']:.2f}  passes/token {row[workload]['passes_per_token']:.2f}  "
                f"step {step_ms:5.1f} ms = propose {propose_ms:4.1f} + target {model_ms:4.1f} + rest  "
                f"same tokens {same}/{len(ids)}")  # fmt: skip
        if name != "default":
            row["speculation"] = engines[name]
            say(f"{'':>16} {name:>34} governor: {engines[name]}")
    results["resolved_dtype"] = str(base_llm.resolved.dtype)
    base_llm.close()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"bench-eagle-tree-{date.today()}-{machine['cpu'].split()[0].replace('(R)', '')}-{torch.get_num_threads()}t"
    stem += f"-batch{args.batch}" if args.batch > 1 else ""
    (out / f"{stem}.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    (out / f"{stem}.log").write_text("\n".join(lines) + "\n")
    print(f"wrote {out / stem}.json and .log")


if __name__ == "__main__":
    main()
