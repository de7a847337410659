"""The engine under attack: shared use, resource limits, hostile input, degenerate sampling.

Every case asserts the error type and that the message names the culprit, and that the
engine (and every other request) is unharmed afterwards.
"""

from __future__ import annotations

import json
import math
import shutil
import threading
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from minillm import LLM, LLMEngine, SamplingParams
from minillm.config import EngineConfig, parse_memory
from minillm.errors import ModelLoadError
from minillm.sampling import sample

PROMPTS = [[5, 17, 42, 8, 99, 3], [11, 12], [300, 4, 77, 77, 150], [9] * 20]
PARAMS = SamplingParams(max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(tiny_model, dtype="fp32", block_size=4)


@pytest.fixture(scope="module")
def solo(llm):
    return [llm.generate([p], PARAMS)[0].token_ids for p in PROMPTS]


def assert_clean(llm):
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.block_manager.num_used_blocks == 0
    assert llm.client.num_open == 0
    llm.engine.block_manager.check_invariants()


# ------------------------------------------------------------------------------------------
# Shared use: one engine loop, every delta delivered to its own caller
# ------------------------------------------------------------------------------------------


def run_threads(*targets, timeout=120):
    errors, threads = [], []
    for target in targets:

        def wrapped(target=target):
            try:
                target()
            except BaseException as err:  # noqa: BLE001 - reported below
                errors.append(err)

        threads.append(threading.Thread(target=wrapped, daemon=True))
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        assert not t.is_alive(), "a thread hung"
    assert not errors, errors


def test_two_threads_generate_on_one_llm(llm, solo):
    results = {}
    run_threads(
        lambda: results.__setitem__("a", llm.generate(PROMPTS[:2], PARAMS)),
        lambda: results.__setitem__("b", llm.generate(PROMPTS[2:], PARAMS)),
    )
    assert [o.token_ids for o in results["a"] + results["b"]] == solo
    assert_clean(llm)


def test_generate_and_stream_from_two_threads(llm, solo):
    results = {}

    def streamer():
        deltas = list(llm.stream(PROMPTS[3], PARAMS))
        results["stream"] = deltas

    run_threads(lambda: results.__setitem__("gen", llm.generate(PROMPTS[:3], PARAMS)), streamer)
    deltas = results["stream"]
    assert len(deltas) == PARAMS.max_tokens and deltas[-1].finish_reason == "length"
    assert [d.token_id for d in deltas] == solo[3] == deltas[-1].output.token_ids
    assert [o.token_ids for o in results["gen"]] == solo[:3]
    assert_clean(llm)


def test_interleaved_streams_in_one_thread_both_complete(llm, solo):
    a, b = llm.stream(PROMPTS[0], PARAMS), llm.stream(PROMPTS[1], PARAMS)
    got = {0: [], 1: []}
    live = {0: a, 1: b}
    while live:
        for i, gen in list(live.items()):
            delta = next(gen, None)
            if delta is None:
                del live[i]
            else:
                got[i].append(delta)
    for i in (0, 1):
        assert [d.token_id for d in got[i]] == solo[i]
        assert got[i][-1].finish_reason == "length" and got[i][-1].output is not None
    assert_clean(llm)


def test_abandoned_stream_is_aborted(llm):
    gen = llm.stream(PROMPTS[0], PARAMS)
    next(gen)
    gen.close()
    assert_clean(llm)


def test_abort_from_outside_ends_the_stream(llm):
    gen = llm.stream(PROMPTS[0], PARAMS)
    first = next(gen)
    llm.engine.abort(first.request_id)
    rest = list(gen)
    assert rest[-1].finish_reason == "abort" and rest[-1].output.finish_reason == "abort"
    assert_clean(llm)


def test_foreign_engine_requests_are_not_stolen(llm):
    rid = llm.engine.add_request(PROMPTS[0], PARAMS)
    with pytest.raises(RuntimeError, match="requests added through llm.engine"):
        llm.generate(PROMPTS[1], PARAMS)
    llm.engine.abort(rid)
    assert_clean(llm)


def test_engine_add_and_abort_from_another_thread_while_stepping(tiny_model):
    engine = LLMEngine(tiny_model, dtype="fp32", block_size=4)
    done = []
    stop = threading.Event()

    def loop():
        while not stop.is_set() or engine.has_unfinished_requests():
            deltas = engine.step()
            for d in deltas:
                if d.finish_reason is not None:
                    done.append(d.request_id)
            if not deltas:  # nothing to run: do not spin on the engine's lock (the client would starve on it)
                time.sleep(0.001)

    def client():
        for i in range(12):
            rid = engine.add_request(PROMPTS[i % 4], PARAMS, request_id=f"r{i}")
            if i % 3 == 0:
                engine.abort(rid)
        stop.set()

    run_threads(loop, client)
    assert sorted(done) == sorted(f"r{i}" for i in range(12) if i % 3)
    assert engine.block_manager.num_used_blocks == 0


# ------------------------------------------------------------------------------------------
# Limits and validation at the door
# ------------------------------------------------------------------------------------------


def test_kv_pool_larger_than_memory_is_refused(tiny_model):
    with pytest.raises(ValueError, match=r"kv_cache_memory=1000000000000000 bytes asks for more than the .* free"):
        LLMEngine(tiny_model, kv_cache_memory=10**15)
    with pytest.raises(ValueError, match="kv_cache_memory=1 gives 1 bytes, less than one KV block"):
        LLMEngine(tiny_model, kv_cache_memory=1)  # an int is bytes: 1 is one byte, not "all of it"


@pytest.mark.parametrize(
    ("text", "value"),
    [("0.5", 0.5), ("1.0", 1.0), ("50%", 0.5), ("2e9", 2 * 10**9), ("2GB", 2 * 10**9), ("1.5GiB", 3 * 2**29), ("7", 7)],
)
def test_memory_sizes_parse(text, value):
    assert parse_memory(text) == value and type(parse_memory(text)) is type(value)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("inf", "positive, finite"),
        ("-5", "positive, finite"),
        ("nan", "positive, finite"),
        ("lots", "not a size"),
        ("2.5", "must be in \\(0, 1\\]"),
        ("150%", "cannot exceed 100%"),
    ],
)
def test_bad_memory_sizes_are_named(text, message, capsys):
    from minillm.cli import main

    with pytest.raises(ValueError, match=message):
        parse_memory(text)
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--prompt", "x", f"--kv-cache-memory={text}"])
    assert exit_info.value.code == 2
    assert text in capsys.readouterr().err


