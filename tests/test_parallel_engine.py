"""Tensor and pipeline parallelism in the engine, on 2-4 worker processes (gloo on CPU): greedy
tokens identical to the single-process engine and fp32 logits within 1e-4, with prefix caching,
preemption and sliding windows; shards hold only their part; a dead rank or an interrupt during
a step stops every worker and says so; an interrupt between steps leaves the engine serving."""

from __future__ import annotations

import _thread
import os
import signal
import threading
import time

import pytest
import torch
from conftest import build_tiny_model, child_pids

from minillm import LLM, SamplingParams
from minillm.layers.tensor_parallel import heads_of_rank, split_evenly
from minillm.parallel.launch import RankFailed
from minillm.parallel.worker import split_microbatches

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 9, 14, 3, 22, 7], [8, 8, 31, 2, 17], list(range(3, 40)), [11]]


@pytest.fixture(scope="module")
def nine_head_model(tmp_path_factory):
    """SmolLM2's head layout in miniature: 9 query heads over 3 K/V heads."""
    folder = tmp_path_factory.mktemp("nine_heads") / "m"
    return build_tiny_model(
        folder, "llama_gqa", num_attention_heads=9, num_key_value_heads=3, head_dim=16, hidden_size=72,
        intermediate_size=96, num_hidden_layers=3,
    )  # fmt: skip


def _recording(llm: LLM) -> list[torch.Tensor]:
    """Keep every step's logits (the runner's output) as the engine runs."""
    seen: list[torch.Tensor] = []
    execute = llm.engine.runner.execute

    def wrapped(inputs):
        logits = execute(inputs)
        seen.append(logits.clone())
        return logits

    llm.engine.runner.execute = wrapped
    return seen


def _run(folder, prompts=PROMPTS, params=GREEDY, **engine):
    with LLM(folder, dtype="float32", num_threads=1, max_num_seqs=4, **engine) as llm:
        logits = _recording(llm)
        outs = llm.generate(prompts, params)
        report = llm.engine.memory_report()
        prefix_hits = llm.engine.block_manager.prefix_hits
    return outs, logits, report, prefix_hits


def _assert_same(want, got, rtol=0.0, atol=1e-4):
    (outs_a, logits_a, *_), (outs_b, logits_b, *_) = want, got
    assert [o.token_ids for o in outs_b] == [o.token_ids for o in outs_a]
    assert len(logits_b) == len(logits_a)  # the same schedule, step for step
    for a, b in zip(logits_a, logits_b):
        torch.testing.assert_close(b, a, atol=atol, rtol=rtol)


@pytest.mark.parametrize(
    "variant, sizes",
    [
        ("llama_gqa", dict(tensor_parallel_size=2)),
        ("llama_mqa", dict(tensor_parallel_size=2)),  # one K/V head, replicated on both ranks
        ("llama_untied", dict(tensor_parallel_size=2)),  # its own LM head, column parallel
        ("qwen2_bias", dict(tensor_parallel_size=2)),  # q/k/v biases sliced with their rows
        ("mistral_window", dict(tensor_parallel_size=2)),  # sliding window
        ("llama_gqa", dict(pipeline_parallel_size=2)),  # tied: the last stage loads the embedding as its head
        ("llama_untied", dict(pipeline_parallel_size=2, pipeline_microbatches=3)),
    ],
)
def test_parallel_engine_reproduces_the_single_process_engine(tiny_models, variant, sizes):
    folder = tiny_models[variant]
    want = _run(folder)
    got = _run(folder, **sizes)
    _assert_same(want, got)
    ranks = got[2]["ranks"]
    assert len(ranks) == sizes.get("tensor_parallel_size", 1) * sizes.get("pipeline_parallel_size", 1)
    assert all(r["weights_bytes"] < want[2]["weights_bytes"] for r in ranks)  # a shard, never the whole model


def test_tp3_and_tp2_with_three_kv_heads(nine_head_model):
    """SmolLM2's case: 3 K/V heads on 3 ranks (one each) and on 2 (whole groups, 6 + 3 query heads)."""
    want = _run(nine_head_model)
    for tp, heads in ((3, [(3, 1)] * 3), (2, [(6, 2), (3, 1)])):
        got = _run(nine_head_model, tensor_parallel_size=tp)
        _assert_same(want, got)
        assert [(r["q_heads"], r["kv_heads"]) for r in got[2]["ranks"]] == heads


