"""Chapter 09's tensor-parallel attention (``check_tp_attention``): module-level defs using only
torch, F, dist and math (the ranks run them from their source), right ones written independently
and the wrong ones a learner writes, one slip each."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from check_catalogue import right, wrong

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
