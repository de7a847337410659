"""Decode steps replayed as CUDA graphs.

A decode step of a small model is hundreds of tiny kernel launches; on a GPU the CPU time to
*issue* them exceeds the GPU time to *run* them. A CUDA graph records the launches of one step
once and replays them with a single call. The catch: a graph replays fixed shapes and fixed
memory addresses. So we keep, for each of a few batch sizes (1, 2, 4, 8, ... up to
``max_num_seqs``), static input buffers — token ids, positions, slots, block tables, context
lengths — capture the model's forward pass reading them, and before each replay copy the
step's real inputs into the buffers of the next size up. Rows beyond the real batch are
padding: they write into and read from the pool's reserved **null block**, so they never touch
a real sequence's K/V.

On CUDA the buffers are captured into graphs. Elsewhere (``capture=False``, for tests on a CPU)
the very same padded, static-shape forward pass runs eagerly, so the padding logic is tested
wherever the engine runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minillm.attention.layout import KVPool, StepLayout
from minillm.kvcache import addressing
from minillm.kvcache.paged import PagedKVCache
from minillm.models.llama import LlamaForCausalLM
from minillm.runtime.block_table_rows import BlockTableRows
from minillm.runtime.fast_path import pad_decode_rows
from minillm.runtime.runner import ChunkInput, long_tensor


def capture_sizes(max_batch: int) -> list[int]:
    """Powers of two up to ``max_batch``, and ``max_batch`` itself."""
    sizes = [1]
    while sizes[-1] * 2 < max_batch:
        sizes.append(sizes[-1] * 2)
    if sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


@dataclass
class StaticDecode:
    """The fixed input buffers of one batch size (a ``StepLayout`` over static tensors) and,
    on CUDA, the graph captured reading them."""

    size: int
    layout: StepLayout
    graph: torch.cuda.CUDAGraph | None = None
    logits: torch.Tensor | None = None


class DecodeGraphs:
    """Pure decode steps through static buffers, replayed as CUDA graphs on CUDA (a ``DecodeFastPath``)."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        cache: PagedKVCache,
        max_batch: int,
        max_model_len: int,
        window: int | None,
        capture: bool,
    ):
        self.model = model
        self.cache = cache
        self.device = model.device
        self.max_blocks = addressing.blocks_for(max_model_len, cache.block_size)
        self.max_context = max_model_len
        self.window = window
        self.capture = capture
        self.sizes = capture_sizes(max_batch)
        self.static: dict[int, StaticDecode] = {}
        self.pool = None  # graphs share one memory pool

    def supports(self, chunks: list[ChunkInput]) -> bool:
        """Only pure decode steps (one token per sequence) that fit a captured size."""
        return bool(chunks) and len(chunks) <= self.sizes[-1] and all(c.is_decode for c in chunks)

    def capture_all(self) -> None:
        """Capture every size now (largest first, so smaller graphs reuse its memory pool)."""
        for size in reversed(self.sizes):
            self._get(size)

    def run(self, chunks: list[ChunkInput], block_tables: BlockTableRows) -> torch.Tensor:
        """Logits ``[len(chunks), V]`` for a pure decode step, through the static buffers
        (``block_tables``: the runner's)."""
        n = len(chunks)
        s = self._get(next(size for size in self.sizes if size >= n))
        self._fill(s, chunks, block_tables.gather(chunks, self.max_blocks))
        if s.graph is not None:
            s.graph.replay()
            return s.logits[:n]
        return self.model(s.layout)[:n]

    def _fill(self, s: StaticDecode, chunks: list[ChunkInput], tables: torch.Tensor) -> None:
        """Real rows first, then padding rows by the padding rule (``fast_path.py``;
        ``tables``: the real rows' block tables, ``[len(chunks), max_blocks]``)."""
        null = self.cache.null_block
        rows = pad_decode_rows(chunks, s.size, self.cache.block_size, null, tables=tables)
        values = {
            "input_ids": rows.input_ids,
            "positions": rows.positions,
            "slot_mapping": rows.slot_mapping,
            "context_lens_tensor": rows.context_lens,
        }
        for name, row_values in values.items():
            buffer = getattr(s.layout, name)
            buffer.copy_(long_tensor(row_values).view(buffer.shape), non_blocking=True)
        # Only the real rows cross from the host; padding rows are filled in place (same rule as pad_table_rows).
        s.layout.block_tables[: len(chunks)].copy_(tables, non_blocking=True)
        s.layout.block_tables[len(chunks) :].fill_(null)

    def _get(self, size: int) -> StaticDecode:
        if size not in self.static:
            self.static[size] = self._build(size)
        return self.static[size]

    def _build(self, size: int) -> StaticDecode:
        def buffer(*shape):
            return torch.zeros(shape, dtype=torch.long, device=self.device)

        layout = StepLayout(
            input_ids=buffer(1, size),
            positions=buffer(1, size),
            slot_mapping=buffer(size),
            query_lens=[1] * size,
            context_lens=[self.max_context] * size,  # the kernels read the tensor below
            context_lens_tensor=buffer(size),
            block_tables=buffer(size, self.max_blocks),
            num_decodes=size,
            logit_index=torch.arange(size, device=self.device),
            pool=KVPool.of(self.cache),
            window=self.window,
            max_context=self.max_context,  # fixed: the split-K layout must not change between replays
        )
        s = StaticDecode(size, layout)
        self._fill(s, [], torch.zeros(0, self.max_blocks, dtype=torch.long))
        if self.capture:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # warm up: Triton compiles, the allocator settles
                for _ in range(2):
                    self.model(layout)
            torch.cuda.current_stream().wait_stream(stream)
            s.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(s.graph, pool=self.pool):
                s.logits = self.model(layout)
            self.pool = s.graph.pool()
        return s
