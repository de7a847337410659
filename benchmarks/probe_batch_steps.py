"""Where a batch's time goes, step by step: the default engine against speculative ones.

    python benchmarks/probe_batch_steps.py [ENGINE ...] [--batch 8] [--chats 16] [--rounds 3] [--grounded] [--plain]

Each engine (names from ``bench_eagle_tree.ENGINES``; default: the default engine, prompt lookup
k 4 and the EAGLE tree 4x2, 6 nodes, governor on) is SmolLM2-135M as it ships, settled by two
untimed runs, then decodes the EAGLE recipe's held-out chats ``--batch`` at a time (64 tokens),
``--rounds`` times, the engines taking turns. Per run: tokens per second, the time in steps
with a prefill chunk, in pure decode steps and outside any step; and per batch size class (1,
2-3, 4-7, 8-15 decoding sequences) and number of proposals the governor chose: steps, time,
ms a step, tokens a step and rows a step (a verify row per proposal) — also by the kind of text
the governor was told (copying, free text: prompt lookup at batch 1, a tree engine at every size;
"no match": a prompt-lookup step in which no sequence matched, which proposes nothing and is
timed apart, shown as size 1). The default engine has no governor: its steps all show as size 1, k=0. ``--grounded``: before each timed chat run, an
untimed run of ``--batch`` grounded requests (as ``bench_eagle_tree.py`` alternates its two
workloads), so the governor comes to chat from text where proposals pay. ``--plain``: every
governor made to choose 0 proposals — what the speculative engine's machinery costs when it
proposes nothing. What found the tries' cost and the half-empty
tail of stop 69's governor at batch 8 (docs/benchmarks.md, "2026-12-07 (stop 70)").
"""

from __future__ import annotations

import argparse
import collections
import time

import bench_eagle_tree as bench


def run(llm, chats, batch: int):
    """One timed run: seconds, tokens, and per step (batch, k, tokens, seconds, pure decode, rows)."""
    speculator, steps = llm.engine.speculator, []
    step_done = speculator.step_done

    def recording(chunks, tokens, seconds):
        size, k, text = getattr(speculator, "_step", (None, 0, None))
        if size == 0:  # prompt lookup found no match in any sequence: nothing proposed, no governor
            k, text = 0, "no match"
        pure = all(c.draft_tokens or c.is_decode for c in chunks)
        steps.append((size, k, tokens, seconds, pure, sum(c.num_tokens for c in chunks), text))
        return step_done(chunks, tokens, seconds)

    speculator.step_done = recording
    try:
        seconds, outs = bench.run_once(llm, chats, 64, batch)
    finally:
        speculator.step_done = step_done
    return seconds, sum(len(o.token_ids) for o in outs), steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("engines", nargs="*", default=["default", "ngram k4", "eagle tree 4x2 k6"])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--chats", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--grounded", action="store_true", help="an untimed grounded run before each chat run")
    parser.add_argument("--plain", action="store_true", help="every governor chooses 0 proposals")
    args = parser.parse_args()
    unknown = [name for name in args.engines if name not in bench.ENGINES]
    if unknown:
        parser.error(f"unknown engines {unknown}; choose from {list(bench.ENGINES)}")
    loads = bench.workloads(args.chats, args.batch)
    chats, grounded = loads["chat (held out)"], loads["grounded"]
    engines = {}
    for name in args.engines:
        llm = bench.build(name)
        llm.wait_for_fast_path()
        if args.plain and getattr(llm.engine.speculator, "governor", None) is not None:
            llm.engine.speculator.governor.choose = lambda batch, text=None: 0
        for _ in range(2):
            run(llm, chats, args.batch)
        engines[name] = llm
    for r in range(args.rounds):
        for name, llm in engines.items():
            if args.grounded:
                bench.run_once(llm, grounded, 64, args.batch)
            start = time.perf_counter()
            _, tokens, steps = run(llm, chats, args.batch)
            elapsed = time.perf_counter() - start
            decode = [s for s in steps if s[4]]
            prefill = sum(s[3] for s in steps if not s[4])
            print(f"round {r} {name:>20}: {tokens / elapsed:6.1f} tok/s {elapsed * 1e3:7.0f} ms; steps {len(steps)}; "
                  f"with a prefill {prefill * 1e3:6.0f} ms; pure decode {sum(s[3] for s in decode) * 1e3:6.0f} ms; "
                  f"outside steps {(elapsed - sum(s[3] for s in steps)) * 1e3:5.0f} ms")  # fmt: skip
            by = collections.defaultdict(lambda: [0, 0.0, 0, 0])
            for size, k, emitted, seconds, _, rows, text in decode:
                row = by[(1 << (max(size or 1, 1).bit_length() - 1), k, text or "")]
                row[0], row[1], row[2], row[3] = row[0] + 1, row[1] + seconds, row[2] + emitted, row[3] + rows
            for (size, k, text), (n, seconds, emitted, rows) in sorted(by.items()):
                print(f"      size {size} k={k} {text:>9}: {n:4d} steps {seconds * 1e3:7.1f} ms {seconds / n * 1e3:6.2f} ms/step "
                      f"{emitted / n:5.2f} tok/step {rows / n:5.1f} rows/step")  # fmt: skip
    for name, llm in engines.items():
        print(f"{name}: {llm.resolved.speculation}")
        llm.close()


if __name__ == "__main__":
    main()
