"""Chapter 01, prefill and decode: the answers its exercises' checks are tested against (see
``catalogue/__init__.py``)."""

from __future__ import annotations

import math
import re

import numpy as np
import torch
import torch.nn.functional as F

from catalogue.answers import Answers
from minillm.course import apply_rotary, forward_logits, model_weights, rope_cos_sin
from minillm.sampling import filtered_logits

ANSWERS = Answers()
right, wrong = ANSWERS.right, ANSWERS.wrong


# ---- 01: the naive loop ---------------------------------------------------------------------


def generate_naive(model, prompt_ids, max_new_tokens):
    ids, new = list(prompt_ids), []
    for _ in range(max_new_tokens):
        token = int(forward_logits(model, ids)[-1].argmax())
        new.append(token)
        ids.append(token)
    return new


def generate_naive_tensors(model, prompt_ids, max_new_tokens):
    ids = torch.tensor(prompt_ids)
    start = len(ids)
    while len(ids) < start + max_new_tokens:
        logits = forward_logits(model, ids.tolist())
        ids = torch.cat([ids, logits[-1:].argmax(-1)])
    return ids[start:].tolist()


right("check_generate_naive", generate_naive)
right("check_generate_naive", generate_naive_tensors)
wrong("check_generate_naive", "returned 31 tokens, expected 32", lambda m, p, n: generate_naive(m, p, n - 1))
wrong(
    "check_generate_naive",
    "token 1 is",
    lambda m, p, n: [int(forward_logits(m, list(p))[-1].argmax()) for _ in range(n)],
)
wrong("check_generate_naive", "prompt tokens followed by", lambda m, p, n: list(p) + generate_naive(m, p, n))
wrong(
    "check_generate_naive",
    "list of Python ints",
    lambda m, p, n: [torch.tensor(t) for t in generate_naive(m, p, n)],
)


def naive_first_row(model, prompt_ids, n):
    ids = list(prompt_ids)
    for _ in range(n):
        ids.append(int(forward_logits(model, ids)[0].argmax()))
    return ids[len(prompt_ids) :]


def naive_no_context(model, prompt_ids, n):
    new, last = [], list(prompt_ids)
    for _ in range(n):
        token = int(forward_logits(model, last)[-1].argmax())
        new.append(token)
        last = [token]
    return new


wrong("check_generate_naive", "token 0 is", naive_first_row)
wrong("check_generate_naive", "the reference engine produced", naive_no_context)


# ---- 01: causal attention -------------------------------------------------------------------


def causal_attention(q, k, v):
    t = q.shape[-2]
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    future = torch.ones(t, t, dtype=torch.bool).triu(diagonal=1)
    return torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1) @ v


def _masked(q, k, v, keep, scale=True, dim=-1):
    s = q @ k.transpose(-1, -2) / (math.sqrt(q.shape[-1]) if scale else 1.0)
    return torch.softmax(s.masked_fill(~keep, float("-inf")), dim=dim) @ v


def _tril(q, offset=0):
    t = q.shape[-2]
    return torch.ones(t, t, dtype=torch.bool).tril(offset)


right("check_causal_attention", causal_attention)
right("check_causal_attention", lambda q, k, v: _masked(q, k, v, torch.ones(q.shape[-2], q.shape[-2]).tril().bool()))
# torch's fused attention computes the whole answer: the exercise asks for the computation (issue 46)
wrong("check_causal_attention", "calls torch's scaled_dot_product_attention, which computes this exercise's whole",
      lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True))  # fmt: skip
wrong("check_causal_attention", "not scaled", lambda q, k, v: _masked(q, k, v, _tril(q), scale=False))
wrong("check_causal_attention", "no causal mask", lambda q, k, v: _masked(q, k, v, torch.ones_like(_tril(q))))
wrong("check_causal_attention", "wrong axis", lambda q, k, v: _masked(q, k, v, _tril(q), dim=-2))
wrong("check_causal_attention", "inverted", lambda q, k, v: _masked(q, k, v, ~_tril(q, -1)).nan_to_num())
wrong("check_causal_attention", "diagonal", lambda q, k, v: _masked(q, k, v, _tril(q, -1)))
wrong("check_causal_attention", "has shape (2, 5, 3, 8)", lambda q, k, v: causal_attention(q, k, v).transpose(1, 2))


# ---- ch01: more wrong answers a learner writes


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


