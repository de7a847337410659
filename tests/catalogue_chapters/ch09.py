"""Chapter 09: more wrong answers a learner writes (see ``check_catalogue``)."""

from __future__ import annotations

import torch.distributed as dist
import torch.nn.functional as F
from check_catalogue import heads_of_rank, right, wrong  # noqa: F401

# ---- tp_mlp: module-level defs using only torch, F, dist, math (the ranks run them from source) ----

TM = "check_tp_mlp"


def tp_mlp_returns_all_reduce(x, gate, up, down, rank, world_size):
    per = gate.shape[0] // world_size
    mine = slice(rank * per, (rank + 1) * per)
    out = (F.silu(x @ gate[mine].T) * (x @ up[mine].T)) @ down[:, mine].T
    return dist.all_reduce(out)  # in place: returns None


def tp_mlp_averaged(x, gate, up, down, rank, world_size):
    per = gate.shape[0] // world_size
    mine = slice(rank * per, (rank + 1) * per)
    out = (F.silu(x @ gate[mine].T) * (x @ up[mine].T)) @ down[:, mine].T
    dist.all_reduce(out)
    return out / world_size  # "the mean over the ranks"


def tp_mlp_hidden_sized_slices(x, gate, up, down, rank, world_size):
    per = x.shape[-1] // world_size  # H / ws: the slices cover only H of the I neurons
    mine = slice(rank * per, (rank + 1) * per)
    out = (F.silu(x @ gate[mine].T) * (x @ up[mine].T)) @ down[:, mine].T
    dist.all_reduce(out)
    return out


wrong(TM, "dist.all_reduce works in place", tp_mlp_returns_all_reduce)
wrong(TM, "the output is 1/2 of the MLP's", tp_mlp_averaged)
wrong(TM, "intermediate neurons 0..31 only, of I = 96", tp_mlp_hidden_sized_slices)

# ---- heads_of_rank (the layout table runs in the notebook's process: these fail before any rank starts) ----

KH = "check_kv_heads"


def heads_of_rank_asserts(num_heads, num_kv_heads, rank, tp_size):
    group = num_heads // num_kv_heads
    if num_kv_heads >= tp_size:
        return heads_of_rank(num_heads, num_kv_heads, rank, tp_size)
    replicas = tp_size // num_kv_heads
    assert tp_size % num_kv_heads == 0 and group % replicas == 0, "TP size does not fit the K/V heads"
    kv_head, share = divmod(rank, replicas)
    per = group // replicas
    return range(kv_head * group + share * per, kv_head * group + (share + 1) * per), range(kv_head, kv_head + 1)


def heads_of_rank_kv_first(num_heads, num_kv_heads, rank, tp_size):
    q, kv = heads_of_rank(num_heads, num_kv_heads, rank, tp_size)
    return kv, q


def heads_of_rank_extra_le(num_heads, num_kv_heads, rank, tp_size):
    group = num_heads // num_kv_heads
    if num_kv_heads < tp_size:
        return heads_of_rank(num_heads, num_kv_heads, rank, tp_size)
    base, extra = divmod(num_kv_heads, tp_size)
    first = rank * base + min(rank, extra)
    kv = range(first, first + base + (rank <= extra))
    return range(kv.start * group, kv.stop * group), kv


def heads_of_rank_true_division(num_heads, num_kv_heads, rank, tp_size):
    group = num_heads / num_kv_heads
    base, extra = divmod(num_kv_heads, tp_size)
    first = rank * base + min(rank, extra)
    kv = range(first, first + base + (rank < extra))
    return range(kv.start * group, kv.stop * group), kv


wrong(
    KH, "raised AssertionError: TP size does not fit the K/V heads. This layout cannot be split", heads_of_rank_asserts
)
wrong(KH, "the pair is in the other order", heads_of_rank_kv_first)
wrong(
    KH,
    "more groups than its share: 3 groups over 1 rank give each rank 3, no rank gets one more",
    heads_of_rank_extra_le,
)
wrong(KH, "Use integer division, //, for heads", heads_of_rank_true_division)
