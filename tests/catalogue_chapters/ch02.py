"""Chapter 02: more wrong answers a learner writes (see ``check_catalogue``)."""

from __future__ import annotations

import torch
from check_catalogue import generate_cached, right, wrong  # noqa: F401

from minillm.course import forward_step, new_cache

# ---- kv_write -------------------------------------------------------------------------------

KW = "check_kv_write"


def kv_write_end_one_short(k_cache, v_cache, k_new, v_new, start):
    t = k_new.shape[2]
    k_cache[:, :, start : start + t - 1] = k_new[:, :, : t - 1]
    v_cache[:, :, start : start + t - 1] = v_new[:, :, : t - 1]


def kv_write_ignores_start(k_cache, v_cache, k_new, v_new, start):
    """Right for the prefill (start=0) only."""
    t = k_new.shape[2]
    k_cache[:, :, :t] = k_new
    v_cache[:, :, :t] = v_new


def kv_write_one_early(k_cache, v_cache, k_new, v_new, start):
    """Counts positions from 1: the token at ``start`` goes to slot ``start - 1``."""
    t = k_new.shape[2]
    k_cache[:, :, start - 1 : start - 1 + t] = k_new
    v_cache[:, :, start - 1 : start - 1 + t] = v_new


def kv_write_cat(k_cache, v_cache, k_new, v_new, start):
    """Grows the cache with torch.cat: a new tensor bound to the local name, the caller's cache untouched."""
    k_cache = torch.cat([k_cache[:, :, :start], k_new], dim=2)  # noqa: F841 - the mistake under test
    v_cache = torch.cat([v_cache[:, :, :start], v_new], dim=2)  # noqa: F841


def kv_write_keys_twice(k_cache, v_cache, k_new, v_new, start):
    t = k_new.shape[2]
    k_cache[:, :, start : start + t] = k_new
    v_cache[:, :, start : start + t] = k_new  # copy-paste: the keys again


def kv_write_copy_backwards(k_cache, v_cache, k_new, v_new, start):
    """``a.copy_(b)`` copies b into a: this overwrites the new K/V with the cache's zeros."""
    t = k_new.shape[2]
    k_new.copy_(k_cache[:, :, start : start + t])
    v_new.copy_(v_cache[:, :, start : start + t])


def kv_write_first_row(k_cache, v_cache, k_new, v_new, start):
    """Written for a batch of one."""
    t = k_new.shape[2]
    k_cache[0, :, start : start + t] = k_new[0]
    v_cache[0, :, start : start + t] = v_new[0]


def kv_write_adds(k_cache, v_cache, k_new, v_new, start):
    """``+=`` "adds the new tokens to the cache": right only where the slots were still zero."""
    t = k_new.shape[2]
    k_cache[:, :, start : start + t] += k_new
    v_cache[:, :, start : start + t] += v_new


wrong(KW, "positions [5], expected [5, 6]", kv_write_end_one_short)
wrong(KW, "positions [0, 1], expected [5, 6]", kv_write_ignores_start)
wrong(KW, "positions [4, 5], expected [5, 6]", kv_write_one_early)
wrong(KW, "torch.cat", kv_write_cat)
wrong(KW, "the value cache holds the new keys", kv_write_keys_twice)
wrong(KW, "kv_write changed k_new", kv_write_copy_backwards)
wrong(KW, "batch row 1", kv_write_first_row)
wrong(KW, "added k_new to", kv_write_adds)

# ---- kv_read --------------------------------------------------------------------------------

KR = "check_kv_read"


def kv_read_keys_only(k_cache, v_cache, length):
    return k_cache[:, :, :length]


wrong(KR, "off by one", lambda k, v, n: (k[:, :, : n + 1], v[:, :, : n + 1]))
wrong(KR, "swapped", lambda k, v, n: (v[:, :, :n], k[:, :, :n]))
wrong(KR, "copied the cache", lambda k, v, n: (k[:, :, :n].contiguous(), v[:, :, :n].contiguous()))
wrong(KR, "one position", lambda k, v, n: (k[:, :, n], v[:, :, n]))
wrong(KR, "has shape (1, 3, 7, 4), expected (2, 3, 7, 4)", lambda k, v, n: (k[:1, :, :n], v[:1, :, :n]))
wrong(KR, "positions 1..7", lambda k, v, n: (k[:, :, 1 : n + 1], v[:, :, 1 : n + 1]))
wrong(KR, "a pair (keys, values), got Tensor", kv_read_keys_only)

