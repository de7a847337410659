"""Chapter 01: more wrong answers a learner writes (see ``check_catalogue``)."""

from __future__ import annotations

import math

import numpy as np
import torch
from check_catalogue import generate_naive, right, wrong  # noqa: F401

from minillm.course import forward_logits

# ---- generate_naive -------------------------------------------------------------------------

GN = "check_generate_naive"


def naive_le(model, prompt_ids, max_new_tokens):
    """``<=`` where ``<`` belongs: one token too many."""
    ids = list(prompt_ids)
    while len(ids) <= len(prompt_ids) + max_new_tokens:
        ids.append(int(forward_logits(model, ids)[-1].argmax()))
    return ids[len(prompt_ids) :]


def naive_aliases_prompt(model, prompt_ids, max_new_tokens):
    """``ids = prompt_ids`` does not copy: the caller's prompt list grows."""
    ids = prompt_ids
    for _ in range(max_new_tokens):
        ids.append(int(forward_logits(model, ids)[-1].argmax()))
    return ids[len(ids) - max_new_tokens :]


def naive_no_return(model, prompt_ids, max_new_tokens):
    ids = list(prompt_ids)
    for _ in range(max_new_tokens):
        ids.append(int(forward_logits(model, ids)[-1].argmax()))


def naive_slice_from_last_prompt_token(model, prompt_ids, max_new_tokens):
    ids = list(prompt_ids)
    for _ in range(max_new_tokens):
        ids.append(int(forward_logits(model, ids)[-1].argmax()))
    return ids[len(prompt_ids) - 1 :]


def naive_slice_one_late(model, prompt_ids, max_new_tokens):
    ids = list(prompt_ids)
    for _ in range(max_new_tokens):
        ids.append(int(forward_logits(model, ids)[-1].argmax()))
    return ids[len(prompt_ids) + 1 :]


def naive_records_before_appending(model, prompt_ids, max_new_tokens):
    """Records ``ids[-1]`` at the top of the loop, before the new token is appended."""
    ids, new = list(prompt_ids), []
    for _ in range(max_new_tokens):
        new.append(ids[-1])
        ids.append(int(forward_logits(model, ids)[-1].argmax()))
    return new


def naive_returns_tensor(model, prompt_ids, max_new_tokens):
    ids = torch.tensor(prompt_ids)
    for _ in range(max_new_tokens):
        ids = torch.cat([ids, forward_logits(model, ids.tolist())[-1:].argmax(-1)])
    return ids[len(prompt_ids) :]


def naive_one_pass(model, prompt_ids, max_new_tokens):
    """Reads "one pass scores every prefix at once" as: one pass generates every token."""
    return forward_logits(model, list(prompt_ids)).argmax(dim=-1).tolist()


def naive_second_to_last_row(model, prompt_ids, max_new_tokens):
    ids, new = list(prompt_ids), []
    for _ in range(max_new_tokens):
        logits = forward_logits(model, ids)
        new.append(int(logits[len(ids) - 2].argmax()))
        ids.append(new[-1])
    return new


def naive_prepends(model, prompt_ids, max_new_tokens):
    """``new.insert(0, token)``: the new tokens come back newest first."""
    ids, new = list(prompt_ids), []
    for _ in range(max_new_tokens):
        token = int(forward_logits(model, ids)[-1].argmax())
        ids.append(token)
        new.insert(0, token)
    return new


wrong(GN, "returned 33 tokens, expected 32", naive_le)
wrong(GN, "added tokens to the prompt_ids list", naive_aliases_prompt)
wrong(GN, "returned None", naive_no_return)
wrong(GN, "starts with the last 1 prompt token", naive_slice_from_last_prompt_token)
wrong(GN, "starts with the last 1 prompt token", naive_records_before_appending)
wrong(GN, "misses the first 1 new token", naive_slice_one_late)
wrong(GN, "got Tensor", naive_returns_tensor)
wrong(GN, "one forward pass over the prompt", naive_one_pass)
wrong(GN, "each of your first 4 tokens is the argmax of logits[-2]", naive_second_to_last_row)
wrong(GN, "in reverse order", naive_prepends)


def naive_with(choose):
    """The right loop, with the token chosen from the logits by ``choose(logits) -> int``."""

    def loop(model, prompt_ids, max_new_tokens):
        ids = list(prompt_ids)
        for _ in range(max_new_tokens):
            ids.append(choose(forward_logits(model, ids)))
        return ids[len(prompt_ids) :]

    return loop