def test_bad_arrival_time_or_request_id_poisons_nothing(tiny_model, solo):
    engine = LLMEngine(tiny_model, dtype="fp32", block_size=4)
    good = engine.add_request(PROMPTS[0], PARAMS)
    with pytest.raises(TypeError, match="arrival_time for prompt must be .* got 'now'"):
        engine.add_request(PROMPTS[1], PARAMS, arrival_time="now")
    with pytest.raises(TypeError, match="arrival_time .* got nan"):
        engine.add_request(PROMPTS[1], PARAMS, arrival_time=math.nan)
    with pytest.raises(TypeError, match=r"request_id=\['x'\] must be hashable"):
        engine.add_request(PROMPTS[1], PARAMS, request_id=["x"])
    out = {}
    while engine.has_unfinished_requests():
        for d in engine.step():
            if d.output is not None:
                out[d.request_id] = d.output.token_ids
    assert out == {good: solo[0]}


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (dict(max_model_len=2.5), ValueError, "max_model_len=2.5 must be an integer"),
        (dict(max_model_len="64"), ValueError, "max_model_len='64' must be an integer"),
        (dict(max_model_len=math.nan), ValueError, "max_model_len=nan must be an integer"),
        (dict(max_num_seqs=2.5), ValueError, "max_num_seqs=2.5 must be an integer"),
        (dict(num_threads=1.5), ValueError, "num_threads=1.5 must be an integer"),
        (dict(max_num_batched_tokens=2.5), ValueError, "max_num_batched_tokens=2.5 must be an integer"),
        (dict(batch_timeout=math.nan), ValueError, "batch_timeout=nan must be a finite number"),
        (dict(batch_timeout="1"), ValueError, "batch_timeout='1' must be a finite number"),
        (dict(seed="x"), ValueError, "seed='x' must be an integer"),
        (dict(seed=-1), ValueError, "seed=-1 must be >= 0"),
        (dict(seed=2**64), ValueError, "seed=18446744073709551616 must fit in 64 bits"),
        (dict(cpu_prepack="yes"), TypeError, "cpu_prepack='yes' must be True or False"),
        (dict(enable_prefix_caching=1), TypeError, "enable_prefix_caching=1 must be True or False"),
        (dict(cuda_graphs="auto"), TypeError, "cuda_graphs='auto' must be True or False"),
        (dict(device=0), TypeError, "device=0 must be a string"),
        (dict(mode=None), TypeError, "mode=None must be a string"),
        (dict(sliding_window=0), ValueError, "sliding_window=0 must be >= 1"),
        (dict(kv_cache_memory=2.0), ValueError, r"kv_cache_memory=2.0 as a fraction .* \(bytes are an int\)"),
    ],
)
def test_engine_config_types_are_named(kwargs, error, message):
    with pytest.raises(error, match=message):
        EngineConfig(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(ignore_eos="no"), "ignore_eos='no' must be True or False"),
        (dict(seed=2**64), "seed=18446744073709551616 must fit in 64 bits"),
        (dict(seed=-1), "seed=-1 must fit in 64 bits"),
        (dict(seed="x"), "seed='x' must be an integer"),
    ],
)
def test_sampling_params_types_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def _model_copy(tiny_model, tmp_path, edit_config=None):
    folder = tmp_path / "m"
    shutil.copytree(tiny_model, folder)
    if edit_config is not None:
        path = folder / "config.json"
        path.write_text(json.dumps(edit_config(json.loads(path.read_text()))))
    return folder


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda c: [c], "config.json: must hold a JSON object, got list"),
        (lambda c: c | {"num_attention_heads": 0}, "field 'num_attention_heads' = 0 must be a positive integer"),
        (lambda c: c | {"hidden_size": "64"}, "field 'hidden_size' = '64' must be a positive integer"),
        (lambda c: c | {"max_position_embeddings": -1}, "field 'max_position_embeddings' = -1 must be a positive"),
        (lambda c: c | {"vocab_size": 3.5}, "field 'vocab_size' = 3.5 must be a positive integer"),
        (lambda c: c | {"rms_norm_eps": "tiny"}, "field 'rms_norm_eps' = 'tiny' must be a positive number"),
        (lambda c: c | {"torch_dtype": "int4"}, "field 'torch_dtype' = 'int4' is not a dtype"),
        (
            lambda c: c | {"rope_theta": -1, "rope_parameters": {"rope_type": "default", "rope_theta": -1}},
            "field 'rope_theta' = -1 must be a positive number",
        ),
        (lambda c: c | {"eos_token_id": "eos"}, "field 'eos_token_id' = 'eos' must be token id"),
        (lambda c: {k: v for k, v in c.items() if k != "vocab_size"}, "required field 'vocab_size' is missing"),
    ],
)
def test_bad_config_json_names_file_and_field(tiny_model, tmp_path, edit, message):
    folder = _model_copy(tiny_model, tmp_path, edit)
    with pytest.raises(ModelLoadError, match=message) as info:
        LLM(folder)
    assert "config.json" in str(info.value)


