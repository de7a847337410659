"""The committed SmolLM2 drafts (``data/smollm2-draft*``, ``data/recipes/distill_smollm2_draft.py``):
assembled from their committed weights and SmolLM2's shared embedding and tokenizer, loadable,
rebuilt when the committed files change, and — as speculative drafts — leaving SmolLM2's greedy
output unchanged while getting tokens accepted; the distilled one agrees with SmolLM2 more often."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from minillm import assets
from minillm.assets import DRAFT_MODELS, resolve_model

TARGET = "smollm2-135m"
PROMPTS = [
    [{"role": "user", "content": "Give me two tips for keeping houseplants alive."}],
    [{"role": "user", "content": "What is a Python dictionary?"}],
]


def spec(name: str, k: int = 4) -> dict:
    """Always k proposals: these tests measure acceptance (the governor: test_governor.py)."""
    return {"method": "draft", "model": name, "num_speculative_tokens": k, "adaptive": False}


@pytest.mark.parametrize("name", sorted(DRAFT_MODELS))
def test_committed_draft_is_small_and_new_weights_only(name):
    from safetensors import safe_open

    folder = assets.data_dir() / name
    weights = folder / "model.safetensors"
    assert weights.stat().st_size <= 16_000_000
    with safe_open(str(weights), framework="pt") as f:
        names = set(f.keys())
        assert {f.get_tensor(n).dtype for n in names} == {torch.bfloat16}
    assert not any(n.startswith(("model.embed_tokens", "lm_head")) for n in names)
    config = json.loads((folder / "config.json").read_text())
    record = json.loads((folder / "training.json").read_text())
    assert record["config"]["num_hidden_layers"] == config["num_hidden_layers"]
    assert len(names) == 9 * config["num_hidden_layers"] + 1  # 9 tensors a layer + the final norm


@pytest.mark.parametrize("name", sorted(DRAFT_MODELS))
def test_resolved_draft_loads_and_shares_smollm2_tokenizer_and_embedding(smollm2_dir, name):
    from safetensors import safe_open

    from minillm.config import ModelConfig
    from minillm.models import load_model
    from minillm.tokenizer import Tokenizer

    folder = resolve_model(name)
    assert folder == assets.cache_dir() / name
    model = load_model(folder, torch.bfloat16)
    config = ModelConfig.from_folder(folder)
    assert config.vocab_size == 49152 and config.hidden_size == 576 and config.tie_word_embeddings
    assert len(model.layers) == json.loads((assets.data_dir() / name / "config.json").read_text())["num_hidden_layers"]
    with safe_open(str(smollm2_dir / "model.safetensors"), framework="pt") as f:
        assert torch.equal(model.embed_tokens.weight, f.get_tensor("model.embed_tokens.weight"))
    draft_tok, target_tok = Tokenizer(folder), Tokenizer(smollm2_dir)
    probe = "The quick brown fox, 1234 — naïve café.\n\tdef f(x): return x**2"
    assert draft_tok.encode(probe) == target_tok.encode(probe)
    assert draft_tok.eos_token_ids == target_tok.eos_token_ids
    assert draft_tok.render_chat(PROMPTS[0]) == target_tok.render_chat(PROMPTS[0])


def test_assembled_draft_is_rebuilt_when_the_committed_files_change(smollm2_dir, tmp_path, monkeypatch):
    data, cache = tmp_path / "data", tmp_path / "cache"
    shutil.copytree(assets.data_dir() / "smollm2-draft", data / "smollm2-draft")
    cache.mkdir()
    (cache / TARGET).symlink_to(smollm2_dir)  # the converted target, not converted again
    monkeypatch.setattr(assets, "data_dir", lambda: data)
    monkeypatch.setenv("MINILLM_CACHE", str(cache))

    with pytest.raises(assets.ModelNotFoundError, match="not assembled"):
        resolve_model("smollm2-draft", convert=False)
    folder = resolve_model("smollm2-draft")
    stamp = json.loads((folder / "minillm_asset.json").read_text())
    assert resolve_model("smollm2-draft", convert=False) == folder  # up to date: nothing to do

    config = json.loads((data / "smollm2-draft" / "config.json").read_text())
    config["rms_norm_eps"] = 1e-6  # a "retrained" draft
    (data / "smollm2-draft" / "config.json").write_text(json.dumps(config))
    with pytest.raises(assets.ModelNotFoundError, match="not assembled"):
        resolve_model("smollm2-draft", convert=False)
    resolve_model("smollm2-draft")
    assert json.loads((folder / "minillm_asset.json").read_text())["sha256"] != stamp["sha256"]
    assert json.loads((folder / "config.json").read_text())["rms_norm_eps"] == 1e-6


@pytest.fixture(scope="module")
def reference(smollm2_dir):
    from minillm import LLM, SamplingParams

    # fp32: in bf16 the (k+1)-token verify pass rounds differently from one-token decoding and
    # SmolLM2's greedy text can drift from its plain output after a few dozen tokens.
    llm = LLM(TARGET, dtype="fp32")
    return [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=24))]


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(DRAFT_MODELS))
def test_draft_leaves_smollm2_greedy_output_unchanged_and_gets_tokens_accepted(reference, name):
    from minillm import LLM, SamplingParams

    llm = LLM(TARGET, dtype="fp32", speculative_config=spec(name))
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=24))
    assert [o.token_ids for o in outs] == reference
    for o in outs:
        assert o.metrics.acceptance_rate > 0
        assert o.metrics.forward_passes_per_token < 1


@pytest.mark.slow
def test_distillation_buys_agreement_with_smollm2_not_perplexity(smollm2_dir):
    """What the recipe measured on all of the held-out prose, on its first 2048 tokens: the
    distilled draft's top-1 token is SmolLM2's more often (0.33 vs 0.29), while the data-only
    draft, trained for exactly that, has the lower perplexity (130 vs 159). On the 8 free-chat
    prompts the two drafts' acceptance rates were too close to call, so that is not asserted."""
    from pydoc_data.topics import topics

    from minillm.models import load_model
    from minillm.models.llama import ForwardBatch
    from minillm.tokenizer import Tokenizer

    text = "\n\n".join(topics[k] for k in sorted(topics))[:40_000]  # the recipe's held-out slice
    ids = torch.tensor(Tokenizer(smollm2_dir).encode(text, add_special_tokens=False)[: 8 * 256]).view(8, 256)
    batch = ForwardBatch(ids, torch.arange(256)[None].expand(8, -1))
    with torch.inference_mode():
        target = load_model(smollm2_dir)(batch).argmax(-1)
        agreement, ppl = {}, {}
        for name in ("smollm2-draft", "smollm2-draft-data"):
            logp = load_model(resolve_model(name))(batch).float().log_softmax(-1)
            agreement[name] = (logp.argmax(-1) == target).float().mean().item()
            ppl[name] = logp[:, :-1].gather(-1, ids[:, 1:, None]).mean().neg().exp().item()
    assert agreement["smollm2-draft"] > agreement["smollm2-draft-data"] + 0.02, agreement
    assert ppl["smollm2-draft-data"] < ppl["smollm2-draft"], ppl
