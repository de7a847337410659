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

import torch
import torch.nn.functional as F
from torch import nn

from minillm.attention import AttentionBackend, get_backend
from minillm.attention.contiguous import AttentionMask, ForwardBatch
from minillm.config import ModelConfig
from minillm.layers import Linear, LinearMethod
from minillm.models.rope import RotaryEmbedding, apply_rope

__all__ = ["AttentionMask", "ForwardBatch", "LlamaForCausalLM"]


class RMSNorm(nn.Module):
    """``x / rms(x) * weight``: scale each token's vector to unit root-mean-square, then
    re-weight each channel. PyTorch's fused kernel accumulates in fp32 for half types."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


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
        shards = {"q": self.q_size, "k": self.kv_size, "v": self.kv_size}
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, config.attention_bias, shards)
        self.o_proj = Linear(self.q_size, config.hidden_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, step) -> torch.Tensor:
        """``step``: this forward pass's attention (``ContiguousStep`` or a backend's paged step),
        which knows where K/V are kept and what each query may see."""
        b, t, _ = x.shape
        h, kv = self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x).view(b, t, h + 2 * kv, self.head_dim)
        qk = apply_rope(qkv[:, :, : h + kv], cos, sin)  # q and k heads rotated in one go
        out = step.attend(self.layer_index, qk[:, :, :h], qk[:, :, h:], qkv[:, :, h + kv :], self.scale)
        return self.o_proj(out.reshape(b, t, self.q_size))


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with gate and up fused into one matmul."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.intermediate_size = config.intermediate_size
        shards = {"gate": config.intermediate_size, "up": config.intermediate_size}
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, shards=shards)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size)

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

    def forward(self, x, cos, sin, step):
        x = x + self.attn(self.input_norm(x), cos, sin, step)
        return x + self.mlp(self.post_attn_norm(x))


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size)
        self.tie_weights()
        self.rope: RotaryEmbedding | None = None
        self.attention_backend: AttentionBackend = get_backend("sdpa")
        self.sliding_window = config.sliding_window  # the engine may set its own
        self._compiled_step = None
        self._compiled_single_row_only = False

    @property
    def device(self) -> torch.device:
        """Where the weights live (the final norm's weight is always a plain tensor, whatever
        storage the embedding or the linear layers use)."""
        return self.norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype: the model's floating-point dtype."""
        return self.norm.weight.dtype

    def tie_weights(self) -> None:
        """Tied checkpoints use the embedding matrix as the LM head: one tensor, two uses."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def checkpoint_targets(self) -> dict[str, tuple[nn.Module, str, str | None]]:
        """HF checkpoint name → (module, parameter, shard of a fused matrix). The loader hands
        each tensor to ``module.weight_loader`` (linear layers) or copies it (the rest)."""
        cfg = self.config
        out: dict[str, tuple[nn.Module, str, str | None]] = {
            "model.embed_tokens.weight": (self.embed_tokens, "weight", None),
            "model.norm.weight": (self.norm, "weight", None),
        }
        if not cfg.tie_word_embeddings:
            out["lm_head.weight"] = (self.lm_head, "weight", None)
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            for name in ("q", "k", "v"):
                out[f"{p}self_attn.{name}_proj.weight"] = (layer.attn.qkv_proj, "weight", name)
                if cfg.attention_bias:
                    out[f"{p}self_attn.{name}_proj.bias"] = (layer.attn.qkv_proj, "bias", name)
            out[f"{p}self_attn.o_proj.weight"] = (layer.attn.o_proj, "weight", None)
            out[f"{p}mlp.gate_proj.weight"] = (layer.mlp.gate_up_proj, "weight", "gate")
            out[f"{p}mlp.up_proj.weight"] = (layer.mlp.gate_up_proj, "weight", "up")
            out[f"{p}mlp.down_proj.weight"] = (layer.mlp.down_proj, "weight", None)
            out[f"{p}input_layernorm.weight"] = (layer.input_norm, "weight", None)
            out[f"{p}post_attention_layernorm.weight"] = (layer.post_attn_norm, "weight", None)
        return out

    def set_attention_backend(self, name: str) -> None:
        """``torch`` | ``sdpa`` | ``triton`` (the engine's builder resolves ``auto`` first)."""
        self.attention_backend = get_backend(name)

    def init_rope(self, max_positions: int) -> None:
        """Build the cos/sin table once weights are on their device (it is not a parameter)."""
        self.rope = RotaryEmbedding(self.config, max_positions, self.device)

    def linear_layers(self) -> list[Linear]:
        return [m for m in self.modules() if isinstance(m, Linear)]

    def set_linear_method(self, method: LinearMethod) -> None:
        """Give every linear layer (the tied LM head included) a new weight method, e.g. prepacked."""
        for layer in self.linear_layers():
            layer.set_method(method)

    def weight_bytes(self) -> int:
        """Bytes of every tensor the model holds for its weights, each storage counted once
        (a tied head that still shares the embedding is not counted twice; a packed copy is)."""
        seen: dict[tuple, int] = {}
        tensors = [p for p in self.parameters()] + [b for b in self.buffers()]
        for layer in self.linear_layers():
            tensors += layer.method.held_tensors(layer)
        for t in tensors:
            try:
                key = (t.untyped_storage().data_ptr(), t.dtype)
            except (RuntimeError, NotImplementedError):  # opaque (oneDNN-packed) tensors have no storage
                key = (id(t), t.dtype)
            seen[key] = max(seen.get(key, 0), t.numel() * t.element_size())
        return sum(seen.values())

    def compile_decode(self, single_row_only: bool = False) -> None:
        """Compile the one-token decode step with ``torch.compile`` (shapes symbolic, so the
        growing context and a shrinking batch do not recompile). Fusion removes most of the
        ~500 small eager operations per step; the price is a one-time compile of a minute or
        two on a small CPU.

        ``single_row_only``: compile only batch-1 steps and run larger batches eagerly — for
        prepacked fp32 models, whose single-row linears are plain (traceable) matmuls while
        multi-row ones use oneDNN's packed kernels, faster than anything the compiler emits.
        """
        self._compiled_step = torch.compile(self._forward, dynamic=True)
        self._compiled_single_row_only = single_row_only

    def decode_step(self, batch: ForwardBatch) -> torch.Tensor:
        """A decode step: the compiled graph when ``compile_decode`` was called, else eager."""
        eager = self._compiled_step is None or (self._compiled_single_row_only and batch.input_ids.shape[0] > 1)
        if eager:
            return self.forward(batch)
        with torch.no_grad():  # compiled graphs cannot run under inference_mode
            return self._compiled_step(batch)

    def forward(self, batch) -> torch.Tensor:
        """Logits for ``batch`` — a padded ``ForwardBatch`` or a paged ``StepLayout``; the batch
        binds its own attention (``batch.bind(self)``), so the model never asks which it is.

        Returns ``[R, V]`` for the rows ``batch.logit_rows`` selects, or ``[B, T, V]`` when it
        selects none."""
        with torch.inference_mode():
            return self._forward(batch)

    def _forward(self, batch) -> torch.Tensor:
        if self.rope is None:
            raise RuntimeError("call init_rope(max_positions) before running the model")
        step = batch.bind(self)  # built once, shared by every layer
        x = self.embed_tokens(batch.input_ids)
        cos, sin = self.rope.lookup(batch.positions, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, step)
        rows = batch.logit_rows
        if rows is not None:
            x = x.flatten(0, 1)[rows]  # [R, hidden]
        return self.lm_head(self.norm(x)).float()
