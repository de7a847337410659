"""The compatibility table, the flags generated from the config's fields, and the resolved choices."""

from __future__ import annotations

import argparse
import dataclasses
from types import SimpleNamespace

import pytest
import torch

from minillm import LLM, EngineConfig
from minillm.config import Where, compatibility, refusal
from minillm.engine import builder

NGRAM = {"method": "ngram", "num_speculative_tokens": 2}

# One configuration that breaks each rule (options given as EngineConfig keyword arguments) and
# the Where it needs; the rule's message must come back, and the config must be refused.
BREAKS = {
    0: (dict(compile=True, mode="naive"), Where()),
    1: (dict(compile=True, cuda_graphs=True), Where()),
    2: (dict(cuda_graphs=True, mode="contiguous"), Where()),
    3: (dict(speculative_config=NGRAM, mode="contiguous"), Where()),
    4: (dict(sparsity="2:4", compile=True), Where()),
    5: (dict(kv_cache_dtype="int8", mode="contiguous"), Where()),
    6: (dict(tensor_parallel_size=2, mode="contiguous"), Where()),
    7: (dict(tensor_parallel_size=2, speculative_config=NGRAM), Where()),
    8: (dict(tensor_parallel_size=2, quantization="awq"), Where()),
    9: (dict(pipeline_parallel_size=2, sparsity="2:4"), Where()),
    10: (dict(tensor_parallel_size=2, compile=True), Where()),
    11: (dict(weight_offload="host", quantization="int8"), Where()),
    12: (dict(weight_offload="disk"), Where(device="cuda")),
    13: (dict(attention_backend="cpu", mode="contiguous"), Where()),
    14: (dict(attention_backend="cpu"), Where(device="cuda")),
    15: (dict(attention_backend="cpu", kv_cache_dtype="int8"), Where()),
    16: (dict(attention_backend="triton", mode="contiguous"), Where(backend="triton")),
    17: (dict(compile=True), Where(device="cuda")),
    18: (dict(cuda_graphs=True), Where(backend="sdpa")),
    19: (dict(data_parallel_size=2, tensor_parallel_size=2), Where()),
    20: (dict(router_policy="round_robin"), Where()),
    21: (dict(enable_prefix_caching=False), Where(deployment="disaggregated")),
    22: (dict(speculative_config=NGRAM), Where(deployment="disaggregated")),
    23: (dict(data_parallel_size=2), Where(deployment="engine")),
    24: (dict(), Where(device="cuda", deployment="disaggregated")),
}


def _unchecked(**options) -> EngineConfig:
    """A config with ``options`` set without running the table (to probe one rule at a time)."""
    config = EngineConfig()
    for name, value in options.items():
        setattr(config, name, value)
    return config


def test_every_rule_is_tested_here():
    assert sorted(BREAKS) == list(range(len(compatibility.RULES)))


@pytest.mark.parametrize("index", sorted(BREAKS))
def test_each_rule_breaks_and_gives_its_reason(index):
    rule = compatibility.RULES[index]
    options, where = BREAKS[index]
    config = _unchecked(**options)
    assert rule.breaks(config, where), (index, rule.summary)
    assert set(options) - {"attention_backend", "device"} <= set(rule.options) | {"pipeline_parallel_size"}
    reason = refusal(config, where)
    assert reason == rule.reason(config, where)
    assert EngineConfig().__class__ and not rule.breaks(EngineConfig(), Where("cpu", "sdpa"))  # the default holds
    with pytest.raises(ValueError, match="."):
        compatibility.check_compatible(config, where)


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(compile=True, mode="naive"), "compile=True needs mode='paged' or 'contiguous'"),
        (dict(tensor_parallel_size=2, quantization="w8a8"), "int8 and int4 can"),
        (dict(weight_offload="disk", sparsity="2:4"), "weight_offload='disk' cannot be combined with sparsity"),
        (dict(attention_backend="cpu", device="cuda"), "runs on the CPU, not on device='cuda'"),
    ],
)
def test_the_config_refuses_what_it_already_knows(options, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**options)


def test_rules_that_need_the_device_wait_for_the_builder():
    config = EngineConfig(weight_offload="disk")  # device="auto": could still be the CPU
    assert refusal(config) is None
    assert "use 'host' on a GPU" in refusal(config, Where("cuda", "triton"))
    assert refusal(config, Where("cpu", "sdpa")) is None


def test_int8_and_int4_are_allowed_under_tensor_parallelism():
    for method in ("int8", "int4"):
        assert EngineConfig(tensor_parallel_size=2, quantization=method).quantization == method


def test_compile_by_default_asks_the_table(tiny_model, monkeypatch):
    """Whatever the table refuses with compile=True, the default skips — with the same reason."""
    from minillm.models.loader import load_model

    model = load_model(tiny_model, torch.float32)
    monkeypatch.setenv("MINILLM_COMPILE", "1")
    monkeypatch.setattr(builder, "COMPILE_BY_DEFAULT_MIN_BYTES", 0)
    for options in (dict(sparsity="2:4"), dict(tensor_parallel_size=2), dict(weight_offload="host")):
        config = EngineConfig(**options)
        decision = builder.compile_by_default(config, model, "sdpa")
        assert not decision and decision.reason == refusal(config, Where("cpu", "sdpa"), compile=True), options
    on_gpu = builder.compile_by_default(EngineConfig(), model, "triton")
    assert not on_gpu and "on CUDA the decode fast path is cuda_graphs=True" in on_gpu.reason
    decision = builder.compile_by_default(EngineConfig(), model, "sdpa")
    assert decision and "default" in decision.reason
    monkeypatch.setattr(builder, "COMPILE_BY_DEFAULT_MIN_BYTES", 2**40)
    assert "decode fast enough eagerly" in builder.compile_by_default(EngineConfig(), model, "sdpa").reason
    monkeypatch.setenv("MINILLM_COMPILE", "0")
    assert builder.compile_by_default(EngineConfig(), model, "sdpa").reason == "MINILLM_COMPILE=0"


