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

# ---- rope_tables ----------------------------------------------------------------------------

RT = "check_rope_tables"


def rope_loops(inv_freq, max_positions):
    """Independent: Python loops over positions and frequencies, one row at a time."""
    freqs = inv_freq.tolist()
    rows = [[p * f for f in freqs] * 2 for p in range(max_positions)]
    angles = torch.tensor(rows)
    return torch.cos(angles), torch.sin(angles)


def rope_float64(inv_freq, max_positions):
    """Independent: the angles in float64, tiled, cast back to float32 at the end."""
    positions = torch.arange(max_positions, dtype=torch.float64)[:, None]
    angles = (positions * inv_freq.double()).repeat(1, 2)
    return angles.cos().float(), angles.sin().float()


def rope_doubled_frequencies(inv_freq, max_positions):
    """Independent: the frequencies written twice first, then one broadcast product."""
    freq = torch.cat((inv_freq, inv_freq))
    angles = torch.arange(max_positions).float().unsqueeze(1) * freq
    return [angles.cos(), angles.sin()]


def rope_einsum(inv_freq, max_positions):
    angles = torch.einsum("p,f->pf", torch.arange(max_positions, dtype=torch.float32), inv_freq).tile(1, 2)
    return angles.cos(), angles.sin()


right(RT, rope_loops)
right(RT, rope_float64)
right(RT, rope_doubled_frequencies)
right(RT, rope_einsum)


def _angles(inv_freq, max_positions):
    return torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)


def rope_interleaved(inv_freq, max_positions):
    """The RoPE paper's (and GGML's) layout: dimensions 2i and 2i+1 share an angle."""
    angles = _angles(inv_freq, max_positions).repeat_interleave(2, dim=-1)
    return angles.cos(), angles.sin()


def rope_not_doubled(inv_freq, max_positions):
    """One column per frequency: the angles never written twice."""
    angles = _angles(inv_freq, max_positions)
    return angles.cos(), angles.sin()


def rope_outer_swapped(inv_freq, max_positions):
    """outer(inv_freq, positions): frequencies down the rows, positions along the columns."""
    angles = torch.outer(inv_freq, torch.arange(max_positions, dtype=torch.float32))
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def rope_cat_wrong_axis(inv_freq, max_positions):
    angles = _angles(inv_freq, max_positions)
    angles = torch.cat([angles, angles], dim=0)
    return angles.cos(), angles.sin()


def rope_transposed(inv_freq, max_positions):
    """Right tables, returned [D, P] (positions along the columns)."""
    angles = torch.cat([_angles(inv_freq, max_positions)] * 2, dim=-1).T
    return angles.cos(), angles.sin()


