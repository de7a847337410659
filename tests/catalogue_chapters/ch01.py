"""Chapter 01: more wrong answers a learner writes (see ``check_catalogue``)."""

from __future__ import annotations

import math

import numpy as np
import torch
from check_catalogue import generate_naive, right, wrong  # noqa: F401

from minillm.course import forward_logits

# ---- next_token -----------------------------------------------------------------------------

NT = "check_next_token"


def next_token_sampled(logits):
    """Samples from the softmax instead of taking the most likely token."""
    return int(torch.multinomial(torch.softmax(logits[-1], dim=-1), 1))


def next_token_in_place(logits):
    """Subtracts the row maximum in place "for stability": the caller's logits change."""
    logits -= logits.max(dim=-1, keepdim=True).values
    return int(logits[-1].argmax())


def next_token_no_return(logits):
    token = int(logits[-1].argmax())  # noqa: F841 - the mistake under test: no return


wrong(NT, "the largest logit's *value*", lambda logits: int(logits[-1].max()))
wrong(NT, "the largest logit's *value*", lambda logits: int(torch.max(logits[-1], dim=-1)[0]))
wrong(NT, "wrong axis", lambda logits: int(logits[:, -1].argmax()))
wrong(NT, "argmax of position 1", lambda logits: int(logits[-2].argmax()))
wrong(NT, "over every position", lambda logits: int(logits.sum(dim=0).argmax()))
wrong(NT, "softmax over the positions", lambda logits: int(torch.softmax(logits, dim=0)[-1].argmax()))
wrong(NT, "different tokens for the same logits", next_token_sampled)
wrong(NT, "changed the logits it was given", next_token_in_place)
wrong(NT, "(int64); return one token id as a Python int", lambda logits: np.argmax(logits[-1].numpy()))
wrong(NT, "returned [7] (list)", lambda logits: logits[-1:].argmax(dim=-1).tolist())
wrong(NT, "forget the `return`", next_token_no_return)

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
