"""Padded batches: the naive engine (no cache) and the contiguous KV cache (chapters 01-02).

``ForwardBatch`` is ``B`` sequences of ``T`` new tokens each (right-padded when prompts differ).
Bound to a model it becomes a ``ContiguousStep``, whose ``attend`` writes the new K/V into the
contiguous cache (if any), reads the history back and runs the backend's padded attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minillm.attention.torch_ref import causal_mask


@dataclass
class ForwardBatch:
    """Everything one padded forward pass needs besides the weights.

    ``input_ids`` and ``positions`` are ``[B, T]``: B sequences, T new tokens each (right-padded
    when prompts differ in length). ``positions`` are absolute — they pick the RoPE angle and
    the cache slot. With ``cache=None`` the model attends only to the tokens it is given, which
    must sit at positions ``0..T-1`` (the naive engine); otherwise it first writes the new K/V
    into the cache and attends to positions ``0 .. kv_len-1`` of it. ``logit_index[B]`` selects
    which of the T positions need logits (the last real token of each row); ``None`` returns
    logits for all of them. ``same_start`` lets the cache write a slice instead of scattering,
    decided once per step rather than once per layer.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    cache: object | None = None  # a ContiguousKVCache: write(layer, positions, k, v, same_start), read(...)
    kv_len: int | None = None
    logit_index: torch.Tensor | None = None
    same_start: int | None = None  # set when every row's new tokens start at this position

    @property
    def logit_rows(self) -> torch.Tensor | None:
        """``logit_index`` as rows of the flattened ``[B*T]`` tokens."""
        if self.logit_index is None:
            return None
        b, t = self.input_ids.shape
        return torch.arange(b, device=self.logit_index.device) * t + self.logit_index

    def bind(self, model) -> ContiguousStep:
        return ContiguousStep(self, AttentionMask.for_batch(self, model.sliding_window), model.attention_backend.padded)


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
        """New tokens at ``batch.positions`` attending to positions ``< kv_len`` (the tokens
        themselves without a cache), only the last ``window`` of them with a sliding window."""
        t = batch.input_ids.shape[1]
        kv_len = t if batch.cache is None else batch.kv_len
        start = 0 if batch.cache is None else batch.same_start
        if (window is None or kv_len <= window) and start is not None and start + t == kv_len:
            return cls(is_causal=t > 1)  # all rows at the same position: a plain causal triangle
        return cls(mask=causal_mask(batch.positions, kv_len, window))


class ContiguousStep:
    """The attention of one padded forward pass, built once and shared by every layer."""

    def __init__(self, batch: ForwardBatch, mask: AttentionMask, attention_fn):
        self.batch, self.mask, self.attention_fn = batch, mask, attention_fn

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """``q[B, T, H, D]``, ``k, v[B, T, KV, D]`` → ``[B, T, H, D]``."""
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        cache = self.batch.cache
        if cache is not None:
            cache.write(layer, self.batch.positions, k, v, self.batch.same_start)
            k, v = cache.read(layer, q.shape[0], self.batch.kv_len)
        return self.attention_fn(q, k, v, self.mask.mask, self.mask.is_causal, scale).transpose(1, 2)
