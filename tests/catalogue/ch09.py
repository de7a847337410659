"""Chapter 09, parallelism: the answers its exercises' checks are tested against (see
``catalogue/__init__.py``)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from catalogue.answers import Answers

ANSWERS = Answers()
right, wrong = ANSWERS.right, ANSWERS.wrong


# ---- 09: parallelism -------------------------------------------------------------------------------
# The ranks run an answer from its source (a notebook's function cannot be pickled into a spawned
# process), so the tensor-parallel answers are self-contained module-level defs: no lambdas, no helpers.


def tp_mlp(x, gate, up, down, rank, world_size):
    """The reference: rows of gate/up and the same columns of down, then one all-reduce."""
    per = gate.shape[0] // world_size
    mine = slice(rank * per, (rank + 1) * per)
    out = (F.silu(x @ gate[mine].T) * (x @ up[mine].T)) @ down[:, mine].T
    dist.all_reduce(out)
    return out


def tp_mlp_chunks(x, gate, up, down, rank, world_size):
    """Independent: chunk/F.linear, the collective spelled out in full."""
    g, u = gate.chunk(world_size, dim=0)[rank], up.chunk(world_size, dim=0)[rank]
    partial = F.linear(F.silu(F.linear(x, g)) * F.linear(x, u), down.chunk(world_size, dim=1)[rank])
    torch.distributed.all_reduce(partial, op=torch.distributed.ReduceOp.SUM)
    return partial


def tp_mlp_whole(x, gate, up, down, rank, world_size):
    return (F.silu(x @ gate.T) * (x @ up.T)) @ down.T


def tp_mlp_no_reduce(x, gate, up, down, rank, world_size):
    per = gate.shape[0] // world_size
    mine = slice(rank * per, (rank + 1) * per)
    return (F.silu(x @ gate[mine].T) * (x @ up[mine].T)) @ down[:, mine].T


def tp_mlp_reduce_intermediate(x, gate, up, down, rank, world_size):
    per = gate.shape[0] // world_size
    mine = slice(rank * per, (rank + 1) * per)
    h = F.silu(x @ gate[mine].T) * (x @ up[mine].T)
    dist.all_reduce(h)
    return h @ down[:, mine].T


def tp_mlp_unpaired(x, gate, up, down, rank, world_size):
    per = gate.shape[0] // world_size
    mine = slice(rank * per, (rank + 1) * per)
    out = (F.silu(x @ gate[mine].T) * (x @ up[rank::world_size].T)) @ down[:, mine].T
    dist.all_reduce(out)
    return out


def tp_mlp_down_rows(x, gate, up, down, rank, world_size):
    per = gate.shape[0] // world_size
    mine = slice(rank * per, (rank + 1) * per)
    out = (F.silu(x @ gate[mine].T) * (x @ up[mine].T)) @ down[mine].T
    dist.all_reduce(out)
    return out


def tp_mlp_two_reduces(x, gate, up, down, rank, world_size):
    per = gate.shape[0] // world_size
    mine = slice(rank * per, (rank + 1) * per)
    out = (F.silu(x @ gate[mine].T) * (x @ up[mine].T)) @ down[:, mine].T
    dist.all_reduce(out)
    dist.all_reduce(out)
    return out


def tp_mlp_rank0_only(x, gate, up, down, rank, world_size):
    per = gate.shape[0] // world_size
    mine = slice(rank * per, (rank + 1) * per)
    out = (F.silu(x @ gate[mine].T) * (x @ up[mine].T)) @ down[:, mine].T
    dist.all_reduce(out)
    return out if rank == 0 else None


def tp_mlp_reduce_on_rank0(x, gate, up, down, rank, world_size):
    per = gate.shape[0] // world_size
    mine = slice(rank * per, (rank + 1) * per)
    out = (F.silu(x @ gate[mine].T) * (x @ up[mine].T)) @ down[:, mine].T
    if rank == 0:
        dist.all_reduce(out)
    return out


def tp_mlp_helper(x, gate, up, down, rank, world_size):
    return tp_mlp(x, gate, up, down, rank, world_size)  # fine in the notebook, undefined on the ranks


def tp_mlp_full_weights_reduced(x, gate, up, down, rank, world_size):
    out = (F.silu(x @ gate.T) * (x @ up.T)) @ down.T
    dist.all_reduce(out)
    return out


def tp_mlp_divided(x, gate, up, down, rank, world_size):
    per = gate.shape[0] // world_size
    mine = slice(rank * per, (rank + 1) * per)
    out = (F.silu(x @ gate[mine].T) * (x @ up[mine].T)) @ down[:, mine].T
    dist.all_reduce(out)
    out /= world_size  # "the average over the ranks"
    return out


def tp_mlp_reduce_not_all(x, gate, up, down, rank, world_size):
    per = gate.shape[0] // world_size
    mine = slice(rank * per, (rank + 1) * per)
    out = (F.silu(x @ gate[mine].T) * (x @ up[mine].T)) @ down[:, mine].T
    dist.reduce(out, dst=0)  # the sum lands on rank 0 only
    return out


TM = "check_tp_mlp"
right(TM, tp_mlp)
right(TM, tp_mlp_chunks)
wrong(TM, "each rank computed the whole MLP: no communication", tp_mlp_whole)
wrong(TM, "rank outputs are partial sums", tp_mlp_no_reduce)
wrong(TM, "the intermediate activation, before the down projection", tp_mlp_reduce_intermediate)
wrong(TM, "the slices do not pair", tp_mlp_unpaired)
wrong(TM, "the matching columns down[:, lo:hi]", tp_mlp_down_rows)
wrong(TM, "called all_reduce [2, 2] times", tp_mlp_two_reduces)
wrong(TM, "rank 1 returned None: every rank must return", tp_mlp_rank0_only)
wrong(TM, "the output is 2× the MLP's", tp_mlp_full_weights_reduced)
wrong(TM, "waited in a collective the other ranks never joined", tp_mlp_reduce_on_rank0)
wrong(TM, "define helpers and imports inside it", tp_mlp_helper)
wrong(TM, "not a lambda", lambda x, gate, up, down, rank, world_size: x)
wrong(
    TM,
    "the all-reduce already sums the partial outputs into the full output; dividing by world_size averages them",
    tp_mlp_divided,
)
wrong(TM, "reduce leaves the sum on rank 0 only; every rank needs the full output", tp_mlp_reduce_not_all)


def heads_of_rank(num_heads, num_kv_heads, rank, tp_size):
    """The reference: deal whole groups, or replicate each K/V head and share its query heads."""
    group = num_heads // num_kv_heads
    if num_kv_heads >= tp_size:
        base, extra = divmod(num_kv_heads, tp_size)
        first = rank * base + min(rank, extra)
        kv = range(first, first + base + (rank < extra))
        return range(kv.start * group, kv.stop * group), kv
    replicas = tp_size // num_kv_heads
    if tp_size % num_kv_heads or group % replicas:
        raise ValueError(f"{tp_size} ranks cannot share {num_kv_heads} K/V heads of {group} query heads equally")
    kv_head, share = divmod(rank, replicas)
    per = group // replicas
    return range(kv_head * group + share * per, kv_head * group + (share + 1) * per), range(kv_head, kv_head + 1)


def heads_of_rank_lists(num_heads, num_kv_heads, rank, tp_size):
    """Independent: lists, built by walking the K/V heads (the larger shares last)."""
    group = num_heads // num_kv_heads
    if num_kv_heads < tp_size:
        copies, left = divmod(tp_size, num_kv_heads)
        if left or group % copies:
            raise ValueError("the query heads of a K/V head do not split evenly over its copies")
        kv = rank // copies
        q = [kv * group + i for i in range(group) if i * copies // group == rank % copies]
        return q, [kv]
    owner = [(k * tp_size) // num_kv_heads for k in range(num_kv_heads)]
    kv = [k for k in range(num_kv_heads) if owner[k] == rank]
    return [h for k in kv for h in range(k * group, (k + 1) * group)], kv


def heads_of_rank_ignoring_groups(num_heads, num_kv_heads, rank, tp_size):
    q_per, kv_per = num_heads // tp_size, max(1, num_kv_heads // tp_size)
    return range(rank * q_per, (rank + 1) * q_per), range(rank * kv_per, (rank + 1) * kv_per)


def heads_of_rank_no_replication(num_heads, num_kv_heads, rank, tp_size):
    group = num_heads // num_kv_heads
    kv = range(rank * num_kv_heads // tp_size, (rank + 1) * num_kv_heads // tp_size)
    return range(kv.start * group, kv.stop * group), kv


def heads_of_rank_query_split(num_heads, num_kv_heads, rank, tp_size):
    group = num_heads // num_kv_heads
    base, extra = divmod(num_heads, tp_size)
    first = rank * base + min(rank, extra)
    q = range(first, first + base + (rank < extra))
    return q, range(q.start // group, (q.stop - 1) // group + 1)


def heads_of_rank_whole_group_copies(num_heads, num_kv_heads, rank, tp_size):
    group = num_heads // num_kv_heads
    if num_kv_heads >= tp_size:
        return heads_of_rank(num_heads, num_kv_heads, rank, tp_size)
    kv = rank // (tp_size // num_kv_heads)
    return range(kv * group, (kv + 1) * group), range(kv, kv + 1)


def heads_of_rank_never_raises(num_heads, num_kv_heads, rank, tp_size):
    group = num_heads // num_kv_heads
    if num_kv_heads >= tp_size:
        return heads_of_rank(num_heads, num_kv_heads, rank, tp_size)
    replicas = tp_size // num_kv_heads
    kv_head, share = divmod(rank, replicas)
    per = max(1, group // replicas)
    return range(kv_head * group + share * per, kv_head * group + (share + 1) * per), range(kv_head, kv_head + 1)


def heads_of_rank_rest_to_last(num_heads, num_kv_heads, rank, tp_size):
    group = num_heads // num_kv_heads
    if num_kv_heads < tp_size:
        return heads_of_rank(num_heads, num_kv_heads, rank, tp_size)
    per = num_kv_heads // tp_size
    kv = range(rank * per, num_kv_heads if rank == tp_size - 1 else (rank + 1) * per)
    return range(kv.start * group, kv.stop * group), kv


def heads_of_rank_extra_to_last(num_heads, num_kv_heads, rank, tp_size):
    """Deals whole groups evenly, but the extra ones go to the last ranks."""
    group = num_heads // num_kv_heads
    if num_kv_heads < tp_size:
        return heads_of_rank(num_heads, num_kv_heads, rank, tp_size)
    base, extra = divmod(num_kv_heads, tp_size)
    start = rank * base + max(0, rank - (tp_size - extra))
    kv = range(start, start + base + (rank >= tp_size - extra))
    return range(kv.start * group, kv.stop * group), kv


def heads_of_rank_interleaved(num_heads, num_kv_heads, rank, tp_size):
    group = num_heads // num_kv_heads
    kv = list(range(rank, num_kv_heads, tp_size)) if num_kv_heads >= tp_size else [rank % num_kv_heads]
    return [h for k in kv for h in range(k * group, (k + 1) * group)], kv


def heads_of_rank_query_heads_only(num_heads, num_kv_heads, rank, tp_size):
    return list(range(num_heads))


KH = "check_kv_heads"
right(KH, heads_of_rank)
right(KH, heads_of_rank_lists)
wrong(KH, "query head 3 reads K/V head 1, which rank 0 does not hold", heads_of_rank_ignoring_groups)
wrong(KH, "holds no K/V head", heads_of_rank_no_replication)
wrong(KH, "serve [3, 2] query heads", heads_of_rank_query_split)
wrong(KH, "query head 0 is on ranks [0, 1]", heads_of_rank_whole_group_copies)
wrong(KH, "instead of raising ValueError", heads_of_rank_never_raises)
wrong(KH, "deal whole groups as evenly as possible", heads_of_rank_rest_to_last)
wrong(KH, "are not consecutive", heads_of_rank_interleaved)
wrong(KH, "gives the 1 extra group to the first ranks: [2, 1]", heads_of_rank_extra_to_last)
wrong(KH, "return two ranges", heads_of_rank_query_heads_only)
wrong(KH, "not a lambda", lambda num_heads, num_kv_heads, rank, tp_size: (range(num_heads), range(num_kv_heads)))


def prefix_rule(matched_blocks, load, max_imbalance):
    """The reference: most matched blocks among the replicas near the lightest; ties least loaded, then lowest."""
    lightest = min(load)
    eligible = [r for r in range(len(load)) if load[r] - lightest <= max_imbalance]
    return max(eligible, key=lambda r: (matched_blocks[r], -load[r], -r))


def prefix_rule_loop(matched_blocks, load, max_imbalance):
    """Independent: one pass, keeping the best so far."""
    best = None
    for r, (matched, busy) in enumerate(zip(matched_blocks, load)):
        if busy > min(load) + max_imbalance:
            continue
        if best is None or matched > matched_blocks[best] or (matched == matched_blocks[best] and busy < load[best]):
            best = r
    return best


def prefix_rule_busiest_on_ties(matched_blocks, load, max_imbalance):
    eligible = [r for r in range(len(load)) if load[r] <= min(load) + max_imbalance]
    return max(eligible, key=lambda r: (matched_blocks[r], load[r]))  # new prefixes pile onto the busiest


def _round_robin_rule():
    turn = itertools.count()
    return lambda matched_blocks, load, max_imbalance: next(turn) % len(load)


PR = "check_prefix_rule"
right(PR, prefix_rule)
right(PR, prefix_rule_loop)
wrong(PR, "within the cap", _round_robin_rule())
wrong(PR, "within the cap", lambda m, load, k: load.index(min(load)))
wrong(PR, "nothing matches: the least loaded", lambda m, load, k: m.index(max(m)))
wrong(PR, "within the cap", lambda m, load, k: m.index(min(m)))
wrong(PR, "within the cap", lambda m, load, k: load.index(max(load)))
wrong(PR, "nothing matches: the least loaded", prefix_rule_busiest_on_ties)
wrong(PR, "not a float", lambda m, load, k: float(prefix_rule(m, load, k)))


def prefix_rule_absolute_cap(matched_blocks, load, max_imbalance):
    """Forgot to subtract the lightest replica's load (falls back to every replica when none fits)."""
    eligible = [r for r in range(len(load)) if load[r] <= max_imbalance] or list(range(len(load)))
    return max(eligible, key=lambda r: (matched_blocks[r], -load[r], -r))


