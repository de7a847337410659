"""The paged runner: step inputs → the neutral flat layout → one forward pass → logits.

Each chunk is ``num_tokens`` tokens of a sequence from position ``start`` on. The runner lays
their tokens out flat (decodes first, sorted by context length so the reference backend can
attend in buckets of similar lengths; then prefill chunks), computes each token's **slot**
in the pool from its block table, and gathers the block tables, padded, into one tensor (kept
up to date step by step: ``block_table_rows.py``). What each
attention backend needs beyond that it builds itself (``attention/layout.py``). There is no
padding of tokens anywhere.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Hashable

import torch

import minillm.hooks as hooks
from minillm.attention.layout import KVPool, StepLayout
from minillm.kvcache import addressing
from minillm.kvcache.paged import PagedKVCache
from minillm.models.llama import LlamaForCausalLM
from minillm.runtime.block_table_rows import BlockTableRows
from minillm.runtime.compiled_decode import attends_in_place
from minillm.runtime.fast_path import DecodeFastPath, flat_inputs, token_rows
from minillm.runtime.runner import ChunkInput, StepInputs, long_tensor, select_logit_rows


class PagedRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        cache: PagedKVCache,
        window: int | None = None,
        graphs: DecodeFastPath | None = None,
    ):
        """``window``: sliding-window attention. ``graphs``: the decode fast path (CUDA graphs
        or compiled CPU graphs) for the pure decode steps it supports."""
        self.model = model
        self.cache = cache
        self.pool = KVPool.of(cache)
        self.window = window
        self.graphs = graphs
        self.device = model.device
        self.block_tables = BlockTableRows(cache.null_block, cache.block_size)
        self.last_hidden: list[torch.Tensor] | None = None  # per chunk, when the step asked (want_hidden)
        self.last_inputs_seconds = 0.0  # the last step's time building its tensors (StepPhases.inputs)

    def execute(self, inputs: StepInputs) -> torch.Tensor:
        """Copy-on-write copies first, then the forward pass; logits chunk by chunk (and, with
        ``inputs.want_hidden``, each chunk's hidden states in ``last_hidden``)."""
        self.cache.copy_blocks(inputs.block_copies)
        chunks = inputs.chunks
        self.last_hidden = None
        self.last_inputs_seconds = 0.0  # the fast path builds its inputs inside its run
        fast = self.graphs is not None and (not inputs.want_hidden or getattr(self.graphs, "returns_hidden", False))
        if fast and self.graphs.supports(chunks):
            logits = self.graphs.run(chunks, self.block_tables)  # a row per token
            ends = list(itertools.accumulate(c.num_tokens for c in chunks))
            if inputs.want_hidden:
                hidden = self.graphs.last_hidden
                self.last_hidden = [hidden[end - c.num_tokens : end] for c, end in zip(chunks, ends)]
            rows = select_logit_rows(chunks, ends)
            if len(rows) < len(logits):  # a one-token chunk in the middle of a prompt: no logits wanted
                logits = logits[torch.tensor(rows, device=logits.device, dtype=torch.long)]
            return logits
        started = time.perf_counter()
        layout = hooks.step_layout(self, chunks)  # chapter 04's learner writes one
        layout.keep_hidden = inputs.want_hidden
        self.last_inputs_seconds = time.perf_counter() - started
        logits = self.model(layout)
        if inputs.want_hidden:
            hidden, self.model.last_hidden = self.model.last_hidden, None
            self.last_hidden = [hidden[end - c.num_tokens : end] for c, end in zip(chunks, layout.chunk_ends)]
        return logits

    def release(self, request_id: Hashable) -> None:
        """Blocks belong to the block manager (the scheduler frees them); only our copy of the
        sequence's block table goes."""
        self.block_tables.release(request_id)

    def supports_trees(self) -> bool:
        """Whether a step can verify a speculative tree: its node rows attend through the C++
        kernel, which reads their ancestor bits (``fast_path.token_rows``) — the ``cpu``
        backend's eager step and the compiled step's in-place graphs, over the model's own pool
        dtype, without a sliding window, with the package's ``paged_attention``. Elsewhere the
        speculator proposes chains."""
        return (
            self.model.attention_backend.name == "cpu"
            and self.window is None
            and attends_in_place(self.cache)
            and hooks.current("paged_attention") is hooks.default("paged_attention")
        )

    def keep_tree_branch(self, block_table: list[int], first: int, path: list[int]) -> None:
        """A verified tree's accepted branch ``path`` (node indices, root to leaf): node ``i``'s
        K/V lies at address ``first + i``; the branch's ``d``-th node's moves to ``first + d``,
        where the sequence continues (its keys already carry that position: ``token_rows``).
        The engine rolls the rest back after."""
        moves = [(first + node, first + d) for d, node in enumerate(path) if node != d]
        if moves:
            bs = self.cache.block_size
            slot = lambda a: block_table[a // bs] * bs + a % bs  # noqa: E731
            self.cache.copy_slots([slot(a) for a, _ in moves], [slot(b) for _, b in moves])

    def layout(self, chunks: list[ChunkInput]) -> StepLayout:
        """The flat layout of ``chunks`` (see ``StepLayout``): the decodes first, sorted by their
        start (neighbours in the pool's order), then each tree chunk's tokens as decode rows
        (``token_rows``: the kernel reads their ancestor bits), then the other chunks as they come."""
        bs = self.cache.block_size
        decodes = sorted((c for c in chunks if c.is_decode), key=lambda c: c.start)
        trees = [c for c in chunks if c.tree_parents is not None and not c.is_decode]
        tree_rows = [token_rows([c]) for c in trees]
        order = decodes + [row for rows in tree_rows for row in rows]
        order += [c for c in chunks if not c.is_decode and c.tree_parents is None]
        width = addressing.blocks_for(max(c.start + len(c.token_ids) for c in order), bs)
        tables = self.block_tables.gather(order, width)
        flat = flat_inputs(order, bs, tables)
        ends = dict(zip(map(id, order), itertools.accumulate(flat.query_lens)))
        for c, rows in zip(trees, tree_rows):
            ends[id(c)] = ends[id(rows[-1])]  # a tree chunk's rows lie together, in order
        num_decodes = len(decodes) + sum(map(len, tree_rows))
        logit_rows = select_logit_rows(chunks, [ends[id(c)] for c in chunks])
        layout = StepLayout(
            input_ids=self._tensor(flat.input_ids)[None],
            positions=self._tensor(flat.positions)[None],
            slot_mapping=self._tensor(flat.slot_mapping),
            query_lens=flat.query_lens,
            context_lens=flat.context_lens,
            block_tables=tables.to(self.device),
            num_decodes=num_decodes,
            logit_index=self._tensor(logit_rows),
            pool=self.pool,
            window=self.window,
            chunk_ends=[ends[id(c)] for c in chunks],
            visible=long_tensor(flat.visible[:num_decodes]) if trees else None,
        )
        return layout

    def _tensor(self, values) -> torch.Tensor:
        return long_tensor(values, self.device)


@hooks.reference("step_layout")
def step_layout(runner: PagedRunner, chunks: list[ChunkInput]) -> StepLayout:
    """The package's inputs for a step: ``runner.layout`` (a hook, so chapter 04 can run a
    learner's input building in the real engine)."""
    return runner.layout(chunks)
