"""Tensor and pipeline parallelism: who holds which part of the model (Megatron-LM, Shoeybi et
al., 2019, arXiv:1909.08053; GPipe, Huang et al., 2019, arXiv:1811.06965).

Tensor parallelism (TP) splits every layer's matrices over ``tp_size`` ranks:

- **column parallel** (q/k/v, gate/up, the LM head): each rank holds a slice of the *output*
  rows and computes its part of the activation. SiLU × up and attention are per-column /
  per-head, so nothing is exchanged inside the block;
- **row parallel** (o, down): each rank holds the matching slice of the *input* columns, so
  its output is a partial sum; one **all-reduce** adds the partial sums and every rank ends
  with the full hidden state — the layer does it itself (``Linear(..., parallel=context)``),
  so the model code is the same split or whole. Two all-reduces per decoder layer are the
  whole cost of TP;
- the **vocabulary** is split too: a rank embeds only the ids in its range (zeros elsewhere;
  an all-reduce sums), and as the LM head it scores only its range (the logits are gathered).

Attention is split **by head**. A rank's query heads must find their K/V head on the same
rank (``heads_of_rank``), which decides how the K/V heads spread — and when there are fewer
K/V heads than ranks, some are **replicated**.

Pipeline parallelism (PP) splits the layers into ``pp_size`` consecutive stages
(``stage_layers``); activations go from stage to stage (``minillm.parallel.worker``).

``ParallelContext`` is what a model shard is told about its place; the single-process model
gets ``SINGLE`` and runs exactly as before (no communication at all).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

import minillm.hooks as hooks
from minillm.layers.embedding import Embedding


def split_evenly(n: int, parts: int, index: int) -> range:
    """Part ``index`` of ``range(n)`` cut into ``parts`` contiguous pieces whose sizes differ by
    at most one (the first ``n % parts`` pieces get the extra one)."""
    if not 0 <= index < parts or parts > n:
        raise ValueError(f"cannot cut {n} items into {parts} non-empty parts (asked for part {index})")
    base, extra = divmod(n, parts)
    start = index * base + min(index, extra)
    return range(start, start + base + (index < extra))


@hooks.reference("heads_of_rank")  # each attention layer's shard is built through the hook (chapter 09)
def heads_of_rank(num_heads: int, num_kv_heads: int, rank: int, tp_size: int) -> tuple[range, range]:
    """The query heads and the K/V heads rank ``rank`` holds under ``tp_size``-way TP.

    Query head ``h`` reads K/V head ``h // group`` (``group = num_heads / num_kv_heads``), so a
    rank must hold the K/V heads its query heads read, and within a rank every K/V head must
    serve the same number of query heads (the attention kernels assume one group size):

    - ``num_kv_heads >= tp_size``: whole **groups** are dealt out, as evenly as possible. When
      they do not divide (SmolLM2: 3 K/V heads on 2 ranks), one rank gets one group more — 6
      query heads and 2 K/V heads against 3 and 1: correct, but that rank does more attention
      work (the MLP and the vocabulary still split evenly);
    - ``num_kv_heads < tp_size``: each K/V head is **replicated** on ``tp_size / num_kv_heads``
      ranks, each taking an equal share of its group's query heads (SmolLM2 at TP = 9: one
      query head per rank, every K/V head held by three ranks). K/V memory per rank stops
      shrinking once every rank holds a single K/V head.
    """
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} K/V heads")
    group = num_heads // num_kv_heads
    if num_kv_heads >= tp_size:
        kv = split_evenly(num_kv_heads, tp_size, rank)
        return range(kv.start * group, kv.stop * group), kv
    replicas = tp_size // num_kv_heads
    if tp_size % num_kv_heads or group % replicas:
        raise ValueError(
            f"tensor_parallel_size={tp_size} does not fit {num_kv_heads} K/V heads of {group} query heads each: "
            f"with fewer K/V heads than ranks, the ranks must be a multiple of the K/V heads and share each "
            f"group's query heads equally"
        )
    kv_head, part = divmod(rank, replicas)
    per = group // replicas
    first = kv_head * group + part * per
    return range(first, first + per), range(kv_head, kv_head + 1)


def stage_layers(num_layers: int, pp_size: int, stage: int) -> range:
    """The decoder layers of pipeline stage ``stage``: consecutive, as even as possible."""
    if pp_size > num_layers:
        raise ValueError(f"pipeline_parallel_size={pp_size} exceeds the model's {num_layers} layers")
    return split_evenly(num_layers, pp_size, stage)


@dataclass
class CommStats:
    """What this process's collectives cost so far: calls, bytes each rank put in, seconds
    spent waiting in them (read and reset by the worker around each step)."""

    calls: int = 0
    all_reduce_bytes: int = 0
    all_gather_bytes: int = 0
    seconds: float = 0.0


COMM = CommStats()


@dataclass(frozen=True)
class ParallelContext:
    """Where one model shard sits: its tensor-parallel rank among ``tp_size`` (talking over
    ``tp_group``) and its pipeline stage among ``pp_size``."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    tp_group: Any = None  # a torch.distributed process group; None: the default group

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def layers(self, num_layers: int) -> range:
        return stage_layers(num_layers, self.pp_size, self.pp_rank)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the tensor-parallel ranks, in place (nothing to do at TP = 1)."""
        return self._all_reduce(x, dist.ReduceOp.SUM)

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        """The element-wise maximum of ``x`` over the tensor-parallel ranks, in place: a
        row-parallel layer's per-row scales, from the whole rows its ranks share (once, when
        the weights are quantized — never inside a step)."""
        return self._all_reduce(x, dist.ReduceOp.MAX)

    def _all_reduce(self, x: torch.Tensor, op) -> torch.Tensor:
        if self.tp_size > 1:
            start = time.perf_counter()
            dist.all_reduce(x, op=op, group=self.tp_group)
            COMM.seconds += time.perf_counter() - start
            COMM.calls += 1
            COMM.all_reduce_bytes += x.numel() * x.element_size()
        return x

    def gather_columns(self, local: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """Concatenate every TP rank's ``[..., sizes[r]]`` along the last dim (an all-gather;
        the parts are padded to one size because the collective wants equal shapes)."""
        if self.tp_size == 1:
            return local
        width = max(sizes)
        padded = F.pad(local, (0, width - local.shape[-1])).contiguous()
        parts = [torch.empty_like(padded) for _ in sizes]
        start = time.perf_counter()
        dist.all_gather(parts, padded, group=self.tp_group)
        COMM.seconds += time.perf_counter() - start
        COMM.calls += 1
        COMM.all_gather_bytes += padded.numel() * padded.element_size()
        return torch.cat([p[..., :n] for p, n in zip(parts, sizes)], dim=-1)


SINGLE = ParallelContext()


class VocabParallelEmbedding(Embedding):
    """The embedding table split by vocabulary rows: this rank holds rows ``vocab_range`` only,
    looks up the ids that fall in it, zeros the rest, and an all-reduce sums the ranks' rows
    (exactly one rank contributes each id). Tied to an int8 LM head, it reads its rows through
    the head like the unsplit embedding (``embedding.py``): the head holds the same vocabulary
    rows, one per-row scale each, so every rank's rows are exactly the one-process model's."""

    def __init__(self, vocab_size: int, hidden: int, parallel: ParallelContext):
        rows = split_evenly(vocab_size, parallel.tp_size, parallel.tp_rank)
        super().__init__(vocab_size, hidden, rows, requires_grad=False)
        self.parallel = parallel

    def weight_loader(self, param: str, loaded, shard: str | None = None) -> None:
        """This rank's rows of the full ``[vocab, hidden]`` checkpoint matrix (read as a slice)."""
        if tuple(loaded.shape) != (self.vocab_size, self.embedding_dim):
            raise ValueError(f"has shape {tuple(loaded.shape)}, expected {(self.vocab_size, self.embedding_dim)}")
        part = loaded.narrow(0, self.vocab_range.start, len(self.vocab_range))
        with torch.no_grad():
            self.weight.copy_(part if isinstance(part, torch.Tensor) else part.load())

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab_range.start
        mine = (local >= 0) & (local < len(self.vocab_range))
        out = self.rows_of(local.clamp(0, len(self.vocab_range) - 1)) * mine.unsqueeze(-1)
        return self.parallel.all_reduce(out)
