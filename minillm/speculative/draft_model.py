"""The draft model: a small model with the target's tokenizer, run by its own paged runner.

It keeps its own paged KV pool and block manager (no prefix caching: its blocks live only as
long as the request), so proposing is the same machinery as serving, in miniature. Each step,
for every sequence it proposes for:

1. **catch up** — run the tokens the draft has not seen yet (the whole prompt the first time,
   then the tokens the target emitted last step that the draft did not compute) as one chunk
   per sequence, all sequences in one batched forward pass; its last position proposes ``d1``;
2. **run ahead** — ``k − 1`` batched single-token steps, each feeding the previous proposal.

After the target's verdict the draft's KV is rolled back to the longest prefix where its tokens
equal the sequence's (``BlockManager.truncate``): the accepted proposals stay cached, the rest
are recomputed next step as part of the catch-up. A preempted or finished sequence's draft
state is dropped and rebuilt from its tokens if it runs again.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

import torch

from minillm.config import ModelConfig
from minillm.kvcache.block_manager import BlockManager
from minillm.kvcache.paged import PagedKVCache
from minillm.runtime.paged_runner import PagedRunner
from minillm.runtime.runner import ChunkInput, StepInputs
from minillm.sampling import filtered_logits
from minillm.sequence import Sequence


@dataclass
class DraftState:
    """What the draft's block manager sees of one request."""

    request_id: Hashable
    seq: Sequence
    num_computed_tokens: int = 0
    written: list[int] = field(default_factory=list)  # the tokens at positions 0.. whose K/V it holds
    agreed: int = 0  # positions already checked against the sequence's tokens (they never change)

    @property
    def token_ids(self) -> list[int]:
        return self.seq.token_ids


class DraftModelProposer:
    def __init__(self, model, model_config: ModelConfig, block_size: int, num_blocks: int):
        """``model``: the draft, loaded and prepared like the target (``engine/builder.py``)."""
        self.model = model
        self.config = model_config
        self.cache = PagedKVCache(model_config, num_blocks, block_size, model.dtype, model.device)
        self.blocks = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
        self.runner = PagedRunner(model, self.cache)
        self.states: dict[Hashable, DraftState] = {}

    def propose(self, seqs: list[Sequence], ks: list[int]) -> dict[Hashable, tuple[list[int], torch.Tensor | None]]:
        """For each sequence, up to its ``k`` proposals and (sampled requests) the draft's
        distributions they were drawn from, ``[k, V]``. A sequence the draft pool cannot hold
        this step gets none."""
        active = []
        for seq, k in zip(seqs, ks):
            state = self._state(seq)
            self.rollback(seq)  # proposals of a step that did not run them (budget, preemption) go too
            ahead = len(seq) - state.num_computed_tokens + k - 1
            if self.blocks.allocate_slots(state, ahead) is None:
                continue
            active.append((seq, state, k))
        if not active:
            return {}
        proposals: dict[Hashable, list[int]] = {seq.request_id: [] for seq, _, _ in active}
        dists: dict[Hashable, list[torch.Tensor]] = {seq.request_id: [] for seq, _, _ in active}
        chunks = [
            ChunkInput(
                seq.request_id,
                seq.tokens(st.num_computed_tokens, len(seq)),
                st.num_computed_tokens,
                1,
                self.blocks.block_table_of(st),
            )  # fmt: skip
            for seq, st, _ in active
        ]
        for st, chunk in zip((st for _, st, _ in active), chunks):
            st.written[chunk.start :] = chunk.token_ids
            st.num_computed_tokens = chunk.start + chunk.num_tokens
        logits = self.runner.execute(StepInputs(chunks))
        running = active
        for step in range(max(k for _, _, k in active)):
            self._pick(running, logits, proposals, dists)
            running = [(seq, st, k) for seq, st, k in running if k > step + 1]
            if not running:
                break
            chunks = []
            for seq, st, _ in running:
                token = proposals[seq.request_id][-1]
                chunks.append(
                    ChunkInput(seq.request_id, [token], st.num_computed_tokens, 1, self.blocks.block_table_of(st))
                )
                st.written.append(token)
                st.num_computed_tokens += 1
            logits = self.runner.execute(StepInputs(chunks))
        return {rid: (tokens, torch.stack(dists[rid]) if dists[rid] else None) for rid, tokens in proposals.items()}

    def _pick(self, running, logits: torch.Tensor, proposals: dict, dists: dict) -> None:
        for row, (seq, _, _) in enumerate(running):
            if seq.params.greedy:
                proposals[seq.request_id].append(int(logits[row].argmax()))
                continue
            q = filtered_logits(logits[row : row + 1].float(), [seq.params]).softmax(-1)[0]
            proposals[seq.request_id].append(int(torch.multinomial(q, 1, generator=seq.generator)))
            dists[seq.request_id].append(q)

    def rollback(self, seq: Sequence) -> None:
        """Keep the draft's K/V only where its tokens equal the sequence's (after the verdict)."""
        state = self.states.get(seq.request_id)
        if state is None:
            return
        tokens = seq.token_ids
        valid = min(state.agreed, state.num_computed_tokens)
        limit = min(state.num_computed_tokens, len(tokens))
        while valid < limit and state.written[valid] == tokens[valid]:
            valid += 1
        # the sequence's last token is never computed here: it is the next catch-up's query
        valid = min(valid, len(tokens) - 1)
        self.blocks.truncate(state, valid)
        del state.written[valid:]
        state.agreed = valid

    def release(self, request_id: Hashable) -> None:
        state = self.states.pop(request_id, None)
        if state is not None:
            self.blocks.free(state)
            self.runner.release(request_id)

    def _state(self, seq: Sequence) -> DraftState:
        state = self.states.get(seq.request_id)
        if state is None or state.seq is not seq:
            self.release(seq.request_id)
            state = self.states[seq.request_id] = DraftState(seq.request_id, seq)
            self.blocks.match_prefix(state)  # no prefix caching here: an empty table
        return state


def check_same_tokenizer(draft, target, draft_config: ModelConfig, target_config: ModelConfig, name: str) -> None:
    """A draft proposes token *ids*: they only mean the same text if both models share the
    tokenizer. ``ValueError`` naming the draft otherwise."""
    probe = "The quick brown fox, 1234 — naïve café.\n\tdef f(x): return x**2"
    if draft_config.vocab_size != target_config.vocab_size or draft.encode(probe) != target.encode(probe):
        raise ValueError(
            f"speculative_config model={name!r} does not share the target's tokenizer "
            f"(vocab {draft_config.vocab_size} vs {target_config.vocab_size}, or different ids for the same text)"
        )
