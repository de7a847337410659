"""The parallelism planner: parameter counts of published configs, KV per device with K/V
heads split or replicated, memory fit, all-reduce bytes, and its refusals."""

from __future__ import annotations

import pytest

from minillm.config import ModelConfig
from minillm.kvcache.addressing import kv_bytes_per_token
from minillm.parallel import MODELS, plan


@pytest.mark.parametrize(
    ("name", "billions"),
    [("Llama-2-7B", 6.74), ("Llama-2-70B", 68.98), ("Llama-3.1-405B", 405.8), ("SmolLM2-135M", 0.1345)],
)
def test_parameter_counts_match_the_published_models(name, billions):
    assert MODELS[name].params / 1e9 == pytest.approx(billions, rel=0.005)


def test_single_device_kv_matches_the_engine_for_smollm2(smollm2_dir):
    p = plan("SmolLM2-135M", "H100 SXM 80GB", kv_dtype="bf16")
    assert p.kv_per_token_per_device_bytes == kv_bytes_per_token(ModelConfig.from_folder(smollm2_dir), "bf16")


def test_kv_heads_split_until_each_rank_has_one_then_replicate():
    one = plan("Llama-2-70B", "H100 SXM 80GB", tp=1)
    eight = plan("Llama-2-70B", "H100 SXM 80GB", tp=8)
    sixteen = plan("Llama-2-70B", "H100 SXM 80GB", tp=16)
    assert eight.kv_heads_per_rank == 1 and eight.kv_replication == 1
    assert eight.kv_per_token_per_device_bytes == one.kv_per_token_per_device_bytes / 8
    assert sixteen.kv_heads_per_rank == 1 and sixteen.kv_replication == 2
    assert sixteen.kv_per_token_per_device_bytes == eight.kv_per_token_per_device_bytes  # no further saving
    assert sixteen.weights_per_device_gb == pytest.approx(eight.weights_per_device_gb / 2, rel=0.01)


def test_memory_fit_and_the_largest_batch():
    assert not plan("Llama-2-70B", "H100 SXM 80GB", tp=1).fits  # 138 GB of bf16 weights
    tp2 = plan("Llama-2-70B", "H100 SXM 80GB", tp=2)
    assert tp2.fits and tp2.max_batch >= 1
    tp8 = plan("Llama-2-70B", "H100 SXM 80GB", tp=8)
    assert tp8.max_batch > 8 * tp2.max_batch  # weights shrink and the KV per device shrinks too
    on_h200 = plan("Llama-2-70B", "H200 SXM 141GB", tp=2)
    assert on_h200.max_batch > tp2.max_batch
    int8 = plan("Llama-3.1-405B", "H100 SXM 80GB", tp=8, weight_dtype="int8")
    assert int8.fits and not plan("Llama-3.1-405B", "H100 SXM 80GB", tp=8).fits  # 810 GB bf16 > 8 × 72 GB


def test_allreduce_bytes_follow_the_ring_formula():
    p = plan("Llama-2-70B", "H100 SXM 80GB", tp=8)
    assert p.allreduce_bytes_per_token == 2 * 80 * 8192 * 2 * (2 * 7 / 8)
    assert plan("Llama-2-70B", "H200 SXM 141GB", tp=1).allreduce_bytes_per_token == 0
    assert (
        plan("Llama-2-70B", "H100 SXM 80GB", tp=8).tok_s_batch1
        > plan("Llama-2-70B", "H100 SXM 80GB", tp=2).tok_s_batch1
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [(dict(tp=12), "does not fit 8 K/V heads"), (dict(pp=81), "exceeds the model's 80 layers"), (dict(tp=0), "positive"), (dict(weight_dtype="int3"), "int3"),
     (dict(context=0), "context")],
)  # fmt: skip
def test_bad_plans_are_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        plan("Llama-2-70B", "H100 SXM 80GB", **kwargs)


def test_the_planner_widget_draws_every_layout_the_model_can_take():
    from minillm.viz.planner import planner_figure, planner_widget

    fig, plans = planner_figure("Llama-2-70B", "H200 SXM 141GB")
    assert [(p.tp, p.pp) for p in plans] == [(1, 1), (2, 1), (4, 1), (8, 1), (4, 2), (8, 2)]
    assert len(fig.data) == 3 and not plans[0].fits and plans[1].fits
    _, smol = planner_figure("SmolLM2-135M", "H100 SXM 80GB")  # 3 K/V heads of 3 query heads: TP 4 and 8 do not fit
    assert [(p.tp, p.pp) for p in smol] == [(1, 1), (2, 1)]  # TP 2: whole groups, 2 + 1
    assert planner_widget().children
