"""Chapter 06: more wrong answers a learner writes (see ``check_catalogue``).

The Triton kernel's wrong variants live in ``test_check_catalogue.py`` (a kernel needs
``@triton.jit`` at import time); here, the online-softmax update."""

from __future__ import annotations

import torch
from check_catalogue import right, wrong  # noqa: F401


def _update(
    m,
    l_sum,
    acc,
    scores,
    v,
    *,
    tile_max="rows",
    in_place=False,
    inverted=False,
    old_max=False,
    sum_dim=-1,
    carry_l=True,
    carry_acc=True,
    transpose_p=False,
    normalise=False,
    return_old_m=False,
    order=("m", "l", "acc"),
):
    """The update of the solution, with one of a learner's slips."""
    if tile_max == "rows":
        tile = scores.max(dim=-1).values
    elif tile_max == "columns":
        tile = scores.max(dim=0).values  # the max over the queries, one per key
    else:
        tile = scores.max()  # one max for the whole tile
    m_new = torch.maximum(m, tile, out=m) if in_place else torch.maximum(m, tile)
    alpha = torch.exp(m_new - m) if inverted else torch.exp(m - m_new)
    p = torch.exp(scores - (m if old_max else m_new)[:, None])
    new_l = (l_sum * alpha if carry_l else 0) + p.sum(dim=sum_dim)
    new_acc = (acc * alpha[:, None] if carry_acc else 0) + (p.T @ v if transpose_p else p @ v)
    if normalise:
        new_acc = new_acc / new_l[:, None]
    values = {"m": m if return_old_m else m_new, "l": new_l, "acc": new_acc}
    return tuple(values[name] for name in order)


def online_softmax_no_infinity(m, l_sum, acc, scores, v):
    """Avoids -inf by starting the running max at 0: a row whose scores are all negative gets
    the wrong max (and, far enough below 0, an l that underflows)."""
    return _update(torch.nan_to_num(m, neginf=0.0), l_sum, acc, scores, v)


def online_softmax_in_place(m, l_sum, acc, scores, v):
    """Correct, and updates the caller's l and acc in place (allowed: they are the loop's state)."""
    m_new = torch.maximum(m, scores.amax(-1))
    scale = (m - m_new).exp()
    weights = (scores - m_new.unsqueeze(-1)).exp()
    l_sum.mul_(scale).add_(weights.sum(-1))
    acc.mul_(scale.unsqueeze(-1)).addmm_(weights, v)
    return m_new, l_sum, acc


right("check_online_softmax", online_softmax_in_place)
wrong("check_online_softmax", "rescaled the wrong way round", lambda *a: _update(*a, inverted=True))
wrong("check_online_softmax", "p is taken against the old max", lambda *a: _update(*a, old_max=True))
wrong("check_online_softmax", "not each key's max", lambda *a: _update(*a, tile_max="columns"))
wrong("check_online_softmax", "the max of the whole tile", lambda *a: _update(*a, tile_max="whole"))
wrong("check_online_softmax", "p is summed over the wrong axis", lambda *a: _update(*a, sum_dim=0))
wrong("check_online_softmax", "it adds p.T @ v", lambda *a: _update(*a, transpose_p=True))
wrong("check_online_softmax", "acc is divided by l", lambda *a: _update(*a, normalise=True))
wrong("check_online_softmax", "only this tile's sum", lambda *a: _update(*a, carry_l=False))
wrong("check_online_softmax", "only this tile's p @ v", lambda *a: _update(*a, carry_acc=False))
wrong("check_online_softmax", "changed its argument m in place", lambda *a: _update(*a, in_place=True))
wrong("check_online_softmax", "it came back unchanged", lambda *a: _update(*a, return_old_m=True))
wrong("check_online_softmax", "returned (m, acc, l)", lambda *a: _update(*a, order=("m", "acc", "l")))
wrong("check_online_softmax", "after the first tile", online_softmax_no_infinity)