def test_the_table_prints():
    text = compatibility.table()
    assert text.count("\n    (") == len(compatibility.RULES)
    assert "weight_offload='disk' is for the CPU" in text


# ------------------------------------------------------------------------------------------
# Command-line flags generated from the fields
# ------------------------------------------------------------------------------------------


def _parse(*argv):
    from minillm.cli import _engine_kwargs, build_parser

    return _engine_kwargs(build_parser().parse_args(["generate", "--prompt", "x", *argv]))


def test_every_flag_field_round_trips():
    from minillm.cli import _engine_fields, _flag

    fields = {f.name: f for f in _engine_fields()}
    assert {"dtype", "num_threads", "kv_cache_memory", "enable_prefix_caching", "compile", "tensor_parallel_size",
            "speculative_config", "quantization"} <= set(fields)  # fmt: skip
    defaults = _parse()
    assert defaults == {name: f.default for name, f in fields.items()}  # no flag: the config's defaults
    EngineConfig(**defaults)
    examples = {
        "num_threads": ("3", 3),
        "max_model_len": ("64", 64),
        "kv_cache_memory": ("2GB", 2 * 10**9),
        "speculative_config": ('{"method": "ngram", "num_speculative_tokens": 2}', NGRAM),
        "compile": ("on", True),
        "device": ("cpu", "cpu"),
        "dtype": ("bf16", "bf16"),
    }
    for name, f in fields.items():
        if f.default is True:
            assert _parse(_flag(f))[name] is False, name
        elif name in examples:
            text, value = examples[name]
            assert _parse(_flag(f), text)[name] == value, name
        elif f.metadata["choices"]:
            choice = list(f.metadata["choices"])[-1]
            assert _parse(_flag(f), choice)[name] == choice, name
        else:
            assert _parse(_flag(f), "2")[name] == 2, name


@pytest.mark.parametrize(
    "argv, message",
    [(["--kv-cache-memory", "lots"], "is not a size"), (["--speculative-config", "[1]"], "JSON object"),
     (["--threads", "two"], "invalid"), (["--quantization", "int3"], "invalid choice")],
)  # fmt: skip
def test_bad_flags_are_usage_errors_naming_the_value(argv, message, capsys):
    with pytest.raises(SystemExit):
        _parse(*argv)
    assert message in capsys.readouterr().err


def test_flag_help_comes_from_the_field():
    from minillm.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    text = sub.choices["serve"].format_help()
    for f in dataclasses.fields(EngineConfig):
        if f.metadata.get("cli"):
            assert (f.metadata.get("flag") or "--" + f.name.replace("_", "-")) in text, f.name


# ------------------------------------------------------------------------------------------
# What the engine resolved
# ------------------------------------------------------------------------------------------


def test_the_engine_says_what_it_resolved(tiny_model):
    llm = LLM(tiny_model, dtype="fp32")
    resolved = llm.resolved
    assert resolved.device == "cpu" and resolved.dtype == "float32"
    assert resolved.attention_backend == llm.engine.attention_backend
    assert resolved.compile is False and resolved.compile_reason == "MINILLM_COMPILE=0"  # the test suite's setting
    assert llm.engine_config.compile is False  # written back: no longer None
    assert resolved.num_kv_blocks == llm.engine.block_manager.num_blocks
    assert resolved.decode_fast_path == "none (eager)"
    text = str(resolved)
    assert "compile_reason" in text and "MINILLM_COMPILE=0" in text


def test_an_explicit_choice_is_resolved_as_given(tiny_model):
    llm = LLM(tiny_model, dtype="fp32", mode="contiguous", compile=False, attention_backend="sdpa")
    assert llm.resolved.attention_backend == "sdpa" and llm.resolved.num_kv_blocks is None
    assert llm.resolved.compile_reason == "compile=False"


def test_kv_cache_dtype_is_a_checked_value_the_pool_owns():
    """Checked once where it is made; the pool and the kernels ask it (``quantized``, ``storage``,
    ``kernel_code``) instead of comparing names; it stays a string where one is expected."""
    from minillm.config import KVCacheDtype
    from minillm.kvcache.paged import PagedKVCache

    assert [KVCacheDtype(n).kernel_code for n in ("auto", "int8", "fp8")] == [0, 1, 2]
    assert [KVCacheDtype(n).storage for n in ("auto", "int8", "fp8")] == [None, torch.int8, torch.uint8]
    assert not KVCacheDtype().quantized and KVCacheDtype("int8").quantized
    assert KVCacheDtype("fp8") == "fp8" and repr(KVCacheDtype("fp8")) == "'fp8'"
    for bad in ("int4", "INT8", None, 8):
        with pytest.raises(ValueError, match="expected one of"):
            KVCacheDtype(bad)
    config = EngineConfig(kv_cache_dtype="int8")
    assert type(config.kv_cache_dtype) is KVCacheDtype
    shape = SimpleNamespace(num_layers=1, num_kv_heads=1, head_dim=4)  # all a pool reads of its model
    pool = PagedKVCache(shape, 2, 4, torch.float32, torch.device("cpu"), "fp8")
    assert type(pool.kv_cache_dtype) is KVCacheDtype and pool.k.dtype == torch.uint8 and pool.k_scale is not None