# ---- Chapter 01's sampler (``check_sample``): two right answers written independently, and the wrong
# ones a learner writes, one slip each (``sample_with``).


SA = "check_sample"


def sample_with(**slip):
    """The penalty-argmax-race sampler, with one learner's slip switched on."""

    def sample(logits, params, generators, seen=None):
        logits = logits.float() if slip.get("in_place") else logits.float().clone()
        for i, p in enumerate(params):
            if slip.get("ignores_none"):
                history = seen[i]
            elif seen is None:
                continue
            else:
                history = seen[i]
            if p.repetition_penalty == 1.0 or not history or (slip.get("sampled_only") and p.greedy):
                continue
            if slip.get("filter_first") and not p.greedy:
                continue  # penalized below, after filtering
            ids = list(history) if slip.get("each_time") else sorted(set(history))
            for t in ids:
                v = float(logits[i, t])
                if slip.get("wrong_way"):
                    logits[i, t] = v * p.repetition_penalty
                else:
                    logits[i, t] = v / p.repetition_penalty if v > 0 else v * p.repetition_penalty
        tokens = logits.argmax(dim=-1).tolist()
        for i, p in enumerate(params):
            if p.greedy and not slip.get("samples_greedy"):
                continue
            row = logits[i : i + 1]
            if slip.get("no_filter"):
                probs = row[0].softmax(dim=-1)
            else:
                probs = filtered_logits(row, [p])[0].softmax(dim=-1)
            if slip.get("filter_first") and p.repetition_penalty != 1.0 and seen is not None and seen[i]:
                ids = torch.tensor(sorted(set(seen[i])))
                probs = probs.clone()
                probs[ids] = probs[ids] / p.repetition_penalty
            generator = generators[0] if slip.get("one_generator") else generators[i]
            if slip.get("multinomial"):
                tokens[i] = int(torch.multinomial(probs, 1, generator=generator))
            elif slip.get("global_rng"):
                tokens[i] = int((probs / torch.empty_like(probs).exponential_()).argmax())
            elif slip.get("times_noise"):
                tokens[i] = int((probs * torch.empty_like(probs).exponential_(generator=generator)).argmax())
            else:
                tokens[i] = int((probs / torch.empty_like(probs).exponential_(generator=generator)).argmax())
        return torch.tensor(tokens) if slip.get("tensor") else tokens

    return sample


def sample_batched(logits, params, generators, seen=None):
    """Right, written differently: the penalty as a masked multiply, the sampled rows filtered together."""
    out = logits.to(torch.float32).clone()
    if seen is not None:
        for i, p in enumerate(params):
            if p.repetition_penalty != 1.0 and len(seen[i]):
                mask = torch.zeros(out.shape[-1], dtype=torch.bool)
                mask[list(seen[i])] = True
                factor = torch.where(out[i] > 0, 1 / p.repetition_penalty, p.repetition_penalty)
                out[i] = torch.where(mask, out[i] * factor, out[i])
    chosen = out.argmax(-1).tolist()
    drawn = [i for i, p in enumerate(params) if p.temperature != 0]
    if drawn:
        probs = filtered_logits(out[drawn], [params[i] for i in drawn]).softmax(-1)
        for row, i in zip(probs, drawn):
            noise = torch.empty_like(row).exponential_(generator=generators[i])
            chosen[i] = int(torch.argmax(row / noise))
    return chosen


right(SA, sample_with())
right(SA, sample_batched)
right(SA, sample_with(multinomial=True))  # torch.multinomial draws one token by the same exponential race
wrong(SA, "is the argmax before the penalty", sample_with(sampled_only=True))
wrong(SA, "the penalty made a seen token more likely", sample_with(wrong_way=True))
wrong(SA, "penalized twice", sample_with(each_time=True))
wrong(SA, "changed the logits it was given", sample_with(in_place=True))
wrong(SA, "the engine draws", sample_with(global_rng=True))
wrong(SA, "the engine draws", sample_with(one_generator=True))
wrong(SA, "the engine draws", sample_with(times_noise=True))
wrong(SA, "which the row's settings exclude", sample_with(no_filter=True))
wrong(SA, "is never drawn", sample_with(samples_greedy=True))
wrong(SA, "return a list of Python ints", sample_with(tensor=True))
wrong(SA, "your code raised TypeError", sample_with(ignores_none=True))
wrong(SA, "which the row's settings exclude", sample_with(filter_first=True))


