"""Chapter 01's whole model (``check_transformer``): right answers written independently, and the
wrong ones a learner writes — each piece's classic slips, one at a time, the other pieces right.

An answer is ``(rms_norm, decoder_layer, transformer_forward)``; ``forward_with(layer=...)``
builds a forward pass around a given layer (a learner's forward calls their own layer by name).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from check_catalogue import right, wrong

from minillm.course import apply_rotary, forward_logits, model_weights, rope_cos_sin

TR = "check_transformer"


# ---- right answers --------------------------------------------------------------------------


def rms_a(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * weight


def causal(q, k, v):
    t = q.shape[-2]
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    return torch.softmax(s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf")), -1) @ v


def layer_a(x, w, cos, sin, config, rms=rms_a, **slip):
    """The textbook block; ``slip`` switches on one learner's mistake (the wrong answers below)."""
    T = x.shape[0]
    H, KV, D = config.num_heads, config.num_kv_heads, config.head_dim
    eps = config.rms_norm_eps
    h = rms(x, w.input_layernorm, eps)
    q = (h @ w.q_proj.T).view(T, H, D).transpose(0, 1)
    k = (h @ w.k_proj.T).view(T, KV, D).transpose(0, 1)
    v = (h @ w.v_proj.T).view(T, KV, D).transpose(0, 1)
    if not slip.get("no_rope"):
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    if slip.get("tile"):
        k, v = k.repeat(H // KV, 1, 1), v.repeat(H // KV, 1, 1)
    else:
        k, v = k.repeat_interleave(H // KV, dim=0), v.repeat_interleave(H // KV, dim=0)
    a = causal(q[None], k[None], v[None])[0]
    merged = a.reshape(T, H * D) if slip.get("merge") else a.transpose(0, 1).reshape(T, H * D)
    attn = merged @ w.o_proj.T
    x = attn if slip.get("no_residual") else x + attn
    h = rms(x, w.post_attention_layernorm, eps)
    gate, up = h @ w.gate_proj.T, h @ w.up_proj.T
    act = gate * F.silu(up) if slip.get("silu_on_up") else F.silu(gate) * up
    return x + act @ w.down_proj.T


def forward_with(layer=layer_a, rms=rms_a, final_norm=True, skip_last=False, last_row=False):
    def transformer_forward(model, ids):
        w = model_weights(model)
        x = w.embed_tokens[torch.tensor(ids)]
        cos, sin = rope_cos_sin(model, len(ids))
        for lw in w.layers[:-1] if skip_last else w.layers:
            x = layer(x, lw, cos, sin, model.config)
        if final_norm:
            x = rms(x, w.norm, model.config.rms_norm_eps)
        logits = x @ w.lm_head.T
        return logits[-1] if last_row else logits

    return transformer_forward


def rms_b(x, weight, eps):
    return weight * (x / torch.sqrt((x * x).sum(-1, keepdim=True) / x.shape[-1] + eps))


def layer_b(x, w, cos, sin, config):
    """Hugging Face's shapes: [1, heads, T, D], its own rotate_half, SDPA with enable_gqa."""
    b = x[None]
    n = F.rms_norm(b, (b.shape[-1],), w.input_layernorm, config.rms_norm_eps)

    def split(y, heads):
        return y.unflatten(-1, (heads, config.head_dim)).permute(0, 2, 1, 3)

    def rotate(y):
        y1, y2 = y.chunk(2, dim=-1)
        return y * cos + torch.cat((-y2, y1), dim=-1) * sin

    q = rotate(split(F.linear(n, w.q_proj), config.num_heads))
    k = rotate(split(F.linear(n, w.k_proj), config.num_kv_heads))
    v = split(F.linear(n, w.v_proj), config.num_kv_heads)
    a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    b = b + F.linear(a.permute(0, 2, 1, 3).flatten(2), w.o_proj)
    n = F.rms_norm(b, (b.shape[-1],), w.post_attention_layernorm, config.rms_norm_eps)
    b = b + F.linear(F.silu(F.linear(n, w.gate_proj)) * F.linear(n, w.up_proj), w.down_proj)
    return b[0]


def forward_b(model, ids):
    w = model_weights(model)
    x = F.embedding(torch.tensor(ids), w.embed_tokens)
    cos, sin = rope_cos_sin(model.config, len(ids))
    for lw in w.layers:
        x = layer_b(x, lw, cos, sin, model.config)
    return F.linear(rms_b(x, w.norm, model.config.rms_norm_eps), w.lm_head)


right(TR, rms_a, layer_a, forward_with())
right(TR, rms_b, layer_b, forward_b)


# ---- rms_norm -------------------------------------------------------------------------------


def rms_no_weight(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)


def rms_layer_norm(x, weight, eps):
    x = x - x.mean(dim=-1, keepdim=True)
    return x / torch.sqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * weight


def rms_eps_outside(x, weight, eps):
    return x / (x.pow(2).mean(dim=-1, keepdim=True).sqrt() + eps) * weight


def rms_no_eps(x, weight, eps):
    return x / x.pow(2).mean(dim=-1, keepdim=True).sqrt() * weight


def rms_over_tokens(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(dim=0, keepdim=True) + eps) * weight


def rms_std(x, weight, eps):
    """torch.std for the root mean square: it subtracts the mean (and divides by n - 1)."""
    return x / (x.std(dim=-1, keepdim=True) + eps) * weight


def rms_in_place(x, weight, eps):
    x /= torch.sqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
    return x * weight


wrong(TR, "never multiplied by `weight`", rms_no_weight, layer_a, forward_with(rms=rms_no_weight))
wrong(TR, "that is LayerNorm", rms_layer_norm, layer_a, forward_with(rms=rms_layer_norm))
wrong(TR, "eps after the square root", rms_eps_outside, layer_a, forward_with(rms=rms_eps_outside))
wrong(TR, "rms_norm has no eps", rms_no_eps, layer_a, forward_with(rms=rms_no_eps))
wrong(TR, "averaged over the tokens", rms_over_tokens, layer_a, forward_with(rms=rms_over_tokens))
wrong(TR, "rms_norm(x[5, 16], weight, eps=1e-5) differs", rms_std, layer_a, forward_with(rms=rms_std))
wrong(TR, "changed its input x in place", rms_in_place, layer_a, forward_with(rms=rms_in_place))


# ---- decoder_layer --------------------------------------------------------------------------


def slipped(**slip):
    def layer(x, w, cos, sin, config):
        return layer_a(x, w, cos, sin, config, **slip)

    return layer


def layer_post_norm(x, w, cos, sin, config):
    """Post-norm, as in the original Transformer: normalise after each residual add."""
    eps = config.rms_norm_eps
    T, H, KV, D = x.shape[0], config.num_heads, config.num_kv_heads, config.head_dim
    q = apply_rotary((x @ w.q_proj.T).view(T, H, D).transpose(0, 1), cos, sin)
    k = apply_rotary((x @ w.k_proj.T).view(T, KV, D).transpose(0, 1), cos, sin).repeat_interleave(H // KV, 0)
    v = (x @ w.v_proj.T).view(T, KV, D).transpose(0, 1).repeat_interleave(H // KV, 0)
    x = rms_a(x + causal(q, k, v).transpose(0, 1).reshape(T, -1) @ w.o_proj.T, w.input_layernorm, eps)
    return rms_a(x + (F.silu(x @ w.gate_proj.T) * (x @ w.up_proj.T)) @ w.down_proj.T, w.post_attention_layernorm, eps)


def layer_heads_by_column(x, w, cos, sin, config):
    """Cuts heads as view(T, head_dim, heads): head i gets every heads-th column."""
    T, H, KV, D = x.shape[0], config.num_heads, config.num_kv_heads, config.head_dim
    h = rms_a(x, w.input_layernorm, config.rms_norm_eps)
    q = apply_rotary((h @ w.q_proj.T).view(T, D, H).permute(2, 0, 1), cos, sin)
    k = apply_rotary((h @ w.k_proj.T).view(T, D, KV).permute(2, 0, 1), cos, sin).repeat_interleave(H // KV, 0)
    v = (h @ w.v_proj.T).view(T, D, KV).permute(2, 0, 1).repeat_interleave(H // KV, 0)
    x = x + causal(q, k, v).transpose(0, 1).reshape(T, -1) @ w.o_proj.T
    h = rms_a(x, w.post_attention_layernorm, config.rms_norm_eps)
    return x + (F.silu(h @ w.gate_proj.T) * (h @ w.up_proj.T)) @ w.down_proj.T


def layer_no_transpose(x, w, cos, sin, config):
    """Multiplies by the stored matrices as if they were [in, out]."""
    T, H, D = x.shape[0], config.num_heads, config.head_dim
    h = rms_a(x, w.input_layernorm, config.rms_norm_eps)
    return (h @ w.q_proj).view(T, H, D).transpose(0, 1)  # fails here: [T, hidden] @ [H*D, hidden]


def layer_sdpa_not_causal(x, w, cos, sin, config):
    """SDPA without is_causal: every token sees the whole sequence."""
    T, H, KV, D = x.shape[0], config.num_heads, config.num_kv_heads, config.head_dim
    h = rms_a(x, w.input_layernorm, config.rms_norm_eps)
    q = apply_rotary((h @ w.q_proj.T).view(T, H, D).transpose(0, 1), cos, sin)
    k = apply_rotary((h @ w.k_proj.T).view(T, KV, D).transpose(0, 1), cos, sin)
    v = (h @ w.v_proj.T).view(T, KV, D).transpose(0, 1)
    a = F.scaled_dot_product_attention(q[None], k[None], v[None], enable_gqa=True)[0]
    x = x + a.transpose(0, 1).reshape(T, -1) @ w.o_proj.T
    h = rms_a(x, w.post_attention_layernorm, config.rms_norm_eps)
    return x + (F.silu(h @ w.gate_proj.T) * (h @ w.up_proj.T)) @ w.down_proj.T


def layer_in_place_residual(x, w, cos, sin, config):
    """``x += ...``: the caller's hidden states change under it."""
    out = layer_a(x, w, cos, sin, config)
    x += out - x
    return x


def layer_rope_on_v_too(x, w, cos, sin, config):
    T, H, KV, D = x.shape[0], config.num_heads, config.num_kv_heads, config.head_dim
    h = rms_a(x, w.input_layernorm, config.rms_norm_eps)
    q, k, v = ((h @ m.T).view(T, n, D).transpose(0, 1) for m, n in ((w.q_proj, H), (w.k_proj, KV), (w.v_proj, KV)))
    q, k, v = (apply_rotary(t, cos, sin) for t in (q, k, v))
    a = causal(q, k.repeat_interleave(H // KV, 0), v.repeat_interleave(H // KV, 0))
    x = x + a.transpose(0, 1).reshape(T, -1) @ w.o_proj.T
    h = rms_a(x, w.post_attention_layernorm, config.rms_norm_eps)
    return x + (F.silu(h @ w.gate_proj.T) * (h @ w.up_proj.T)) @ w.down_proj.T


def layer_gate_plus_up(x, w, cos, sin, config):
    """Adds the gate to up instead of multiplying: a slip no named variant covers."""
    T, H, KV, D = x.shape[0], config.num_heads, config.num_kv_heads, config.head_dim
    h = rms_a(x, w.input_layernorm, config.rms_norm_eps)
    q = apply_rotary((h @ w.q_proj.T).view(T, H, D).transpose(0, 1), cos, sin)
    k = apply_rotary((h @ w.k_proj.T).view(T, KV, D).transpose(0, 1), cos, sin).repeat_interleave(H // KV, 0)
    v = (h @ w.v_proj.T).view(T, KV, D).transpose(0, 1).repeat_interleave(H // KV, 0)
    x = x + causal(q, k, v).transpose(0, 1).reshape(T, -1) @ w.o_proj.T
    h = rms_a(x, w.post_attention_layernorm, config.rms_norm_eps)
    return x + (F.silu(h @ w.gate_proj.T) + (h @ w.up_proj.T)) @ w.down_proj.T


for slip, message in (
    ({"no_residual": True}, "the attention's output replaced x"),
    ({"silu_on_up": True}, "SiLU went on up_proj's output"),
    ({"tile": True}, "repeat_interleave"),
    ({"merge": True}, "without moving the heads back"),
    ({"no_rope": True}, "q and k were never rotated"),
):
    wrong(TR, message, rms_a, slipped(**slip), forward_with(layer=slipped(**slip)))
wrong(TR, "the norm went after the residual", rms_a, layer_post_norm, forward_with(layer=layer_post_norm))
wrong(TR, "cut into heads the wrong way round", rms_a, layer_heads_by_column, forward_with(layer=layer_heads_by_column))
wrong(TR, "multiply by the transpose", rms_a, layer_no_transpose, forward_with(layer=layer_no_transpose))
wrong(TR, "every position saw the later ones", rms_a, layer_sdpa_not_causal, forward_with(layer=layer_sdpa_not_causal))
wrong(TR, "changed its input x in place", rms_a, layer_in_place_residual, forward_with(layer=layer_in_place_residual))
wrong(TR, "v was rotated too", rms_a, layer_rope_on_v_too, forward_with(layer=layer_rope_on_v_too))
wrong(TR, "the attention half (MLP off: down_proj = 0) matches", rms_a, layer_gate_plus_up,
      forward_with(layer=layer_gate_plus_up))


# ---- transformer_forward --------------------------------------------------------------------


def forward_calls_the_package(model, ids):
    return forward_logits(model, ids)


def forward_hidden_states(model, ids):
    w = model_weights(model)
    x = w.embed_tokens[torch.tensor(ids)]
    cos, sin = rope_cos_sin(model, len(ids))
    for lw in w.layers:
        x = layer_a(x, lw, cos, sin, model.config)
    return x


def forward_scaled_embedding(model, ids):
    """Scales the embedding rows by sqrt(hidden), as Gemma and T5 do; Llama does not."""
    w = model_weights(model)
    x = w.embed_tokens[torch.tensor(ids)] * math.sqrt(model.config.hidden_size)
    cos, sin = rope_cos_sin(model, len(ids))
    for lw in w.layers:
        x = layer_a(x, lw, cos, sin, model.config)
    return rms_a(x, w.norm, model.config.rms_norm_eps) @ w.lm_head.T


wrong(TR, "skipped the final norm", rms_a, layer_a, forward_with(final_norm=False))
wrong(TR, "ran 3 of the model's 4 layers", rms_a, layer_a, forward_with(skip_last=True))
wrong(TR, "returned one row", rms_a, layer_a, forward_with(last_row=True))
wrong(TR, "ran the package's model", rms_a, layer_a, forward_calls_the_package)
wrong(TR, "returned the hidden states", rms_a, layer_a, forward_hidden_states)
wrong(TR, "look at its own steps", rms_a, layer_a, forward_scaled_embedding)
