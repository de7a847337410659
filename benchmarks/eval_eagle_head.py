"""How often the EAGLE head's first guess is SmolLM2's own next token, held out and trained on.

    python benchmarks/eval_eagle_head.py [--head smollm2-eagle] [--threads 2]

SmolLM2 (bf16, eager) answers chat prompts greedily (64 tokens); one pass over prompt + answer
gives its features and its next token at every position; the head, fed the *true* features
(teacher forcing, as in training), guesses the token after the next at every answer position.
Top-1 agreement on the recipe's held-out chats (``data/recipes/train_eagle_smollm2.py``: the
draft recipe's 8 evaluation prompts and one prompt on each of 34 topics no training chat
mentions) against 16 of its training chats: the gap is how much the head learnt by heart. This
is the head's best case; in the engine its later guesses read its own, imperfect, features.

Then the cost of one run-ahead step (the decoder layer on one row over 128 earlier draft
positions, and the scores over the draft vocabulary), median of 200, with the head's matrices
prepacked for oneDNN (how the engine loads a bf16 head on CPU) and with plain matmuls.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from pathlib import Path

import torch

RECIPE = Path(__file__).resolve().parents[1] / "data" / "recipes" / "train_eagle_smollm2.py"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head", default="smollm2-eagle")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    spec = importlib.util.spec_from_file_location("train_eagle_smollm2", RECIPE)
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)

    from minillm import LLM
    from minillm.assets import resolve_model
    from minillm.machine import machine_description
    from minillm.speculative.eagle import load_eagle_head

    llm = LLM("smollm2-135m", compile=False)
    head = load_eagle_head(resolve_model(args.head), llm.model)
    machine = machine_description(torch.device("cpu"))
    print(f"{args.head} over smollm2-135m bf16; {machine['cpu']}, {args.threads} threads")
    trained = [c["prompt"] for c in recipe.training_chats(False)[:16]]
    for name, prompts in (("held out", recipe.held_out_chats()), ("trained on", trained)):
        got = recipe.teacher_forced_top1(llm, head, prompts, args.max_tokens)
        print(f"{name:>10}: top-1 agreement with SmolLM2 {got['top1']:.1%} over {got['positions']} answer positions "
              f"of {got['prompts']} chats")  # fmt: skip
    step_cost(head)


def step_cost(head, past: int = 128, repeats: int = 200) -> None:
    """Milliseconds per run-ahead step, prepacked against plain, in the same run."""
    cfg, dtype = head.cfg, head.fc.weight.dtype
    gen = torch.Generator().manual_seed(0)
    feat = torch.randn(1, cfg.hidden_size, generator=gen).to(dtype)
    past_k = torch.randn(past, cfg.num_kv_heads, cfg.head_dim, generator=gen).to(dtype)
    past_v = torch.randn(past, cfg.num_kv_heads, cfg.head_dim, generator=gen).to(dtype)
    token, position = torch.tensor([5]), torch.tensor([past])
    packed, times = head.packed, {}
    for name, mats in (("prepacked", packed), ("plain", {})):
        if name == "prepacked" and not packed:
            continue
        head.packed = mats
        samples = []
        with torch.inference_mode():
            for i in range(repeats + 20):
                start = time.perf_counter()
                pred, _, _ = head(feat, token, position, past_k, past_v)
                head.logits(pred)
                if i >= 20:  # the first calls warm the allocator and oneDNN's primitives
                    samples.append(time.perf_counter() - start)
        times[name] = statistics.median(samples) * 1e3
    head.packed = packed
    print("one run-ahead step (layer + draft-vocabulary scores), median ms: "
          + ", ".join(f"{k} {v:.2f}" for k, v in times.items())
          + (f"; plain / prepacked {times['plain'] / times['prepacked']:.2f}x" if len(times) == 2 else ""))  # fmt: skip


if __name__ == "__main__":
    main()