# ---- Chapter 01's stopping exercise (``check_stopping``): two right answers written independently, and
# the wrong ones a learner writes, one slip each (``append_with``, ``stream_with``).


ST = "check_stopping"


def append_with(**slip):
    """The engine's append_token, with one learner's slip switched on."""

    def append_token(seq, token_id):
        p = seq.params
        if not slip.get("appends_late"):
            seq.output_token_ids.append(token_id)
        stops = set(p.stop_token_ids)
        if not slip.get("never_eos") and (slip.get("always_eos") or not p.ignore_eos):
            stops |= set(seq.eos_token_ids)
        if slip.get("length_first") and len(seq.output_token_ids) >= seq.max_output:
            seq.text += seq.detokenizer.add(token_id) + seq.detokenizer.flush()
            return "length"
        if token_id in stops:
            if slip.get("adds_stop_text"):
                seq.text += seq.detokenizer.add(token_id)
            if not slip.get("no_flush"):
                seq.text += seq.detokenizer.flush()
            return "stop"
        before = len(seq.text)
        new = seq.detokenizer.add(token_id)
        seq.text += new
        if slip.get("appends_late"):
            seq.output_token_ids.append(token_id)
        if p.stop:
            longest = max(len(s) for s in p.stop)
            start = max(0, before - longest + (2 if slip.get("search_late") else 1))
            if slip.get("new_text_only"):
                hits = [before + i for s in p.stop if (i := new.find(s)) != -1]
            else:
                hits = [i for s in p.stop if (i := seq.text.find(s, start)) != -1]
            if hits:
                cut = hits[0] if slip.get("first_listed") else min(hits)
                if slip.get("keeps_stop"):
                    pass
                elif slip.get("cuts_after"):
                    stop = next(s for s in p.stop if seq.text.find(s, start) == cut)
                    seq.text = seq.text[: cut + len(stop)]
                else:
                    seq.text = seq.text[:cut]
                return "stop"
        limit = p.max_tokens if slip.get("max_tokens") else seq.max_output
        done = len(seq.output_token_ids) > limit if slip.get("one_late") else len(seq.output_token_ids) >= limit
        if done and not slip.get("length_first"):
            if not slip.get("no_flush_at_length"):
                seq.text += seq.detokenizer.flush()
            return True if slip.get("returns_bool") else "length"
        return None

    return append_token


def take_stream_text(seq):
    hold = max(len(s) for s in seq.params.stop) - 1 if seq.params.stop and not seq.is_finished else 0
    end = max(seq.num_emitted_chars, len(seq.text) - hold)
    delta = seq.text[seq.num_emitted_chars : end]
    seq.num_emitted_chars = end
    return delta


def stream_with(**slip):
    """take_stream_text with one slip switched on."""

    def take(seq):
        stop = seq.params.stop
        hold = 0
        if stop and (slip.get("holds_when_finished") or not seq.is_finished) and not slip.get("no_hold"):
            hold = max(len(s) for s in stop) - (0 if slip.get("holds_whole") else 1)
        end = len(seq.text) - hold if slip.get("moves_back") else max(seq.num_emitted_chars, len(seq.text) - hold)
        delta = seq.text[seq.num_emitted_chars : end]
        if slip.get("from_start"):
            delta = seq.text[:end]
        if not slip.get("no_advance"):
            seq.num_emitted_chars = end
        return delta

    return take


def append_by_regex(seq, token_id):
    """Right, written differently: the stop strings as one regex over a window of the text."""
    p = seq.params
    seq.output_token_ids += [token_id]
    ends = set(p.stop_token_ids) | (set() if p.ignore_eos else set(seq.eos_token_ids))
    if token_id in ends:
        seq.text = seq.text + seq.detokenizer.flush()
        return "stop"
    old = seq.text
    seq.text = old + seq.detokenizer.add(token_id)
    if p.stop:
        window = max(0, len(old) - max(map(len, p.stop)) + 1)
        m = re.compile("|".join(map(re.escape, p.stop))).search(seq.text, window)
        if m is not None:  # search finds the leftmost start of any alternative: the earliest match
            seq.text = seq.text[: m.start()]
            return "stop"
    if len(seq.output_token_ids) < seq.max_output:
        return None
    seq.text += seq.detokenizer.flush()
    return "length"