# ---- generate_cached ------------------------------------------------------------------------

GC = "check_generate_cached"


def cached_fixed_position(model, prompt_ids, max_new_tokens):
    """Every decode step at position len(prompt): the position never advances."""
    cache = new_cache(model, len(prompt_ids) + max_new_tokens)
    new = [int(forward_step(model, list(prompt_ids), 0, cache)[-1].argmax())]
    while len(new) < max_new_tokens:
        new.append(int(forward_step(model, [new[-1]], len(prompt_ids), cache)[-1].argmax()))
    return new


def cached_position_without_prompt(model, prompt_ids, max_new_tokens):
    """Counts the position among the new tokens only, forgetting the prompt before them."""
    cache = new_cache(model, len(prompt_ids) + max_new_tokens)
    new = [int(forward_step(model, list(prompt_ids), 0, cache)[-1].argmax())]
    while len(new) < max_new_tokens:
        new.append(int(forward_step(model, [new[-1]], len(new), cache)[-1].argmax()))
    return new


def cached_first_row(model, prompt_ids, max_new_tokens):
    """Takes the prefill's first row, as if it held the prediction after the whole prompt."""
    cache = new_cache(model, len(prompt_ids) + max_new_tokens)
    new = [int(forward_step(model, list(prompt_ids), 0, cache)[0].argmax())]
    while len(new) < max_new_tokens:
        logits = forward_step(model, [new[-1]], len(prompt_ids) + len(new) - 1, cache)
        new.append(int(logits[0].argmax()))
    return new


def cached_new_cache_each_step(model, prompt_ids, max_new_tokens):
    """Makes the cache inside the loop: each decode step starts from an empty one."""
    cache = new_cache(model, len(prompt_ids) + max_new_tokens)
    new = [int(forward_step(model, list(prompt_ids), 0, cache)[-1].argmax())]
    while len(new) < max_new_tokens:
        cache = new_cache(model, len(prompt_ids) + max_new_tokens)
        new.append(int(forward_step(model, [new[-1]], len(prompt_ids) + len(new) - 1, cache)[-1].argmax()))
    return new


def cached_feeds_last_prompt_token(model, prompt_ids, max_new_tokens):
    """Feeds ``prompt_ids[-1]`` (the last token *given*) instead of the newest generated one."""
    cache = new_cache(model, len(prompt_ids) + max_new_tokens)
    new = [int(forward_step(model, list(prompt_ids), 0, cache)[-1].argmax())]
    while len(new) < max_new_tokens:
        position = len(prompt_ids) + len(new) - 1
        new.append(int(forward_step(model, [prompt_ids[-1]], position, cache)[-1].argmax()))
    return new


def cached_tensor_tokens(model, prompt_ids, max_new_tokens):
    cache = new_cache(model, len(prompt_ids) + max_new_tokens)
    new = [forward_step(model, list(prompt_ids), 0, cache)[-1].argmax()]
    while len(new) < max_new_tokens:
        new.append(forward_step(model, [int(new[-1])], len(prompt_ids) + len(new) - 1, cache)[-1].argmax())
    return new


def cached_no_return(model, prompt_ids, max_new_tokens):
    cache = new_cache(model, len(prompt_ids) + max_new_tokens)
    new = [int(forward_step(model, list(prompt_ids), 0, cache)[-1].argmax())]
    while len(new) < max_new_tokens:
        new.append(int(forward_step(model, [new[-1]], len(prompt_ids) + len(new) - 1, cache)[-1].argmax()))


wrong(GC, "decode step 2 ran at position 11, expected 12", cached_fixed_position)
wrong(GC, "decode step 1 ran at position 1, expected 11", cached_position_without_prompt)
wrong(GC, "the argmax of row 0 of the prompt's logits", cached_first_row)
wrong(GC, "a new cache", cached_new_cache_each_step)
wrong(GC, "decode step 1 fed token", cached_feeds_last_prompt_token)
wrong(GC, "list of Python ints", cached_tensor_tokens)
wrong(GC, "returned None", cached_no_return)
