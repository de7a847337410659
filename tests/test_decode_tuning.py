"""The paged-decode search space and its measured choice (``minillm/attention/decode_tuning.py``).

On a CPU the kernels run under Triton's interpreter, so these tests check what a GPU's choice
cannot change: every setting in the space, the split merge and the gather + SDPA candidate
compute the reference's numbers, and the chooser keeps the fastest, once per shape bucket,
skipping what fails and never deciding during a CUDA-graph capture. What the GPU picks, and
how fast it is, is ``benchmarks/gpu_checks.sh``'s to measure.
"""

from __future__ import annotations

import pytest
import torch

from minillm import LLM, SamplingParams
from minillm.attention import triton_available

if not triton_available():
    pytest.skip("triton is not installed", allow_module_level=True)

from minillm.attention import decode_tuning  # noqa: E402
from minillm.attention.decode_tuning import (  # noqa: E402
    DEFAULT,
    GATHER_SDPA,
    SEARCH_SPACE,
    DecodeConfig,
    MeasuredChoice,
    gather_sdpa_decode,
    shape_bucket,
)  # fmt: skip
from minillm.attention.triton_kernels import merge_splits, merge_splits_reference, paged_decode  # noqa: E402
from tests.test_triton_kernels import DEVICE, FP32_TOL, reference, scatter_into_pool  # noqa: E402


def _decode_case(heads=6, kv_heads=2, dim=48, contexts=(1, 17, 70), block_size=8, seed=5):
    gen = torch.Generator().manual_seed(seed)
    ks = [torch.randn(s, kv_heads, dim, generator=gen).to(DEVICE) for s in contexts]
    vs = [torch.randn(s, kv_heads, dim, generator=gen).to(DEVICE) for s in contexts]
    k_pool, v_pool, tables = scatter_into_pool(ks, vs, block_size, 40, gen)
    q = torch.randn(len(contexts), heads, dim, generator=gen).to(DEVICE)
    return q, ks, vs, k_pool, v_pool, tables, torch.tensor(contexts, device=DEVICE)


def _check_rows(out, q, ks, vs, window=None):
    for i in range(q.shape[0]):
        k, v = ks[i], vs[i]
        if window is not None:
            k, v = k[-window:], v[-window:]
        torch.testing.assert_close(out[i : i + 1], reference(q[i : i + 1], k, v, False), atol=FP32_TOL, rtol=FP32_TOL)


def test_the_space_holds_the_default_and_distinct_settings():
    assert SEARCH_SPACE[0] == DEFAULT == DecodeConfig(32, 4, 3, 2)  # the kernel's launch before tuning
    assert len(set(SEARCH_SPACE)) == len(SEARCH_SPACE) and len(SEARCH_SPACE) <= 16
    assert {c.block_n for c in SEARCH_SPACE} == {32, 64, 128}


@pytest.mark.parametrize("config", SEARCH_SPACE, ids=str)
@pytest.mark.parametrize("splits", [None, 3])
def test_every_setting_computes_the_reference(config, splits):
    """Odd shapes: GQA 3:1, head_dim 48 (masked to 64), contexts not multiples of any block."""
    q, ks, vs, k_pool, v_pool, tables, lens = _decode_case()
    out = paged_decode(q, k_pool, v_pool, tables, lens, 48**-0.5, 8, 70, num_splits=splits, config=config)
    _check_rows(out, q, ks, vs)


def test_a_sliding_window_with_empty_splits():
    """With a window of 9 over 70 keys in 4 splits, the early splits hold no key (m = -inf)."""
    q, ks, vs, k_pool, v_pool, tables, lens = _decode_case(contexts=(70, 66))
    out = paged_decode(q, k_pool, v_pool, tables, lens, 48**-0.5, 8, 70, num_splits=4, window=9)
    _check_rows(out, q, ks, vs, window=9)


@pytest.mark.parametrize(("splits", "dim"), [(1, 16), (5, 48), (16, 128)])
def test_the_merge_kernel_is_the_log_sum_exp_rule(splits, dim):
    gen = torch.Generator().manual_seed(splits)
    m = torch.randn(3, 4, splits, generator=gen) * 4
    sums = torch.rand(3, 4, splits, generator=gen) + 0.5
    o = torch.randn(3, 4, splits, dim, generator=gen)
    if splits > 1:  # empty splits, as a window or a short row leaves them
        m[0, :, 0], sums[0, :, 0], o[0, :, 0] = float("-inf"), 0.0, 0.0
    m, sums, o = m.to(DEVICE), sums.to(DEVICE), o.to(DEVICE)
    torch.testing.assert_close(merge_splits(m, sums, o, torch.float32), merge_splits_reference(m, sums, o, torch.float32),
                               atol=1e-6, rtol=1e-6)  # fmt: skip