def _sampled(logits):
    return int(torch.multinomial(torch.softmax(logits[-1], dim=-1), 1))


def _argmax_numpy(logits):
    """Right, by another road: NumPy's argmax of the last row, made a Python int."""
    return int(np.argmax(logits[-1].numpy()))


right(GN, naive_with(_argmax_numpy))
wrong(GN, "the *smallest* logit of the last position", naive_with(lambda logits: int(logits[-1].argmin())))
wrong(GN, "the largest logit's *value*", naive_with(lambda logits: int(logits[-1].max())))
wrong(GN, "the largest logit's *value*", naive_with(lambda logits: int(torch.max(logits[-1], dim=-1)[0])))
wrong(GN, "a position index rather than a token id", naive_with(lambda logits: int(logits.argmax(dim=0)[-1])))
wrong(GN, "no sampling", naive_with(_sampled))
wrong(GN, "argmax of row 0", naive_with(lambda logits: int(logits[0].argmax())))

# ---- causal_attention -----------------------------------------------------------------------

CA = "check_causal_attention"


def _scores(q, k, scale):
    return q @ k.transpose(-1, -2) * scale


def _keep(q):
    t = q.shape[-2]
    return torch.ones(t, t, dtype=torch.bool).tril()


def attention_scale(scale_of):
    """Causal attention whose scores are multiplied by ``scale_of(q)`` instead of 1/sqrt(head_dim)."""

    def attention(q, k, v):
        scores = _scores(q, k, scale_of(q)).masked_fill(~_keep(q), float("-inf"))
        return torch.softmax(scores, dim=-1) @ v

    return attention


def attention_mask_after_softmax(q, k, v):
    weights = torch.softmax(_scores(q, k, q.shape[-1] ** -0.5), dim=-1)
    return (weights * _keep(q)) @ v


def attention_zero_mask(q, k, v):
    """Multiplies the scores by the 0/1 mask: hidden scores become 0, not -inf."""
    return torch.softmax(_scores(q, k, q.shape[-1] ** -0.5) * _keep(q), dim=-1) @ v


def attention_sees_next(q, k, v):
    t = q.shape[-2]
    future = torch.ones(t, t, dtype=torch.bool).triu(diagonal=2)  # should be diagonal=1
    return torch.softmax(_scores(q, k, q.shape[-1] ** -0.5).masked_fill(future, float("-inf")), dim=-1) @ v


def attention_transposed_scores(q, k, v):
    scores = k @ q.transpose(-1, -2) / math.sqrt(q.shape[-1])
    return torch.softmax(scores.masked_fill(~_keep(q), float("-inf")), dim=-1) @ v


def attention_weights_only(q, k, v):
    scores = _scores(q, k, q.shape[-1] ** -0.5).masked_fill(~_keep(q), float("-inf"))
    return torch.softmax(scores, dim=-1)


def attention_additive_mask_nan(q, k, v):
    """An additive mask made by multiplying with -inf: 0 × -inf is NaN, not 0."""
    t = q.shape[-2]
    mask = torch.ones(t, t).triu(diagonal=1) * float("-inf")
    return torch.softmax(_scores(q, k, q.shape[-1] ** -0.5) + mask, dim=-1) @ v


