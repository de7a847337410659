"""``ModelConfig``: our own small, explicit view of a Hugging Face ``config.json``.

Only the fields the Llama-family decoder needs, with defaults resolved once here so the model
code never has to ask "is this field present?". A bad field is a ``ModelLoadError`` naming it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from minillm.errors import ModelLoadError

#: ``model_type`` values we can run, and what distinguishes them. All share one decoder.
SUPPORTED_MODEL_TYPES = {
    "llama": "Llama 1/2/3, SmolLM, TinyLlama",
    "mistral": "Mistral (optionally with a sliding window)",
    "qwen2": "Qwen2 (bias on the q/k/v projections)",
}

#: ``torch_dtype`` values a checkpoint may declare (what its tensors are stored as).
KNOWN_CHECKPOINT_DTYPES = ("float32", "bfloat16", "float16", "float", "half", "auto")

#: RoPE frequency variants implemented in ``minillm.models.rope``.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")

DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """Turn ``"bf16"``/``"float32"``/``torch.float16`` into a ``torch.dtype``; reject others."""
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"unsupported dtype {dtype}; use one of fp32, bf16, fp16")
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; use one of fp32, bf16, fp16 (or 'auto')")
    return DTYPES[dtype]


@dataclass(frozen=True)
class ModelConfig:
    """The architecture of one Llama-family checkpoint."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    rope_theta: float
    rope_scaling: dict[str, Any] = field(default_factory=dict)
    torch_dtype: str = "float32"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    sliding_window: int | None = None  # Mistral-style: each query sees only the last W keys

    @property
    def rope_type(self) -> str:
        return self.rope_scaling.get("rope_type", "default")

    @property
    def num_params(self) -> int:
        """Parameter count (embedding counted once when tied), for MBU/MFU arithmetic."""
        h, i, L = self.hidden_size, self.intermediate_size, self.num_layers
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        per_layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h
        if self.attention_bias:
            per_layer += q + 2 * kv
        embed = self.vocab_size * h
        return L * per_layer + h + embed * (1 if self.tie_word_embeddings else 2)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config") -> ModelConfig:
        if not isinstance(raw, dict):
            raise ModelLoadError(f"{source}: must hold a JSON object, got {type(raw).__name__}")

        def positive(name: str, default=None, kind=int):
            """Field ``name`` (or ``default`` when absent/null) as a positive ``kind``, else a ModelLoadError."""
            value = raw.get(name) if raw.get(name) is not None else default
            if value is None:
                raise ModelLoadError(f"{source}: required field '{name}' is missing")
            ok = kind is int and isinstance(value, int) or kind is float and isinstance(value, (int, float))
            if isinstance(value, bool) or not ok or not 0 < value < math.inf:
                what = "a positive integer" if kind is int else "a positive number"
                raise ModelLoadError(f"{source}: field '{name}' = {value!r} must be {what}")
            return kind(value)

        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            supported = ", ".join(sorted(SUPPORTED_MODEL_TYPES))
            raise ModelLoadError(
                f"{source}: unknown architecture model_type={model_type!r} "
                f"(architectures={raw.get('architectures')}); minillm supports: {supported}"
            )
        hidden = positive("hidden_size")
        num_heads = positive("num_attention_heads")
        num_layers = positive("num_hidden_layers")
        vocab = positive("vocab_size")
        inter = positive("intermediate_size")
        num_kv = positive("num_key_value_heads", num_heads)
        if num_heads % num_kv:
            raise ModelLoadError(
                f"{source}: num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv}"
            )
        head_dim = positive("head_dim", hidden // num_heads or None)
        max_positions = positive("max_position_embeddings", 2048)
        dtype = raw.get("torch_dtype") or raw.get("dtype") or "float32"
        if not isinstance(dtype, str) or dtype.replace("torch.", "") not in KNOWN_CHECKPOINT_DTYPES:
            raise ModelLoadError(
                f"{source}: field 'torch_dtype' = {dtype!r} is not a dtype minillm can load "
                f"({', '.join(KNOWN_CHECKPOINT_DTYPES)})"
            )
        if raw.get("hidden_act", "silu") != "silu":
            raise ModelLoadError(f"{source}: hidden_act={raw['hidden_act']!r} is not supported (silu only)")

        # transformers >= 5 writes "rope_parameters"; older configs use rope_theta + rope_scaling.
        rope, legacy = raw.get("rope_parameters") or {}, raw.get("rope_scaling") or {}
        if not isinstance(rope, dict) or not isinstance(legacy, dict):
            raise ModelLoadError(f"{source}: fields 'rope_parameters' / 'rope_scaling' must be JSON objects")
        rope = {**legacy, **rope}
        if "type" in rope and "rope_type" not in rope:
            rope["rope_type"] = rope.pop("type")
        rope.setdefault("rope_type", "default")
        theta = rope.pop("rope_theta", raw.get("rope_theta", 10000.0))
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not 0 < theta < math.inf:
            raise ModelLoadError(f"{source}: field 'rope_theta' = {theta!r} must be a positive number")
        if rope["rope_type"] not in SUPPORTED_ROPE_TYPES:
            raise ModelLoadError(
                f"{source}: rope_type={rope['rope_type']!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        window = None
        if raw.get("sliding_window") and raw.get("use_sliding_window", model_type == "mistral"):
            window = positive("sliding_window")
            if window >= max_positions:
                window = None  # a window as long as the context is full attention
        # Qwen2 always has q/k/v bias; Llama/Mistral declare it with attention_bias.
        bias = bool(raw.get("attention_bias", False)) or model_type == "qwen2"
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in eos_ids):
            raise ModelLoadError(f"{source}: field 'eos_token_id' = {eos!r} must be token id(s)")
        return cls(
            model_type=model_type,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=inter,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv,
            head_dim=head_dim,
            rms_norm_eps=positive("rms_norm_eps", 1e-6, float),
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bias,
            rope_theta=float(theta),
            rope_scaling=rope,
            torch_dtype=dtype,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
            sliding_window=window,
        )

    @classmethod
    def from_folder(cls, folder: str | Path) -> ModelConfig:
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise ModelLoadError(f"{folder}: no config.json; is this a Hugging Face model folder?")
        try:
            raw = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ModelLoadError(f"{path}: not valid JSON ({err})") from None
        return cls.from_dict(raw, source=str(path))


