"""The first rung: no cache at all.

Every step is a full forward pass over every token of every sequence in the step, from
position 0: O(n²) work, obviously correct. The only state it keeps is each sequence's token
ids (its "cache" holds tokens, not K/V). Every faster runner must produce identical greedy
tokens — the correctness ladder starts here.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

from minillm.attention.contiguous import ForwardBatch
from minillm.models.llama import LlamaForCausalLM
from minillm.runtime.runner import ChunkInput, StepInputs, select_logit_rows


def padded(rows: list[list[int]], device: torch.device, pad: int = 0) -> torch.Tensor:
    """Rows of token ids as one right-padded ``[B, T]`` tensor."""
    width = max(len(r) for r in rows)
    return torch.tensor([r + [pad] * (width - len(r)) for r in rows], dtype=torch.long, device=device)


def run_padded(model: LlamaForCausalLM, inputs: StepInputs, **cache_args) -> torch.Tensor:
    """One padded forward pass over the chunks (row ``i`` = chunk ``i``) → the wanted logits."""
    chunks = inputs.chunks
    device = model.device
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
        self.history: dict[Hashable, list[int]] = {}  # every token of every running sequence

    def execute(self, inputs: StepInputs) -> torch.Tensor:
        whole = []
        for c in inputs.chunks:
            tokens = self.history.setdefault(c.request_id, [])
            if c.start != len(tokens):
                raise ValueError(f"request {c.request_id!r}: chunk starts at {c.start}, the runner has {len(tokens)}")
            tokens.extend(c.token_ids)
            whole.append(ChunkInput(c.request_id, tokens, 0, c.num_logits))
        return run_padded(self.model, StepInputs(whole))

    def release(self, request_id: Hashable) -> None:
        self.history.pop(request_id, None)
