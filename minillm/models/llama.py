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

from minillm.attention import AttentionFn, causal_mask, get_backend, get_paged_backend
from minillm.attention.paged import PagedAttentionMetadata
from minillm.config import ModelConfig
from minillm.kvcache import ContiguousKVCache
from minillm.models.rope import RotaryEmbedding, apply_rope


@dataclass
class ForwardBatch:
    """Everything one forward pass needs besides the weights.

    ``input_ids`` and ``positions`` are ``[B, T]``: B sequences, T new tokens each (right-padded
    when prompts differ in length). ``positions`` are absolute — they pick the RoPE angle and
    the cache slot. With ``cache=None`` the model attends only to the tokens it is given, which
    must sit at positions ``0..T-1`` (the naive engine); otherwise it first writes the new K/V
    into the cache and attends to positions ``0 .. kv_len-1`` of it. ``logit_index[B]`` selects which of the T positions
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


@dataclass
class PagedForwardBatch:
    """A continuous-batching step: ``N`` new tokens of many sequences, flat, without padding.

    ``input_ids[N]`` and ``positions[N]`` run sequence after sequence; ``attention`` says where
    their K/V go in the paged pool and what each attends to; ``logit_index[S]`` lists the rows
    whose next token is sampled (the last new token of each sequence that completes a prompt
    or decodes; a prefill chunk that stops mid-prompt needs no logits).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    attention: PagedAttentionMetadata
    logit_index: torch.Tensor


@dataclass
class AttentionMask:
    """Which keys each query may see, in the cheapest form that says it.

    ``mask=None, is_causal=False``: every query sees every key (a decode step whose rows all
    have the same length). ``is_causal=True``: the usual triangle (a prefill from position 0).
    Otherwise an explicit boolean ``mask[B, 1, T, S]``. Fused kernels run fastest without a
    mask tensor, so we only build one when rows really differ.
    """

    mask: torch.Tensor | None = None
    is_causal: bool = False

    @classmethod
    def for_batch(cls, batch: ForwardBatch, window: int | None = None) -> AttentionMask:
        """The mask for new tokens at ``batch.positions`` attending to cache positions ``< batch.kv_len``
        (only the last ``window`` of them with sliding-window attention)."""
        t = batch.input_ids.shape[1]
        within_window = window is None or batch.kv_len <= window
        if within_window and batch.same_start is not None and batch.same_start + t == batch.kv_len:
            return cls(is_causal=t > 1)  # all rows at the same position: a plain causal triangle
        return cls(mask=causal_mask(batch.positions, batch.kv_len, window))


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
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: ForwardBatch,
        mask: AttentionMask,
        attention_fn: AttentionFn,
    ) -> torch.Tensor:
        b, t, _ = x.shape
        h, kv = self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x).view(b, t, h + 2 * kv, self.head_dim)
        qk = apply_rope(qkv[:, :, : h + kv], cos, sin)  # q and k heads rotated in one go
        if isinstance(batch, PagedForwardBatch):  # flat tokens: b == 1, t == N
            q, k, v = qk[0, :, :h], qk[0, :, h:], qkv[0, :, h + kv :]
            # For a flat batch, attention_fn is the backend's *paged* attention.
            out = attention_fn(q, k, v, self.layer_index, batch.attention, self.scale)
            return self.o_proj(out.reshape(b, t, self.q_size))
        q = qk[:, :, :h].transpose(1, 2)  # [B, H, T, D]
        k = qk[:, :, h:].transpose(1, 2)  # [B, KV, T, D]
        v = qkv[:, :, h + kv :].transpose(1, 2)
        if batch.cache is not None:
            batch.cache.write(self.layer_index, batch.positions, k, v, batch.same_start)
            k, v = batch.cache.read(self.layer_index, b, batch.kv_len)
        out = attention_fn(q, k, v, mask.mask, mask.is_causal, self.scale)  # [B, H, T, D]
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

    def forward(self, x, cos, sin, batch, mask, attention_fn):
        x = x + self.attn(self.input_norm(x), cos, sin, batch, mask, attention_fn)
        return x + self.mlp(self.post_attn_norm(x))


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = (
            None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        self.rope: RotaryEmbedding | None = None
        self.attention_fn: AttentionFn = get_backend("auto")
        self.paged_attention_fn = get_paged_backend("sdpa")
        self.sliding_window = config.sliding_window  # the engine may set its own
        self._compiled_step = None
        self._compiled_single_row_only = False

    def set_attention_backend(self, name: str) -> None:
        """``torch`` | ``sdpa`` | ``triton`` (resolve ``auto`` first: ``attention.resolve_backend``)."""
        self.attention_fn = get_backend(name)
        self.paged_attention_fn = get_paged_backend(name)

    def init_rope(self, max_positions: int) -> None:
        """Build the cos/sin table once weights are on their device (it is not a parameter)."""
        self.rope = RotaryEmbedding(self.config, max_positions, self.embed_tokens.weight.device)

    def prepack_for_cpu(self) -> None:
        """Swap every linear layer (and the tied LM head) for a oneDNN-prepacked one."""
        from minillm.models.cpu_prepack import PackedLinear, prepack_linears

        prepack_linears(self)
        if self.lm_head is None:  # tied: pack a copy of the embedding matrix as the head
            self.lm_head = PackedLinear(self.embed_tokens.weight)

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

    def forward(self, batch: ForwardBatch | PagedForwardBatch) -> torch.Tensor:
        """Logits ``[B, V]`` (one position per row) or ``[B, T, V]`` when ``logit_index`` is None.
        For a ``PagedForwardBatch``, ``[len(logit_index), V]``."""
        with torch.inference_mode():
            return self._forward(batch)

    def _forward(self, batch: ForwardBatch) -> torch.Tensor:
        if self.rope is None:
            raise RuntimeError("call init_rope(max_positions) before running the model")
        if isinstance(batch, PagedForwardBatch):
            return self._forward_flat(batch)
        x = self.embed_tokens(batch.input_ids)
        cos, sin = self.rope.lookup(batch.positions, x.dtype)
        t, window = batch.input_ids.shape[1], self.sliding_window
        if batch.cache is None and (window is None or t <= window):
            mask = AttentionMask(is_causal=t > 1)  # the naive engine: positions 0..T-1, a plain triangle
        elif batch.cache is None:
            mask = AttentionMask(mask=causal_mask(batch.positions, t, window))
        else:
            mask = AttentionMask.for_batch(batch, window)  # built once, shared by every layer
        for layer in self.layers:
            x = layer(x, cos, sin, batch, mask, self.attention_fn)
        if batch.logit_index is not None:
            x = x[torch.arange(x.shape[0], device=x.device), batch.logit_index]  # [B, hidden]
        return self._logits(x)

    def _forward_flat(self, batch: PagedForwardBatch) -> torch.Tensor:
        """The same layers on ``[1, N]`` tokens; attention is where the sequences are told apart."""
        x = self.embed_tokens(batch.input_ids)[None]
        cos, sin = self.rope.lookup(batch.positions[None], x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, batch, None, self.paged_attention_fn)
        return self._logits(x[0, batch.logit_index])

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x)
        logits = F.linear(x, self.embed_tokens.weight) if self.lm_head is None else self.lm_head(x)
        return logits.float()