def attention_double(q, k, v):
    """Computes in float64 "for accuracy" and forgets to cast back."""
    q, k, v = q.double(), k.double(), v.double()
    scores = _scores(q, k, q.shape[-1] ** -0.5).masked_fill(~_keep(q), float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def attention_scale_after_softmax(q, k, v):
    scores = _scores(q, k, 1.0).masked_fill(~_keep(q), float("-inf"))
    return torch.softmax(scores, dim=-1) / math.sqrt(q.shape[-1]) @ v


def attention_merged_heads(q, k, v):
    """Merges the heads as an attention *layer* would, but this function returns per-head outputs."""
    b, h, t, d = q.shape
    scores = _scores(q, k, d**-0.5).masked_fill(~_keep(q), float("-inf"))
    return (torch.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(b, t, h * d)


wrong(CA, "divided by head_dim (8) instead of by sqrt(head_dim)", attention_scale(lambda q: 1 / q.shape[-1]))
wrong(CA, "sqrt of the number of positions", attention_scale(lambda q: q.shape[-2] ** -0.5))
wrong(CA, "multiplied by sqrt(head_dim)", attention_scale(lambda q: q.shape[-1] ** 0.5))
wrong(CA, "mask is applied after the softmax", attention_mask_after_softmax)
wrong(CA, "set to 0, not -inf", attention_zero_mask)
wrong(CA, "query 0 gives weight", attention_sees_next)
wrong(CA, "scores are transposed", attention_transposed_scores)
wrong(CA, "the attention weights", attention_weights_only)
wrong(CA, "0 × -inf", attention_additive_mask_nan)
wrong(CA, "has dtype torch.float64, expected torch.float32", attention_double)
wrong(CA, "the scale is applied after the softmax", attention_scale_after_softmax)
wrong(CA, "has shape (2, 5, 24)", attention_merged_heads)


def attention_scales_q_in_place(q, k, v):
    q *= q.shape[-1] ** -0.5  # scales the caller's q
    return torch.softmax(_scores(q, k, 1.0).masked_fill(~_keep(q), float("-inf")), dim=-1) @ v


wrong(CA, "changed its input q in place", attention_scales_q_in_place)


def attention_manual_softmax_sum_all(q, k, v):
    """A hand-written softmax whose sum has no dim: it normalises over every score of the tensor."""
    scores = _scores(q, k, q.shape[-1] ** -0.5).masked_fill(~_keep(q), float("-inf"))
    weights = scores.exp()
    return weights / weights.sum() @ v


wrong(CA, "attention weights sum to", attention_manual_softmax_sum_all)


def attention_manual_softmax_no_max(q, k, v):
    """A hand-written softmax, exp over its row sum, that never subtracts the row's max."""
    scores = _scores(q, k, q.shape[-1] ** -0.5).masked_fill(~_keep(q), float("-inf"))
    weights = scores.exp()
    return weights / weights.sum(dim=-1, keepdim=True) @ v


def attention_exp2_no_max(q, k, v):
    """The same mistake in base 2 (as fast kernels write it): exp2(x · log2 e) overflows just the same."""
    scores = _scores(q, k, q.shape[-1] ** -0.5 * math.log2(math.e)).masked_fill(~_keep(q), float("-inf"))
    weights = torch.exp2(scores)
    return weights / weights.sum(dim=-1, keepdim=True) @ v


wrong(CA, "exp(100) overflows float32", attention_manual_softmax_no_max)
wrong(CA, "exp(100) overflows float32", attention_exp2_no_max)


def attention_softmax_row_max(q, k, v):
    """Independent: a hand-written softmax that subtracts each row's max (amax over the keys)."""
    scores = _scores(q, k, q.shape[-1] ** -0.5).masked_fill(~_keep(q), float("-inf"))
    weights = (scores - scores.amax(dim=-1, keepdim=True)).exp()
    return weights / weights.sum(dim=-1, keepdim=True) @ v


right(CA, attention_softmax_row_max)

# ---- filter_logits (the sampler's filter) ---------------------------------------------------

FL = "check_filter_logits"
NEG = float("-inf")


def filter_rows_loop(logits, temperature, top_k, top_p):
    """Row by row in 1-D; top-k by kthvalue, top-p through the inverse permutation of the sort."""
    out = []
    for row in logits:
        x = (row - row.max()) / temperature
        if 0 < top_k < x.numel():
            x = torch.where(x >= -torch.kthvalue(-x, top_k).values, x, NEG)
        if top_p < 1:
            probs, order = torch.sort(torch.softmax(x, 0), descending=True)
            keep = torch.cumsum(probs, 0) - probs < top_p
            keep[0] = True
            x = torch.where(keep[torch.argsort(order)], x, NEG)
        out.append(x)
    return torch.stack(out)


def filter_ascending(logits, temperature, top_k, top_p):
    """As Hugging Face's warpers: top-p on an ascending sort, removing what holds at most 1 - p."""
    x = logits - logits.amax(-1, keepdim=True)
    x = x / temperature
    if top_k and top_k < x.size(-1):
        smallest_kept = torch.topk(x, top_k).values[..., -1, None]
        x = x.masked_fill(x < smallest_kept, NEG)
    if top_p < 1.0:
        sorted_x, idx = torch.sort(x, descending=False)
        cumulative = sorted_x.softmax(-1).cumsum(-1)
        remove = cumulative <= 1 - top_p
        remove[..., -1] = False
        x = x.masked_fill(remove.scatter(-1, idx, remove), NEG)
    return x


def filter_numpy_threshold(logits, temperature, top_k, top_p):
    """numpy, a reciprocal temperature, top-p as a probability threshold (the nucleus's smallest)."""
    x = logits.numpy()
    with np.errstate(over="ignore"):  # a tiny temperature sends the others to -inf, as it should
        x = (x - x.max(axis=-1, keepdims=True)) * np.float32(1 / temperature)
    if 0 < top_k < x.shape[-1]:
        kth = -np.sort(-x, axis=-1)[:, top_k - 1 : top_k]
        x = np.where(x >= kth, x, -np.inf).astype(np.float32)
    if top_p < 1:
        e = np.exp(x - x.max(axis=-1, keepdims=True))
        p = e / e.sum(axis=-1, keepdims=True)
        ps = -np.sort(-p, axis=-1)
        n = ((np.cumsum(ps, axis=-1) - ps) < np.float32(top_p)).sum(axis=-1, keepdims=True)
        threshold = np.take_along_axis(ps, np.maximum(n, 1) - 1, axis=-1)
        x = np.where(p >= threshold, x, -np.inf).astype(np.float32)
    return torch.from_numpy(np.ascontiguousarray(x))


right(FL, filter_rows_loop)
right(FL, filter_ascending)
right(FL, filter_numpy_threshold)


def _filter(
    logits,
    temperature,
    top_k,
    top_p,
    *,
    shift=lambda x: x.max(dim=-1, keepdim=True).values,
    scale=lambda x, t: x / t,
    kth_index=lambda k: k - 1,
    nucleus_before_temperature=False,
    nucleus_after_k=True,
    drop=lambda cum, probs, p: cum - probs >= p,
    keep_top=True,
    back_to_vocab=True,
    guard_p=True,
):
    """A learner's filter, one step of it written as given (the defaults: right)."""
    x = logits - shift(logits)
    tempered = scale(x, temperature)
    nucleus_of = x if nucleus_before_temperature else tempered
    if 0 < top_k < x.shape[-1]:
        kth = tempered.sort(dim=-1, descending=True).values[..., kth_index(top_k)].unsqueeze(-1)
        tempered = tempered.masked_fill(tempered < kth, NEG)
        if nucleus_after_k:
            nucleus_of = nucleus_of.masked_fill(tempered == NEG, NEG)
    if top_p < 1 or not guard_p:
        probs, order = nucleus_of.softmax(dim=-1).sort(dim=-1, descending=True)
        dropped = drop(probs.cumsum(dim=-1), probs, top_p)
        if keep_top:
            dropped[..., 0] = False
        if back_to_vocab:
            dropped = torch.zeros_like(dropped).scatter(-1, order, dropped)
        tempered = tempered.masked_fill(dropped, NEG)
    return tempered


def filter_exactly_k(logits, temperature, top_k, top_p):
    """top-k by the indices topk returns: exactly k tokens, a tie with the k-th dropped."""
    x = (logits - logits.max(dim=-1, keepdim=True).values) / temperature
    if 0 < top_k < x.shape[-1]:
        keep = torch.zeros_like(x, dtype=torch.bool).scatter(-1, x.topk(top_k, dim=-1).indices, True)
        x = x.masked_fill(~keep, NEG)
    return _filter(x, 1.0, 0, top_p)


def filter_k_larger_than_vocab(logits, temperature, top_k, top_p):
    """No bound on k: topk(50) of 8 logits raises."""
    x = (logits - logits.max(dim=-1, keepdim=True).values) / temperature
    if top_k > 0:
        x = x.masked_fill(x < x.topk(top_k, dim=-1).values[..., -1:], NEG)
    return _filter(x, 1.0, 0, top_p)


def filter_k_zero_not_skipped(logits, temperature, top_k, top_p):
    """top_k = 0 read as "keep 0": topk(0) is empty and the comparison cannot broadcast."""
    x = (logits - logits.max(dim=-1, keepdim=True).values) / temperature
    x = x.masked_fill(x < x.topk(min(top_k, x.shape[-1]), dim=-1).values[..., -1:], NEG)
    return _filter(x, 1.0, 0, top_p)


def filter_divides_before_max(logits, temperature, top_k, top_p):
    """Divides first, then subtracts the maximum: a tiny temperature already overflowed to inf."""
    x = logits / temperature
    return _filter(x - x.max(dim=-1, keepdim=True).values, 1.0, top_k, top_p)


def filter_no_max(logits, temperature, top_k, top_p):
    """Never subtracts the maximum ("the softmax does it anyway")."""
    return _filter(logits, temperature, top_k, top_p, shift=lambda x: 0.0)


def filter_global_max(logits, temperature, top_k, top_p):
    """``logits.max()`` without a dim: the maximum of the whole batch."""
    return _filter(logits, temperature, top_k, top_p, shift=lambda x: x.max())


def filter_softmax_over_rows(logits, temperature, top_k, top_p):
    """The nucleus from a softmax and cumsum along dim 0 (the rows), as if on a 1-D row."""
    x = _filter(logits, temperature, top_k, 1.0)
    if top_p < 1:
        probs, order = x.softmax(dim=0).sort(dim=-1, descending=True)
        drop = probs.cumsum(dim=0) - probs >= top_p
        drop[..., 0] = False
        x = x.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), NEG)
    return x