def test_tp2_by_pp2_on_four_processes(nine_head_model):
    want = _run(nine_head_model)
    got = _run(nine_head_model, tensor_parallel_size=2, pipeline_parallel_size=2)
    _assert_same(want, got)
    assert [(r["stage"], r["layers"]) for r in got[2]["ranks"]] == [(0, [0, 2]), (0, [0, 2]), (1, [2, 3]), (1, [2, 3])]


def test_prefix_caching_and_preemption_under_tp_and_pp(tiny_model):
    """A shared prefix (cached blocks reused) and a pool too small for every sequence
    (preemption): the driver's scheduler decides, every rank's pool follows."""
    shared = list(range(3, 35))
    prompts = [shared + [40 + i, 50 + i] for i in range(4)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    engine = dict(block_size=4, kv_cache_memory=2 * 4 * 2 * 64 * 4 * 26)  # 26 blocks of 4 tokens, fp32
    want = _run(tiny_model, prompts, params, **engine)
    assert sum(o.num_preemptions for o in want[0]) > 0 and want[3] > 0
    for sizes in (dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2)):
        # kv_cache_memory is per rank, and each rank keeps half the K/V: half the bytes, the same 26 blocks.
        got = _run(tiny_model, prompts, params, **sizes, block_size=4, kv_cache_memory=engine["kv_cache_memory"] // 2)
        assert got[2]["kv_pool_blocks"] == want[2]["kv_pool_blocks"]
        _assert_same(want, got)
        assert sum(o.num_preemptions for o in got[0]) > 0 and got[3] == want[3]


def test_parallel_samples_share_blocks_copy_on_write(tiny_model):
    params = SamplingParams(max_tokens=8, temperature=0.8, seed=3, n=3)
    want = _run(tiny_model, [[4, 5, 6, 7, 8]], params)
    got = _run(tiny_model, [[4, 5, 6, 7, 8]], params, tensor_parallel_size=2)
    assert [s.token_ids for s in got[0][0].samples] == [s.token_ids for s in want[0][0].samples]


@pytest.mark.slow
@pytest.mark.parametrize(
    "sizes", [dict(tensor_parallel_size=2), dict(tensor_parallel_size=3), dict(pipeline_parallel_size=2)]
)
def test_smollm2_parallel_greedy_tokens(smollm2_dir, sizes):
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    # 30 layers of sums in another order: |diff| <= 2e-4 + 1e-5 |logit| (logits reach ~20; measured: at most
    # 1.0e-4 beyond 1e-5 |logit| with the sdpa backend, 1.2e-4 with the cpu decode kernel, the CPU default)
    want, got = _run(smollm2_dir, prompts, params), _run(smollm2_dir, prompts, params, **sizes)
    _assert_same(want, got, rtol=1e-5, atol=2e-4)


def _alive(pids):
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split()[2] != "Z":
                    alive.append(pid)
        except (ProcessLookupError, FileNotFoundError):
            pass
    return alive


def test_a_dead_rank_is_named_and_every_worker_stops(tiny_model):
    llm = LLM(tiny_model, dtype="float32", num_threads=1, tensor_parallel_size=2)
    pids = [p.pid for p in llm.engine.runner.procs]
    os.kill(pids[1], signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(RankFailed, match="rank 1 failed: exited with code -9") as err:
        llm.generate([[4, 5, 6]], GREEDY)
    assert err.value.rank == 1 and time.monotonic() - start < 30  # no hang
    assert _alive(pids) == []
    with pytest.raises(RuntimeError, match=r"stopped \(rank 1 failed\); create a new engine"):
        llm.generate([[4, 5, 6]], GREEDY)


def test_an_interrupt_during_a_step_stops_the_workers(tiny_model):
    """The notebook's stop button while the workers run a step: the step's pipe may be half
    read, so every worker is stopped and the next call says so."""
    llm = LLM(tiny_model, dtype="float32", num_threads=1, tensor_parallel_size=2)
    try:
        pids = [p.pid for p in llm.engine.runner.procs]
        workers = llm.engine.runner.workers
        receive, calls = workers.receive, []

        def interrupted_on_the_third_wait(*args, **kwargs):
            calls.append(1)
            if len(calls) == 3:  # where Python raises it when Ctrl-C lands in the driver's wait
                raise KeyboardInterrupt
            return receive(*args, **kwargs)

        workers.receive = interrupted_on_the_third_wait
        with pytest.raises(KeyboardInterrupt):
            llm.generate([[4, 5, 6]] * 4, SamplingParams(max_tokens=200, ignore_eos=True))
        assert _alive(pids) == []
        with pytest.raises(RuntimeError, match=r"stopped \(interrupted\); create a new engine"):
            llm.generate([[4, 5, 6]], GREEDY)
    finally:
        llm.close()


def test_an_interrupt_between_steps_leaves_the_engine_usable(tiny_model):
    """Ctrl-C while the driver samples: the workers are idle and consistent, so they keep
    running and the same engine gives the same tokens again."""
    llm = LLM(tiny_model, dtype="float32", num_threads=1, tensor_parallel_size=2)
    try:
        pids = [p.pid for p in llm.engine.runner.procs]
        want = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
        choose, calls = llm.engine._choose_tokens, []

        def interrupted_on_the_third_sampling(*args, **kwargs):
            calls.append(1)
            if len(calls) == 3:
                raise KeyboardInterrupt
            return choose(*args, **kwargs)

        llm.engine._choose_tokens = interrupted_on_the_third_sampling
        with pytest.raises(KeyboardInterrupt):
            llm.generate([[4, 5, 6]] * 4, SamplingParams(max_tokens=200, ignore_eos=True))
        assert sorted(_alive(pids)) == sorted(pids)
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == want
    finally:
        llm.close()
    assert _alive(pids) == []


def test_an_interrupt_wherever_it_lands_leaves_the_workers_stopped_or_serving(tiny_model):
    """A real Ctrl-C (``interrupt_main``) a few steps in: it lands in a step or between steps,
    as the machine's timing decides — either way nothing is left half-stopped.

    Ctrl-C raises ``KeyboardInterrupt`` only under Python's own SIGINT handler, which a terminal
    and a notebook kernel have. A suite started in the background by a shell (``make test &``,
    ``nohup``) inherits SIGINT ignored, and Python then installs no handler: the press did
    nothing (DID NOT RAISE) in two such runs of make test. So the test puts Python's handler in
    place for its press, and back afterwards."""
    found = signal.signal(signal.SIGINT, signal.default_int_handler)
    llm = LLM(tiny_model, dtype="float32", num_threads=1, tensor_parallel_size=2)
    try:
        pids = [p.pid for p in llm.engine.runner.procs]
        want = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
        start, pressed, pressing = llm.engine.num_steps, threading.Event(), threading.Event()
        step = llm.engine.step

        def step_waiting_for_the_press():
            # Five steps in, the next step waits until the presser is pressing: on a busy machine
            # the presser's thread may not be scheduled before a 200-step generate ends (it was
            # not once, in make test's two-worker run). Where the press lands is still the race.
            if llm.engine.num_steps >= start + 5 and not pressed.is_set():
                pressing.wait(30)
            return step()

        def press_stop_a_few_steps_in():
            while llm.engine.num_steps < start + 5 and not pressed.is_set():
                time.sleep(0.001)
            if not pressed.is_set():
                pressing.set()
                _thread.interrupt_main()

        llm.engine.step = step_waiting_for_the_press
        presser = threading.Thread(target=press_stop_a_few_steps_in, daemon=True)
        presser.start()
        try:
            with pytest.raises(KeyboardInterrupt):
                llm.generate([[4, 5, 6]] * 8, SamplingParams(max_tokens=200, ignore_eos=True))
        finally:
            pressed.set()
            presser.join()
            llm.engine.step = step
        alive = _alive(pids)
        if alive:
            assert sorted(alive) == sorted(pids)
            assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == want
        else:
            with pytest.raises(RuntimeError, match=r"stopped \(interrupted\)"):
                llm.generate([[4, 5, 6]], GREEDY)
    finally:
        llm.close()
        signal.signal(signal.SIGINT, found)
    assert _alive(pids) == []


def test_close_stops_the_workers(tiny_model):
    llm = LLM(tiny_model, dtype="float32", num_threads=1, pipeline_parallel_size=2)
    pids = [p.pid for p in llm.engine.runner.procs]
    llm.close()
    llm.close()  # twice is fine
    assert _alive(pids) == []


@pytest.mark.parametrize(
    "args, message",
    [
        (dict(tensor_parallel_size=3), "tensor_parallel_size=3 does not fit 2 K/V heads"),
        (dict(pipeline_parallel_size=3), "pipeline_parallel_size=3 exceeds the model's 2 layers"),
        (dict(tensor_parallel_size=0), "tensor_parallel_size=0 must be >= 1"),
        (dict(tensor_parallel_size=2, mode="contiguous"), "needs mode='paged'"),
        (dict(tensor_parallel_size=2, quantization="awq"), "quantization='awq' cannot be combined"),  # int8/int4 run
        (dict(pipeline_parallel_size=2, speculative_config={"method": "ngram", "num_speculative_tokens": 2}),
         "speculative_config=.* cannot be combined"),
    ],
)  # fmt: skip
def test_bad_parallel_settings_are_refused_before_any_worker_starts(tiny_model, args, message):
    with pytest.raises(ValueError, match=message):
        LLM(tiny_model, dtype="float32", **args)


def test_head_assignment_rules():
    assert heads_of_rank(9, 3, 0, 2) == (range(0, 6), range(0, 2))  # whole groups, uneven
    assert heads_of_rank(9, 3, 1, 2) == (range(6, 9), range(2, 3))
    assert [heads_of_rank(8, 2, r, 4) for r in range(4)] == [
        (range(0, 2), range(0, 1)), (range(2, 4), range(0, 1)), (range(4, 6), range(1, 2)), (range(6, 8), range(1, 2))
    ]  # fmt: skip
    assert [heads_of_rank(9, 3, r, 9)[1] for r in range(9)] == [range(k, k + 1) for k in (0, 0, 0, 1, 1, 1, 2, 2, 2)]
    with pytest.raises(ValueError, match="does not fit 3 K/V heads"):
        heads_of_rank(9, 3, 0, 6)  # 3 query heads per group cannot be shared by 2 ranks
    assert [len(split_evenly(10, 3, i)) for i in range(3)] == [4, 3, 3]


def test_microbatches_keep_order_and_balance_tokens():
    from minillm.runtime.runner import ChunkInput

    chunks = [ChunkInput(i, [0] * n, 0) for i, n in enumerate([30, 1, 1, 1, 1, 30])]
    groups = split_microbatches(chunks, 2)
    assert [c for g in groups for c in g] == chunks and len(groups) == 2
    assert [sum(c.num_tokens for c in g) for g in groups] == [32, 32]
    assert len(split_microbatches(chunks[:1], 4)) == 1


def _cli_tokens(command: list[str]) -> list[int]:
    import json
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, done.stdout  # one record: only rank 0 prints
    return lines[0]["token_ids"]


def test_torchrun_launch_matches_one_process(tiny_model):
    """Every rank runs the same command; rank 0 keeps the engine and broadcasts each step, the
    other ranks serve inside the engine's constructor and exit when rank 0 is done."""
    import sys

    args = ["generate", "--model", str(tiny_model), "--dtype", "float32", "--threads", "1", "--max-tokens", "8",
            "--ignore-eos", "--prompt", "hello there", "--json"]  # fmt: skip
    want = _cli_tokens([sys.executable, "-m", "minillm", *args])
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "minillm"]
    assert _cli_tokens([*torchrun, *args, "--tensor-parallel-size", "2"]) == want
    assert _cli_tokens([sys.executable, "-m", "minillm", *args, "--pipeline-parallel-size", "2"]) == want  # spawned


def test_a_rank_that_raises_while_loading_is_named_with_its_error(tiny_model, tmp_path):
    """Stage 1's layer holds a NaN: only rank 1 reads it, raises, and the parent says so."""
    import shutil

    from safetensors.torch import load_file, save_file

    folder = tmp_path / "corrupt"
    shutil.copytree(tiny_model, folder)
    (weights,) = folder.glob("*.safetensors")
    tensors = load_file(weights)
    tensors["model.layers.1.mlp.down_proj.weight"][0, 0] = float("nan")
    save_file(tensors, weights, metadata={"format": "pt"})
    before = child_pids()
    with pytest.raises(
        RankFailed, match=r"rank 1 failed: .*ModelLoadError.*model\.layers\.1\.mlp\.down_proj\.weight.*NaN"
    ):
        LLM(folder, dtype="float32", num_threads=1, pipeline_parallel_size=2)
    assert child_pids() <= before  # both ranks of the failed engine were stopped