def prefix_rule_absolute_cap_no_fallback(matched_blocks, load, max_imbalance):
    eligible = [r for r in range(len(load)) if load[r] <= max_imbalance]
    return max(eligible, key=lambda r: (matched_blocks[r], -load[r], -r))


def prefix_rule_ties_to_highest(matched_blocks, load, max_imbalance):
    lightest = min(load)
    eligible = [r for r in range(len(load)) if load[r] - lightest <= max_imbalance]
    return max(eligible, key=lambda r: (matched_blocks[r], -load[r], r))


wrong(PR, "you capped load[r] itself", prefix_rule_absolute_cap)
wrong(PR, "you capped load[r] itself", prefix_rule_absolute_cap_no_fallback)
wrong(PR, "the lowest index on ties", prefix_rule_ties_to_highest)
wrong(PR, "numpy integer", lambda m, load, k: np.argmax(m))
wrong(PR, "expected a replica index in [0, 4)", lambda m, load, k: prefix_rule(m, load, k) + 1)


# ---- ch09: more wrong answers a learner writes


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


# ---- Chapter 09's tensor-parallel attention (``check_tp_attention``): module-level defs using only
# torch, F, dist and math (the ranks run them from their source), right ones written independently
# and the wrong ones a learner writes, one slip each.


TA = "check_tp_attention"