def filter_in_place(logits, temperature, top_k, top_p):
    """Filters the caller's tensor in place."""
    logits -= logits.max(dim=-1, keepdim=True).values
    logits /= temperature
    return _filter(logits, 1.0, top_k, top_p)


def filter_returns_probs(logits, temperature, top_k, top_p):
    return _filter(logits, temperature, top_k, top_p).softmax(dim=-1)


def filter_excluded_zero(logits, temperature, top_k, top_p):
    """Multiplies by a 0/1 keep-mask: the excluded tokens become 0."""
    x = _filter(logits, temperature, top_k, top_p)
    keep = x > NEG
    return torch.where(keep, x, torch.zeros_like(x))


def filter_excluded_large_negative(logits, temperature, top_k, top_p):
    x = _filter(logits, temperature, top_k, top_p)
    return x.masked_fill(x == NEG, -1e9)


def filter_double(logits, temperature, top_k, top_p):
    return _filter(logits.double(), temperature, top_k, top_p)


def filter_kept_only(logits, temperature, top_k, top_p):
    """Returns the kept logits alone, not the whole row."""
    x = _filter(logits, temperature, top_k, top_p)
    return x[x > NEG]


def filter_no_return(logits, temperature, top_k, top_p):
    x = _filter(logits, temperature, top_k, top_p)  # noqa: F841 - the mistake under test: no return


