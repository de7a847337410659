"""What finding prompt lookup's match costs a step: from the request's Python lists, or from its array.

    python benchmarks/bench_match_length.py

Prompt lookup asks, every decode step and for every sequence that may speculate, how long a
suffix of its text occurs earlier (``ngram.match_length``, one vectorized comparison). Given the
sequence's tokens as Python lists (``Sequence.token_ids`` joins prompt and output), most of the
time goes into joining them and converting to an array; ``ngram.TokenArrays`` keeps each
request's array and appends the new tokens only. Timed here on texts of 150, 600 and 1,500
tokens (a chat, a grounded request, an edit of a long passage), the last 64 generated, random
tokens from a 300-word vocabulary so that matches occur: the median of 7 repeats of 2,000
calls each, both ways in the same run, and what 8 sequences cost a 17 ms decode step (batch 8,
SmolLM2-135M, Intel Xeon, stop 76).
"""

from __future__ import annotations

import random
import statistics
import timeit
from types import SimpleNamespace

from minillm.machine import machine_description
from minillm.speculative.ngram import TokenArrays, match_length


def per_call(call) -> float:
    """Seconds a call: the median of 7 repeats of 2,000 calls."""
    return statistics.median(timeit.repeat(call, number=2000, repeat=7)) / 2000


def main() -> None:
    import torch

    from minillm.viz.spec import machine_words

    print(f"bench_match_length: {machine_words(machine_description(torch.device('cpu')))}")
    rng = random.Random(0)
    vocab = [rng.randrange(49152) for _ in range(300)]  # words of a small text: matches happen
    for length in (150, 600, 1500):
        tokens = [rng.choice(vocab) for _ in range(length)]
        seq = SimpleNamespace(request_id=0, prompt_token_ids=tokens[:-64], output_token_ids=tokens[-64:])
        arrays = TokenArrays()
        arrays.of(seq)  # the array exists; each step appends its new tokens (none here)
        lists = per_call(lambda seq=seq: match_length(seq.prompt_token_ids + seq.output_token_ids))
        kept = per_call(lambda seq=seq, arrays=arrays: match_length(arrays.of(seq)))
        print(f"{length:5d} tokens: from the lists {lists * 1e6:5.1f} µs, from the kept array {kept * 1e6:5.1f} µs "
              f"({lists / kept:4.1f}x); 8 sequences: {8 * lists / 17e-3:5.2%} vs {8 * kept / 17e-3:5.2%} of a 17 ms step")  # fmt: skip


if __name__ == "__main__":
    main()