def stream_by_slices(seq):
    """Right, written differently: what is safe to show, then the part of it not shown yet."""
    if seq.is_finished or not seq.params.stop:
        safe = seq.text
    else:
        safe = seq.text[: max(0, len(seq.text) - (max(len(s) for s in seq.params.stop) - 1))]
    if len(safe) <= seq.num_emitted_chars:
        return ""
    delta = safe[seq.num_emitted_chars :]
    seq.num_emitted_chars = len(safe)
    return delta


right(ST, append_with(), take_stream_text)
right(ST, append_by_regex, stream_by_slices)
right(ST, append_by_regex, take_stream_text)
wrong(ST, "with params.ignore_eos the EOS token is an ordinary token", append_with(always_eos=True), take_stream_text)
wrong(ST, "an EOS id (seq.eos_token_ids) ends the request", append_with(never_eos=True), take_stream_text)
wrong(ST, "its text is not part of the answer", append_with(adds_stop_text=True), take_stream_text)
wrong(ST, "add seq.detokenizer.flush() to the text before ending", append_with(no_flush=True), take_stream_text)
wrong(ST, "the one that ends the request too", append_with(appends_late=True), take_stream_text)
wrong(ST, "a stop token at the length limit ends with 'stop'", append_with(length_first=True), take_stream_text)
wrong(ST, "a stop string may span tokens", append_with(new_text_only=True), take_stream_text)
wrong(ST, "cut it *before* the match", append_with(keeps_stop=True), take_stream_text)
wrong(ST, "cut it *before* the match", append_with(cuts_after=True), take_stream_text)
wrong(ST, "search from max(0, text_before", append_with(search_late=True), take_stream_text)
wrong(ST, "cut at the *earliest* position", append_with(first_listed=True), take_stream_text)
wrong(ST, "at the 3rd, not after it", append_with(one_late=True), take_stream_text)
wrong(ST, "not params.max_tokens", append_with(max_tokens=True), take_stream_text)
wrong(ST, "the detokenizer may still hold half a character", append_with(no_flush_at_length=True), take_stream_text)
wrong(ST, "return 'stop', 'length' or None", append_with(returns_bool=True), take_stream_text)
wrong(ST, "hold back len(longest stop string) - 1", append_with(), stream_with(no_hold=True))
wrong(ST, "hold back len(longest stop string) - 1", append_with(), stream_with(holds_whole=True))
wrong(ST, "once it is finished show everything left", append_with(), stream_with(holds_when_finished=True))
wrong(ST, "never moves back", append_with(), stream_with(moves_back=True))
wrong(ST, "set seq.num_emitted_chars to where what you return ends", append_with(), stream_with(no_advance=True))
wrong(ST, "set seq.num_emitted_chars to where what you return ends", append_with(), stream_with(from_start=True))


# ---- Chapter 01's whole model (``check_transformer``): right answers written independently, and the
# wrong ones a learner writes — each piece's classic slips, one at a time, the other pieces right.
#
# An answer is ``(rms_norm, decoder_layer, transformer_forward)``; ``forward_with(layer=...)``
# builds a forward pass around a given layer (a learner's forward calls their own layer by name).


TR = "check_transformer"


# ---- right answers --------------------------------------------------------------------------


