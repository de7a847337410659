"""Two processes on gloo: a tensor-parallel SwiGLU equals the single-process block, and the
launcher ends every rank — and names the culprit — when one raises, dies or hangs."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.nn.functional as F

from minillm.parallel.launch import RankFailed, run_ranks
from minillm.parallel.tensor import ParallelSwiGLU

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
