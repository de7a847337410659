"""The first rung: no cache at all.

Every step is a full forward pass over every token of every sequence in the step, from
position 0: O(n²) work, no state, obviously correct. Each chunk it is given is the whole
sequence so far (the static batcher's ``recompute`` policy). Every faster runner must produce
identical greedy tokens — the correctness ladder starts here.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

from minillm.attention.contiguous import ForwardBatch
from minillm.engine.runner import StepInputs, select_logit_rows
from minillm.models.llama import LlamaForCausalLM


def padded(rows: list[list[int]], device: torch.device, pad: int = 0) -> torch.Tensor:
    """Rows of token ids as one right-padded ``[B, T]`` tensor."""
    width = max(len(r) for r in rows)
    return torch.tensor([r + [pad] * (width - len(r)) for r in rows], dtype=torch.long, device=device)


def run_padded(model: LlamaForCausalLM, inputs: StepInputs, **cache_args) -> torch.Tensor:
    """One padded forward pass over the chunks (row ``i`` = chunk ``i``) → the wanted logits."""
    chunks = inputs.chunks
    device = model.embed_tokens.weight.device
    ids = padded([c.token_ids for c in chunks], device)
    positions = torch.arange(ids.shape[1], device=device).expand(ids.shape[0], -1)
    if all(c.num_logits == 1 for c in chunks):  # the usual case: the last token of each row
        last = torch.tensor([c.num_tokens - 1 for c in chunks], device=device)
        return model(ForwardBatch(ids, positions, logit_index=last, **cache_args))
    width = ids.shape[1]
    rows = select_logit_rows(chunks, [i * width + c.num_tokens for i, c in enumerate(chunks)])
    logits = model(ForwardBatch(ids, positions, **cache_args))  # [B, T, V]
    return logits.flatten(0, 1)[torch.tensor(rows, dtype=torch.long, device=device)]


class NaiveRunner:
    def __init__(self, model: LlamaForCausalLM):
        self.model = model

    def execute(self, inputs: StepInputs) -> torch.Tensor:
        if any(c.start != 0 for c in inputs.chunks):
            raise ValueError("the naive runner recomputes whole sequences: every chunk must start at position 0")
        return run_padded(self.model, inputs)

    def release(self, request_id: Hashable) -> None:
        pass  # nothing is kept between steps