@pytest.mark.parametrize(
    ("content", "message"),
    [("{not json", "not valid JSON"), ("[1, 2]", "must hold a JSON object"), ('{"eos_token_id": "x"}', "eos_token_id")],
)
def test_bad_generation_config_names_the_file(tiny_model, tmp_path, content, message):
    folder = _model_copy(tiny_model, tmp_path)
    (folder / "generation_config.json").write_text(content)
    with pytest.raises(ModelLoadError, match=f"generation_config.json: .*{message}"):
        LLM(folder)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_weights_are_refused_at_load(tiny_model, tmp_path, bad):
    folder = _model_copy(tiny_model, tmp_path)
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["model.norm.weight"][3] = bad
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="tensor 'model.norm.weight' holds 1 NaN/inf value"):
        LLM(folder)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_finite_check_finds_one_bad_value_anywhere(dtype):
    """The load's check reads only the extremes (``aminmax``): one NaN or infinity at any position
    of a vectorised pass (the first lane, the last, the scalar tail) must still show."""
    from minillm.models.loader import _all_finite

    for n in (1, 2, 7, 16, 33, 4097):
        assert _all_finite(torch.randn(n).to(dtype))
        for position in {0, n // 2, n - 1}:
            for bad in (math.nan, math.inf, -math.inf):
                t = torch.randn(n).to(dtype)
                t[position] = bad
                assert not _all_finite(t), (n, position, bad)
    assert _all_finite(torch.empty(0, dtype=dtype))


# ------------------------------------------------------------------------------------------
# Degenerate sampling: the limits of every parameter, on both sides
# ------------------------------------------------------------------------------------------


def _draw(logits, **kwargs):
    params = [SamplingParams(seed=1, **kwargs)] * logits.shape[0]
    gens = [torch.Generator().manual_seed(i) for i in range(logits.shape[0])]
    return sample(logits, params, gens, seen=[[0, 1, 2]] * logits.shape[0])


@pytest.fixture
def logits():
    return torch.randn(6, 50, generator=torch.Generator().manual_seed(0)) * 8


@pytest.mark.parametrize("temperature", [1e-38, 5e-324, 1e-30, 1e-12])
def test_tiny_temperature_is_greedy(logits, temperature):
    assert _draw(logits, temperature=temperature) == logits.argmax(-1).tolist()


@pytest.mark.parametrize("top_p", [1e-46, 1e-30, 1e-9])
def test_tiny_top_p_keeps_the_top_token(logits, top_p):
    assert _draw(logits, temperature=1.0, top_p=top_p) == logits.argmax(-1).tolist()


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(temperature=1e30),
        dict(temperature=1e300),
        dict(temperature=1.0, top_p=1.0),
        dict(temperature=1.0, min_p=1e-30),
        dict(temperature=1.0, top_k=10**9),
        dict(temperature=1.0, repetition_penalty=1e-38),
        dict(temperature=1.0, repetition_penalty=1e38),
        dict(temperature=0.0, repetition_penalty=1e-38),
    ],
)
def test_extreme_parameters_still_draw_valid_tokens(logits, kwargs):
    tokens = _draw(logits, **kwargs)
    assert all(0 <= t < logits.shape[1] for t in tokens)


