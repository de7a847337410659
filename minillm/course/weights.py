"""The model's weights as plain tensors under their Hugging Face names, and the RoPE rows in the
textbook form: what chapter 01's learner needs to write the forward pass from nothing but
matrices.

Why a view and not the modules: the engine stores its weights for speed — q/k/v fused into one
matrix, the MLP's gate and up into another, and on a CPU often repacked into oneDNN's blocked
layout that is no tensor a learner can multiply by. The view undoes all of that once per layer
(and caches it), so a learner writes ``h @ w.q_proj.T`` exactly as the checkpoint names it and
as the papers write it.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from minillm.config import ModelConfig
from minillm.layers import Linear


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer's matrices, ``[out_features, in_features]`` as in the checkpoint."""

    input_layernorm: torch.Tensor  # [hidden]
    q_proj: torch.Tensor  # [num_heads * head_dim, hidden]
    k_proj: torch.Tensor  # [num_kv_heads * head_dim, hidden]
    v_proj: torch.Tensor  # [num_kv_heads * head_dim, hidden]
    o_proj: torch.Tensor  # [hidden, num_heads * head_dim]
    post_attention_layernorm: torch.Tensor  # [hidden]
    gate_proj: torch.Tensor  # [intermediate, hidden]
    up_proj: torch.Tensor  # [intermediate, hidden]
    down_proj: torch.Tensor  # [hidden, intermediate]


@dataclass(frozen=True)
class ModelWeights:
    """The whole model: the embedding table, the layers, the final norm and the LM head."""

    embed_tokens: torch.Tensor  # [vocab, hidden]
    layers: list[LayerWeights]
    norm: torch.Tensor  # [hidden]
    lm_head: torch.Tensor  # [vocab, hidden] (the embedding table itself when the checkpoint ties them)


def dense_weight(linear: Linear) -> torch.Tensor:
    """``linear``'s matrix ``[out, in]`` as a plain tensor, whatever storage its method keeps: the
    parameter when it is still one, else read back through the method (``x = I`` gives ``Wᵀ``)."""
    for name in ("weight", "plain_weight"):
        w = getattr(linear, name, None)
        if isinstance(w, torch.Tensor) and w.layout == torch.strided and w.dim() == 2:
            return w.detach()
    eye = torch.eye(linear.in_features, dtype=_dtype_of(linear), device=_device_of(linear))
    with torch.inference_mode():
        rows = linear.method.apply(linear, eye)  # [in, out] = I Wᵀ (+ b)
    if linear.bias is not None:
        rows = rows - linear.bias.detach()
    return rows.t().contiguous()


def _dtype_of(linear: Linear) -> torch.dtype:
    for t in linear.method.held_tensors(linear):
        if t.is_floating_point():
            return t.dtype
    return torch.float32


def _device_of(linear: Linear) -> torch.device:
    held = linear.method.held_tensors(linear)
    return held[0].device if held else torch.device("cpu")


_LAYERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module → (methods, LayerWeights)
_MODELS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def layer_weights(layer) -> LayerWeights:
    """The matrices of one of the engine's ``DecoderLayer`` modules, split back into the
    checkpoint's q/k/v and gate/up (cached until the layer's weight methods change)."""
    attn, mlp = layer.attn, layer.mlp
    methods = (attn.qkv_proj.method, attn.o_proj.method, mlp.gate_up_proj.method, mlp.down_proj.method)
    cached = _LAYERS.get(layer)
    if cached is not None and all(a is b for a, b in zip(cached[0], methods)):
        return cached[1]
    if attn.qkv_proj.tp_size > 1:
        raise ValueError("layer_weights reads a whole layer; this one is a tensor-parallel shard")
    q, k, v = dense_weight(attn.qkv_proj).split(list(attn.qkv_proj.shards.values()))
    gate, up = dense_weight(mlp.gate_up_proj).split(mlp.intermediate_size)
    weights = LayerWeights(
        layer.input_norm.weight.detach(),
        q,
        k,
        v,
        dense_weight(attn.o_proj),
        layer.post_attn_norm.weight.detach(),
        gate,
        up,
        dense_weight(mlp.down_proj),
    )
    _LAYERS[layer] = (methods, weights)
    return weights


def model_weights(model) -> ModelWeights:
    """Every weight of ``model`` (a ``LlamaForCausalLM`` with all its layers) as plain tensors."""
    if model.embed_tokens is None or model.lm_head is None or model.parallel.tp_size > 1:
        raise ValueError("model_weights reads a whole model; this one is a pipeline stage or a tensor-parallel shard")
    layers = [layer_weights(x) for x in model.layers]
    cached = _MODELS.get(model)
    if cached is None or cached[0] is not model.lm_head.method:
        head = dense_weight(model.lm_head)
        table = model.embed_tokens.weight
        embed = table.detach() if isinstance(table, torch.Tensor) else head  # read through the head: tied
        cached = _MODELS[model] = (model.lm_head.method, embed, model.norm.weight.detach(), head)
    _, embed, norm, head = cached
    return ModelWeights(embed, layers, norm, head)


def rope_cos_sin(model_or_config, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)``, each ``[length, head_dim]`` in float32, for positions ``0 .. length-1``: row
    ``p`` holds position ``p``'s angles, dimension ``i`` and ``i + head_dim/2`` sharing one angle
    (the Hugging Face layout). Chapter 02 shows where they come from."""
    from minillm.models.rope import inv_frequencies, rope_tables

    config: ModelConfig = getattr(model_or_config, "config", model_or_config)
    inv_freq, scaling = inv_frequencies(config)
    cos, sin = rope_tables(inv_freq, length)
    return cos * scaling, sin * scaling


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x[..., T, head_dim]`` by its positions' angles: ``x·cos + rotate_half(x)·sin``,
    where ``rotate_half([x1, x2]) = [-x2, x1]`` turns every pair ``(i, i + head_dim/2)`` by 90°."""
    half = x.shape[-1] // 2
    turned = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.to(x.dtype) + turned * sin.to(x.dtype)
