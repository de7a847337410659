"""Measuring a model's quality: perplexity on held-out text.

Every change that trades quality for speed or memory — pooling K/V heads (chapter 05),
quantizing weights or the KV cache, a distilled draft model — is judged by how much it raises
perplexity on text the model never trained on.
"""

from __future__ import annotations

import torch

from minillm.attention.contiguous import ForwardBatch


@torch.inference_mode()
def perplexity(model, token_ids: list[int], window: int = 256, batch_size: int = 8) -> float:
    """``exp(mean negative log-likelihood)`` of ``token_ids`` under ``model`` (a ``LlamaForCausalLM``),
    scored in non-overlapping windows of ``window`` tokens (each window predicts its tokens 1..).
    Lower is better; a model that guesses uniformly over V tokens scores V."""
    device = model.embed_tokens.weight.device
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