def test_min_p_one_and_top_k_one_keep_only_the_top(logits):
    top = logits.argmax(-1).tolist()
    assert _draw(logits, temperature=1.0, min_p=1.0) == top
    assert _draw(logits, temperature=5.0, top_k=1) == top


def test_tiny_temperature_end_to_end_equals_greedy(llm, solo):
    out = llm.generate(PROMPTS, SamplingParams(max_tokens=16, ignore_eos=True, temperature=1e-38, top_p=1e-46))
    assert [o.token_ids for o in out] == solo


# ------------------------------------------------------------------------------------------
# The batch-invariance claim, exactly as stated
# ------------------------------------------------------------------------------------------


def _random_prompts(n, vocab, seed):
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randint(3, vocab, (int(torch.randint(2, 40, (1,), generator=gen)),), generator=gen).tolist()
        for _ in range(n)
    ]


def test_fp32_tokens_are_identical_alone_and_batched(tiny_model):
    llm = LLM(tiny_model, dtype="fp32")
    prompts = _random_prompts(16, llm.model_config.vocab_size, 0)
    params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.8, seed=3)
    alone = [llm.generate([p], params)[0].token_ids for p in prompts]
    assert [o.token_ids for o in llm.generate(prompts, params)] == alone


@pytest.mark.slow
def test_bf16_batched_tokens_differ_only_at_near_ties(tiny_model):
    """bf16 batched kernels may reduce in another order: a token may differ from the solo run
    only where the solo run's top two logits were within a few bf16 steps of each other."""
    from minillm.course.helpers import forward_logits

    llm = LLM(tiny_model, dtype="bf16")
    prompts = _random_prompts(16, llm.model_config.vocab_size, 1)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    alone = [llm.generate([p], params)[0].token_ids for p in prompts]
    batched = [o.token_ids for o in llm.generate(prompts, params)]
    for prompt, a, b in zip(prompts, alone, batched):
        if a == b:
            continue
        i = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
        logits = forward_logits(llm.model, prompt + a[:i])[-1].float()
        top2 = logits.topk(2).values
        step = 2.0 ** (math.floor(math.log2(abs(float(top2[0])) or 1.0)) - 7)  # one bf16 step at that size
        assert float(top2[0] - top2[1]) <= 4 * step, (prompt, i, top2)


def test_an_interrupted_step_loses_nobody(tiny_model, monkeypatch):
    """Ctrl-C after the forward pass but before the tokens are appended: the step's sequences
    run that step again, so every request still finishes with its own tokens."""
    engine = LLMEngine(tiny_model, dtype="fp32", block_size=4)
    solo = LLM(tiny_model, dtype="fp32")
    expected = [solo.generate([p], PARAMS)[0].token_ids for p in PROMPTS[:2]]
    ids = [engine.add_request(p, PARAMS) for p in PROMPTS[:2]]
    real = engine._append
    calls = {"n": 0}

    def interrupted(*args):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(engine, "_append", interrupted)
    out = {}
    with pytest.raises(KeyboardInterrupt):
        for _ in range(10):
            engine.step()
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        for d in engine.step():
            if d.output is not None:
                out[d.request_id] = d.output.token_ids
    assert not engine.has_unfinished_requests(), "a request was left waiting forever"
    assert [out[i] for i in ids] == expected
    assert engine.block_manager.num_used_blocks == 0


def test_lenient_where_users_were_right():
    import numpy as np

    assert EngineConfig(max_num_seqs=np.int64(8), device=torch.device("cpu")).max_num_seqs == 8
    with pytest.raises(ValueError, match="less than one byte"):
        parse_memory("5e-1")
