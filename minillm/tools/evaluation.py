"""Measuring a model's quality: perplexity on held-out text.

Every change that trades quality for speed or memory — pooling K/V heads (chapter 05),
quantizing weights or the KV cache, a distilled draft model — is judged by how much it raises
perplexity on text the model never trained on.
"""

from __future__ import annotations

import torch

from minillm.attention.contiguous import ForwardBatch
from minillm.runtime.runner import ChunkInput, StepInputs
from minillm.sampling import SamplingParams


@torch.inference_mode()
def perplexity(model, token_ids: list[int], window: int = 256, batch_size: int = 8) -> float:
    """``exp(mean negative log-likelihood)`` of ``token_ids`` under ``model`` (a ``LlamaForCausalLM``),
    scored in non-overlapping windows of ``window`` tokens (each window predicts its tokens 1..).
    Lower is better; a model that guesses uniformly over V tokens scores V."""
    device = model.device
    n = (len(token_ids) - 1) // window
    if n < 1:
        raise ValueError(f"perplexity needs more than window={window} tokens, got {len(token_ids)}")
    data = torch.tensor(token_ids[: n * window + 1], device=device)
    windows = data[: n * window].view(n, window)
    targets = data[1 : n * window + 1].view(n, window)
    total, count = 0.0, 0
    positions = torch.arange(window, device=device)
    for i in range(0, n, batch_size):
        ids = windows[i : i + batch_size]
        logits = model(ForwardBatch(ids, positions.expand(ids.shape[0], -1)))  # [B, T, V]
        nll = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), targets[i : i + batch_size].flatten(), reduction="sum"
        )
        total += nll.item()
        count += ids.numel()
    return float(torch.exp(torch.tensor(total / count)))


@torch.inference_mode()
def engine_perplexity(engine, token_ids: list[int], window: int = 256, chunk: int = 64) -> float:
    """Perplexity as the paged engine computes it: each window of ``window`` tokens is prefilled
    ``chunk`` tokens at a time through the engine's runner and KV pool, so every position's
    logits come from keys and values read back from the pool — with ``kv_cache_dtype="int8"``
    or ``"fp8"``, the quantized ones. ``perplexity`` (the model alone, no pool) cannot see a
    quantized KV cache; this can."""
    n = (len(token_ids) - 1) // window
    if n < 1:
        raise ValueError(f"perplexity needs more than window={window} tokens, got {len(token_ids)}")
    if engine.block_manager is None:
        raise ValueError("engine_perplexity needs the paged engine (mode='paged')")
    bm, total = engine.block_manager, 0.0
    caching, bm.enable_prefix_caching = bm.enable_prefix_caching, False  # every position computed, none shared
    try:
        for w in range(n):
            total += _window_nll(engine, bm, token_ids[w * window : (w + 1) * window + 1], chunk, ("perplexity", w))
    finally:
        bm.enable_prefix_caching = caching
    return float(torch.exp(torch.tensor(total / (n * window))))


def _window_nll(engine, bm, ids: list[int], chunk: int, request_id) -> float:
    """Summed negative log-likelihood of ``ids[1:]``, prefilled ``chunk`` tokens per step."""
    window, total = len(ids) - 1, 0.0
    seq = engine.make_sequence(ids[:-1], SamplingParams(max_tokens=1), request_id=request_id)
    bm.match_prefix(seq)
    try:
        bm.allocate_slots(seq, window)
        for start in range(0, window, chunk):
            piece = ids[start : start + chunk]
            step = ChunkInput(seq.request_id, piece, start, len(piece), bm.block_table_of(seq))
            logits = engine.runner.execute(StepInputs([step])).float()
            targets = torch.tensor(ids[start + 1 : start + 1 + len(piece)], device=logits.device)
            total += torch.nn.functional.cross_entropy(logits, targets, reduction="sum").item()
    finally:
        engine.runner.release(seq.request_id)
        bm.free(seq)
    return total
