"""Chapter 02's cached model (``check_cached_model``): right answers written independently, and the
wrong ones a learner writes — each piece's slips, one at a time, the other pieces right.

An answer is ``(apply_rope, KVCache, cached_forward)``; ``forward_with(...)`` builds a cached
forward pass around the given rotation, with one slip switched on.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from check_catalogue import right, wrong

from minillm.course import forward_step, model_weights, rms_norm, rope_cos_sin

CM = "check_cached_model"


# ---- right answers --------------------------------------------------------------------------


def rope_a(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class CacheA:
    def __init__(self, num_layers, num_kv_heads, max_len, head_dim, dtype=torch.float32):
        self.k = torch.zeros(num_layers, num_kv_heads, max_len, head_dim, dtype=dtype)
        self.v = torch.zeros_like(self.k)

    def append(self, layer, start, k, v):
        end = start + k.shape[1]
        self.k[layer, :, start:end] = k
        self.v[layer, :, start:end] = v
        return self.k[layer, :, :end], self.v[layer, :, :end]


def forward_with(rope=rope_a, **slip):
    """The textbook cached step; ``slip`` switches on one learner's mistake."""

    def cached_forward(model, ids, start, cache):
        cfg = model.config
        H, KV, D, eps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps
        w = model_weights(model)
        T = len(ids)
        cos, sin = rope_cos_sin(model, start + T)
        first = 0 if slip.get("position_zero") else start
        cos, sin = cos[first : first + T], sin[first : first + T]
        seen = start + T
        visible = torch.arange(seen)[None, :] <= torch.arange(start, start + T)[:, None]
        if slip.get("mask_from_zero"):  # the prefill's triangle reused for every step
            visible = torch.ones(T, seen, dtype=torch.bool).tril()
        x = w.embed_tokens[torch.tensor(ids)]
        for i, lw in enumerate(w.layers):
            h = rms_norm(x, lw.input_layernorm, eps)
            q = rope((h @ lw.q_proj.T).view(T, H, D).transpose(0, 1), cos, sin)
            k = (h @ lw.k_proj.T).view(T, KV, D).transpose(0, 1)
            v = (h @ lw.v_proj.T).view(T, KV, D).transpose(0, 1)
            if not slip.get("rope_after_cache"):
                k = rope(k, cos, sin)
            if slip.get("no_cache"):
                pass  # attends over the new tokens only
            elif slip.get("same_layer"):
                k, v = cache.append(0, start, k, v)
            else:
                k, v = cache.append(i, start, k, v)
            if slip.get("rope_after_cache"):
                k = rope(k, *(t[: k.shape[1]] for t in rope_cos_sin(model, k.shape[1])))
            k, v = k.repeat_interleave(H // KV, dim=0), v.repeat_interleave(H // KV, dim=0)
            scores = q @ k.transpose(-1, -2) / math.sqrt(D)
            if k.shape[1] == seen:
                scores = scores.masked_fill(~visible, float("-inf"))
            else:
                scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
            a = torch.softmax(scores, dim=-1) @ v
            x = x + a.transpose(0, 1).reshape(T, H * D) @ lw.o_proj.T
            h = rms_norm(x, lw.post_attention_layernorm, eps)
            x = x + (F.silu(h @ lw.gate_proj.T) * (h @ lw.up_proj.T)) @ lw.down_proj.T
        return rms_norm(x, w.norm, eps) @ w.lm_head.T

    return cached_forward


def rope_b(x, cos, sin):
    """As complex numbers: pair (i, i + D/2) is one complex value, turned by e^{iθ}."""
    half = x.shape[-1] // 2
    z = torch.complex(x[..., :half].double(), x[..., half:].double())
    turned = z * torch.complex(cos[..., :half].double(), sin[..., :half].double())
    return torch.cat((turned.real, turned.imag), dim=-1).to(x.dtype)


class CacheB:
    """Per layer, a dict of two buffers; the filled length is tracked too."""

    def __init__(self, num_layers, num_kv_heads, max_len, head_dim, dtype=torch.float32):
        self.layers = [
            {"k": torch.empty(num_kv_heads, max_len, head_dim, dtype=dtype),
             "v": torch.empty(num_kv_heads, max_len, head_dim, dtype=dtype)}
            for _ in range(num_layers)
        ]

    def append(self, layer, start, k, v):
        buf = self.layers[layer]
        n = k.shape[-2]
        buf["k"][:, start : start + n].copy_(k)
        buf["v"][:, start : start + n].copy_(v)
        return buf["k"].narrow(1, 0, start + n), buf["v"].narrow(1, 0, start + n)


def forward_b(model, ids, start, cache):
    """SDPA with enable_gqa and an explicit boolean mask; F.linear for the matmuls."""
    cfg = model.config
    w = model_weights(model)
    T = len(ids)
    cos, sin = rope_cos_sin(model.config, start + T)
    cos, sin = cos[start:], sin[start:]
    mask = torch.ones(T, start + T, dtype=torch.bool).tril(diagonal=start)
    x = F.embedding(torch.tensor(ids), w.embed_tokens)
    for i, lw in enumerate(w.layers):
        h = rms_norm(x, lw.input_layernorm, cfg.rms_norm_eps)
        q, k, v = (F.linear(h, m).unflatten(-1, (n, cfg.head_dim)).transpose(0, 1)
                   for m, n in ((lw.q_proj, cfg.num_heads), (lw.k_proj, cfg.num_kv_heads), (lw.v_proj, cfg.num_kv_heads)))
        k, v = cache.append(i, start, rope_b(k, cos, sin), v)
        a = F.scaled_dot_product_attention(rope_b(q, cos, sin)[None], k[None], v[None], attn_mask=mask, enable_gqa=True)[0]
        x = x + F.linear(a.transpose(0, 1).flatten(1), lw.o_proj)
        h = rms_norm(x, lw.post_attention_layernorm, cfg.rms_norm_eps)
        x = x + F.linear(F.silu(F.linear(h, lw.gate_proj)) * F.linear(h, lw.up_proj), lw.down_proj)
    return F.linear(rms_norm(x, w.norm, cfg.rms_norm_eps), w.lm_head)


right(CM, rope_a, CacheA, forward_with())
right(CM, rope_b, CacheB, forward_b)


# ---- apply_rope -----------------------------------------------------------------------------


def rope_interleaved(x, cos, sin):
    """Pairs (2i, 2i+1), as in the paper's first form."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    c, s = cos[..., : x.shape[-1] // 2], sin[..., : x.shape[-1] // 2]  # one angle per pair
    return torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)


def rope_wrong_way(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat((x[..., half:], -x[..., :half]), dim=-1) * sin


def rope_swapped(x, cos, sin):
    return rope_a(x, sin, cos)


def rope_cos_only(x, cos, sin):
    return x * cos


def rope_no_minus(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat((x[..., half:], x[..., :half]), dim=-1) * sin


def rope_in_place(x, cos, sin):
    half = x.shape[-1] // 2
    turned = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    x.mul_(cos)
    return x.add_(turned * sin)


def rope_only_3d(x, cos, sin):
    """Unpacks three dims: works on [heads, T, D] only."""
    heads, t, d = x.shape
    return rope_a(x, cos, sin)


for fn, message in (
    (rope_interleaved, "rotates pairs (0, 1), (2, 3)"),
    (rope_wrong_way, "turns the wrong way"),
    (rope_swapped, "swapped cos and sin"),
    (rope_cos_only, "dropped the rotate_half(x)·sin term"),
    (rope_no_minus, "without the minus sign"),
    (rope_in_place, "changed its input x in place"),
    (rope_only_3d, "ValueError"),
):
    wrong(CM, message, fn, CacheA, forward_with(rope=fn))


# ---- KVCache --------------------------------------------------------------------------------


class CacheCat:
    """Grows with torch.cat: every token copies the whole history."""

    def __init__(self, num_layers, num_kv_heads, max_len, head_dim, dtype=torch.float32):
        self.k = [torch.zeros(num_kv_heads, 0, head_dim, dtype=dtype) for _ in range(num_layers)]
        self.v = [torch.zeros(num_kv_heads, 0, head_dim, dtype=dtype) for _ in range(num_layers)]

    def append(self, layer, start, k, v):
        self.k[layer] = torch.cat([self.k[layer][:, :start], k], dim=1)
        self.v[layer] = torch.cat([self.v[layer][:, :start], v], dim=1)
        return self.k[layer], self.v[layer]


class CacheNewOnly(CacheA):
    def append(self, layer, start, k, v):
        super().append(layer, start, k, v)
        return k, v


class CacheWholeBuffer(CacheA):
    def append(self, layer, start, k, v):
        super().append(layer, start, k, v)
        return self.k[layer], self.v[layer]


class CacheSharedLayers:
    """One buffer for all layers: [num_layers] * [buffer] repeats the same tensor."""

    def __init__(self, num_layers, num_kv_heads, max_len, head_dim, dtype=torch.float32):
        self.k = [torch.zeros(num_kv_heads, max_len, head_dim, dtype=dtype)] * num_layers
        self.v = [torch.zeros(num_kv_heads, max_len, head_dim, dtype=dtype)] * num_layers

    def append(self, layer, start, k, v):
        end = start + k.shape[1]
        self.k[layer][:, start:end] = k
        self.v[layer][:, start:end] = v
        return self.k[layer][:, :end], self.v[layer][:, :end]


class CacheKeepsReference:
    """Stores the prefill's tensors themselves, then writes decode tokens into a buffer it grows."""

    def __init__(self, num_layers, num_kv_heads, max_len, head_dim, dtype=torch.float32):
        self.k = [torch.zeros(num_kv_heads, max_len, head_dim, dtype=dtype) for _ in range(num_layers)]
        self.v = [torch.zeros(num_kv_heads, max_len, head_dim, dtype=dtype) for _ in range(num_layers)]
        self.held = {}

    def append(self, layer, start, k, v):
        end = start + k.shape[1]
        self.held[(layer, start)] = (k, v)  # "saves a copy" that is the caller's tensor
        for (lay, at), (kk, vv) in self.held.items():
            if lay == layer:
                self.k[layer][:, at : at + kk.shape[1]] = kk
                self.v[layer][:, at : at + vv.shape[1]] = vv
        return self.k[layer][:, :end], self.v[layer][:, :end]


class CacheOffByOne(CacheA):
    """Returns one position too few: the token just written is left out."""

    def append(self, layer, start, k, v):
        got_k, got_v = super().append(layer, start, k, v)
        return got_k[:, :-1], got_v[:, :-1]


for cls, message in (
    (CacheCat, "returned a new tensor each step"),
    (CacheNewOnly, "returned only the new token's keys"),
    (CacheWholeBuffer, "returned the whole buffer"),
    (CacheSharedLayers, "Each layer keeps its own"),
    (CacheKeepsReference, "kept a reference to the k it was given"),
    (CacheOffByOne, "returned positions 0..1"),
):
    wrong(CM, message, rope_a, cls, forward_with())


# ---- cached_forward -------------------------------------------------------------------------


def forward_calls_the_package(model, ids, start, cache):
    from minillm.course import new_cache

    if not hasattr(cache, "package"):
        cache.package = new_cache(model, 64)
    return forward_step(model, ids, start, cache.package)


wrong(CM, "decode step 1 (one token at position 11) differs", rope_a, CacheA, forward_with(position_zero=True))
wrong(CM, "a one-token query sees every cached key", rope_a, CacheA, forward_with(mask_from_zero=True))
wrong(CM, "your prefill matches the engine's, but decode step 1", rope_a, CacheA, forward_with(no_cache=True))
wrong(CM, "ran the package's model", rope_a, CacheA, forward_calls_the_package)
wrong(CM, "your prefill matches the engine's, but decode step 1", rope_a, CacheA, forward_with(same_layer=True))
# Caching K before the rotation and rotating every cached key at each step is slow but right:
right(CM, rope_a, CacheA, forward_with(rope_after_cache=True))
