"""How many tokens should prompt lookup propose — per sequence? Offline, on the default engine's answers.

The governor (``speculative/governor.py``) picks one ``k`` for every sequence of a batch size,
measured over the steps of all of them: on a server that mixes chats (where a guess is rarely
longer than a token or two) with edits (where a request copies its prompt for dozens of tokens)
its one choice is wrong for one of the two. This probe replays policies on the default engine's
own greedy answers (SmolLM2-135M, the workloads of ``bench_eagle_tree.py --copy``) and prints, per
workload, the tokens a verify step makes and the proposals it verifies:

- ``fixed k``: always up to ``k`` guesses (``propose_ngram`` as shipped);
- ``grow k``: each sequence's own length, from 1 up to ``k``: +2 after a step that accepted every
  guess, -1 after one that did not (the schedule of Hugging Face's assisted generation,
  ``num_assistant_tokens_schedule="heuristic"``);
- ``by match k``: up to ``k`` guesses when the matched n-gram is 3+ tokens long (``by match 2
  k``: 2+), else as many as it is long;
- ``reach k``: what the engine ships (``ngram.reach``): up to 1, 2, 4, 8 guesses after a match of
  1, 2, 3, 4 tokens, never more than ``k``.

The answers are the default engine's once its compiled step is in (bf16 answers differ a little
between the eager and the compiled step).

The costs are not here — a verify row's price depends on the machine (nearly free with AMX,
not without): the engine measures them (``bench_eagle_tree.py``). Usage::

    python benchmarks/probe_ngram_policy.py [--chats 12] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from datetime import date
from pathlib import Path

import torch

from minillm.speculative.ngram import match_length, propose_ngram, reach

BENCH = Path(__file__).with_name("bench_eagle_tree.py")


def match(tokens: list[int], max_n: int = 4) -> tuple[int, list[int]]:
    """The matched n-gram's length and everything that followed it (the package's own search)."""
    n = match_length(tokens, max_n)
    return n, (propose_ngram(tokens, len(tokens), n, n) if n else [])


def replay(prompt: list[int], answer: list[int], policy: str, k: int) -> tuple[int, int]:
    """Steps and proposals verified to emit ``answer`` after ``prompt`` under ``policy``."""
    steps = proposed = i = 0
    own = 1  # "grow": this sequence's length
    while i < len(answer):
        n, follow = match(prompt + answer[:i])
        if policy == "fixed":
            size = k
        elif policy == "grow":
            size = own
        elif policy == "by match":
            size = k if n >= 3 else n
        elif policy == "by match 2":
            size = k if n >= 2 else n
        else:  # "reach": the engine's
            size = reach(n, k)
        guess = follow[:size] if n else []
        accepted = 0
        while accepted < len(guess) and i + accepted < len(answer) and guess[accepted] == answer[i + accepted]:
            accepted += 1
        if guess and policy == "grow":
            own = min(own + 2, k) if accepted == len(guess) else max(own - 1, 1)
        i += accepted + 1
        steps += 1
        proposed += len(guess)
    return steps, proposed


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chats", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    spec = importlib.util.spec_from_file_location("bench_eagle_tree", BENCH)
    bench = importlib.util.module_from_spec(spec)
    sys.modules["bench_eagle_tree"] = bench
    spec.loader.exec_module(bench)
    from minillm import LLM, SamplingParams
    from minillm.machine import machine_description
    from minillm.viz.spec import machine_words

    print(f"probe_ngram_policy, {date.today()}: {machine_words(machine_description(torch.device('cpu')))}")
    llm = LLM("smollm2-135m")
    llm.wait_for_fast_path()
    policies = [("fixed", k) for k in (1, 2, 4, 8)] + [("grow", 4), ("grow", 8), ("by match", 4), ("by match", 8),
                                                                  ("by match 2", 8), ("reach", 4), ("reach", 8)]
    for workload, prompts in bench.workloads(args.chats, copy=True).items():
        outs = llm.generate(prompts, SamplingParams(max_tokens=args.max_tokens))
        tokens = sum(len(o.token_ids) for o in outs)
        print(f"\n{workload}: {len(outs)} answers, {tokens} tokens")
        print(f"  {'policy':>12}  tokens/step  proposals/step  accepted share")
        for policy, k in policies:
            steps = proposed = 0
            for o in outs:
                s, p = replay(list(o.prompt_token_ids), list(o.token_ids), policy, k)
                steps, proposed = steps + s, proposed + p
            accepted = tokens - steps
            print(f"  {policy + ' ' + str(k):>12}  {tokens / steps:11.2f}  {proposed / steps:14.2f}"
                  f"  {accepted / proposed if proposed else 0:14.0%}")  # fmt: skip
    llm.close()


if __name__ == "__main__":
    main()
