"""The real model: SmolLM2-135M-Instruct converted from its GGUF, against HF on the same folder."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import hf_model

from minillm import LLM, SamplingParams
from minillm.assets import _unpermute_rope, resolve_model
from minillm.models import load_model
from minillm.models.llama import ForwardBatch

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
#: fp32 logits of the real model vs HF: observed ~3e-5; the bound leaves room for BLAS differences.
LOGIT_TOL = 1e-3


@pytest.fixture(scope="module")
def llm(smollm2_dir):
    return LLM(smollm2_dir, dtype="fp32")


@pytest.fixture(scope="module")
def reference(smollm2_dir):
    return hf_model(smollm2_dir)


def test_converted_folder_is_complete(smollm2_dir):
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ):
        assert (smollm2_dir / name).is_file(), name
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_key_value_heads"]) == (30, 576, 3)
    assert config["tie_word_embeddings"] is True
    assert "im_start" in json.loads((smollm2_dir / "tokenizer_config.json").read_text())["chat_template"]


def test_conversion_is_idempotent(smollm2_dir):
    before = (smollm2_dir / "model.safetensors").stat().st_mtime_ns
    assert resolve_model("smollm2-135m") == smollm2_dir
    assert (smollm2_dir / "model.safetensors").stat().st_mtime_ns == before


def test_unpermute_inverts_llama_cpp_permutation():
    """llama.cpp's converter interleaves each head's rows; we must undo exactly that."""

    def llama_cpp_permute(w, n_head):
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    w = torch.randn(3 * 64, 10).numpy()
    assert (_unpermute_rope(llama_cpp_permute(w, 3), 3) == w).all()


def test_answers_paris(llm):
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    out = llm.generate(chat, SamplingParams(max_tokens=20))[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"  # it ends its turn with <|im_end|>


def test_prefill_logits_match_hf(smollm2_dir, reference, llm):
    for prompt in PROMPTS:
        ids = torch.tensor([llm.tokenizer.encode(prompt)])
        ours = llm.model(ForwardBatch(ids, torch.arange(ids.shape[1])[None]))
        with torch.no_grad():
            ref = reference(ids).logits
        diff = (ours - ref).abs().max().item()
        assert diff <= LOGIT_TOL, f"{prompt!r}: {diff:.2e}"


def test_greedy_tokens_match_hf_generate(llm, reference):
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=24, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs):
        ids = torch.tensor([out.prompt_token_ids])
        with torch.no_grad():
            ref = reference.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=24,
                min_new_tokens=24,
                do_sample=False,
                pad_token_id=2,
            )
        assert out.token_ids == ref[0, ids.shape[1] :].tolist(), prompt


def test_bf16_default_runs_and_stays_close(smollm2_dir):
    """bf16 is the CPU default; its logits stay within a bf16-sized distance of fp32."""
    bf16 = LLM(smollm2_dir)
    assert bf16.dtype == torch.bfloat16
    fp32 = load_model(smollm2_dir, torch.float32)
    ids = torch.tensor([bf16.tokenizer.encode(PROMPTS[0])])
    pos = torch.arange(ids.shape[1])[None]
    a = fp32(ForwardBatch(ids, pos))[0, -1]
    b = bf16.model(ForwardBatch(ids, pos))[0, -1]
    assert a.argmax() == b.argmax()
    assert (a - b).abs().max().item() < 1.0
    assert "Paris" in bf16.generate(PROMPTS[0], SamplingParams(max_tokens=4))[0].text