def rms_a(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * weight


def causal(q, k, v):
    t = q.shape[-2]
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    return torch.softmax(s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf")), -1) @ v


def layer_a(x, w, cos, sin, config, rms=rms_a, **slip):
    """The textbook block; ``slip`` switches on one learner's mistake (the wrong answers below)."""
    T = x.shape[0]
    H, KV, D = config.num_heads, config.num_kv_heads, config.head_dim
    eps = config.rms_norm_eps
    h = rms(x, w.input_layernorm, eps)
    q = (h @ w.q_proj.T).view(T, H, D).transpose(0, 1)
    k = (h @ w.k_proj.T).view(T, KV, D).transpose(0, 1)
    v = (h @ w.v_proj.T).view(T, KV, D).transpose(0, 1)
    if not slip.get("no_rope"):
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    if slip.get("tile"):
        k, v = k.repeat(H // KV, 1, 1), v.repeat(H // KV, 1, 1)
    else:
        k, v = k.repeat_interleave(H // KV, dim=0), v.repeat_interleave(H // KV, dim=0)
    a = causal(q[None], k[None], v[None])[0]
    merged = a.reshape(T, H * D) if slip.get("merge") else a.transpose(0, 1).reshape(T, H * D)
    attn = merged @ w.o_proj.T
    x = attn if slip.get("no_residual") else x + attn
    h = rms(x, w.post_attention_layernorm, eps)
    gate, up = h @ w.gate_proj.T, h @ w.up_proj.T
    act = gate * F.silu(up) if slip.get("silu_on_up") else F.silu(gate) * up
    return x + act @ w.down_proj.T


def forward_with(layer=layer_a, rms=rms_a, final_norm=True, skip_last=False, last_row=False):
    def transformer_forward(model, ids):
        w = model_weights(model)
        x = w.embed_tokens[torch.tensor(ids)]
        cos, sin = rope_cos_sin(model, len(ids))
        for lw in w.layers[:-1] if skip_last else w.layers:
            x = layer(x, lw, cos, sin, model.config)
        if final_norm:
            x = rms(x, w.norm, model.config.rms_norm_eps)
        logits = x @ w.lm_head.T
        return logits[-1] if last_row else logits

    return transformer_forward


def rms_b(x, weight, eps):
    return weight * (x / torch.sqrt((x * x).sum(-1, keepdim=True) / x.shape[-1] + eps))


def layer_b(x, w, cos, sin, config):
    """Hugging Face's shapes: [1, heads, T, D], its own rotate_half, SDPA with enable_gqa."""
    b = x[None]
    n = F.rms_norm(b, (b.shape[-1],), w.input_layernorm, config.rms_norm_eps)

    def split(y, heads):
        return y.unflatten(-1, (heads, config.head_dim)).permute(0, 2, 1, 3)

    def rotate(y):
        y1, y2 = y.chunk(2, dim=-1)
        return y * cos + torch.cat((-y2, y1), dim=-1) * sin

    q = rotate(split(F.linear(n, w.q_proj), config.num_heads))
    k = rotate(split(F.linear(n, w.k_proj), config.num_kv_heads))
    v = split(F.linear(n, w.v_proj), config.num_kv_heads)
    a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    b = b + F.linear(a.permute(0, 2, 1, 3).flatten(2), w.o_proj)
    n = F.rms_norm(b, (b.shape[-1],), w.post_attention_layernorm, config.rms_norm_eps)
    b = b + F.linear(F.silu(F.linear(n, w.gate_proj)) * F.linear(n, w.up_proj), w.down_proj)
    return b[0]


def forward_b(model, ids):
    w = model_weights(model)
    x = F.embedding(torch.tensor(ids), w.embed_tokens)
    cos, sin = rope_cos_sin(model.config, len(ids))
    for lw in w.layers:
        x = layer_b(x, lw, cos, sin, model.config)
    return F.linear(rms_b(x, w.norm, model.config.rms_norm_eps), w.lm_head)


right(TR, rms_a, layer_a, forward_with())
right(TR, rms_b, layer_b, forward_b)


# ---- rms_norm -------------------------------------------------------------------------------


def rms_no_weight(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)


def rms_layer_norm(x, weight, eps):
    x = x - x.mean(dim=-1, keepdim=True)
    return x / torch.sqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * weight


def rms_eps_outside(x, weight, eps):
    return x / (x.pow(2).mean(dim=-1, keepdim=True).sqrt() + eps) * weight


def rms_no_eps(x, weight, eps):
    return x / x.pow(2).mean(dim=-1, keepdim=True).sqrt() * weight


def rms_over_tokens(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(dim=0, keepdim=True) + eps) * weight


def rms_std(x, weight, eps):
    """torch.std for the root mean square: it subtracts the mean (and divides by n - 1)."""
    return x / (x.std(dim=-1, keepdim=True) + eps) * weight


def rms_in_place(x, weight, eps):
    x /= torch.sqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
    return x * weight


wrong(TR, "never multiplied by `weight`", rms_no_weight, layer_a, forward_with(rms=rms_no_weight))
wrong(TR, "that is LayerNorm", rms_layer_norm, layer_a, forward_with(rms=rms_layer_norm))
wrong(TR, "eps after the square root", rms_eps_outside, layer_a, forward_with(rms=rms_eps_outside))
wrong(TR, "rms_norm has no eps", rms_no_eps, layer_a, forward_with(rms=rms_no_eps))
wrong(TR, "averaged over the tokens", rms_over_tokens, layer_a, forward_with(rms=rms_over_tokens))
wrong(TR, "rms_norm(x[5, 16], weight, eps=1e-5) differs", rms_std, layer_a, forward_with(rms=rms_std))
wrong(TR, "changed its input x in place", rms_in_place, layer_a, forward_with(rms=rms_in_place))


# ---- decoder_layer --------------------------------------------------------------------------


def slipped(**slip):
    def layer(x, w, cos, sin, config):
        return layer_a(x, w, cos, sin, config, **slip)

    return layer


def layer_post_norm(x, w, cos, sin, config):
    """Post-norm, as in the original Transformer: normalise after each residual add."""
    eps = config.rms_norm_eps
    T, H, KV, D = x.shape[0], config.num_heads, config.num_kv_heads, config.head_dim
    q = apply_rotary((x @ w.q_proj.T).view(T, H, D).transpose(0, 1), cos, sin)
    k = apply_rotary((x @ w.k_proj.T).view(T, KV, D).transpose(0, 1), cos, sin).repeat_interleave(H // KV, 0)
    v = (x @ w.v_proj.T).view(T, KV, D).transpose(0, 1).repeat_interleave(H // KV, 0)
    x = rms_a(x + causal(q, k, v).transpose(0, 1).reshape(T, -1) @ w.o_proj.T, w.input_layernorm, eps)
    return rms_a(x + (F.silu(x @ w.gate_proj.T) * (x @ w.up_proj.T)) @ w.down_proj.T, w.post_attention_layernorm, eps)


def layer_heads_by_column(x, w, cos, sin, config):
    """Cuts heads as view(T, head_dim, heads): head i gets every heads-th column."""
    T, H, KV, D = x.shape[0], config.num_heads, config.num_kv_heads, config.head_dim
    h = rms_a(x, w.input_layernorm, config.rms_norm_eps)
    q = apply_rotary((h @ w.q_proj.T).view(T, D, H).permute(2, 0, 1), cos, sin)
    k = apply_rotary((h @ w.k_proj.T).view(T, D, KV).permute(2, 0, 1), cos, sin).repeat_interleave(H // KV, 0)
    v = (h @ w.v_proj.T).view(T, D, KV).permute(2, 0, 1).repeat_interleave(H // KV, 0)
    x = x + causal(q, k, v).transpose(0, 1).reshape(T, -1) @ w.o_proj.T
    h = rms_a(x, w.post_attention_layernorm, config.rms_norm_eps)
    return x + (F.silu(h @ w.gate_proj.T) * (h @ w.up_proj.T)) @ w.down_proj.T


def layer_no_transpose(x, w, cos, sin, config):
    """Multiplies by the stored matrices as if they were [in, out]."""
    T, H, D = x.shape[0], config.num_heads, config.head_dim
    h = rms_a(x, w.input_layernorm, config.rms_norm_eps)
    return (h @ w.q_proj).view(T, H, D).transpose(0, 1)  # fails here: [T, hidden] @ [H*D, hidden]


def layer_sdpa_not_causal(x, w, cos, sin, config):
    """SDPA without is_causal: every token sees the whole sequence."""
    T, H, KV, D = x.shape[0], config.num_heads, config.num_kv_heads, config.head_dim
    h = rms_a(x, w.input_layernorm, config.rms_norm_eps)
    q = apply_rotary((h @ w.q_proj.T).view(T, H, D).transpose(0, 1), cos, sin)
    k = apply_rotary((h @ w.k_proj.T).view(T, KV, D).transpose(0, 1), cos, sin)
    v = (h @ w.v_proj.T).view(T, KV, D).transpose(0, 1)
    a = F.scaled_dot_product_attention(q[None], k[None], v[None], enable_gqa=True)[0]
    x = x + a.transpose(0, 1).reshape(T, -1) @ w.o_proj.T
    h = rms_a(x, w.post_attention_layernorm, config.rms_norm_eps)
    return x + (F.silu(h @ w.gate_proj.T) * (h @ w.up_proj.T)) @ w.down_proj.T


def layer_in_place_residual(x, w, cos, sin, config):
    """``x += ...``: the caller's hidden states change under it."""
    out = layer_a(x, w, cos, sin, config)
    x += out - x
    return x


def layer_rope_on_v_too(x, w, cos, sin, config):
    T, H, KV, D = x.shape[0], config.num_heads, config.num_kv_heads, config.head_dim
    h = rms_a(x, w.input_layernorm, config.rms_norm_eps)
    q, k, v = ((h @ m.T).view(T, n, D).transpose(0, 1) for m, n in ((w.q_proj, H), (w.k_proj, KV), (w.v_proj, KV)))
    q, k, v = (apply_rotary(t, cos, sin) for t in (q, k, v))
    a = causal(q, k.repeat_interleave(H // KV, 0), v.repeat_interleave(H // KV, 0))
    x = x + a.transpose(0, 1).reshape(T, -1) @ w.o_proj.T
    h = rms_a(x, w.post_attention_layernorm, config.rms_norm_eps)
    return x + (F.silu(h @ w.gate_proj.T) * (h @ w.up_proj.T)) @ w.down_proj.T


def layer_gate_plus_up(x, w, cos, sin, config):
    """Adds the gate to up instead of multiplying: a slip no named variant covers."""
    T, H, KV, D = x.shape[0], config.num_heads, config.num_kv_heads, config.head_dim
    h = rms_a(x, w.input_layernorm, config.rms_norm_eps)
    q = apply_rotary((h @ w.q_proj.T).view(T, H, D).transpose(0, 1), cos, sin)
    k = apply_rotary((h @ w.k_proj.T).view(T, KV, D).transpose(0, 1), cos, sin).repeat_interleave(H // KV, 0)
    v = (h @ w.v_proj.T).view(T, KV, D).transpose(0, 1).repeat_interleave(H // KV, 0)
    x = x + causal(q, k, v).transpose(0, 1).reshape(T, -1) @ w.o_proj.T
    h = rms_a(x, w.post_attention_layernorm, config.rms_norm_eps)
    return x + (F.silu(h @ w.gate_proj.T) + (h @ w.up_proj.T)) @ w.down_proj.T


for slip, message in (
    ({"no_residual": True}, "the attention's output replaced x"),
    ({"silu_on_up": True}, "SiLU went on up_proj's output"),
    ({"tile": True}, "repeat_interleave"),
    ({"merge": True}, "without moving the heads back"),
    ({"no_rope": True}, "q and k were never rotated"),
):
    wrong(TR, message, rms_a, slipped(**slip), forward_with(layer=slipped(**slip)))
wrong(TR, "the norm went after the residual", rms_a, layer_post_norm, forward_with(layer=layer_post_norm))
wrong(TR, "cut into heads the wrong way round", rms_a, layer_heads_by_column, forward_with(layer=layer_heads_by_column))
wrong(TR, "multiply by the transpose", rms_a, layer_no_transpose, forward_with(layer=layer_no_transpose))
wrong(TR, "every position saw the later ones", rms_a, layer_sdpa_not_causal, forward_with(layer=layer_sdpa_not_causal))
wrong(TR, "changed its input x in place", rms_a, layer_in_place_residual, forward_with(layer=layer_in_place_residual))
wrong(TR, "v was rotated too", rms_a, layer_rope_on_v_too, forward_with(layer=layer_rope_on_v_too))
wrong(TR, "the attention half (MLP off: down_proj = 0) matches", rms_a, layer_gate_plus_up,
      forward_with(layer=layer_gate_plus_up))


# ---- transformer_forward --------------------------------------------------------------------


def forward_calls_the_package(model, ids):
    return forward_logits(model, ids)


def forward_hidden_states(model, ids):
    w = model_weights(model)
    x = w.embed_tokens[torch.tensor(ids)]
    cos, sin = rope_cos_sin(model, len(ids))
    for lw in w.layers:
        x = layer_a(x, lw, cos, sin, model.config)
    return x


def forward_scaled_embedding(model, ids):
    """Scales the embedding rows by sqrt(hidden), as Gemma and T5 do; Llama does not."""
    w = model_weights(model)
    x = w.embed_tokens[torch.tensor(ids)] * math.sqrt(model.config.hidden_size)
    cos, sin = rope_cos_sin(model, len(ids))
    for lw in w.layers:
        x = layer_a(x, lw, cos, sin, model.config)
    return rms_a(x, w.norm, model.config.rms_norm_eps) @ w.lm_head.T


wrong(TR, "skipped the final norm", rms_a, layer_a, forward_with(final_norm=False))
wrong(TR, "ran 3 of the model's 4 layers", rms_a, layer_a, forward_with(skip_last=True))
wrong(TR, "returned one row", rms_a, layer_a, forward_with(last_row=True))
wrong(TR, "ran the package's model", rms_a, layer_a, forward_calls_the_package)
wrong(TR, "returned the hidden states", rms_a, layer_a, forward_hidden_states)
wrong(TR, "look at its own steps", rms_a, layer_a, forward_scaled_embedding)
