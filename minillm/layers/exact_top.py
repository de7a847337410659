"""The top logits of a half-precision LM head, recomputed exactly.

A bf16 matrix product rounds each output to 8 significant bits: at a logit of 20 one step is
0.125. Two candidates for the next token that are 0.1 apart in exact arithmetic can round to
the *same* value, and ``argmax`` then picks the lower token id — a coin flip decided by the
vocabulary's order, and by which CPU rounded how. Measured on SmolLM2-135M in bf16 (AMD EPYC
without AVX-512, 2026-12-04): asked "What is the capital of France?", "The" (-1.864 in fp32)
and "L" (-1.963) both came out at -1.973, and greedy decoding answered "L'Étoile, la
Marseillaise, ..." instead of "The capital of France is Paris." On an Intel Xeon with AMX the
same weights did not tie.

Computing the whole head in fp32 would fix it at 2.6× the head's cost at batch 1 on that CPU
(8.5 vs 3.3 ms; at 8 rows the two cost the same; ``benchmarks/bench_exact_top.py``: the
refinement adds 2-3%), and PyTorch has no CPU product that reads bf16 and writes fp32. So only the logits that could be the row's maximum are recomputed in fp32: every entry
within two rounding steps of the row's (rounded) maximum. An entry outside that band was at
least 1.5 steps below the true maximum before rounding, so the row's exact argmax is always in
the band, and after the recomputation ``argmax`` is exact. Typically the band holds one or two
entries per row: a few hundred multiply-adds, against the head's 28 million.

The rest of the row keeps its rounded values: sampling at a temperature draws from the same
distribution to within the rounding, as in every bf16 engine (vLLM upcasts the rounded logits).
Left out: tensor-parallel heads (each rank holds a slice of the vocabulary; the gathered row
is refined only where one process holds the whole head), heads whose storage cannot give its
rows (int4), and CUDA devices, where finding the band would synchronise the host every step.
"""

from __future__ import annotations

import torch

HALF = (torch.bfloat16, torch.float16)
BAND_STEPS = 2  # rounding steps below the row's maximum that are recomputed


def refine_top_logits(logits: torch.Tensor, hidden: torch.Tensor, head, norm=None) -> torch.Tensor:
    """``logits`` ``[..., V]`` (fp32 holding half-precision values) with every entry that could
    be its row's maximum recomputed in fp32 from ``hidden`` ``[..., H]`` (the head's input; or
    its input before ``norm``, applied here to the rows that need it) and the head's rows.
    Changes ``logits`` in place and returns it; returns it untouched where nothing can tie."""
    if hidden.dtype not in HALF or logits.device.type != "cpu" or getattr(head, "tp_size", 1) > 1:
        return logits
    if not getattr(head, "gives_rows", False):
        return logits
    if torch.compiler.is_compiling():  # a traced graph has no data-dependent band: its caller refines
        return logits
    vocab = logits.shape[-1]
    rows = logits.reshape(-1, vocab)
    top = rows.max(dim=-1, keepdim=True).values
    step = torch.finfo(hidden.dtype).eps * top.abs()  # an upper bound of one rounding step at the maximum
    row, col = torch.nonzero(rows >= top - BAND_STEPS * step, as_tuple=True)
    if col.numel() == rows.shape[0]:  # one entry per row in the band: its argmax is already exact
        return logits
    x = hidden.reshape(-1, hidden.shape[-1])[row]
    if norm is not None:
        x = norm(x)
    exact = (x.float() * head.embedding_rows(col).float()).sum(-1)
    if getattr(head, "bias", None) is not None:
        exact += head.bias[col].float()
    rows[row, col] = exact
    return logits
