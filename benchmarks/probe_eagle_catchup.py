"""Proposing EAGLE trees for a batch: each sequence's catch-up alone against all of them in one call.

    python benchmarks/probe_eagle_catchup.py [--batch 8] [--repeats 7]

The head as the engine loads it over SmolLM2-135M (bf16 where the CPU has fast bf16 kernels,
prepacked), ``--batch`` sequences of 120 tokens whose draft layer is 1, 2, 16 or 64 positions
behind the target's features — 1-2 in steady speculation, tens after the governor kept a batch
on plain steps and tries proposing again. Timed: one ``propose_trees`` (6 nodes, top-4, depth 2)
for the whole batch, with the catch-ups one call per sequence (as before stop 70) and in one
call (``EagleProposer._catch_up_together``), alternating, median of ``--repeats`` each. The
features are random (the time does not depend on their values); the trees' growth, per
sequence in both, is in both figures.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from minillm import LLM, SamplingParams
from minillm.speculative.eagle import EagleProposer


class FakeSeq:
    """What the proposer reads of a sequence."""

    params = SamplingParams(temperature=0)

    def __init__(self, request_id, ids):
        self.request_id, self.token_ids = request_id, ids

    def __len__(self):
        return len(self.token_ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    from minillm.machine import machine_description
    from minillm.viz.spec import machine_words

    spec = {"method": "eagle", "model": "smollm2-eagle", "num_speculative_tokens": 6, "topk": 4, "depth": 2}
    llm = LLM("smollm2-135m", speculative_config=spec)
    head = llm.engine.speculator.draft.head
    print(f"probe_eagle_catchup: {machine_words(machine_description(torch.device('cpu')))}; head {head.fc.weight.dtype}")
    torch.manual_seed(0)

    def batch_behind(proposer: EagleProposer, behind: int, context: int = 120) -> list[FakeSeq]:
        seqs = []
        for i in range(args.batch):
            ids = torch.randint(0, head.target[0].config.vocab_size, (context + 1,)).tolist()
            seq = FakeSeq(i, ids[: context - behind + 1])
            feats = (0.5 * torch.randn(context, head.cfg.hidden_size)).to(head.fc.weight.dtype)
            proposer.observe([i], [0], [feats[: context - behind]], [seq])
            proposer.propose_trees([seq], [6], 4, 2)  # its draft layer caught up to here
            seq.token_ids = ids  # `behind` more tokens, whose features arrive now
            proposer.observe([i], [context - behind], [feats[context - behind :]], [seq])
            seqs.append(seq)
        return seqs

    def timed(together: bool, behind: int) -> float:
        proposer = EagleProposer(head)
        if not together:
            proposer._catch_up_together = lambda pairs: None  # each sequence's _catch_up runs alone
        seqs = batch_behind(proposer, behind)
        start = time.perf_counter()
        proposer.propose_trees(seqs, [6] * len(seqs), 4, 2)
        return (time.perf_counter() - start) * 1e3

    with torch.inference_mode():
        for behind in (1, 2, 16, 64):
            alone, together = [], []
            for _ in range(args.repeats):
                alone.append(timed(False, behind))
                together.append(timed(True, behind))
            a, b = statistics.median(alone), statistics.median(together)
            print(f"{args.batch} sequences {behind:3d} positions behind: catch-ups one by one {a:6.1f} ms, "
                  f"together {b:6.1f} ms ({a / b:.2f}x)")  # fmt: skip
    llm.close()


if __name__ == "__main__":
    main()
