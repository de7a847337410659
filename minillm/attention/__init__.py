"""Attention backends. ``torch_ref`` is the readable reference every kernel is tested against."""

from minillm.attention.torch_ref import attention, causal_mask

__all__ = ["attention", "causal_mask"]
