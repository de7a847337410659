"""One readable Llama-family decoder: Llama, Mistral, Qwen2 and SmolLM are all this file.

    tokens → embedding → N × [ RMSNorm → attention (+ residual) → RMSNorm → SwiGLU MLP (+ residual) ]
           → RMSNorm → LM head → logits

Differences between the checkpoints are configuration, not code: the number of K/V heads
(MHA/GQA/MQA), a bias on the q/k/v projections (Qwen2), a tied or separate LM head, an
explicit ``head_dim``, and the RoPE variant.

For speed the q/k/v projections are fused into one matrix (one matmul instead of three), and
so are the MLP's gate and up projections. The loader fills the fused matrices from the
checkpoint's separate tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from minillm.attention import attention, causal_mask
from minillm.config import ModelConfig
from minillm.kvcache import ContiguousKVCache
from minillm.models.rope import RotaryEmbedding, apply_rope


@dataclass
class ForwardBatch:
    """Everything one forward pass needs besides the weights.

    ``input_ids`` and ``positions`` are ``[B, T]``: B sequences, T new tokens each (right-padded
    when prompts differ in length). ``positions`` are absolute — they pick the RoPE angle and
    the cache slot. With ``cache=None`` the model attends only to the tokens it is given (the
    naive engine); otherwise it first writes the new K/V into the cache and attends to
    positions ``0 .. kv_len-1`` of it. ``logit_index[B]`` selects which of the T positions
    need logits (the last real token of each row); ``None`` returns logits for all of them.
    ``same_start`` lets the cache write a slice instead of scattering, decided once per step
    rather than once per layer.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    cache: ContiguousKVCache | None = None
    kv_len: int | None = None
    logit_index: torch.Tensor | None = None
    same_start: int | None = None  # set when every row's new tokens start at this position


class RMSNorm(nn.Module):
    """``x / rms(x) * weight``, computed in fp32 and cast back, as the checkpoints were trained."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int):
        super().__init__()
        self.layer_index = layer_index
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.scale = config.head_dim**-0.5
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch,
                mask: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(b, t, self.num_heads, self.head_dim).transpose(1, 2)  # [B, H, T, D]
        k = k.view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)  # [B, KV, T, D]
        v = v.view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        if batch.cache is not None:
            batch.cache.write(self.layer_index, batch.positions, k, v, batch.same_start)
            k, v = batch.cache.read(self.layer_index, b, mask.shape[-1])
        out = attention(q, k, v, mask, self.scale)  # [B, H, T, D]
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.q_size))


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with gate and up fused into one matmul."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int):
        super().__init__()
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = Attention(config, layer_index)
        self.post_attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SwiGLU(config)

    def forward(self, x, cos, sin, batch, mask):
        x = x + self.attn(self.input_norm(x), cos, sin, batch, mask)
        return x + self.mlp(self.post_attn_norm(x))


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rope: RotaryEmbedding | None = None

    def init_rope(self, max_positions: int) -> None:
        """Build the cos/sin table once weights are on their device (it is not a parameter)."""
        self.rope = RotaryEmbedding(self.config, max_positions, self.embed_tokens.weight.device)

    @property
    def head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits ``[B, V]`` (one position per row) or ``[B, T, V]`` when ``logit_index`` is None."""
        if self.rope is None:
            raise RuntimeError("call init_rope(max_positions) before running the model")
        x = self.embed_tokens(batch.input_ids)
        cos, sin = self.rope.lookup(batch.positions, x.dtype)
        kv_len = batch.kv_len if batch.cache is not None else batch.input_ids.shape[1]
        mask = causal_mask(batch.positions, kv_len)  # built once, shared by every layer
        for layer in self.layers:
            x = layer(x, cos, sin, batch, mask)
        if batch.logit_index is not None:
            x = x[torch.arange(x.shape[0], device=x.device), batch.logit_index]  # [B, hidden]
        return F.linear(self.norm(x), self.head_weight).float()
