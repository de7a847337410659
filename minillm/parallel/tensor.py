"""Tensor parallelism for one SwiGLU block: the pattern every TP layer follows (Megatron-LM,
Shoeybi et al., 2019).

``gate_up`` is **column parallel**: each rank holds a slice of the output rows (of the gate and
of the up projection alike, so each rank's slice pairs up), computes its part of the
intermediate activation, and applies SiLU × up *locally* — no communication, because the
element-wise product never mixes columns. ``down`` is **row parallel**: each rank holds the
matching slice of the input columns, so its output is a partial sum over its slice; one
**all-reduce** adds the partial sums, and every rank ends with the full output. One
all-reduce per MLP (and one per attention block, after its output projection) is the whole
communication cost of TP in a decoder layer.

The slices are loaded through ``Linear.weight_loader`` (``tp_dim``/``tp_rank``/``tp_size``), so a
rank never holds more of a weight than its share.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from minillm.layers.linear import Linear


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the ranks, in place (a no-op outside a process group of size > 1)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(x)
    return x


class ParallelSwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with gate/up column-parallel and down row-parallel."""

    def __init__(self, hidden: int, intermediate: int, rank: int, world_size: int):
        super().__init__()
        if intermediate % world_size:
            raise ValueError(f"intermediate size {intermediate} does not split over {world_size} ranks")
        self.local = intermediate // world_size
        shards = {"gate": intermediate, "up": intermediate}
        self.gate_up_proj = Linear(hidden, 2 * intermediate, shards=shards, tp_dim=0, tp_rank=rank, tp_size=world_size)
        self.down_proj = Linear(intermediate, hidden, tp_dim=1, tp_rank=rank, tp_size=world_size)

    def load(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> ParallelSwiGLU:
        """Take this rank's slices of full checkpoint matrices."""
        self.gate_up_proj.weight_loader("weight", gate, "gate")
        self.gate_up_proj.weight_loader("weight", up, "up")
        self.down_proj.weight_loader("weight", down)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.local, dim=-1)
        return all_reduce(self.down_proj(F.silu(gate) * up))


def kv_heads_of_rank(num_heads: int, num_kv_heads: int, rank: int, world_size: int) -> list[int]:
    """The K/V heads rank ``rank`` holds under tensor parallelism.

    With at least as many K/V heads as ranks, each rank holds its own ``kv / tp`` of them. With
    fewer (SmolLM2: 3 K/V heads; TP = 6), each rank holds one, **replicated** on ``tp / kv``
    ranks: a rank's query heads all read the same K/V head, so it needs that head's full K/V —
    memory for K/V stops shrinking once every rank holds a single head.
    """
    if num_heads % world_size:
        raise ValueError(f"{num_heads} query heads do not split over {world_size} ranks")
    if num_kv_heads >= world_size:
        if num_kv_heads % world_size:
            raise ValueError(f"{num_kv_heads} K/V heads do not split over {world_size} ranks")
        per = num_kv_heads // world_size
        return list(range(rank * per, (rank + 1) * per))
    if world_size % num_kv_heads:
        raise ValueError(f"{world_size} ranks are not a multiple of {num_kv_heads} K/V heads (for replication)")
    return [rank // (world_size // num_kv_heads)]


class ParallelAttention(nn.Module):
    """Causal self-attention (GQA) with the query heads split across ranks and the K/V heads
    split or replicated (``kv_heads_of_rank``); row-parallel output projection + all-reduce.
    No KV cache: the head bookkeeping of TP, on a whole sequence."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, rank: int, world_size: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.local_heads = heads // world_size
        self.q_heads = list(range(rank * self.local_heads, (rank + 1) * self.local_heads))
        self.kv = kv_heads_of_rank(heads, kv_heads, rank, world_size)
        self.q_proj = nn.Linear(hidden, self.local_heads * head_dim, bias=False)
        self.kv_proj = nn.Linear(hidden, 2 * len(self.kv) * head_dim, bias=False)
        self.o_proj = nn.Linear(self.local_heads * head_dim, hidden, bias=False)

    def load(self, wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor, wo: torch.Tensor) -> ParallelAttention:
        """This rank's rows of q/k/v (by head) and columns of o from full checkpoint matrices."""
        d = self.head_dim

        def rows(w, heads):
            return torch.cat([w[h * d : (h + 1) * d] for h in heads])

        with torch.no_grad():
            self.q_proj.weight.copy_(rows(wq, self.q_heads))
            self.kv_proj.weight.copy_(torch.cat([rows(wk, self.kv), rows(wv, self.kv)]))
            self.o_proj.weight.copy_(torch.cat([wo[:, h * d : (h + 1) * d] for h in self.q_heads], dim=1))
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t, d = x.shape[0], self.head_dim
        q = self.q_proj(x).view(t, self.local_heads, d).transpose(0, 1)
        k, v = self.kv_proj(x).view(t, 2 * len(self.kv), d).transpose(0, 1).split(len(self.kv))
        group = self.heads // self.kv_heads  # query heads per K/V head, in the whole model
        index = torch.tensor([self.kv.index(h // group) for h in self.q_heads])  # each local q head's K/V
        out = F.scaled_dot_product_attention(q, k[index], v[index], is_causal=True)
        return all_reduce(self.o_proj(out.transpose(0, 1).reshape(t, self.local_heads * d)))


class VocabParallelEmbedding(nn.Module):
    """The embedding table split by vocabulary rows: each rank looks up the ids in its range,
    zeros the rest, and an all-reduce sums the ranks' rows. As the LM head (tied or not) the
    same shard gives this rank's slice of the logits, gathered across ranks."""

    def __init__(self, vocab: int, hidden: int, rank: int, world_size: int):
        super().__init__()
        if vocab % world_size:
            raise ValueError(f"vocabulary {vocab} does not split over {world_size} ranks")
        self.per, self.start, self.world_size = vocab // world_size, rank * (vocab // world_size), world_size
        self.weight = nn.Parameter(torch.empty(self.per, hidden), requires_grad=False)

    def load(self, full: torch.Tensor) -> VocabParallelEmbedding:
        with torch.no_grad():
            self.weight.copy_(full[self.start : self.start + self.per])
        return self

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        mine = (local >= 0) & (local < self.per)
        out = F.embedding(local.clamp(0, self.per - 1), self.weight) * mine.unsqueeze(-1)
        return all_reduce(out)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        local = F.linear(hidden, self.weight)
        if self.world_size == 1 or not dist.is_initialized():
            return local
        parts = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(parts, local.contiguous())
        return torch.cat(parts, dim=-1)
