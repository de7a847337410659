"""Bad input gets a clear error naming the problem, and leaves the engine usable."""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from minillm import LLM, ModelLoadError, ModelNotFoundError, PromptTooLongError, SamplingParams
from minillm.config import EngineConfig
from minillm.models import load_model


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(tiny_model, dtype="fp32", max_model_len=64)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(temperature=-0.5), "temperature=-0.5"),
        (dict(temperature=float("nan")), "temperature=nan"),
        (dict(top_p=0.0), "top_p=0.0"),
        (dict(top_p=1.5), "top_p=1.5"),
        (dict(top_k=-1), "top_k=-1"),
        (dict(top_k=2.5), "top_k=2.5"),
        (dict(min_p=1.5), "min_p=1.5"),
        (dict(repetition_penalty=0.0), "repetition_penalty=0.0"),
        (dict(max_tokens=0), "max_tokens=0"),
        (dict(max_tokens=-3), "max_tokens=-3"),
        (dict(stop=[""]), "stop strings"),
        (dict(stop_token_ids=[-1]), "stop_token_ids"),
        (dict(seed="abc"), "seed='abc'"),
    ],
)
def test_invalid_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        SamplingParams(**kwargs)


def test_params_mutated_after_construction_are_revalidated(llm):
    params = SamplingParams()
    params.top_p = 2.0
    with pytest.raises(ValueError, match="top_p=2.0"):
        llm.generate("hello", params)


@pytest.mark.parametrize(
    "prompt,error,message",
    [
        ("", ValueError, "prompt 0 is an empty string"),
        ([[]], ValueError, "prompt 0 is an empty list of token ids"),
        ([5, 10**6], ValueError, r"token id\(s\) \[1000000\] outside the vocabulary"),
        ([5, -1], ValueError, r"token id\(s\) \[-1\] outside"),
        (3.14, TypeError, "must be a prompt or a list of prompts"),
        ([{"role": "user"}], ValueError, "chat message 0 must be a dict with 'role' and 'content'"),
    ],
)
def test_bad_prompts(llm, prompt, error, message):
    with pytest.raises(error, match=message):
        llm.generate(prompt, SamplingParams(max_tokens=2))


def test_empty_batch_is_not_an_error(llm):
    assert llm.generate([]) == []


def test_prompt_longer_than_context(llm):
    with pytest.raises(PromptTooLongError, match="prompt 0 has 64 tokens; max_model_len=64"):
        llm.generate([[5] * 64])
    # one token shorter fits, and generation stops at the context limit with "length"
    out = llm.generate([[5] * 60], SamplingParams(max_tokens=50, ignore_eos=True))[0]
    assert len(out.token_ids) == 4 and out.finish_reason == "length"


def test_bad_request_in_a_batch_names_it_and_poisons_nothing(llm):
    good = [[5, 6, 7], [8, 9]]
    before = llm.generate(good, SamplingParams(max_tokens=6, ignore_eos=True))
    with pytest.raises(ValueError, match="prompt 1 has token id"):
        llm.generate([good[0], [5, 99999], good[1]], SamplingParams(max_tokens=6, ignore_eos=True))
    with pytest.raises(ValueError, match="got 1 SamplingParams for 2 prompts"):
        llm.generate(good, [SamplingParams()])
    after = llm.generate(good, SamplingParams(max_tokens=6, ignore_eos=True))
    assert [o.token_ids for o in after] == [o.token_ids for o in before]


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(mode="fast"), "mode='fast'"),
        (dict(max_model_len=1), "max_model_len=1"),
        (dict(max_num_seqs=0), "max_num_seqs=0"),
        (dict(dtype="int3"), "unsupported dtype 'int3'"),
        (dict(attention_backend="magic"), "attention_backend='magic'"),
        (dict(device="tpu:0"), "device='tpu:0'"),
        (dict(num_threads=0), "num_threads=0"),
        (dict(compile=True, mode="naive"), "compile=True needs mode='paged' or 'contiguous'"),
        (dict(block_size=2.5), "block_size=2.5"),
        (dict(kv_cache_memory="1GB"), "kv_cache_memory='1GB'"),
    ],
)
def test_invalid_engine_config(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs).resolve_device()


def test_context_longer_than_model(tiny_model):
    with pytest.raises(ValueError, match="max_model_len=100000 exceeds the model's max_position_embeddings=256"):
        LLM(tiny_model, max_model_len=100000)


def test_missing_model():
    with pytest.raises(ModelNotFoundError, match="'no-such-model' is neither a known name"):
        LLM("no-such-model")


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_folder_without_config(tiny_model, tmp_path):
    folder = _copy(tiny_model, tmp_path / "m")
    (folder / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="no config.json"):
        LLM(folder)


def test_folder_without_weights(tiny_model, tmp_path):
    folder = _copy(tiny_model, tmp_path / "m")
    (folder / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"no \*.safetensors weight files"):
        load_model(folder)


def test_incomplete_checkpoint_names_missing_tensors(tiny_model, tmp_path):
    folder = _copy(tiny_model, tmp_path / "m")
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"1 tensor\(s\) missing: model.layers.1.mlp.up_proj.weight"):
        load_model(folder)


def test_wrong_shape_names_tensor_and_file(tiny_model, tmp_path):
    folder = _copy(tiny_model, tmp_path / "m")
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["model.norm.weight"] = tensors["model.norm.weight"][:10].clone()
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"model.safetensors: tensor 'model.norm.weight' has shape \(10,\)"):
        load_model(folder)


def test_corrupt_safetensors_names_file(tiny_model, tmp_path):
    folder = _copy(tiny_model, tmp_path / "m")
    (folder / "model.safetensors").write_bytes(b"\x00\x01garbage" * 10)
    with pytest.raises(ModelLoadError, match=r"model.safetensors: corrupt or unreadable"):
        load_model(folder)


def test_truncated_safetensors_names_file(tiny_model, tmp_path):
    folder = _copy(tiny_model, tmp_path / "m")
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match=r"model.safetensors"):
        load_model(folder)


def test_unknown_architecture(tiny_model, tmp_path):
    folder = _copy(tiny_model, tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "gpt2"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="unknown architecture model_type='gpt2'"):
        LLM(folder)


def test_unsupported_rope_variant(tiny_model, tmp_path):
    folder = _copy(tiny_model, tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="rope_type='yarn' is not supported"):
        LLM(folder)


def test_sharded_checkpoint_loads_and_missing_shard_is_named(tiny_model, tmp_path):
    folder = _copy(tiny_model, tmp_path / "m")
    tensors = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(folder / shard))
        weight_map.update({k: shard for k in keys})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    sharded = LLM(folder, dtype="fp32").generate([[5, 6, 7]], SamplingParams(max_tokens=5, ignore_eos=True))
    single = LLM(tiny_model, dtype="fp32").generate([[5, 6, 7]], SamplingParams(max_tokens=5, ignore_eos=True))
    assert sharded[0].token_ids == single[0].token_ids
    (folder / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="model-00002-of-00002.safetensors"):
        load_model(folder)