wrong(FL, "temperature was not applied", lambda x, t, k, p: _filter(x, t, k, p, scale=lambda x, t: x))
wrong(FL, "multiplied by the temperature", lambda x, t, k, p: _filter(x, t, k, p, scale=lambda x, t: x * t))
wrong(FL, "before the temperature", lambda x, t, k, p: _filter(x, t, k, p, nucleus_before_temperature=True))
wrong(FL, "one token too many", lambda x, t, k, p: _filter(x, t, k, p, kth_index=lambda k: k))
wrong(FL, "one token too few", lambda x, t, k, p: _filter(x, t, k, p, kth_index=lambda k: k - 2))
wrong(FL, "ties with the k-th", filter_exactly_k)
wrong(FL, "top_k = 1 keeps only the 1 largest", lambda x, t, k, p: _filter(x, t, k if k > 1 else 0, p))
wrong(FL, "larger than the vocabulary", filter_k_larger_than_vocab)
wrong(FL, "top_k = 0 means no top-k", filter_k_zero_not_skipped)
wrong(FL, "before top-k", lambda x, t, k, p: _filter(x, t, k, p, nucleus_after_k=False))
wrong(FL, "exactly top_p", lambda x, t, k, p: _filter(x, t, k, p, drop=lambda cum, probs, p: cum - probs > p))
wrong(FL, "crosses top_p", lambda x, t, k, p: _filter(x, t, k, p, drop=lambda cum, probs, p: cum > p))
wrong(FL, "left no token", lambda x, t, k, p: _filter(x, t, k, p, keep_top=False))
wrong(FL, "sorted order", lambda x, t, k, p: _filter(x, t, k, p, back_to_vocab=False))
wrong(FL, "top_p = 1 keeps every token", lambda x, t, k, p: _filter(x, t, k, p, guard_p=False))
wrong(FL, "Subtract each row's maximum *before* dividing", filter_divides_before_max)
wrong(FL, "overflows to inf", filter_no_max)
wrong(FL, "the rows were mixed", filter_global_max)
wrong(FL, "the rows were mixed", filter_softmax_over_rows)
wrong(FL, "changed the logits it was given", filter_in_place)
wrong(FL, "returned probabilities", filter_returns_probs)
wrong(FL, "set the excluded tokens to 0", filter_excluded_zero)
wrong(FL, "set the excluded tokens to -1e+09, not -inf", filter_excluded_large_negative)
wrong(FL, "returned dtype torch.float64", filter_double)
wrong(FL, "returned shape (16,)", filter_kept_only)
wrong(FL, "returned None", filter_no_return)
