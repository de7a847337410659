"""Every check passes on the reference answer and fails, with the right message, on the
mistakes learners actually make."""

from __future__ import annotations

import math

import pytest
import torch

from minillm.course import (
    CheckFailed,
    check_causal_attention,
    check_generate_cached,
    check_generate_naive,
    check_kv_read,
    check_kv_write,
    check_next_token,
    forward_logits,
    forward_step,
    new_cache,
)
from minillm.course.results import FAIL, GRADE_LOG_ENV, NOT_ATTEMPTED, PASS

# ---- reference answers (as in solutions/) -------------------------------------------------------


def next_token(logits):
    return int(logits[-1].argmax())


def generate_naive(model, prompt_ids, max_new_tokens):
    ids, new = list(prompt_ids), []
    for _ in range(max_new_tokens):
        token = next_token(forward_logits(model, ids))
        new.append(token)
        ids.append(token)
    return new


def causal_attention(q, k, v):
    t = q.shape[-2]
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    future = torch.ones(t, t, dtype=torch.bool).triu(diagonal=1)
    return torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1) @ v


def kv_write(k_cache, v_cache, k_new, v_new, start):
    t = k_new.shape[2]
    k_cache[:, :, start : start + t] = k_new
    v_cache[:, :, start : start + t] = v_new


def kv_read(k_cache, v_cache, length):
    return k_cache[:, :, :length], v_cache[:, :, :length]


def generate_cached(model, prompt_ids, max_new_tokens):
    cache = new_cache(model, len(prompt_ids) + max_new_tokens)
    logits = forward_step(model, list(prompt_ids), 0, cache)
    new = [int(logits[-1].argmax())]
    while len(new) < max_new_tokens:
        logits = forward_step(model, [new[-1]], len(prompt_ids) + len(new) - 1, cache)
        new.append(int(logits[-1].argmax()))
    return new


@pytest.mark.parametrize(
    "check,answer",
    [
        (check_next_token, next_token),
        (check_generate_naive, generate_naive),
        (check_causal_attention, causal_attention),
        (check_kv_write, kv_write),
        (check_kv_read, kv_read),
        (check_generate_cached, generate_cached),
    ],
)
def test_reference_answers_pass(check, answer, capsys):
    result = check(answer)
    assert result.status == PASS
    assert "✅" in capsys.readouterr().out


# ---- typical wrong answers ----------------------------------------------------------------------


def _fails_with(check, answer, *fragments):
    with pytest.raises(CheckFailed) as err:
        check(answer)
    for fragment in fragments:
        assert fragment in str(err.value), str(err.value)


def test_next_token_mistakes():
    _fails_with(check_next_token, lambda logits: int(logits[0].argmax()), "argmax of position 0", "logits[-1]")
    _fails_with(check_next_token, lambda logits: int(logits.argmax()), "argmax of position 0")
    _fails_with(check_next_token, lambda logits: int(logits.argmax(dim=0)[-1]), "wrong axis")
    _fails_with(check_next_token, lambda logits: logits[-1].argmax(), "return a Python int")


def test_generate_naive_mistakes():
    def one_short(model, prompt, n):
        return generate_naive(model, prompt, n - 1)

    def forgets_to_append(model, prompt, n):
        return [next_token(forward_logits(model, list(prompt))) for _ in range(n)]

    def includes_prompt(model, prompt, n):
        return list(prompt) + generate_naive(model, prompt, n)

    _fails_with(check_generate_naive, one_short, "returned 31 tokens, expected 32")
    _fails_with(check_generate_naive, forgets_to_append, "token 1 is", "first 1 tokens agree")
    _fails_with(check_generate_naive, includes_prompt, "token 0 is")


def test_causal_attention_mistakes():
    def no_scale(q, k, v):
        t = q.shape[-2]
        future = torch.ones(t, t, dtype=torch.bool).triu(1)
        return torch.softmax((q @ k.transpose(-1, -2)).masked_fill(future, float("-inf")), -1) @ v

    def no_mask(q, k, v):
        return torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), -1) @ v

    def wrong_axis(q, k, v):
        t = q.shape[-2]
        future = torch.ones(t, t, dtype=torch.bool).triu(1)
        scores = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(future, float("-inf"))
        return torch.softmax(scores, dim=-2) @ v

    def wrong_shape(q, k, v):
        return causal_attention(q, k, v).transpose(1, 2)

    _fails_with(check_causal_attention, no_scale, "not scaled", "sqrt(head_dim)")
    _fails_with(check_causal_attention, no_mask, "no causal mask")
    _fails_with(check_causal_attention, wrong_axis, "wrong axis", "dim=-1")
    _fails_with(check_causal_attention, wrong_shape, "has shape (2, 5, 3, 8), expected (2, 3, 5, 8)")


def test_kv_write_mistakes():
    def rebinds(k_cache, v_cache, k_new, v_new, start):
        k_cache = k_new  # noqa: F841 - the mistake under test
        v_cache = v_new  # noqa: F841

    def off_by_one(k_cache, v_cache, k_new, v_new, start):
        kv_write(k_cache, v_cache, k_new, v_new, start + 1)

    def keys_only(k_cache, v_cache, k_new, v_new, start):
        k_cache[:, :, start : start + k_new.shape[2]] = k_new

    _fails_with(check_kv_write, rebinds, "still all zeros", "in place")
    _fails_with(check_kv_write, off_by_one, "positions [6, 7], expected [5, 6]")
    _fails_with(check_kv_write, keys_only, "value cache is still all zeros")


def test_kv_read_mistakes():
    _fails_with(check_kv_read, lambda k, v, n: (k[:, :, : n - 1], v[:, :, : n - 1]), "off by one")
    _fails_with(check_kv_read, lambda k, v, n: (k[:, :, :n].clone(), v[:, :, :n].clone()), "copied the cache")
    _fails_with(check_kv_read, lambda k, v, n: (k[:, :, :n], k[:, :, :n]), "values returned by kv_read")


def test_generate_cached_mistakes():
    def wrong_position(model, prompt, n):
        cache = new_cache(model, len(prompt) + n + 1)
        logits = forward_step(model, list(prompt), 0, cache)
        new = [int(logits[-1].argmax())]
        while len(new) < n:
            logits = forward_step(model, [new[-1]], len(prompt) + len(new), cache)  # one too far
            new.append(int(logits[-1].argmax()))
        return new

    def no_cache_reuse(model, prompt, n):
        new = []
        for _ in range(n):
            cache = new_cache(model, len(prompt) + n)
            new.append(int(forward_step(model, list(prompt) + new, 0, cache)[-1].argmax()))
        return new

    _fails_with(check_generate_cached, wrong_position, "decode step 1 ran at position", "len(prompt)")
    _fails_with(check_generate_cached, no_cache_reuse, "fed", "only the newest token")


def test_not_attempted_is_reported_not_raised(tmp_path, monkeypatch, capsys):
    log = tmp_path / "log.jsonl"
    monkeypatch.setenv(GRADE_LOG_ENV, str(log))

    def unfinished(logits):
        raise NotImplementedError()

    assert check_next_token(unfinished).status == NOT_ATTEMPTED
    assert "not attempted" in capsys.readouterr().out
    with pytest.raises(CheckFailed):
        check_next_token(lambda logits: 1 / 0)  # a crash in learner code is a failure with its error
    lines = log.read_text().splitlines()
    assert [NOT_ATTEMPTED, FAIL] == [__import__("json").loads(line)["status"] for line in lines]
    assert "ZeroDivisionError" in lines[1]
