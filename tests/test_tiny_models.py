"""The committed tiny Shakespeare models: complete, documented, shared tokenizer, and loaded
identically by minillm and by transformers."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import hf_model

from minillm import LLM, SamplingParams
from minillm.assets import data_dir, resolve_model
from minillm.models import load_model
from minillm.models.llama import ForwardBatch

NAMES = ["tiny-shakespeare-1m", "tiny-shakespeare-8m"]


@pytest.mark.parametrize("name", NAMES)
def test_model_card_and_files(name):
    folder = resolve_model(name)
    for f in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "README.md",
        "training.json",
    ):
        assert (folder / f).is_file(), f
    info = json.loads((folder / "training.json").read_text())
    assert info["val_loss"] > 0 and info["wall_time_s"] > 0 and info["corpus"]["works"] > 40
    config = json.loads((folder / "config.json").read_text())
    assert config.get("torch_dtype", config.get("dtype")) == "bfloat16"  # committed in bf16


def test_models_share_one_tokenizer():
    a, b = (data_dir() / n / "tokenizer.json" for n in NAMES)
    assert a.read_text() == b.read_text() == (data_dir() / "tiny-shakespeare-tokenizer" / "tokenizer.json").read_text()


def test_parameter_counts():
    sizes = {n: LLM(n).model_config.num_params for n in NAMES}
    assert 0.8e6 < sizes["tiny-shakespeare-1m"] < 2e6
    assert 6e6 < sizes["tiny-shakespeare-8m"] < 10e6


@pytest.mark.parametrize("name", NAMES)
def test_minillm_matches_transformers(name):
    folder = resolve_model(name)
    ours, ref = load_model(folder, torch.float32), hf_model(folder)
    llm = LLM(name, dtype="fp32")
    ids = llm.tokenizer.encode("KING HENRY.\nOnce more unto the breach, dear friends")
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
    got = ours(ForwardBatch(torch.tensor([ids]), torch.arange(len(ids))[None]))[0]
    assert (got - expected).abs().max().item() <= 1e-4
    out = llm.generate([ids], SamplingParams(max_tokens=24, ignore_eos=True))[0]
    with torch.no_grad():
        hf_tokens = ref.generate(
            torch.tensor([ids]), max_new_tokens=24, min_new_tokens=24, do_sample=False, pad_token_id=0
        )[0, len(ids) :].tolist()
    assert out.token_ids == hf_tokens
