"""One readable Llama-family decoder: Llama, Mistral, Qwen2 and SmolLM are all this file.

    tokens → embedding → N × [ RMSNorm → attention (+ residual) → RMSNorm → SwiGLU MLP (+ residual) ]
           → RMSNorm → LM head → logits

Differences between the checkpoints are configuration, not code: the number of K/V heads
(MHA/GQA/MQA), a bias on the q/k/v projections (Qwen2), a tied or separate LM head, an
explicit ``head_dim``, and the RoPE variant.

The same code builds one **shard** of the model for tensor / pipeline parallelism (chapter 09):
given a ``ParallelContext``, each projection holds only its rank's heads or columns, the
output projections (row parallel) all-reduce inside the layer, and a pipeline stage holds only
its layers (the first the embedding, the last the final norm and LM head). With the default ``SINGLE`` context nothing
is split and nothing is communicated.

For speed the q/k/v projections are fused into one matrix (one matmul instead of three), and
so are the MLP's gate and up projections. The loader fills the fused matrices from the
checkpoint's separate tensors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import minillm.hooks as hooks
from minillm import trusted_cache
from minillm.attention import AttentionBackend, get_backend
from minillm.attention.contiguous import AttentionMask, ForwardBatch
from minillm.config import ModelConfig
from minillm.layers import Linear, LinearMethod
from minillm.layers.embedding import Embedding
from minillm.layers.exact_top import refine_top_logits
from minillm.layers.tensor_parallel import SINGLE, ParallelContext, VocabParallelEmbedding, split_evenly
from minillm.models.rope import RotaryEmbedding

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
    def __init__(self, config: ModelConfig, layer_index: int, parallel: ParallelContext = SINGLE):
        """``layer_index``: this layer's place in the KV cache (within its pipeline stage)."""
        super().__init__()
        self.layer_index = layer_index
        d = self.head_dim = config.head_dim
        q_heads, kv_heads = hooks.heads_of_rank(config.num_heads, config.num_kv_heads, parallel.tp_rank, parallel.tp_size)
        self.num_heads, self.num_kv_heads = len(q_heads), len(kv_heads)  # this rank's
        self.q_size = self.num_heads * d
        self.scale = d**-0.5
        full_q, full_kv = config.num_heads * d, config.num_kv_heads * d
        shards = {"q": full_q, "k": full_kv, "v": full_kv}
        tp = {}
        if parallel.tp_size > 1:  # column-parallel q/k/v by head, row-parallel o over the same q heads
            q_rows, kv_rows = range(q_heads.start * d, q_heads.stop * d), range(kv_heads.start * d, kv_heads.stop * d)
            tp = dict(tp_dim=0, tp_rank=parallel.tp_rank, tp_size=parallel.tp_size, parallel=parallel)
            tp["tp_slices"] = {"q": q_rows, "k": kv_rows, "v": kv_rows}
        self.qkv_proj = Linear(config.hidden_size, full_q + 2 * full_kv, config.attention_bias, shards, **tp)
        if tp:
            tp.update(tp_dim=1, tp_slices={None: q_rows})
        self.o_proj = Linear(full_q, config.hidden_size, **tp)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, step) -> torch.Tensor:
        """``step``: this forward pass's attention (``ContiguousStep`` or a backend's paged step),
        which knows where K/V are kept and what each query may see."""
        b, t, _ = x.shape
        h, kv = self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x).view(b, t, h + 2 * kv, self.head_dim)
        rotary = getattr(step, "attend_rotary", None)  # a step that fuses RoPE with its K/V write
        if rotary is not None and hooks.current("apply_rope") is hooks.default("apply_rope"):
            out = rotary(self.layer_index, qkv, cos, sin, h, kv, self.scale)
        else:
            qk = hooks.apply_rope(qkv[:, :, : h + kv], cos, sin)  # q and k heads rotated in one go
            out = step.attend(self.layer_index, qk[:, :, :h], qk[:, :, h:], qkv[:, :, h + kv :], self.scale)
        return self.o_proj(out.reshape(b, t, self.q_size))  # row parallel: the layer all-reduces


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with gate and up fused into one matmul. Under TP gate/up
    are column parallel and down row parallel over the same slice of the intermediate size:
    SiLU × up is element-wise, so it needs nothing from the other ranks."""

    def __init__(self, config: ModelConfig, parallel: ParallelContext = SINGLE):
        super().__init__()
        full = config.intermediate_size
        shards = {"gate": full, "up": full}
        tp = {}
        if parallel.tp_size > 1:
            keep = split_evenly(full, parallel.tp_size, parallel.tp_rank)
            tp = dict(tp_dim=0, tp_rank=parallel.tp_rank, tp_size=parallel.tp_size, parallel=parallel)
            tp["tp_slices"] = {"gate": keep, "up": keep}
        self.gate_up_proj = Linear(config.hidden_size, 2 * full, shards=shards, **tp)
        self.intermediate_size = self.gate_up_proj.out_features // 2  # this rank's
        if tp:
            tp.update(tp_dim=1, tp_slices={None: keep})
        self.down_proj = Linear(full, config.hidden_size, **tp)

    fused = None  # models/triton_fused.py, when the model runs fused kernels (set_fused_kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused is not None:
            return self.down_proj(self.fused.silu_and_mul(self.gate_up_proj(x)))
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)  # row parallel: the layer all-reduces


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int, parallel: ParallelContext = SINGLE):
        super().__init__()
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = Attention(config, layer_index, parallel)
        self.post_attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SwiGLU(config, parallel)

    fused = None  # models/triton_fused.py, when the model runs fused kernels (set_fused_kernels)

    def forward(self, x, cos, sin, step):
        if self.fused is not None:  # the residual add and the second norm in one kernel
            norm = self.post_attn_norm
            h, x = self.fused.add_rms_norm(self.attn(self.input_norm(x), cos, sin, step), x, norm.weight, norm.eps)
            return x + self.mlp(h)
        x = x + self.attn(self.input_norm(x), cos, sin, step)
        return x + self.mlp(self.post_attn_norm(x))


@hooks.reference("decoder_layer")
def run_decoder_layer(layer: DecoderLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, step) -> torch.Tensor:
    """The package's block: the module itself (a hook, so chapter 01 can run a learner's block as
    every layer of the real model; one call more per layer)."""
    return layer(x, cos, sin, step)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, parallel: ParallelContext = SINGLE):
        """``parallel``: build only this rank's shard (see the module docstring)."""
        super().__init__()
        self.config = config
        self.parallel = parallel
        cfg, tp = config, parallel
        self.layer_range = tp.layers(cfg.num_layers)  # this pipeline stage's layers (all of them at PP = 1)
        self.embed_tokens: Embedding | None = None
        if tp.is_first_stage:
            self.embed_tokens = (
                Embedding(cfg.vocab_size, cfg.hidden_size)
                if tp.tp_size == 1
                else VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
            )
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, tp) for i in range(len(self.layer_range)))
        self.norm = self.lm_head = None
        self.vocab_sizes = [len(split_evenly(cfg.vocab_size, tp.tp_size, r)) for r in range(tp.tp_size)]
        if tp.is_last_stage:
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            head = {}
            if tp.tp_size > 1:  # column parallel by vocabulary: this rank's logits, gathered after
                rows = split_evenly(cfg.vocab_size, tp.tp_size, tp.tp_rank)
                head = dict(tp_dim=0, tp_rank=tp.tp_rank, tp_size=tp.tp_size, tp_slices={None: rows})
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, **head)
        self.tie_weights()
        self.rope: RotaryEmbedding | None = None
        self.attention_backend: AttentionBackend = get_backend("sdpa")
        self.sliding_window = config.sliding_window  # the engine may set its own
        self._compiled_step = None
        self._compiled_single_row_only = False

    @property
    def device(self) -> torch.device:
        """Where the weights live (a norm's weight is always a plain tensor, whatever storage
        the embedding or the linear layers use; every shard has its layers' norms)."""
        return self.layers[0].input_norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype: the model's floating-point dtype."""
        return self.layers[0].input_norm.weight.dtype

    def tie_weights(self) -> None:
        """Tied checkpoints use the embedding matrix as the LM head: one tensor, two uses (when
        one shard holds both; a last pipeline stage alone loads the matrix into its head). An
        embedding that reads its rows through the head (an int8 head) has no table to share."""
        embed, head = self.embed_tokens, self.lm_head
        if self.config.tie_word_embeddings and embed is not None and head is not None and embed.weight is not None:
            head.weight = embed.weight

    def checkpoint_targets(self) -> dict[str, tuple[nn.Module, str, str | None]]:
        """HF checkpoint name → (module, parameter, shard of a fused matrix). The loader hands
        each tensor to ``module.weight_loader`` (linear layers) or copies it (the rest)."""
        cfg = self.config
        out: dict[str, tuple[nn.Module, str, str | None]] = {}
        if self.embed_tokens is not None:
            out["model.embed_tokens.weight"] = (self.embed_tokens, "weight", None)
        if self.lm_head is not None:
            out["model.norm.weight"] = (self.norm, "weight", None)
            if not cfg.tie_word_embeddings:
                out["lm_head.weight"] = (self.lm_head, "weight", None)
            elif self.embed_tokens is None:  # a last stage without the embedding: its head reads the matrix
                out["model.embed_tokens.weight"] = (self.lm_head, "weight", None)
        for i, layer in zip(self.layer_range, self.layers):
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

    def set_attention_backend(self, name: str, decode_dtype: torch.dtype | None = None) -> None:
        """``torch`` | ``sdpa`` | ``cpu`` | ``triton`` (the engine's builder resolves ``auto`` first);
        ``decode_dtype``: compute paged decode attention in this dtype (None: the model's)."""
        self.attention_backend = get_backend(name, decode_dtype)

    def set_fused_kernels(self, on: bool) -> None:
        """Run each layer's residual add + RMSNorm and its SiLU × up as fused Triton kernels
        (``models/triton_fused.py``: four launches fewer per layer, for launch-bound GPU decode),
        or PyTorch's ops. The builder turns them on for the Triton backend on a GPU."""
        fused = None
        if on:
            # deferred: triton: imported only when the fused Triton kernels run
            from minillm.models import triton_fused as fused
        for layer in self.layers:
            layer.fused = layer.mlp.fused = fused

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
        trusted_cache.guard_inductor()  # what inductor finds on disk runs only if recorded; recorded at exit
        self._compiled_step = torch.compile(self._forward, dynamic=True)
        self._compiled_single_row_only = single_row_only

    def decode_step(self, batch: ForwardBatch) -> torch.Tensor:
        """A decode step: the compiled graph when ``compile_decode`` was called, else eager."""
        eager = self._compiled_step is None or (self._compiled_single_row_only and batch.input_ids.shape[0] > 1)
        if eager:
            return self.forward(batch)
        with torch.no_grad():  # compiled graphs cannot run under inference_mode
            return self._compiled_step(batch)

    def forward(self, batch, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Logits for ``batch`` — a padded ``ForwardBatch`` or a paged ``StepLayout``; the batch
        binds its own attention (``batch.bind(self)``), so the model never asks which it is.

        Returns ``[R, V]`` for the rows ``batch.logit_rows`` selects, or ``[B, T, V]`` when it
        selects none. A pipeline stage after the first takes the previous stage's ``hidden``
        states instead of embedding the ids; a stage before the last returns its hidden states."""
        with torch.inference_mode():
            return self._forward(batch, hidden)

    def _forward(self, batch, hidden: torch.Tensor | None = None) -> torch.Tensor:
        if self.rope is None:
            raise RuntimeError("call init_rope(max_positions) before running the model")
        x = self._hidden_states(batch, hidden)
        if self.lm_head is None:
            return x  # the next pipeline stage carries on
        if getattr(batch, "keep_hidden", False):  # a feature-level draft reads them (speculative/eagle.py)
            self.last_hidden = x.flatten(0, 1)
        return self._logits(batch, x)

    def forward_with_hidden(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits as ``_forward`` gives them, and every token's last hidden state ``[N, hidden]``
        (the last layer's output, before the final norm) — one pass, two outputs: what a
        compiled decode graph returns when a feature-level draft needs the features."""
        x = self._hidden_states(batch, None)
        return self._logits(batch, x), x.flatten(0, 1)

    def _hidden_states(self, batch, hidden: torch.Tensor | None) -> torch.Tensor:
        step = batch.bind(self)  # built once, shared by every layer
        x = self.embed_tokens(batch.input_ids) if hidden is None else hidden
        cos, sin = self.rope.lookup(batch.positions, x.dtype)
        for layer in self.layers:
            x = hooks.decoder_layer(layer, x, cos, sin, step)  # chapter 01's learner writes one
        return x

    def _logits(self, batch, x: torch.Tensor) -> torch.Tensor:
        rows = batch.logit_rows
        if rows is not None:
            x = x.flatten(0, 1)[rows]  # [R, hidden]
        h = self.norm(x)
        logits = self.parallel.gather_columns(self.lm_head(h), self.vocab_sizes).float()
        return refine_top_logits(logits, h, self.lm_head)  # bf16 near-ties decided in fp32 (exact_top.py)