@pytest.mark.parametrize("window", [None, 5])
def test_gather_sdpa_decode_is_the_reference(window):
    q, ks, vs, k_pool, v_pool, tables, lens = _decode_case(heads=8, kv_heads=2, dim=32, contexts=(3, 16, 29))
    out = gather_sdpa_decode(q, k_pool, v_pool, tables, lens, 32**-0.5, 8, window)
    _check_rows(out, q, ks, vs, window)


def test_shape_buckets_round_up_to_powers_of_two():
    assert shape_bucket(1, 10) == (1, 256)
    assert shape_bucket(3, 257, "x") == (4, 512, "x")
    assert shape_bucket(64, 4096) == (64, 4096) != shape_bucket(65, 4096)


class FakeTimer:
    """Seconds per candidate, and a record of what was timed."""

    def __init__(self, seconds: dict):
        self.seconds, self.timed = seconds, []

    def __call__(self, fn):  # fn: functools.partial(run, candidate)
        fn()
        self.timed.append(fn.args[0])
        return self.seconds[fn.args[0]]


def test_the_choice_keeps_the_fastest_once_per_key():
    timer = FakeTimer({"a": 3.0, "b": 1.0, "c": 2.0})
    choice = MeasuredChoice(["a", "b", "c"], timer)
    assert choice.pick("k", lambda c: c) == "b"
    assert choice.pick("k", lambda c: c) == "b" and timer.timed == ["a", "b", "c"]  # measured once
    assert choice.pick("k2", lambda c: c, candidates=["a", "c"]) == "c"  # a narrowed set
    assert choice.timings["k"] == {"a": 3.0, "b": 1.0, "c": 2.0}


def test_a_candidate_that_cannot_launch_is_skipped_but_the_default_must_run():
    def run(c):
        if c != "a":
            raise RuntimeError("out of resources")
        return c

    choice = MeasuredChoice(["a", "b"], FakeTimer({"a": 1.0}))
    assert choice.pick("k", run) == "a" and choice.timings["k"]["b"] == float("inf")
    with pytest.raises(RuntimeError, match="out of resources"):
        MeasuredChoice(["b", "a"], FakeTimer({"a": 1.0})).pick("k", run)


def test_without_a_timer_the_default_serves_and_nothing_is_decided():
    choice = MeasuredChoice(["a", "b"], None)
    assert choice.pick("k", lambda c: 1 / 0) == "a" and choice.decided == {}
    with pytest.raises(ValueError, match="at least one candidate"):
        MeasuredChoice([])


def test_no_decision_is_made_during_a_graph_capture(monkeypatch):
    monkeypatch.setattr(decode_tuning, "_capturing", lambda: True)
    timer = FakeTimer({"a": 2.0, "b": 1.0})
    choice = MeasuredChoice(["a", "b"], timer)
    assert choice.pick("k", lambda c: c) == "a" and timer.timed == [] and choice.decided == {}


@pytest.mark.parametrize("winner", [GATHER_SDPA, SEARCH_SPACE[-1]], ids=str)
def test_the_engine_runs_whichever_candidate_wins(tiny_model, monkeypatch, winner):
    """The Triton backend asks the choice for every decode step; whichever kernel it names, the
    greedy tokens are the torch backend's (chunked prefill, scattered blocks, decodes)."""
    seconds = {c: (0.0 if c == winner else 1.0) for c in (*SEARCH_SPACE, GATHER_SDPA)}
    choice = MeasuredChoice((*SEARCH_SPACE, GATHER_SDPA), FakeTimer(seconds))
    monkeypatch.setattr(decode_tuning, "decode_choice", lambda device: choice)
    prompts = [[5, 17, 42, 8, 99, 3, 250, 61, 7], [11, 12]]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    args = dict(dtype="fp32", block_size=4, max_num_batched_tokens=7, device=DEVICE.type)
    ref = LLM(tiny_model, attention_backend="torch", **args).generate(prompts, params)
    out = LLM(tiny_model, attention_backend="triton", **args).generate(prompts, params)
    assert [o.token_ids for o in out] == [o.token_ids for o in ref]
    assert choice.decided and set(choice.decided.values()) == {winner}
