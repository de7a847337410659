"""Chapter 02, the KV cache: the answers its exercises' checks are tested against (see
``catalogue/__init__.py``)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from catalogue.answers import Answers
from catalogue.ch01 import generate_naive
from minillm.course import forward_step, model_weights, new_cache, rms_norm, rope_cos_sin

ANSWERS = Answers()
right, wrong = ANSWERS.right, ANSWERS.wrong


# ---- 02: the KV cache -----------------------------------------------------------------------


def kv_write(k_cache, v_cache, k_new, v_new, start):
    t = k_new.shape[2]
    k_cache[:, :, start : start + t] = k_new
    v_cache[:, :, start : start + t] = v_new


def kv_write_narrow(k_cache, v_cache, k_new, v_new, start):
    for cache, new in ((k_cache, k_new), (v_cache, v_new)):
        cache.narrow(2, start, new.shape[2]).copy_(new)


def kv_write_rebinds(k_cache, v_cache, k_new, v_new, start):
    k_cache = k_new  # noqa: F841 - the mistake under test
    v_cache = v_new  # noqa: F841


def kv_write_keys_only(k_cache, v_cache, k_new, v_new, start):
    k_cache[:, :, start : start + k_new.shape[2]] = k_new


def kv_write_heads_axis(k_cache, v_cache, k_new, v_new, start):
    k_cache[:, start : start + k_new.shape[2]] = k_new
    v_cache[:, start : start + v_new.shape[2]] = v_new


def kv_write_swapped(k_cache, v_cache, k_new, v_new, start):
    kv_write(k_cache, v_cache, v_new, k_new, start)


def kv_write_first_token_only(k_cache, v_cache, k_new, v_new, start):
    k_cache[:, :, start] = k_new[:, :, 0]
    v_cache[:, :, start] = v_new[:, :, 0]


right("check_kv_write", kv_write)
right("check_kv_write", kv_write_narrow)
wrong("check_kv_write", "still all zeros", kv_write_rebinds)
wrong("check_kv_write", "positions [6, 7], expected [5, 6]", lambda kc, vc, k, v, s: kv_write(kc, vc, k, v, s + 1))
wrong("check_kv_write", "value cache is still all zeros", kv_write_keys_only)
wrong("check_kv_write", "your code raised RuntimeError", kv_write_heads_axis)
wrong("check_kv_write", "k_cache[:, :, 5:7] after kv_write differs", kv_write_swapped)
wrong("check_kv_write", "positions [5], expected [5, 6]", kv_write_first_token_only)



def generate_cached(model, prompt_ids, max_new_tokens):
    cache = new_cache(model, len(prompt_ids) + max_new_tokens)
    logits = forward_step(model, list(prompt_ids), 0, cache)
    new = [int(logits[-1].argmax())]
    while len(new) < max_new_tokens:
        logits = forward_step(model, [new[-1]], len(prompt_ids) + len(new) - 1, cache)
        new.append(int(logits[-1].argmax()))
    return new


def generate_cached_positions(model, prompt_ids, max_new_tokens):
    cache = new_cache(model, len(prompt_ids) + max_new_tokens)
    position, feed, out = 0, list(prompt_ids), []
    for _ in range(max_new_tokens):
        token = int(forward_step(model, feed, position, cache)[-1].argmax())
        out.append(token)
        position += len(feed)
        feed = [token]
    return out


def cached_wrong_position(model, prompt, n):
    cache = new_cache(model, len(prompt) + n + 1)
    new = [int(forward_step(model, list(prompt), 0, cache)[-1].argmax())]
    while len(new) < n:
        new.append(int(forward_step(model, [new[-1]], len(prompt) + len(new), cache)[-1].argmax()))
    return new


def cached_no_reuse(model, prompt, n):
    new = []
    for _ in range(n):
        cache = new_cache(model, len(prompt) + n)
        new.append(int(forward_step(model, list(prompt) + new, 0, cache)[-1].argmax()))
    return new


def cached_one_extra_step(model, prompt, n):
    cache = new_cache(model, len(prompt) + n + 1)
    new = [int(forward_step(model, list(prompt), 0, cache)[-1].argmax())]
    for i in range(n):
        new.append(int(forward_step(model, [new[-1]], len(prompt) + i, cache)[-1].argmax()))
    return new[:n]


def cached_split_prefill(model, prompt, n):
    cache = new_cache(model, len(prompt) + n)
    forward_step(model, list(prompt[:-1]), 0, cache)  # the prompt but its last token...
    new = [int(forward_step(model, [prompt[-1]], len(prompt) - 1, cache)[-1].argmax())]  # ...then that one
    while len(new) < n:
        new.append(int(forward_step(model, [new[-1]], len(prompt) + len(new) - 1, cache)[-1].argmax()))
    return new


right("check_generate_cached", generate_cached)
right("check_generate_cached", generate_cached_positions)
wrong("check_generate_cached", "decode step 1 ran at position", cached_wrong_position)
wrong("check_generate_cached", "feed only the newest token", cached_no_reuse)
wrong("check_generate_cached", "one too many", cached_one_extra_step)
wrong("check_generate_cached", "prompt tokens followed by", lambda m, p, n: list(p) + generate_cached(m, p, n))
wrong("check_generate_cached", "the first forward pass wrote positions 0..9", cached_split_prefill)
wrong("check_generate_cached", "never ran the model through the cache", generate_naive)


# ---- ch02: more wrong answers a learner writes


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


# ---- Chapter 02's cached model (``check_cached_model``): right answers written independently, and the
# wrong ones a learner writes — each piece's slips, one at a time, the other pieces right.
#
# An answer is ``(apply_rope, KVCache, cached_forward)``; ``forward_with(...)`` builds a cached
# forward pass around the given rotation, with one slip switched on.


CM = "check_cached_model"


# ---- right answers --------------------------------------------------------------------------


def rope_a(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class CacheA:
    def __init__(self, num_layers, num_kv_heads, max_len, head_dim, dtype=torch.float32):
        self.k = torch.zeros(num_layers, num_kv_heads, max_len, head_dim, dtype=dtype)
        self.v = torch.zeros_like(self.k)

    def append(self, layer, start, k, v):
        end = start + k.shape[1]
        self.k[layer, :, start:end] = k
        self.v[layer, :, start:end] = v
        return self.k[layer, :, :end], self.v[layer, :, :end]


def forward_with(rope=rope_a, **slip):
    """The textbook cached step; ``slip`` switches on one learner's mistake."""

    def cached_forward(model, ids, start, cache):
        cfg = model.config
        H, KV, D, eps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps
        w = model_weights(model)
        T = len(ids)
        cos, sin = rope_cos_sin(model, start + T)
        first = 0 if slip.get("position_zero") else start
        cos, sin = cos[first : first + T], sin[first : first + T]
        seen = start + T
        visible = torch.arange(seen)[None, :] <= torch.arange(start, start + T)[:, None]
        if slip.get("mask_from_zero"):  # the prefill's triangle reused for every step
            visible = torch.ones(T, seen, dtype=torch.bool).tril()
        x = w.embed_tokens[torch.tensor(ids)]
        for i, lw in enumerate(w.layers):
            h = rms_norm(x, lw.input_layernorm, eps)
            q = rope((h @ lw.q_proj.T).view(T, H, D).transpose(0, 1), cos, sin)
            k = (h @ lw.k_proj.T).view(T, KV, D).transpose(0, 1)
            v = (h @ lw.v_proj.T).view(T, KV, D).transpose(0, 1)
            if not slip.get("rope_after_cache"):
                k = rope(k, cos, sin)
            if slip.get("no_cache"):
                pass  # attends over the new tokens only
            elif slip.get("same_layer"):
                k, v = cache.append(0, start, k, v)
            else:
                k, v = cache.append(i, start, k, v)
            if slip.get("rope_after_cache"):
                k = rope(k, *(t[: k.shape[1]] for t in rope_cos_sin(model, k.shape[1])))
            k, v = k.repeat_interleave(H // KV, dim=0), v.repeat_interleave(H // KV, dim=0)
            scores = q @ k.transpose(-1, -2) / math.sqrt(D)
            if k.shape[1] == seen:
                scores = scores.masked_fill(~visible, float("-inf"))
            else:
                scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
            a = torch.softmax(scores, dim=-1) @ v
            x = x + a.transpose(0, 1).reshape(T, H * D) @ lw.o_proj.T
            h = rms_norm(x, lw.post_attention_layernorm, eps)
            x = x + (F.silu(h @ lw.gate_proj.T) * (h @ lw.up_proj.T)) @ lw.down_proj.T
        return rms_norm(x, w.norm, eps) @ w.lm_head.T

    return cached_forward


def rope_b(x, cos, sin):
    """As complex numbers: pair (i, i + D/2) is one complex value, turned by e^{iθ}."""
    half = x.shape[-1] // 2
    z = torch.complex(x[..., :half].double(), x[..., half:].double())
    turned = z * torch.complex(cos[..., :half].double(), sin[..., :half].double())
    return torch.cat((turned.real, turned.imag), dim=-1).to(x.dtype)


class CacheB:
    """Per layer, a dict of two buffers; the filled length is tracked too."""

    def __init__(self, num_layers, num_kv_heads, max_len, head_dim, dtype=torch.float32):
        self.layers = [
            {"k": torch.empty(num_kv_heads, max_len, head_dim, dtype=dtype),
             "v": torch.empty(num_kv_heads, max_len, head_dim, dtype=dtype)}
            for _ in range(num_layers)
        ]

    def append(self, layer, start, k, v):
        buf = self.layers[layer]
        n = k.shape[-2]
        buf["k"][:, start : start + n].copy_(k)
        buf["v"][:, start : start + n].copy_(v)
        return buf["k"].narrow(1, 0, start + n), buf["v"].narrow(1, 0, start + n)


def forward_b(model, ids, start, cache):
    """SDPA with enable_gqa and an explicit boolean mask; F.linear for the matmuls."""
    cfg = model.config
    w = model_weights(model)
    T = len(ids)
    cos, sin = rope_cos_sin(model.config, start + T)
    cos, sin = cos[start:], sin[start:]
    mask = torch.ones(T, start + T, dtype=torch.bool).tril(diagonal=start)
    x = F.embedding(torch.tensor(ids), w.embed_tokens)
    for i, lw in enumerate(w.layers):
        h = rms_norm(x, lw.input_layernorm, cfg.rms_norm_eps)
        q, k, v = (F.linear(h, m).unflatten(-1, (n, cfg.head_dim)).transpose(0, 1)
                   for m, n in ((lw.q_proj, cfg.num_heads), (lw.k_proj, cfg.num_kv_heads), (lw.v_proj, cfg.num_kv_heads)))
        k, v = cache.append(i, start, rope_b(k, cos, sin), v)
        a = F.scaled_dot_product_attention(rope_b(q, cos, sin)[None], k[None], v[None], attn_mask=mask, enable_gqa=True)[0]
        x = x + F.linear(a.transpose(0, 1).flatten(1), lw.o_proj)
        h = rms_norm(x, lw.post_attention_layernorm, cfg.rms_norm_eps)
        x = x + F.linear(F.silu(F.linear(h, lw.gate_proj)) * F.linear(h, lw.up_proj), lw.down_proj)
    return F.linear(rms_norm(x, w.norm, cfg.rms_norm_eps), w.lm_head)


right(CM, rope_a, CacheA, forward_with())
right(CM, rope_b, CacheB, forward_b)


# ---- apply_rope -----------------------------------------------------------------------------


def rope_interleaved(x, cos, sin):
    """Pairs (2i, 2i+1), as in the paper's first form."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    c, s = cos[..., : x.shape[-1] // 2], sin[..., : x.shape[-1] // 2]  # one angle per pair
    return torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)


def rope_wrong_way(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat((x[..., half:], -x[..., :half]), dim=-1) * sin


def rope_swapped(x, cos, sin):
    return rope_a(x, sin, cos)


def rope_cos_only(x, cos, sin):
    return x * cos


def rope_no_minus(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat((x[..., half:], x[..., :half]), dim=-1) * sin


def rope_in_place(x, cos, sin):
    half = x.shape[-1] // 2
    turned = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    x.mul_(cos)
    return x.add_(turned * sin)


def rope_only_3d(x, cos, sin):
    """Unpacks three dims: works on [heads, T, D] only."""
    heads, t, d = x.shape
    return rope_a(x, cos, sin)


for fn, message in (
    (rope_interleaved, "rotates pairs (0, 1), (2, 3)"),
    (rope_wrong_way, "turns the wrong way"),
    (rope_swapped, "swapped cos and sin"),
    (rope_cos_only, "dropped the rotate_half(x)·sin term"),
    (rope_no_minus, "without the minus sign"),
    (rope_in_place, "changed its input x in place"),
    (rope_only_3d, "ValueError"),
):
    wrong(CM, message, fn, CacheA, forward_with(rope=fn))


# ---- KVCache --------------------------------------------------------------------------------


class CacheCat:
    """Grows with torch.cat: every token copies the whole history."""

    def __init__(self, num_layers, num_kv_heads, max_len, head_dim, dtype=torch.float32):
        self.k = [torch.zeros(num_kv_heads, 0, head_dim, dtype=dtype) for _ in range(num_layers)]
        self.v = [torch.zeros(num_kv_heads, 0, head_dim, dtype=dtype) for _ in range(num_layers)]

    def append(self, layer, start, k, v):
        self.k[layer] = torch.cat([self.k[layer][:, :start], k], dim=1)
        self.v[layer] = torch.cat([self.v[layer][:, :start], v], dim=1)
        return self.k[layer], self.v[layer]


class CacheNewOnly(CacheA):
    def append(self, layer, start, k, v):
        super().append(layer, start, k, v)
        return k, v


class CacheWholeBuffer(CacheA):
    def append(self, layer, start, k, v):
        super().append(layer, start, k, v)
        return self.k[layer], self.v[layer]


class CacheSharedLayers:
    """One buffer for all layers: [num_layers] * [buffer] repeats the same tensor."""

    def __init__(self, num_layers, num_kv_heads, max_len, head_dim, dtype=torch.float32):
        self.k = [torch.zeros(num_kv_heads, max_len, head_dim, dtype=dtype)] * num_layers
        self.v = [torch.zeros(num_kv_heads, max_len, head_dim, dtype=dtype)] * num_layers

    def append(self, layer, start, k, v):
        end = start + k.shape[1]
        self.k[layer][:, start:end] = k
        self.v[layer][:, start:end] = v
        return self.k[layer][:, :end], self.v[layer][:, :end]


class CacheKeepsReference:
    """Stores the prefill's tensors themselves, then writes decode tokens into a buffer it grows."""

    def __init__(self, num_layers, num_kv_heads, max_len, head_dim, dtype=torch.float32):
        self.k = [torch.zeros(num_kv_heads, max_len, head_dim, dtype=dtype) for _ in range(num_layers)]
        self.v = [torch.zeros(num_kv_heads, max_len, head_dim, dtype=dtype) for _ in range(num_layers)]
        self.held = {}

    def append(self, layer, start, k, v):
        end = start + k.shape[1]
        self.held[(layer, start)] = (k, v)  # "saves a copy" that is the caller's tensor
        for (lay, at), (kk, vv) in self.held.items():
            if lay == layer:
                self.k[layer][:, at : at + kk.shape[1]] = kk
                self.v[layer][:, at : at + vv.shape[1]] = vv
        return self.k[layer][:, :end], self.v[layer][:, :end]


class CacheOffByOne(CacheA):
    """Returns one position too few: the token just written is left out."""

    def append(self, layer, start, k, v):
        got_k, got_v = super().append(layer, start, k, v)
        return got_k[:, :-1], got_v[:, :-1]


for cls, message in (
    (CacheCat, "returned a new tensor each step"),
    (CacheNewOnly, "returned only the new token's keys"),
    (CacheWholeBuffer, "returned the whole buffer"),
    (CacheSharedLayers, "Each layer keeps its own"),
    (CacheKeepsReference, "kept a reference to the k it was given"),
    (CacheOffByOne, "returned positions 0..1"),
):
    wrong(CM, message, rope_a, cls, forward_with())


# ---- cached_forward -------------------------------------------------------------------------


def forward_calls_the_package(model, ids, start, cache):
    from minillm.course import new_cache

    if not hasattr(cache, "package"):
        cache.package = new_cache(model, 64)
    return forward_step(model, ids, start, cache.package)


wrong(CM, "decode step 1 (one token at position 11) differs", rope_a, CacheA, forward_with(position_zero=True))
wrong(CM, "a one-token query sees every cached key", rope_a, CacheA, forward_with(mask_from_zero=True))
wrong(CM, "your prefill matches the engine's, but decode step 1", rope_a, CacheA, forward_with(no_cache=True))
wrong(CM, "ran the package's model", rope_a, CacheA, forward_calls_the_package)
wrong(CM, "your prefill matches the engine's, but decode step 1", rope_a, CacheA, forward_with(same_layer=True))
# Caching K before the rotation and rotating every cached key at each step is slow but right:
right(CM, rope_a, CacheA, forward_with(rope_after_cache=True))


# ---- Chapter 02's batch cache (``check_contiguous_cache``): two right answers written independently,
# and the wrong ones a learner writes, one slip each (``cache_with``).


CC = "check_contiguous_cache"


def cache_with(**slip):
    """The slab-per-K-and-V class, with one learner's slip switched on."""

    class ContiguousKVCache:
        def __init__(self, config, batch_size, max_len, dtype, device):
            shape = (config.num_layers, batch_size, config.num_kv_heads, max_len, config.head_dim)
            make = torch.empty if slip.get("empty") else torch.zeros
            self.k = make(shape, dtype=dtype, device=device)
            self.v = make(shape, dtype=dtype, device=device)
            if slip.get("shared_slab"):
                self.v = self.k

        def write(self, layer, positions, k, v, same_start=None):
            batch = positions.shape[0]
            if slip.get("all_rows"):
                batch = self.k.shape[1]
            layer = 0 if slip.get("layer_zero") else layer
            if same_start is not None and not slip.get("always_slice"):
                t = k.shape[2]
                start = 0 if slip.get("slice_from_zero") else same_start
                self.k[layer, :batch, :, start : start + t] = k
                self.v[layer, :batch, :, start : start + t] = v
                return
            if slip.get("always_slice"):
                start = int(positions[0, 0])
                self.k[layer, :batch, :, start : start + k.shape[2]] = k
                self.v[layer, :batch, :, start : start + k.shape[2]] = v
                return
            rows = torch.arange(batch)[:, None]
            self.k[layer][rows, :, positions] = k.transpose(1, 2)
            self.v[layer][rows, :, positions] = (k if slip.get("keys_twice") else v).transpose(1, 2)

        def read(self, layer, batch, length):
            if slip.get("copies"):
                return self.k[layer, :batch, :, :length].clone(), self.v[layer, :batch, :, :length].clone()
            if slip.get("all_rows_read"):
                return self.k[layer, :, :, :length], self.v[layer, :, :, :length]
            if slip.get("swapped"):
                return self.v[layer, :batch, :, :length], self.k[layer, :batch, :, :length]
            end = length - 1 if slip.get("short") else length
            return self.k[layer, :batch, :, :end], self.v[layer, :batch, :, :end]

        def move_row(self, src, dst, length):
            if slip.get("no_move"):
                return
            if slip.get("move_swapped"):
                src, dst = dst, src
            if slip.get("move_one_layer"):
                self.k[0, dst, :, :length] = self.k[0, src, :, :length]
                self.v[0, dst, :, :length] = self.v[0, src, :, :length]
                return
            self.k[:, dst, :, :length] = self.k[:, src, :, :length]
            self.v[:, dst, :, :length] = self.v[:, src, :, :length]

    return ContiguousKVCache


class CacheByLayers:
    """Right, written differently: one tensor per layer (a list), narrow() for views, index_copy_ for rows."""

    def __init__(self, config, batch_size, max_len, dtype, device):
        shape = (batch_size, config.num_kv_heads, max_len, config.head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]

    def write(self, layer, positions, k, v, same_start=None):
        for b in range(positions.shape[0]):  # row by row: each row's positions may differ
            for cache, new in ((self.keys[layer], k), (self.values[layer], v)):
                cache[b].index_copy_(1, positions[b], new[b])

    def read(self, layer, batch, length):
        return self.keys[layer].narrow(0, 0, batch).narrow(2, 0, length), self.values[layer].narrow(0, 0, batch).narrow(
            2, 0, length
        )

    def move_row(self, src, dst, length):
        for cache in (*self.keys, *self.values):
            cache[dst, :, :length] = cache[src, :, :length]


right(CC, cache_with())
right(CC, CacheByLayers)
wrong(CC, "a new cache holds zeros", cache_with(empty=True))
wrong(CC, "(they are the other tensor's: keys and values swapped)", cache_with(swapped=True))
wrong(CC, "each layer has its own K/V", cache_with(layer_zero=True))
wrong(CC, "gets its token at position 6", cache_with(slice_from_zero=True))
wrong(CC, "each row's tokens go to its own positions", cache_with(always_slice=True))
wrong(CC, "your code raised RuntimeError: The expanded size of the tensor (3)", cache_with(all_rows=True))
wrong(CC, "move_row(src, dst, length) copies positions", cache_with(no_move=True))
wrong(CC, "move_row(src, dst, length) copies positions", cache_with(move_swapped=True))
wrong(CC, "in every layer", cache_with(move_one_layer=True))
wrong(CC, "read returned a copy", cache_with(copies=True))
wrong(CC, "expected (3, 2, 8, 4) [batch, kv_heads, length, head_dim]", cache_with(short=True))
wrong(CC, "expected (2, 2, 4, 4): the first `batch` rows", cache_with(all_rows_read=True))
wrong(CC, "layer 0's keys differ", cache_with(shared_slab=True))
wrong(CC, "values differ", cache_with(keys_twice=True))
