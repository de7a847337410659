"""The acceptance rules: which proposed tokens the target keeps, and what it says instead.

The target model scores all k proposed tokens in one forward pass: its logits at the k + 1
positions (the sequence's last token, then each proposal) are what it would have produced one
token at a time. What is emitted must be *exactly* what the target alone would produce:

- **greedy** — keep proposals while they equal the target's argmax; at the first that does
  not, emit the target's own token instead and stop. If all k are kept, the (k+1)-th position
  gives one more token for free. Every step emits between 1 and k + 1 tokens.
- **sampling** (Leviathan et al., 2023; Chen et al., 2023) — proposal ``d`` drawn from the
  draft's distribution ``q`` is kept with probability ``min(1, p(d) / q(d))``, where ``p`` is
  the target's; when it is rejected, the replacement is drawn from the *residual*
  ``normalize(max(0, p − q))``. Together the two cases give ``P(token) = p(token)`` exactly:
  kept mass ``min(p, q)`` plus replaced mass ``(1 − Σ min(p, q)) · residual = max(0, p − q)``.
  A proposer without a distribution (n-gram lookup) proposes deterministically: ``q`` is one
  point, ``p(d)`` is its acceptance probability, and the residual is ``p`` without ``d``.

``p`` and ``q`` are the distributions the request samples from — after temperature, top-k,
top-p and min-p — so the guarantee covers those too.
"""

from __future__ import annotations

import torch

import minillm.hooks as hooks


@hooks.reference("accept_greedy")  # Speculator.verify calls it through the hook (chapter 08's exercise)
def accept_greedy(target_tokens: list[int], draft_tokens: list[int]) -> list[int]:
    """``target_tokens``: the target's argmax at each of the ``k + 1`` positions; returns the
    tokens to emit — the longest agreeing prefix of ``draft_tokens``, then the target's token."""
    emitted = []
    for draft, target in zip(draft_tokens, target_tokens):
        if draft != target:
            return [*emitted, target]
        emitted.append(draft)
    return [*emitted, target_tokens[len(draft_tokens)]]


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``normalize(max(0, p − q))``: where the target wants more mass than the draft gave.
    (When ``q`` covers ``p`` everywhere nothing is rejected, so the fallback ``p`` is never
    reached with a positive probability.)"""
    r = (p - q).clamp(min=0)
    total = r.sum()
    return r / total if total > 0 else p


@hooks.reference("accept_sampled")  # Speculator.verify calls it through the hook (chapter 08's exercise)
def accept_sampled(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    draft_tokens: list[int],
    generator: torch.Generator | None = None,
) -> list[int]:
    """``target_probs[k+1, V]``, ``draft_probs[k, V]`` (None: deterministic proposals) → the
    tokens to emit, distributed exactly as the target's own samples."""
    emitted = []
    for i, token in enumerate(draft_tokens):
        p = target_probs[i]
        if draft_probs is None:
            q = torch.zeros_like(p)
            q[token] = 1.0
        else:
            q = draft_probs[i]
        u = torch.rand((), generator=generator, device=p.device)
        if u * q[token] < p[token]:  # u < p/q without dividing by a q that may be 0
            emitted.append(token)
            continue
        replacement = torch.multinomial(residual_distribution(p, q), 1, generator=generator)
        return [*emitted, int(replacement)]
    bonus = torch.multinomial(target_probs[len(draft_tokens)], 1, generator=generator)
    return [*emitted, int(bonus)]
