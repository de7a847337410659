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
