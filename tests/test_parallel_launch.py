"""Two processes on gloo: the model's SwiGLU and the vocabulary-parallel embedding, sharded, equal
the single-process blocks, and the launcher ends every rank — and names the culprit — when one raises, dies or hangs."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.nn.functional as F
from conftest import child_pids

from minillm.config import ModelConfig
from minillm.layers import Linear
from minillm.layers.tensor_parallel import ParallelContext, VocabParallelEmbedding, split_evenly
from minillm.models.llama import SwiGLU
from minillm.parallel.launch import RankFailed, run_ranks

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
    config = ModelConfig("llama", 10, HIDDEN, INTERMEDIATE, 1, 2, 2, 16, 1e-6, 8, True, False, 1e4)
    mlp = SwiGLU(config, ParallelContext(tp_rank=rank, tp_size=world_size))  # the model's own block, sharded
    mlp.gate_up_proj.weight_loader("weight", gate, "gate")
    mlp.gate_up_proj.weight_loader("weight", up, "up")
    mlp.down_proj.weight_loader("weight", down)
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
    before = child_pids()
    start = time.monotonic()
    with pytest.raises(RankFailed, match=message):
        run_ranks(fn, 2, timeout=120)
    assert time.monotonic() - start < 25  # not the healthy rank's 30 s sleep
    assert child_pids() <= before


def test_a_hung_rank_times_out_and_is_terminated():
    before = child_pids()
    with pytest.raises(TimeoutError, match=r"ranks \[0\]"):
        run_ranks(_hang, 2, timeout=8)
    assert child_pids() <= before


def _a_tensor(rank, world_size):
    return torch.arange(6.0) + rank


def test_a_rank_result_outlives_the_rank():
    """A rank reports and exits at once; the parent may read the report only afterwards. The
    result must travel by value: a tensor put on the queue as it is is shared through a file
    descriptor fetched from the (by then gone) rank — a FileNotFoundError, seen in CI."""
    import pickle

    import torch.multiprocessing as mp

    from minillm.parallel.launch import Rendezvous, _rank_main

    ctx = mp.get_context("spawn")
    reports = ctx.Queue()
    rank = ctx.Process(target=_rank_main, args=(_a_tensor, 0, 1, Rendezvous(), "gloo", 1, (), reports))
    rank.start()
    rank.join(60)
    assert rank.exitcode == 0
    kind, index, payload = reports.get(timeout=10)  # read only after the rank has exited
    assert (kind, index) == ("ok", 0)
    assert torch.equal(pickle.loads(payload), torch.arange(6.0))


def test_bad_world_size_is_refused():
    with pytest.raises(ValueError, match="world_size"):
        run_ranks(_tp_swiglu, 0)


VOCAB = 47  # does not divide by 2 or 4: the vocabulary split is uneven and the gather pads


def _tp_vocab(rank, world_size):
    gen = torch.Generator().manual_seed(1)
    emb, ids = torch.randn(VOCAB, HIDDEN, generator=gen), torch.tensor([3, 46, 0, 25, 24, 11])
    ctx = ParallelContext(tp_rank=rank, tp_size=world_size)
    embed = VocabParallelEmbedding(VOCAB, HIDDEN, ctx)
    embed.weight_loader("weight", emb)
    head = Linear(HIDDEN, VOCAB, tp_dim=0, tp_rank=rank, tp_size=world_size, tp_slices={None: embed.vocab_range})
    head.weight = embed.weight  # tied: the head is the embedding shard
    sizes = [len(split_evenly(VOCAB, world_size, r)) for r in range(world_size)]
    with torch.no_grad():
        x = embed(ids)
        return x, ctx.gather_columns(head(x), sizes), embed.weight.shape[0]


@pytest.mark.parametrize("world_size", [2, 4])
def test_vocabulary_parallel_embedding_and_tied_head(world_size):
    gen = torch.Generator().manual_seed(1)
    emb, ids = torch.randn(VOCAB, HIDDEN, generator=gen), torch.tensor([3, 46, 0, 25, 24, 11])
    x = F.embedding(ids, emb)
    results = run_ranks(_tp_vocab, world_size, timeout=120)
    for got_x, got_logits, _ in results:
        torch.testing.assert_close(got_x, x)  # exactly one rank contributes each id
        torch.testing.assert_close(got_logits, F.linear(x, emb), atol=1e-5, rtol=1e-5)
    assert sum(r[2] for r in results) == VOCAB  # each row held once


def test_ranks_meet_through_a_private_file_and_listen_on_loopback_only():
    """No TCPStore on a probed port (it listened on every interface, unauthenticated): the store
    is a file in a folder only this user can open, removed afterwards; every socket a rank
    listens on (gloo's) is bound to loopback."""
    import stat
    import sys

    from minillm.parallel.launch import Rendezvous

    rendezvous = Rendezvous()
    assert stat.S_IMODE(os.stat(rendezvous.folder).st_mode) == 0o700
    rendezvous.close()
    assert not os.path.exists(rendezvous.folder)
    if sys.platform.startswith("linux"):
        for listening in run_ranks(_listening_addresses, 2):
            assert listening and all(a in ("0100007F", "00000000000000000000000001000000") for a in listening), listening


def _listening_addresses(rank, world_size):
    """The local addresses (hex, as /proc/net/tcp writes them) of this process's listening sockets."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    addresses = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # LISTEN, and ours
                    addresses.append(fields[1].split(":")[0])
    return addresses


# ---------------------------------------------------------------------------------------------
# How the ranks start (minillm.parallel.start_method)
# ---------------------------------------------------------------------------------------------


def _environment_and_parent(rank, world_size):
    return os.environ.get("MINILLM_START_PROBE"), os.getppid()


def test_ranks_start_from_the_fork_server_with_the_drivers_environment_of_now(monkeypatch):
    """The ranks are forked from a server that imported torch once (Linux and macOS have one),
    and each sees the driver's environment as it is at the call, not as it was when the server
    started."""
    import multiprocessing

    from minillm.parallel import start_method

    if "forkserver" in multiprocessing.get_all_start_methods():
        assert start_method.context().get_start_method() == "forkserver"
    monkeypatch.setenv("MINILLM_START_PROBE", "first")
    first = run_ranks(_environment_and_parent, 2)
    assert [value for value, _ in first] == ["first", "first"]
    monkeypatch.setenv("MINILLM_START_PROBE", "changed since the server started")
    again = run_ranks(_environment_and_parent, 2)
    assert [value for value, _ in again] == ["changed since the server started"] * 2
    assert all(parent != os.getpid() for _, parent in first + again)  # forked by the server, not by us


DRIVER = """
import os, sys, time
from minillm.parallel.processes import WorkerGroup

def report_and_work(spec, rank, conn):
    conn.send(("ready", os.getpid()))
    time.sleep(600)  # busy, never reading its pipe: only the watch on the driver can end it

if __name__ == "__main__":
    group = WorkerGroup(report_and_work, None, 2)
    print(*group.gather_ready(), flush=True)
    time.sleep(600)
"""


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_workers_end_when_their_driver_is_killed(tmp_path):
    """A kernel restart kills the driver without any clean-up: its workers — children of the fork
    server, not of the driver — must notice and end, leaving nothing behind."""
    import signal
    import subprocess
    import sys

    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    driver = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        workers = [int(pid) for pid in driver.stdout.readline().split()]
        assert len(workers) == 2 and all(_running(pid) for pid in workers)
    finally:
        driver.send_signal(signal.SIGKILL)
        driver.wait()
    deadline = time.monotonic() + 60  # a bound on a hang, not a speed: they poll every 0.5 s
    while any(_running(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_running(pid) for pid in workers), workers