def tp_attention_sdpa(x, positions, wq, wk, wv, wo, num_heads, num_kv_heads, rope_theta, rank, world_size):
    """PyTorch's fused attention with its own GQA and causal mask."""
    d = wq.shape[0] // num_heads
    nq, nkv = num_heads // world_size, num_kv_heads // world_size
    q = (x @ wq[rank * nq * d : (rank + 1) * nq * d].T).unflatten(-1, (nq, d)).transpose(0, 1)
    k = (x @ wk[rank * nkv * d : (rank + 1) * nkv * d].T).unflatten(-1, (nkv, d)).transpose(0, 1)
    v = (x @ wv[rank * nkv * d : (rank + 1) * nkv * d].T).unflatten(-1, (nkv, d)).transpose(0, 1)
    ang = positions.float()[:, None] * rope_theta ** (-torch.arange(0, q.shape[-1], 2).float() / q.shape[-1])
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    q = q * cos + torch.cat([-q[..., q.shape[-1] // 2 :], q[..., : q.shape[-1] // 2]], -1) * sin
    k = k * cos + torch.cat([-k[..., k.shape[-1] // 2 :], k[..., : k.shape[-1] // 2]], -1) * sin
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    partial = o.transpose(0, 1).flatten(1) @ wo[:, rank * nq * d : (rank + 1) * nq * d].T
    dist.all_reduce(partial)
    return partial


def tp_attention_head_loop(x, positions, wq, wk, wv, wo, num_heads, num_kv_heads, rope_theta, rank, world_size):
    """One head at a time, the K/V head looked up by index, RoPE as complex multiplication."""
    dim = wq.shape[0] // num_heads
    group = num_heads // num_kv_heads
    kv_mine = range(rank * num_kv_heads // world_size, (rank + 1) * num_kv_heads // world_size)
    q_mine = range(kv_mine.start * group, kv_mine.stop * group)
    t = x.shape[0]
    causal = torch.full((t, t), float("-inf")).triu(1)
    out = torch.zeros(t, wo.shape[0])
    turn = torch.polar(torch.ones(t, dim // 2, dtype=torch.float64), positions[:, None].double() * rope_theta ** (
        -2.0 * torch.arange(dim // 2).double() / dim)).to(torch.complex64)  # e^(i·angle) per (row, pair)

    def rotate(z):  # pair (j, j + dim/2) as one complex number, turned by multiplication
        turned = torch.complex(z[:, : dim // 2], z[:, dim // 2 :]) * turn
        return torch.cat([turned.real, turned.imag], dim=-1)

    for h in q_mine:
        kvh = h // group
        q = rotate(x @ wq[h * dim : (h + 1) * dim].T)
        k = rotate(x @ wk[kvh * dim : (kvh + 1) * dim].T)
        v = x @ wv[kvh * dim : (kvh + 1) * dim].T
        weights = torch.softmax(q @ k.T / math.sqrt(dim) + causal, dim=-1)
        out += (weights @ v) @ wo[:, h * dim : (h + 1) * dim].T
    dist.all_reduce(out)
    return out


right(TA, tp_attention_sdpa)
right(TA, tp_attention_head_loop)


def tp_attention_returns_all_reduce(x, positions, wq, wk, wv, wo, num_heads, num_kv_heads, rope_theta, rank, world_size):
    d = wq.shape[0] // num_heads
    nq, nkv = num_heads // world_size, num_kv_heads // world_size
    q = (x @ wq[rank * nq * d : (rank + 1) * nq * d].T).unflatten(-1, (nq, d)).transpose(0, 1)
    k = (x @ wk[rank * nkv * d : (rank + 1) * nkv * d].T).unflatten(-1, (nkv, d)).transpose(0, 1)
    v = (x @ wv[rank * nkv * d : (rank + 1) * nkv * d].T).unflatten(-1, (nkv, d)).transpose(0, 1)
    ang = positions.float()[:, None] * rope_theta ** (-torch.arange(0, q.shape[-1], 2).float() / q.shape[-1])
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    q = q * cos + torch.cat([-q[..., q.shape[-1] // 2 :], q[..., : q.shape[-1] // 2]], -1) * sin
    k = k * cos + torch.cat([-k[..., k.shape[-1] // 2 :], k[..., : k.shape[-1] // 2]], -1) * sin
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return dist.all_reduce(o.transpose(0, 1).flatten(1) @ wo[:, rank * nq * d : (rank + 1) * nq * d].T)


def tp_attention_averaged(x, positions, wq, wk, wv, wo, num_heads, num_kv_heads, rope_theta, rank, world_size):
    d = wq.shape[0] // num_heads
    nq, nkv = num_heads // world_size, num_kv_heads // world_size
    q = (x @ wq[rank * nq * d : (rank + 1) * nq * d].T).unflatten(-1, (nq, d)).transpose(0, 1)
    k = (x @ wk[rank * nkv * d : (rank + 1) * nkv * d].T).unflatten(-1, (nkv, d)).transpose(0, 1)
    v = (x @ wv[rank * nkv * d : (rank + 1) * nkv * d].T).unflatten(-1, (nkv, d)).transpose(0, 1)
    ang = positions.float()[:, None] * rope_theta ** (-torch.arange(0, q.shape[-1], 2).float() / q.shape[-1])
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    q = q * cos + torch.cat([-q[..., q.shape[-1] // 2 :], q[..., : q.shape[-1] // 2]], -1) * sin
    k = k * cos + torch.cat([-k[..., k.shape[-1] // 2 :], k[..., : k.shape[-1] // 2]], -1) * sin
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    out = o.transpose(0, 1).flatten(1) @ wo[:, rank * nq * d : (rank + 1) * nq * d].T
    dist.all_reduce(out)
    return out / world_size  # "the mean of the ranks"


def tp_attention_no_all_reduce(x, positions, wq, wk, wv, wo, num_heads, num_kv_heads, rope_theta, rank, world_size):
    d = wq.shape[0] // num_heads
    nq, nkv = num_heads // world_size, num_kv_heads // world_size
    q = (x @ wq[rank * nq * d : (rank + 1) * nq * d].T).unflatten(-1, (nq, d)).transpose(0, 1)
    k = (x @ wk[rank * nkv * d : (rank + 1) * nkv * d].T).unflatten(-1, (nkv, d)).transpose(0, 1)
    v = (x @ wv[rank * nkv * d : (rank + 1) * nkv * d].T).unflatten(-1, (nkv, d)).transpose(0, 1)
    ang = positions.float()[:, None] * rope_theta ** (-torch.arange(0, q.shape[-1], 2).float() / q.shape[-1])
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    q = q * cos + torch.cat([-q[..., q.shape[-1] // 2 :], q[..., : q.shape[-1] // 2]], -1) * sin
    k = k * cos + torch.cat([-k[..., k.shape[-1] // 2 :], k[..., : k.shape[-1] // 2]], -1) * sin
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return o.transpose(0, 1).flatten(1) @ wo[:, rank * nq * d : (rank + 1) * nq * d].T


def tp_attention_every_head(x, positions, wq, wk, wv, wo, num_heads, num_kv_heads, rope_theta, rank, world_size):
    d = wq.shape[0] // num_heads
    q = (x @ wq.T).unflatten(-1, (num_heads, d)).transpose(0, 1)
    k = (x @ wk.T).unflatten(-1, (num_kv_heads, d)).transpose(0, 1)
    v = (x @ wv.T).unflatten(-1, (num_kv_heads, d)).transpose(0, 1)
    ang = positions.float()[:, None] * rope_theta ** (-torch.arange(0, q.shape[-1], 2).float() / q.shape[-1])
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    q = q * cos + torch.cat([-q[..., q.shape[-1] // 2 :], q[..., : q.shape[-1] // 2]], -1) * sin
    k = k * cos + torch.cat([-k[..., k.shape[-1] // 2 :], k[..., : k.shape[-1] // 2]], -1) * sin
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    out = o.transpose(0, 1).flatten(1) @ wo.T
    dist.all_reduce(out)  # every rank computed everything: the sum is world_size copies
    return out


def tp_attention_unsharded(x, positions, wq, wk, wv, wo, num_heads, num_kv_heads, rope_theta, rank, world_size):
    d = wq.shape[0] // num_heads
    q = (x @ wq.T).unflatten(-1, (num_heads, d)).transpose(0, 1)
    k = (x @ wk.T).unflatten(-1, (num_kv_heads, d)).transpose(0, 1)
    v = (x @ wv.T).unflatten(-1, (num_kv_heads, d)).transpose(0, 1)
    ang = positions.float()[:, None] * rope_theta ** (-torch.arange(0, q.shape[-1], 2).float() / q.shape[-1])
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    q = q * cos + torch.cat([-q[..., q.shape[-1] // 2 :], q[..., : q.shape[-1] // 2]], -1) * sin
    k = k * cos + torch.cat([-k[..., k.shape[-1] // 2 :], k[..., : k.shape[-1] // 2]], -1) * sin
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return o.transpose(0, 1).flatten(1) @ wo.T  # right, and no parallelism at all


def tp_attention_not_causal(x, positions, wq, wk, wv, wo, num_heads, num_kv_heads, rope_theta, rank, world_size):
    d = wq.shape[0] // num_heads
    nq, nkv = num_heads // world_size, num_kv_heads // world_size
    q = (x @ wq[rank * nq * d : (rank + 1) * nq * d].T).unflatten(-1, (nq, d)).transpose(0, 1)
    k = (x @ wk[rank * nkv * d : (rank + 1) * nkv * d].T).unflatten(-1, (nkv, d)).transpose(0, 1)
    v = (x @ wv[rank * nkv * d : (rank + 1) * nkv * d].T).unflatten(-1, (nkv, d)).transpose(0, 1)
    ang = positions.float()[:, None] * rope_theta ** (-torch.arange(0, q.shape[-1], 2).float() / q.shape[-1])
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    q = q * cos + torch.cat([-q[..., q.shape[-1] // 2 :], q[..., : q.shape[-1] // 2]], -1) * sin
    k = k * cos + torch.cat([-k[..., k.shape[-1] // 2 :], k[..., : k.shape[-1] // 2]], -1) * sin
    o = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # forgets is_causal
    out = o.transpose(0, 1).flatten(1) @ wo[:, rank * nq * d : (rank + 1) * nq * d].T
    dist.all_reduce(out)
    return out


def tp_attention_unscaled(x, positions, wq, wk, wv, wo, num_heads, num_kv_heads, rope_theta, rank, world_size):
    d = wq.shape[0] // num_heads
    nq, nkv = num_heads // world_size, num_kv_heads // world_size
    q = (x @ wq[rank * nq * d : (rank + 1) * nq * d].T).unflatten(-1, (nq, d)).transpose(0, 1)
    k = (x @ wk[rank * nkv * d : (rank + 1) * nkv * d].T).unflatten(-1, (nkv, d)).transpose(0, 1)
    v = (x @ wv[rank * nkv * d : (rank + 1) * nkv * d].T).unflatten(-1, (nkv, d)).transpose(0, 1)
    ang = positions.float()[:, None] * rope_theta ** (-torch.arange(0, q.shape[-1], 2).float() / q.shape[-1])
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    q = q * cos + torch.cat([-q[..., q.shape[-1] // 2 :], q[..., : q.shape[-1] // 2]], -1) * sin
    k = k * cos + torch.cat([-k[..., k.shape[-1] // 2 :], k[..., : k.shape[-1] // 2]], -1) * sin
    k, v = k.repeat_interleave(nq // nkv, 0), v.repeat_interleave(nq // nkv, 0)
    t = x.shape[0]
    scores = (q @ k.transpose(1, 2)).masked_fill(torch.ones(t, t).triu(1).bool(), float("-inf"))  # no 1/sqrt(d)
    out = (scores.softmax(-1) @ v).transpose(0, 1).flatten(1) @ wo[:, rank * nq * d : (rank + 1) * nq * d].T
    dist.all_reduce(out)
    return out


def tp_attention_repeat(x, positions, wq, wk, wv, wo, num_heads, num_kv_heads, rope_theta, rank, world_size):
    d = wq.shape[0] // num_heads
    nq, nkv = num_heads // world_size, num_kv_heads // world_size
    q = (x @ wq[rank * nq * d : (rank + 1) * nq * d].T).unflatten(-1, (nq, d)).transpose(0, 1)
    k = (x @ wk[rank * nkv * d : (rank + 1) * nkv * d].T).unflatten(-1, (nkv, d)).transpose(0, 1)
    v = (x @ wv[rank * nkv * d : (rank + 1) * nkv * d].T).unflatten(-1, (nkv, d)).transpose(0, 1)
    ang = positions.float()[:, None] * rope_theta ** (-torch.arange(0, q.shape[-1], 2).float() / q.shape[-1])
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    q = q * cos + torch.cat([-q[..., q.shape[-1] // 2 :], q[..., : q.shape[-1] // 2]], -1) * sin
    k = k * cos + torch.cat([-k[..., k.shape[-1] // 2 :], k[..., : k.shape[-1] // 2]], -1) * sin
    k, v = k.repeat(nq // nkv, 1, 1), v.repeat(nq // nkv, 1, 1)  # heads 0,1,0,1 where 0,0,1,1 was meant
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    out = o.transpose(0, 1).flatten(1) @ wo[:, rank * nq * d : (rank + 1) * nq * d].T
    dist.all_reduce(out)
    return out


def tp_attention_reduce_before_o(x, positions, wq, wk, wv, wo, num_heads, num_kv_heads, rope_theta, rank, world_size):
    d = wq.shape[0] // num_heads
    nq, nkv = num_heads // world_size, num_kv_heads // world_size
    q = (x @ wq[rank * nq * d : (rank + 1) * nq * d].T).unflatten(-1, (nq, d)).transpose(0, 1)
    k = (x @ wk[rank * nkv * d : (rank + 1) * nkv * d].T).unflatten(-1, (nkv, d)).transpose(0, 1)
    v = (x @ wv[rank * nkv * d : (rank + 1) * nkv * d].T).unflatten(-1, (nkv, d)).transpose(0, 1)
    ang = positions.float()[:, None] * rope_theta ** (-torch.arange(0, q.shape[-1], 2).float() / q.shape[-1])
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    q = q * cos + torch.cat([-q[..., q.shape[-1] // 2 :], q[..., : q.shape[-1] // 2]], -1) * sin
    k = k * cos + torch.cat([-k[..., k.shape[-1] // 2 :], k[..., : k.shape[-1] // 2]], -1) * sin
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).transpose(0, 1).flatten(1)
    dist.all_reduce(o)  # the heads' outputs summed: different heads added together
    return o @ wo[:, rank * nq * d : (rank + 1) * nq * d].T


def tp_attention_kv_rows_of_q(x, positions, wq, wk, wv, wo, num_heads, num_kv_heads, rope_theta, rank, world_size):
    d = wq.shape[0] // num_heads
    nq = num_heads // world_size
    mine = slice(rank * nq * d, (rank + 1) * nq * d)  # the same rows for q, k and v
    q = (x @ wq[mine].T).unflatten(-1, (nq, d)).transpose(0, 1)
    k = (x @ wk[mine].T).unflatten(-1, (-1, d)).transpose(0, 1)
    v = (x @ wv[mine].T).unflatten(-1, (-1, d)).transpose(0, 1)
    ang = positions.float()[:, None] * rope_theta ** (-torch.arange(0, q.shape[-1], 2).float() / q.shape[-1])
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    q = q * cos + torch.cat([-q[..., q.shape[-1] // 2 :], q[..., : q.shape[-1] // 2]], -1) * sin
    k = k * cos + torch.cat([-k[..., k.shape[-1] // 2 :], k[..., : k.shape[-1] // 2]], -1) * sin
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    out = o.transpose(0, 1).flatten(1) @ wo[:, mine].T
    dist.all_reduce(out)
    return out


def tp_attention_wo_rows(x, positions, wq, wk, wv, wo, num_heads, num_kv_heads, rope_theta, rank, world_size):
    d = wq.shape[0] // num_heads
    nq, nkv = num_heads // world_size, num_kv_heads // world_size
    q = (x @ wq[rank * nq * d : (rank + 1) * nq * d].T).unflatten(-1, (nq, d)).transpose(0, 1)
    k = (x @ wk[rank * nkv * d : (rank + 1) * nkv * d].T).unflatten(-1, (nkv, d)).transpose(0, 1)
    v = (x @ wv[rank * nkv * d : (rank + 1) * nkv * d].T).unflatten(-1, (nkv, d)).transpose(0, 1)
    ang = positions.float()[:, None] * rope_theta ** (-torch.arange(0, q.shape[-1], 2).float() / q.shape[-1])
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    q = q * cos + torch.cat([-q[..., q.shape[-1] // 2 :], q[..., : q.shape[-1] // 2]], -1) * sin
    k = k * cos + torch.cat([-k[..., k.shape[-1] // 2 :], k[..., : k.shape[-1] // 2]], -1) * sin
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    out = o.transpose(0, 1).flatten(1) @ wo[rank * nq * d : (rank + 1) * nq * d].T  # rows of wo, not columns
    dist.all_reduce(out)
    return out


def tp_attention_twice(x, positions, wq, wk, wv, wo, num_heads, num_kv_heads, rope_theta, rank, world_size):
    d = wq.shape[0] // num_heads
    nq, nkv = num_heads // world_size, num_kv_heads // world_size
    q = (x @ wq[rank * nq * d : (rank + 1) * nq * d].T).unflatten(-1, (nq, d)).transpose(0, 1)
    k = (x @ wk[rank * nkv * d : (rank + 1) * nkv * d].T).unflatten(-1, (nkv, d)).transpose(0, 1)
    v = (x @ wv[rank * nkv * d : (rank + 1) * nkv * d].T).unflatten(-1, (nkv, d)).transpose(0, 1)
    ang = positions.float()[:, None] * rope_theta ** (-torch.arange(0, q.shape[-1], 2).float() / q.shape[-1])
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    q = q * cos + torch.cat([-q[..., q.shape[-1] // 2 :], q[..., : q.shape[-1] // 2]], -1) * sin
    k = k * cos + torch.cat([-k[..., k.shape[-1] // 2 :], k[..., : k.shape[-1] // 2]], -1) * sin
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    out = o.transpose(0, 1).flatten(1) @ wo[:, rank * nq * d : (rank + 1) * nq * d].T
    dist.all_reduce(out)
    dist.all_reduce(out)  # "to be sure every rank has it"
    return out


def tp_attention_reduce(x, positions, wq, wk, wv, wo, num_heads, num_kv_heads, rope_theta, rank, world_size):
    d = wq.shape[0] // num_heads
    nq, nkv = num_heads // world_size, num_kv_heads // world_size
    q = (x @ wq[rank * nq * d : (rank + 1) * nq * d].T).unflatten(-1, (nq, d)).transpose(0, 1)
    k = (x @ wk[rank * nkv * d : (rank + 1) * nkv * d].T).unflatten(-1, (nkv, d)).transpose(0, 1)
    v = (x @ wv[rank * nkv * d : (rank + 1) * nkv * d].T).unflatten(-1, (nkv, d)).transpose(0, 1)
    ang = positions.float()[:, None] * rope_theta ** (-torch.arange(0, q.shape[-1], 2).float() / q.shape[-1])
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    q = q * cos + torch.cat([-q[..., q.shape[-1] // 2 :], q[..., : q.shape[-1] // 2]], -1) * sin
    k = k * cos + torch.cat([-k[..., k.shape[-1] // 2 :], k[..., : k.shape[-1] // 2]], -1) * sin
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    out = o.transpose(0, 1).flatten(1) @ wo[:, rank * nq * d : (rank + 1) * nq * d].T
    dist.reduce(out, dst=0)  # the sum on rank 0 only
    return out


def tp_attention_softmax_over_queries(x, positions, wq, wk, wv, wo, num_heads, num_kv_heads, rope_theta, rank, world_size):
    d = wq.shape[0] // num_heads
    nq, nkv = num_heads // world_size, num_kv_heads // world_size
    q = (x @ wq[rank * nq * d : (rank + 1) * nq * d].T).unflatten(-1, (nq, d)).transpose(0, 1)
    k = (x @ wk[rank * nkv * d : (rank + 1) * nkv * d].T).unflatten(-1, (nkv, d)).transpose(0, 1)
    v = (x @ wv[rank * nkv * d : (rank + 1) * nkv * d].T).unflatten(-1, (nkv, d)).transpose(0, 1)
    ang = positions.float()[:, None] * rope_theta ** (-torch.arange(0, q.shape[-1], 2).float() / q.shape[-1])
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    q = q * cos + torch.cat([-q[..., q.shape[-1] // 2 :], q[..., : q.shape[-1] // 2]], -1) * sin
    k = k * cos + torch.cat([-k[..., k.shape[-1] // 2 :], k[..., : k.shape[-1] // 2]], -1) * sin
    k, v = k.repeat_interleave(nq // nkv, 0), v.repeat_interleave(nq // nkv, 0)
    t = x.shape[0]
    scores = (q @ k.transpose(1, 2) / math.sqrt(d)).masked_fill(torch.ones(t, t).triu(1).bool(), float("-inf"))
    weights = torch.nan_to_num(scores.softmax(-2))  # over the queries, not the keys
    out = (weights @ v).transpose(0, 1).flatten(1) @ wo[:, rank * nq * d : (rank + 1) * nq * d].T
    dist.all_reduce(out)
    return out


def tp_attention_strided_heads(x, positions, wq, wk, wv, wo, num_heads, num_kv_heads, rope_theta, rank, world_size):
    d = wq.shape[0] // num_heads
    heads = list(range(rank, num_heads, world_size))  # every other head: not whole groups
    kv = [h * num_kv_heads // num_heads for h in heads]
    t = x.shape[0]
    out = torch.zeros(t, wo.shape[0])
    for h, g in zip(heads, kv):
        q = x @ wq[h * d : (h + 1) * d].T
        k = x @ wk[(g // world_size) * d : (g // world_size + 1) * d].T  # its rank-local K/V head, it thinks
        v = x @ wv[(g // world_size) * d : (g // world_size + 1) * d].T
        ang = positions.float()[:, None] * rope_theta ** (-torch.arange(0, q.shape[-1], 2).float() / q.shape[-1])
        cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
        q = q * cos + torch.cat([-q[..., q.shape[-1] // 2 :], q[..., : q.shape[-1] // 2]], -1) * sin
        k = k * cos + torch.cat([-k[..., k.shape[-1] // 2 :], k[..., : k.shape[-1] // 2]], -1) * sin
        w = (q @ k.T / math.sqrt(d)).masked_fill(torch.ones(t, t).triu(1).bool(), float("-inf")).softmax(-1)
        out += (w @ v) @ wo[:, h * d : (h + 1) * d].T
    dist.all_reduce(out)
    return out


wrong(TA, "dist.all_reduce works in place and returns None", tp_attention_returns_all_reduce)
wrong(TA, "do not divide it by world_size", tp_attention_averaged)
wrong(TA, "no rank called all_reduce", tp_attention_no_all_reduce)
wrong(TA, "the output is 2× the attention's", tp_attention_every_head)
wrong(TA, "each rank computed every head", tp_attention_unsharded)
wrong(TA, "hide the keys after each query", tp_attention_not_causal)
wrong(TA, "divide them by sqrt(d)", tp_attention_unscaled)
wrong(TA, "repeat_interleave", tp_attention_repeat)
wrong(TA, "the all-reduce goes after the o projection", tp_attention_reduce_before_o)
wrong(TA, "your code raised", tp_attention_kv_rows_of_q)
wrong(TA, "your code raised", tp_attention_wo_rows)
wrong(TA, "called all_reduce [2, 2] times", tp_attention_twice)
wrong(TA, "no rank called all_reduce", tp_attention_reduce)
wrong(TA, "differs from one-process attention", tp_attention_softmax_over_queries)
wrong(TA, "differs from one-process attention", tp_attention_strided_heads)


def tp_attention_no_rope(x, positions, wq, wk, wv, wo, num_heads, num_kv_heads, rope_theta, rank, world_size):
    d = wq.shape[0] // num_heads
    nq, nkv = num_heads // world_size, num_kv_heads // world_size
    q = (x @ wq[rank * nq * d : (rank + 1) * nq * d].T).unflatten(-1, (nq, d)).transpose(0, 1)
    k = (x @ wk[rank * nkv * d : (rank + 1) * nkv * d].T).unflatten(-1, (nkv, d)).transpose(0, 1)
    v = (x @ wv[rank * nkv * d : (rank + 1) * nkv * d].T).unflatten(-1, (nkv, d)).transpose(0, 1)
    pass  # "RoPE is the model's business, not the layer's"
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    out = o.transpose(0, 1).flatten(1) @ wo[:, rank * nq * d : (rank + 1) * nq * d].T
    dist.all_reduce(out)
    return out


def tp_attention_adjacent_pairs(x, positions, wq, wk, wv, wo, num_heads, num_kv_heads, rope_theta, rank, world_size):
    d = wq.shape[0] // num_heads
    nq, nkv = num_heads // world_size, num_kv_heads // world_size
    q = (x @ wq[rank * nq * d : (rank + 1) * nq * d].T).unflatten(-1, (nq, d)).transpose(0, 1)
    k = (x @ wk[rank * nkv * d : (rank + 1) * nkv * d].T).unflatten(-1, (nkv, d)).transpose(0, 1)
    v = (x @ wv[rank * nkv * d : (rank + 1) * nkv * d].T).unflatten(-1, (nkv, d)).transpose(0, 1)
    ang = positions.float()[:, None] * rope_theta ** (-torch.arange(0, d, 2).float() / d)
    cos, sin = ang.cos(), ang.sin()
    q1, q2, k1, k2 = q[..., 0::2], q[..., 1::2], k[..., 0::2], k[..., 1::2]  # pairs (0,1), (2,3), ...
    q = torch.stack([q1 * cos - q2 * sin, q2 * cos + q1 * sin], -1).flatten(-2)
    k = torch.stack([k1 * cos - k2 * sin, k2 * cos + k1 * sin], -1).flatten(-2)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    out = o.transpose(0, 1).flatten(1) @ wo[:, rank * nq * d : (rank + 1) * nq * d].T
    dist.all_reduce(out)
    return out


def tp_attention_values_too(x, positions, wq, wk, wv, wo, num_heads, num_kv_heads, rope_theta, rank, world_size):
    d = wq.shape[0] // num_heads
    nq, nkv = num_heads // world_size, num_kv_heads // world_size
    q = (x @ wq[rank * nq * d : (rank + 1) * nq * d].T).unflatten(-1, (nq, d)).transpose(0, 1)
    k = (x @ wk[rank * nkv * d : (rank + 1) * nkv * d].T).unflatten(-1, (nkv, d)).transpose(0, 1)
    v = (x @ wv[rank * nkv * d : (rank + 1) * nkv * d].T).unflatten(-1, (nkv, d)).transpose(0, 1)
    ang = positions.float()[:, None] * rope_theta ** (-torch.arange(0, d, 2).float() / d)
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    q = q * cos + torch.cat([-q[..., d // 2 :], q[..., : d // 2]], -1) * sin
    k = k * cos + torch.cat([-k[..., d // 2 :], k[..., : d // 2]], -1) * sin
    v = v * cos + torch.cat([-v[..., d // 2 :], v[..., : d // 2]], -1) * sin  # every projection
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    out = o.transpose(0, 1).flatten(1) @ wo[:, rank * nq * d : (rank + 1) * nq * d].T
    dist.all_reduce(out)
    return out


def tp_attention_queries_only(x, positions, wq, wk, wv, wo, num_heads, num_kv_heads, rope_theta, rank, world_size):
    d = wq.shape[0] // num_heads
    nq, nkv = num_heads // world_size, num_kv_heads // world_size
    q = (x @ wq[rank * nq * d : (rank + 1) * nq * d].T).unflatten(-1, (nq, d)).transpose(0, 1)
    k = (x @ wk[rank * nkv * d : (rank + 1) * nkv * d].T).unflatten(-1, (nkv, d)).transpose(0, 1)
    v = (x @ wv[rank * nkv * d : (rank + 1) * nkv * d].T).unflatten(-1, (nkv, d)).transpose(0, 1)
    ang = positions.float()[:, None] * rope_theta ** (-torch.arange(0, d, 2).float() / d)
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    q = q * cos + torch.cat([-q[..., d // 2 :], q[..., : d // 2]], -1) * sin
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    out = o.transpose(0, 1).flatten(1) @ wo[:, rank * nq * d : (rank + 1) * nq * d].T
    dist.all_reduce(out)
    return out


def tp_attention_row_numbers(x, positions, wq, wk, wv, wo, num_heads, num_kv_heads, rope_theta, rank, world_size):
    d = wq.shape[0] // num_heads
    nq, nkv = num_heads // world_size, num_kv_heads // world_size
    q = (x @ wq[rank * nq * d : (rank + 1) * nq * d].T).unflatten(-1, (nq, d)).transpose(0, 1)
    k = (x @ wk[rank * nkv * d : (rank + 1) * nkv * d].T).unflatten(-1, (nkv, d)).transpose(0, 1)
    v = (x @ wv[rank * nkv * d : (rank + 1) * nkv * d].T).unflatten(-1, (nkv, d)).transpose(0, 1)
    ang = torch.arange(x.shape[0]).float()[:, None] * rope_theta ** (-torch.arange(0, d, 2).float() / d)
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()  # row t at position t
    q = q * cos + torch.cat([-q[..., d // 2 :], q[..., : d // 2]], -1) * sin
    k = k * cos + torch.cat([-k[..., d // 2 :], k[..., : d // 2]], -1) * sin
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    out = o.transpose(0, 1).flatten(1) @ wo[:, rank * nq * d : (rank + 1) * nq * d].T
    dist.all_reduce(out)
    return out


def tp_attention_inverted_freq(x, positions, wq, wk, wv, wo, num_heads, num_kv_heads, rope_theta, rank, world_size):
    d = wq.shape[0] // num_heads
    nq, nkv = num_heads // world_size, num_kv_heads // world_size
    q = (x @ wq[rank * nq * d : (rank + 1) * nq * d].T).unflatten(-1, (nq, d)).transpose(0, 1)
    k = (x @ wk[rank * nkv * d : (rank + 1) * nkv * d].T).unflatten(-1, (nkv, d)).transpose(0, 1)
    v = (x @ wv[rank * nkv * d : (rank + 1) * nkv * d].T).unflatten(-1, (nkv, d)).transpose(0, 1)
    ang = positions.float()[:, None] * rope_theta ** (torch.arange(0, d, 2).float() / d)  # the sign lost
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    q = q * cos + torch.cat([-q[..., d // 2 :], q[..., : d // 2]], -1) * sin
    k = k * cos + torch.cat([-k[..., d // 2 :], k[..., : d // 2]], -1) * sin
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    out = o.transpose(0, 1).flatten(1) @ wo[:, rank * nq * d : (rank + 1) * nq * d].T
    dist.all_reduce(out)
    return out


def tp_attention_sin_sign(x, positions, wq, wk, wv, wo, num_heads, num_kv_heads, rope_theta, rank, world_size):
    d = wq.shape[0] // num_heads
    nq, nkv = num_heads // world_size, num_kv_heads // world_size
    q = (x @ wq[rank * nq * d : (rank + 1) * nq * d].T).unflatten(-1, (nq, d)).transpose(0, 1)
    k = (x @ wk[rank * nkv * d : (rank + 1) * nkv * d].T).unflatten(-1, (nkv, d)).transpose(0, 1)
    v = (x @ wv[rank * nkv * d : (rank + 1) * nkv * d].T).unflatten(-1, (nkv, d)).transpose(0, 1)
    ang = positions.float()[:, None] * rope_theta ** (-torch.arange(0, d, 2).float() / d)
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    q = q * cos + torch.cat([q[..., d // 2 :], -q[..., : d // 2]], -1) * sin  # turned the other way
    k = k * cos + torch.cat([k[..., d // 2 :], -k[..., : d // 2]], -1) * sin
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    out = o.transpose(0, 1).flatten(1) @ wo[:, rank * nq * d : (rank + 1) * nq * d].T
    dist.all_reduce(out)
    return out


def tp_attention_half_table(x, positions, wq, wk, wv, wo, num_heads, num_kv_heads, rope_theta, rank, world_size):
    d = wq.shape[0] // num_heads
    nq, nkv = num_heads // world_size, num_kv_heads // world_size
    q = (x @ wq[rank * nq * d : (rank + 1) * nq * d].T).unflatten(-1, (nq, d)).transpose(0, 1)
    k = (x @ wk[rank * nkv * d : (rank + 1) * nkv * d].T).unflatten(-1, (nkv, d)).transpose(0, 1)
    v = (x @ wv[rank * nkv * d : (rank + 1) * nkv * d].T).unflatten(-1, (nkv, d)).transpose(0, 1)
    ang = positions.float()[:, None] * rope_theta ** (-torch.arange(0, d, 2).float() / d)
    cos, sin = ang.cos(), ang.sin()  # [T, d/2]: never doubled
    q = q * cos + torch.cat([-q[..., d // 2 :], q[..., : d // 2]], -1) * sin
    k = k * cos + torch.cat([-k[..., d // 2 :], k[..., : d // 2]], -1) * sin
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    out = o.transpose(0, 1).flatten(1) @ wo[:, rank * nq * d : (rank + 1) * nq * d].T
    dist.all_reduce(out)
    return out


wrong(TA, "no RoPE: rotate every query and key head", tp_attention_no_rope)
wrong(TA, "pairs dimension i with i + d/2", tp_attention_adjacent_pairs)
wrong(TA, "you rotated the values too", tp_attention_values_too)
wrong(TA, "you rotated the queries but not the keys", tp_attention_queries_only)
wrong(TA, "RoPE used the row numbers 0..T-1, not positions [3, 4, 5, 7, 8, 9]", tp_attention_row_numbers)
wrong(TA, "the frequencies are inverted", tp_attention_inverted_freq)
wrong(TA, "your RoPE turns the other way", tp_attention_sin_sign)
wrong(TA, "your code raised", tp_attention_half_table)