def rope_positions_from_one(inv_freq, max_positions):
    """Counts positions 1..P, as a human counts tokens."""
    angles = torch.outer(torch.arange(1, max_positions + 1, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def rope_one_row_short(inv_freq, max_positions):
    angles = torch.outer(torch.arange(1, max_positions, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def rope_one_row_too_many(inv_freq, max_positions):
    angles = torch.outer(torch.arange(max_positions + 1, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def rope_position_step_two(inv_freq, max_positions):
    """Copies the frequencies' arange(0, D, 2) for the positions."""
    angles = torch.outer(torch.arange(0, max_positions, 2, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def rope_swapped(inv_freq, max_positions):
    angles = torch.cat([_angles(inv_freq, max_positions)] * 2, dim=-1)
    return angles.sin(), angles.cos()


def rope_divides(inv_freq, max_positions):
    """Reads inv_freq as a wavelength: position / inv_freq."""
    angles = torch.arange(max_positions, dtype=torch.float32)[:, None] / inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def rope_no_position(inv_freq, max_positions):
    """The frequencies repeated on every row: the position never enters."""
    angles = torch.cat([inv_freq, inv_freq]).expand(max_positions, -1)
    return angles.cos(), angles.sin()


def rope_forgets_cos(inv_freq, max_positions):
    angles = torch.cat([_angles(inv_freq, max_positions)] * 2, dim=-1)
    return angles, angles.sin()


def rope_signed_sin(inv_freq, max_positions):
    """Folds rotate_half's minus sign into the sin table, as the engine's own copy does."""
    angles = _angles(inv_freq, max_positions)
    return torch.cat([angles, angles], dim=-1).cos(), torch.cat([-angles.sin(), angles.sin()], dim=-1)


def rope_second_half_negated(inv_freq, max_positions):
    """Turns the second dimension of each pair the other way."""
    angles = _angles(inv_freq, max_positions)
    both = torch.cat([angles, -angles], dim=-1)
    return both.cos(), both.sin()


def rope_own_frequencies(inv_freq, max_positions):
    """Ignores the argument and recomputes the textbook frequencies, base 10000."""
    dim = 2 * inv_freq.shape[0]
    freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    angles = torch.cat([_angles(freq, max_positions)] * 2, dim=-1)
    return angles.cos(), angles.sin()


def rope_float64_returned(inv_freq, max_positions):
    angles = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq.double())
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def rope_half_precision(inv_freq, max_positions):
    """Half precision, "the tables are small"."""
    angles = torch.cat([_angles(inv_freq, max_positions)] * 2, dim=-1)
    return angles.cos().half(), angles.sin().half()


def rope_mutates_inv_freq(inv_freq, max_positions):
    """unsqueeze_ reshapes the caller's tensor in place."""
    angles = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq.unsqueeze_(0)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def rope_stacked(inv_freq, max_positions):
    """One tensor [2, P, D] instead of the pair."""
    angles = torch.cat([_angles(inv_freq, max_positions)] * 2, dim=-1)
    return torch.stack([angles.cos(), angles.sin()])


def rope_degrees(inv_freq, max_positions):
    """Angles converted to degrees: torch.cos takes radians."""
    angles = torch.cat([_angles(inv_freq, max_positions)] * 2, dim=-1) * (180 / torch.pi)
    return angles.cos(), angles.sin()


wrong(RT, "interleaved layout", rope_interleaved)
wrong(RT, "one column per frequency", rope_not_doubled)
wrong(RT, "outer(positions, inv_freq) (not outer(inv_freq, positions))", rope_outer_swapped)
wrong(RT, "written twice along the positions (dim 0)", rope_cat_wrong_axis)
wrong(RT, "shape (8, 7), expected (7, 8): positions run along the columns", rope_transposed)
wrong(RT, "row p of your tables holds position p+1's angles", rope_positions_from_one)
wrong(RT, "one row short", rope_one_row_short)
wrong(RT, "one row too many", rope_one_row_too_many)
wrong(RT, "every other position only", rope_position_step_two)
wrong(RT, "the two tables are swapped", rope_swapped)
wrong(RT, "position / inv_freq", rope_divides)
wrong(RT, "every row of your tables holds the same angles", rope_no_position)
wrong(RT, "the cos table holds the angles themselves", rope_forgets_cos)
wrong(RT, "the first half of your sin table is negated", rope_signed_sin)
wrong(RT, "the second half of your sin table is negated", rope_second_half_negated)
wrong(RT, "not the inv_freq they were given", rope_own_frequencies)
wrong(RT, "has dtype torch.float64, expected torch.float32", rope_float64_returned)
wrong(RT, "has dtype torch.float16, expected torch.float32", rope_half_precision)
wrong(RT, "rope_tables changed inv_freq", rope_mutates_inv_freq)
wrong(RT, "a pair of tensors (cos, sin), got Tensor", rope_stacked)
wrong(RT, "your angles are in degrees", rope_degrees)


def rope_sin_from_cos(inv_freq, max_positions):
    """sin as sqrt(1 - cos²): loses the sign of every sine past π."""
    cos = torch.cat([_angles(inv_freq, max_positions)] * 2, dim=-1).cos()
    return cos, torch.sqrt(1 - cos**2)


def rope_mixed_layouts(inv_freq, max_positions):
    """cos in the rotate_half layout, sin interleaved: two tables that disagree on the angles."""
    angles = _angles(inv_freq, max_positions)
    return torch.cat([angles, angles], dim=-1).cos(), angles.repeat_interleave(2, dim=-1).sin()


wrong(RT, "q·k changes when both tokens move", rope_sin_from_cos)
wrong(RT, "cos² + sin²", rope_mixed_layouts)
