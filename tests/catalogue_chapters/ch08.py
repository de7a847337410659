"""Chapter 08: more wrong answers a learner writes (see ``check_catalogue``)."""

from __future__ import annotations

import torch
from check_catalogue import right, wrong  # noqa: F401

from minillm.kvcache.addressing import RELEASED

# ---- accept_greedy -------------------------------------------------------------------------------

CG = "check_accept_greedy"


def greedy_extends_drafts(target_tokens, draft_tokens):
    """Right tokens, but built in the caller's list: the engine's proposals grow or shrink."""
    for i, d in enumerate(draft_tokens):
        if d != target_tokens[i]:
            del draft_tokens[i:]
            break
    draft_tokens.append(target_tokens[len(draft_tokens)])
    return draft_tokens


def greedy_loop_variable(target_tokens, draft_tokens):
    out = []
    for i, d in enumerate(draft_tokens):
        if d != target_tokens[i]:
            return out + [target_tokens[i]]
        out.append(d)
    return out + [target_tokens[i + 1]]  # i does not exist when nothing was proposed


def greedy_nothing_proposed_is_empty(target_tokens, draft_tokens):
    if not draft_tokens:
        return []
    out = []
    for i, d in enumerate(draft_tokens):
        if d != target_tokens[i]:
            return out + [target_tokens[i]]
        out.append(d)
    return out + [target_tokens[-1]]


def greedy_counts_all_agreements(target_tokens, draft_tokens):
    n = sum(d == t for d, t in zip(draft_tokens, target_tokens))
    return list(draft_tokens[:n]) + [target_tokens[n]]


def greedy_replacement_one_later(target_tokens, draft_tokens):
    out = []
    for i, d in enumerate(draft_tokens):
        if d != target_tokens[i]:
            return out + [target_tokens[i + 1]]
        out.append(d)
    return out + [target_tokens[len(draft_tokens)]]


def greedy_break_then_bonus(target_tokens, draft_tokens):
    out = []
    for i, d in enumerate(draft_tokens):
        if d != target_tokens[i]:
            out.append(target_tokens[i])
            break
        out.append(d)
    return out + [target_tokens[len(draft_tokens)]]


wrong(CG, "changed its argument draft_tokens", greedy_extends_drafts)
wrong(CG, "accept_greedy([3], []) raised UnboundLocalError", greedy_loop_variable)
wrong(CG, "with no proposals (the draft proposed nothing this step)", greedy_nothing_proposed_is_empty)
wrong(CG, "not the agreeing *prefix*", greedy_counts_all_agreements)
wrong(
    CG,
    "you emitted target_tokens[2] = 7; the replacement is the target's token at the same position",
    greedy_replacement_one_later,
)
wrong(CG, "after a rejected proposal you appended the bonus token", greedy_break_then_bonus)

# ---- accept_sampled -------------------------------------------------------------------------------

CS = "check_accept_sampled"


def _q_of(target_probs, draft_probs, i, d):
    if draft_probs is None:
        q = torch.zeros_like(target_probs[i])
        q[d] = 1.0
        return q
    return draft_probs[i]


def sampled(target_probs, draft_probs, draft_tokens, generator=None, keep=None, residual=None, draw=None, tail=None):
    """The rule with one piece swapped: keep(u, p_d, q_d), residual(p, q, d), draw(weights, generator)."""
    keep = keep or (lambda u, p_d, q_d: u * q_d < p_d)
    residual = residual or (lambda p, q, d: (p - q).clamp(min=0))
    draw = draw or (lambda w, g: int(torch.multinomial(w / w.sum(), 1, generator=g)))
    out = []
    for i, d in enumerate(draft_tokens):
        p, q = target_probs[i], _q_of(target_probs, draft_probs, i, d)
        if keep(float(torch.rand((), generator=generator)), float(p[d]), float(q[d])):
            out.append(d)
            continue
        out.append(draw(residual(p, q, d), generator))
        if tail is None:
            return out
        break
    bonus = torch.multinomial(target_probs[len(draft_tokens)], 1, generator=generator)
    return out + [int(bonus) if tail is None else tail(bonus)]


def _p_without_d(p, q, d):
    r = p.clone()
    r[d] = 0
    return r


def sampled_none_means_no_draft(target_probs, draft_probs, draft_tokens, generator=None):
    """draft_probs=None read as "the draft agrees with the target": q = p, every proposal kept."""
    out = []
    for i, d in enumerate(draft_tokens):
        p = target_probs[i]
        q = p if draft_probs is None else draft_probs[i]
        if torch.rand((), generator=generator) * q[d] < p[d]:
            out.append(d)
            continue
        r = (p - q).clamp(min=0)
        return out + [int(torch.multinomial(r / r.sum(), 1, generator=generator))]
    return out + [int(torch.multinomial(target_probs[len(draft_tokens)], 1, generator=generator))]


wrong(CS, "torch.multinomial refused the weights", lambda *a: sampled(*a, residual=lambda p, q, d: p - q))
wrong(CS, "residual's most likely token (an argmax)", lambda *a: sampled(*a, draw=lambda w, g: int(w.argmax())))
wrong(CS, "with the rejected token removed", lambda *a: sampled(*a, residual=_p_without_d))
wrong(CS, "the comparison is inverted", lambda *a: sampled(*a, keep=lambda u, p_d, q_d: u * q_d >= p_d))
wrong(CS, "kept with probability p(x), forgetting the draft", lambda *a: sampled(*a, keep=lambda u, p_d, q_d: u < p_d))
wrong(CS, "should return a list of Python ints", lambda *a: sampled(*a, tail=lambda bonus: bonus))
wrong(CS, "after the first rejected proposal comes one replacement, and then nothing", lambda *a: sampled(*a, tail=int))
wrong(
    CS,
    "with draft_probs=None (deterministic proposals, as prompt lookup makes) the proposal was kept 100.0%",
    sampled_none_means_no_draft,
)

# ---- blocks_to_roll_back ------------------------------------------------------------------------

CR = "check_rollback"


def rollback_reversed_iterator(table, num_tokens, block_size):
    keep = -(-num_tokens // block_size)
    return table[:keep], reversed([b for b in table[keep:] if b != RELEASED])


def rollback_drops_released_from_kept(table, num_tokens, block_size):
    keep = -(-num_tokens // block_size)
    return [b for b in table[:keep] if b != RELEASED], [b for b in reversed(table[keep:]) if b != RELEASED]


def rollback_tokens_as_entries(table, num_tokens, block_size):
    return table[:num_tokens], [b for b in reversed(table[num_tokens:]) if b != RELEASED]


def rollback_rounded(table, num_tokens, block_size):
    keep = round(num_tokens / block_size)  # to the nearest: 17 tokens of 16 keep 1 block
    return table[:keep], [b for b in reversed(table[keep:]) if b != RELEASED]


def rollback_sorted_by_number(table, num_tokens, block_size):
    keep = -(-num_tokens // block_size)
    return table[:keep], sorted((b for b in table[keep:] if b != RELEASED), reverse=True)


wrong(CR, "returned freed as a list_reverseiterator, an iterator, not a list", rollback_reversed_iterator)
wrong(CR, "you dropped the -1 (RELEASED) entries from kept", rollback_drops_released_from_kept)
wrong(CR, "4 blocks kept for 6 tokens of 4 per block", rollback_tokens_as_entries)
wrong(CR, "you sorted the blocks by their number", rollback_sorted_by_number)
wrong(CR, "the last kept block is only partly filled (token 16 of a block of 16)", rollback_rounded)
