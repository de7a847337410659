"""Two processes on gloo: a tensor-parallel SwiGLU equals the single-process block, and the
launcher ends every rank — and names the culprit — when one raises, dies or hangs."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.nn.functional as F

from minillm.parallel.launch import RankFailed, run_ranks
from minillm.parallel.tensor import ParallelAttention, ParallelSwiGLU, VocabParallelEmbedding, kv_heads_of_rank

HIDDEN, INTERMEDIATE = 32, 64


def _weights():
    gen = torch.Generator().manual_seed(0)
    gate = torch.randn(INTERMEDIATE, HIDDEN, generator=gen) / HIDDEN**0.5
    up = torch.randn(INTERMEDIATE, HIDDEN, generator=gen) / HIDDEN**0.5
    down = torch.randn(HIDDEN, INTERMEDIATE, generator=gen) / INTERMEDIATE**0.5
    x = torch.randn(5, HIDDEN, generator=gen)
    return gate, up, down, x


def _tp_swiglu(rank, world_size):
    gate, up, down, x = _weights()
    mlp = ParallelSwiGLU(HIDDEN, INTERMEDIATE, rank, world_size).load(gate, up, down)
    held = sum(p.numel() for p in mlp.parameters())
    with torch.no_grad():
        return mlp(x), held


def _raise_on_rank_1(rank, world_size):
    if rank == 1:
        raise ValueError("bad shard on purpose")
    time.sleep(30)  # the healthy rank would wait for its peer forever without the parent
    return rank


def _die_on_rank_1(rank, world_size):
    if rank == 1:
        os._exit(3)
    time.sleep(30)
    return rank


def _hang(rank, world_size):
    time.sleep(60 if rank == 0 else 0)
    return rank


def test_tensor_parallel_swiglu_equals_the_single_process_block():
    gate, up, down, x = _weights()
    want = F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)
    results = run_ranks(_tp_swiglu, 2, timeout=120)
    for out, held in results:
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)  # every rank ends with the full output
        assert held == (3 * HIDDEN * INTERMEDIATE) // 2  # and held only half of the weights


@pytest.mark.parametrize(
    ("fn", "message"), [(_raise_on_rank_1, "rank 1 failed: ValueError: bad shard on purpose"), (_die_on_rank_1, "rank 1 failed: exited with code 3")]
)  # fmt: skip
def test_a_failing_rank_is_named_and_no_rank_is_left_behind(fn, message):
    import multiprocessing

    start = time.monotonic()
    with pytest.raises(RankFailed, match=message):
        run_ranks(fn, 2, timeout=120)
    assert time.monotonic() - start < 25  # not the healthy rank's 30 s sleep
    assert not multiprocessing.active_children()


def test_a_hung_rank_times_out_and_is_terminated():
    import multiprocessing

    with pytest.raises(TimeoutError, match=r"ranks \[0\]"):
        run_ranks(_hang, 2, timeout=8)
    assert not multiprocessing.active_children()


def test_bad_world_size_is_refused():
    with pytest.raises(ValueError, match="world_size"):
        run_ranks(_tp_swiglu, 0)


HEADS, KV_HEADS, HEAD_DIM, VOCAB = 4, 2, 8, 48


def _attention_weights():
    gen = torch.Generator().manual_seed(1)
    hidden = HEADS * HEAD_DIM
    wq = torch.randn(HEADS * HEAD_DIM, hidden, generator=gen) / hidden**0.5
    wk = torch.randn(KV_HEADS * HEAD_DIM, hidden, generator=gen) / hidden**0.5
    wv = torch.randn(KV_HEADS * HEAD_DIM, hidden, generator=gen) / hidden**0.5
    wo = torch.randn(hidden, HEADS * HEAD_DIM, generator=gen) / hidden**0.5
    emb = torch.randn(VOCAB, hidden, generator=gen)
    ids = torch.tensor([3, 47, 0, 25, 24, 11])
    return wq, wk, wv, wo, emb, ids


def _reference_attention(x, wq, wk, wv, wo):
    t = x.shape[0]
    q = F.linear(x, wq).view(t, HEADS, HEAD_DIM).transpose(0, 1)
    k = F.linear(x, wk).view(t, KV_HEADS, HEAD_DIM).transpose(0, 1).repeat_interleave(HEADS // KV_HEADS, 0)
    v = F.linear(x, wv).view(t, KV_HEADS, HEAD_DIM).transpose(0, 1).repeat_interleave(HEADS // KV_HEADS, 0)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return F.linear(out.transpose(0, 1).reshape(t, -1), wo)


def _tp_attention_and_vocab(rank, world_size):
    wq, wk, wv, wo, emb, ids = _attention_weights()
    embed = VocabParallelEmbedding(VOCAB, HEADS * HEAD_DIM, rank, world_size).load(emb)
    attn = ParallelAttention(HEADS * HEAD_DIM, HEADS, KV_HEADS, HEAD_DIM, rank, world_size).load(wq, wk, wv, wo)
    with torch.no_grad():
        x = embed(ids)
        return x, attn(x), embed.logits(x), attn.kv


@pytest.mark.parametrize("world_size", [2, 4])  # 4 ranks > 2 K/V heads: each head on two ranks
def test_tensor_parallel_attention_and_vocabulary_parallel_embedding(world_size):
    wq, wk, wv, wo, emb, ids = _attention_weights()
    x = F.embedding(ids, emb)
    want_attn, want_logits = _reference_attention(x, wq, wk, wv, wo), F.linear(x, emb)
    results = run_ranks(_tp_attention_and_vocab, world_size, timeout=120)
    for rank, (got_x, got_attn, got_logits, kv) in enumerate(results):
        torch.testing.assert_close(got_x, x)
        torch.testing.assert_close(got_attn, want_attn, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got_logits, want_logits, atol=1e-5, rtol=1e-5)
        assert kv == kv_heads_of_rank(HEADS, KV_HEADS, rank, world_size)
    assert [r[3] for r in results] == ([[0], [1]] if world_size == 2 else [[0], [0], [1], [1]])


def test_kv_heads_split_or_replicated_like_smollm2():
    assert [kv_heads_of_rank(9, 3, r, 3) for r in range(3)] == [[0], [1], [2]]  # TP=3: one head each
    assert [kv_heads_of_rank(9, 3, r, 9) for r in range(9)] == [[0]] * 3 + [[1]] * 3 + [[2]] * 3  # replicated
    with pytest.raises(ValueError, match="query heads"):
        kv_heads_of_rank(9, 3, 0, 2)  # TP=2: 9 query heads do not split evenly
    with pytest.raises(ValueError, match="multiple"):
        kv_heads_of_rank(8, 3, 0, 4)
