"""Model and engine configuration.

``ModelConfig`` is our own small, explicit view of a Hugging Face ``config.json``: only the
fields the Llama-family decoder needs, with defaults resolved once here so the model code
never has to ask "is this field present?". ``EngineConfig`` holds the knobs of a running
engine (device, dtype, context length, execution mode).
"""

from __future__ import annotations

import importlib.util
import json
import math
import numbers
import os
import warnings
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


EXECUTION_MODES = ("paged", "contiguous", "naive")
#: Old mode names that still work, with a deprecation warning.
DEPRECATED_MODES = {"kv_cache": "contiguous"}
SCHEDULING_POLICIES = ("static", "dynamic", "continuous")
ATTENTION_BACKENDS = ("auto", "torch", "sdpa", "cpu", "triton")
QUANTIZATION_METHODS = ("int8", "int4", "awq", "w8a8")  # the linear-layer methods of minillm/quantization
SPARSITY_METHODS = ("2:4", "2:4-wanda")  # 2:4 pruning by magnitude or by Wanda scores (quantization/sparsity.py)
KV_CACHE_DTYPES = ("auto", "int8", "fp8")  # the paged pool's storage (minillm/kvcache/quantization.py)
INT4_GROUP_SIZES = (32, 64, 128, 256)  # what PyTorch's CPU int4 kernel accepts
INT4_METHODS = ("int4", "awq")  # the methods that store int4 groups


_MEMORY_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_memory(text: str) -> int | float:
    """A KV-pool size as written on a command line: ``"0.5"`` or ``"50%"`` is a fraction of free
    memory (a float in (0, 1]); ``"2e9"``, ``"2000000000"``, ``"2GB"``, ``"1.5GiB"`` are bytes (an int).
    Raises ``ValueError`` saying what is wrong with ``text``."""
    raw = text.strip().lower().replace("_", "")
    unit = next((u for u in sorted(_MEMORY_UNITS, key=len, reverse=True) if raw.endswith(u)), None)
    number = raw[: -len(unit)] if unit else raw[:-1] if raw.endswith("%") else raw
    try:
        value = float(number)
    except ValueError:
        raise ValueError(f"{text!r} is not a size: use bytes (2e9, 2GB, 1.5GiB) or a fraction (0.5, 50%)") from None
    if not 0 < value < math.inf:
        raise ValueError(f"{text!r}: the KV pool size must be a positive, finite amount")
    if raw.endswith("%"):
        value /= 100
        if value > 1:
            raise ValueError(f"{text!r}: a fraction of free memory cannot exceed 100%")
        return value
    if unit is None and "." in number and "e" not in number:  # 0.5, 1.0: a fraction
        if value > 1:
            raise ValueError(f"{text!r}: a fraction of free memory must be in (0, 1]; write bytes as 2e9 or 2GB")
        return value
    size = int(value * _MEMORY_UNITS.get(unit, 1))
    if size < 1:
        raise ValueError(f"{text!r} is less than one byte; write a fraction of free memory as 0.5 or 50%")
    return size


SPECULATIVE_METHODS = ("draft", "ngram")


@dataclass
class SpeculativeConfig:
    """A checked ``speculative_config``: who proposes (``method``), how many tokens per step."""

    method: str
    num_speculative_tokens: int
    model: str | None = None  # the draft model ("draft")
    quantization: str | None = None  # the draft's weights ("draft"): e.g. "int8" — its LM head dominates a small draft
    prompt_lookup_max: int = 4  # the longest n-gram matched ("ngram")
    prompt_lookup_min: int = 1  # the shortest

    KEYS = {
        "draft": {"method", "model", "num_speculative_tokens", "quantization"},
        "ngram": {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"},
    }

    @classmethod
    def from_dict(cls, raw) -> SpeculativeConfig | None:
        """``None`` stays None; anything else is checked, every bad field named."""
        if raw is None:
            return None
        if not isinstance(raw, dict):
            raise TypeError(f"speculative_config={raw!r} must be a dict (or None)")
        method = raw.get("method")
        if method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config method={method!r}: expected one of {SPECULATIVE_METHODS}")
        unknown = sorted(set(raw) - cls.KEYS[method])
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {unknown} for method {method!r}")
        if "num_speculative_tokens" not in raw:
            raise ValueError("speculative_config needs num_speculative_tokens (the k tokens proposed per step)")
        _check_int("speculative_config num_speculative_tokens", raw["num_speculative_tokens"], 1)
        if raw["num_speculative_tokens"] > 16:
            raise ValueError(f"speculative_config num_speculative_tokens={raw['num_speculative_tokens']} is above 16")
        config = cls(method, raw["num_speculative_tokens"])
        if method == "draft":
            if not isinstance(raw.get("model"), (str, os.PathLike)) or not str(raw.get("model")):
                raise ValueError("speculative_config method='draft' needs model=NAME_OR_PATH (the draft model)")
            config.model = str(raw["model"])
            if raw.get("quantization") is not None:
                try:
                    check_quantization(raw["quantization"], None)
                except ValueError as err:
                    raise ValueError(f"speculative_config {err}") from None
                config.quantization = raw["quantization"]
        else:
            for key in ("prompt_lookup_max", "prompt_lookup_min"):
                if key in raw:
                    _check_int(f"speculative_config {key}", raw[key], 1)
                    setattr(config, key, raw[key])
            if config.prompt_lookup_min > config.prompt_lookup_max:
                raise ValueError(
                    f"speculative_config prompt_lookup_min={config.prompt_lookup_min} is above "
                    f"prompt_lookup_max={config.prompt_lookup_max}"
                )
        return config


def check_quantization(method: str | None, group_size: int | None) -> None:
    """A weight-quantization method and group size the engine supports, else ``ValueError``
    naming the option (checked before any weight is touched)."""
    if method is None:
        return
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization={method!r}: expected one of {QUANTIZATION_METHODS} (or None)")
    if method in INT4_METHODS and group_size is not None and group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"quantization_group_size={group_size!r}: int4 groups must be one of {INT4_GROUP_SIZES}")


def _check_int(name: str, value, minimum: int, optional: bool = False) -> None:
    """``ValueError`` naming ``name`` unless ``value`` is an int >= ``minimum`` (or None if optional)."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):  # numpy ints are integers too
        raise ValueError(f"{name}={value!r} must be an integer" + (" or None" if optional else ""))
    if value < minimum:
        raise ValueError(f"{name}={value} must be >= {minimum}")


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


@dataclass
class EngineConfig:
    """How an engine runs a model. Every field is validated in ``__post_init__``.

    Execution modes, one rung of the correctness ladder each:

    - ``naive`` recomputes the whole sequence at every step (no cache): slow, but the simplest
      correct engine, and the rung every optimisation is tested against;
    - ``contiguous``: a contiguous KV cache per static batch (chapter 02; ``kv_cache`` is its
      old, deprecated name);
    - ``paged`` (default): the serving core — paged KV pool with prefix caching, a scheduler
      (``scheduling_policy``), chunked prefill and preemption (chapters 03-04).

    The paged pool holds ``kv_cache_memory`` bytes (an int), or that fraction of the memory
    free when the engine starts (a float in (0, 1]); by default 90% of free GPU memory on
    CUDA, and on CPU enough for ``max_num_seqs`` full-length sequences capped at 1 GiB.
    """

    device: str = "auto"
    dtype: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 64
    mode: str = "paged"
    num_threads: int | None = None
    seed: int = 0
    attention_backend: str = "auto"
    cpu_prepack: bool = True  # oneDNN-prepacked linears on CPU where supported (measured faster)
    # Compile the decode step: the paged engine's on CPU (engine/compiled_decode.py: graphs compiled once
    # per machine and kept on disk), or the contiguous engine's steps (torch.compile at every start).
    # None: on for the paged engine on CPU when nothing else rules it out and the model is big enough
    # to repay the first compile (engine/builder.py::compile_by_default); MINILLM_COMPILE=0 turns that off.
    compile: bool | None = None
    # The paged engine's compiled decode graphs: one per row count; a batch is padded up to the next.
    compile_batch_sizes: tuple[int, ...] = (1, 8)
    # Weight quantization (chapter 07): None | "int8" | "int4" | "awq" | "w8a8"; int4 groups of this many
    # weights (None: the largest of 128/64/32 that divides every layer).
    quantization: str | None = None
    quantization_group_size: int | None = None
    # 2:4 pruning of the decoder's linear layers before any quantization: None | "2:4" | "2:4-wanda".
    sparsity: str | None = None
    # The paged pool's storage: "auto" (the model's dtype) | "int8" | "fp8" (e4m3; both with a
    # scale per token and head).
    kv_cache_dtype: str = "auto"
    # The paged engine (mode="paged").
    scheduling_policy: str = "continuous"
    block_size: int = 16
    kv_cache_memory: int | float | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    max_num_batched_tokens: int | None = None  # per-step token budget; default 512 chunked, else 4096
    batch_timeout: float = 0.05  # seconds the dynamic policy waits for a full batch
    sliding_window: int | None = None  # attend to the last W keys only (overrides the model's own window)
    # Decode steps as CUDA graphs, padded to captured batch sizes (paged + triton backend).
    # None: on when both are in use on CUDA. True on a CPU runs the same padded path eagerly.
    cuda_graphs: bool | None = None
    # Per-step records (``engine.step_records``, read by run reports and the widgets) are kept
    # in a ring of this many steps, so a long-running server does not grow without bound.
    # 0 keeps none; None keeps every step.
    max_step_records: int | None = 10_000
    # Speculative decoding (chapter 08), vLLM's shape: {"method": "draft", "model": NAME_OR_PATH,
    # "num_speculative_tokens": k} or {"method": "ngram", "num_speculative_tokens": k,
    # "prompt_lookup_max": n}. Checked into a SpeculativeConfig (``speculative`` below).
    speculative_config: dict | None = None
    # Parallelism (chapter 09): the model split over tensor_parallel_size x pipeline_parallel_size
    # worker processes (gloo on CPU, NCCL on CUDA); the scheduler stays in this process. A pipeline
    # cuts each step into pipeline_microbatches micro-batches (default: one per stage).
    # kv_cache_memory is then per worker (each holds its K/V heads of its stage's layers); a
    # fraction is of the free memory each worker's share of the host (CPU) or of its GPU.
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    pipeline_microbatches: int | None = None
    # The last resort when the weights do not fit (minillm/layers/offload.py): "host" keeps each
    # decoder layer's weights in host memory and copies them in per layer; "disk" maps them from a
    # file (CPU), read in by the OS as each layer runs. None: weights resident (the default).
    weight_offload: str | None = None

    def __post_init__(self) -> None:
        if self.mode in DEPRECATED_MODES:
            new = DEPRECATED_MODES[self.mode]
            warnings.warn(f"mode={self.mode!r} is deprecated; use mode={new!r}", DeprecationWarning, stacklevel=4)
            self.mode = new
        # Types first, so a wrong one is named here rather than failing deep inside the engine.
        for name, low in (
            ("max_model_len", 2),
            ("num_threads", 1),
            ("max_num_batched_tokens", 1),
            ("sliding_window", 1),
            ("max_step_records", 0),
            ("max_num_seqs", 1),
            ("block_size", 1),
            ("tensor_parallel_size", 1),
            ("pipeline_parallel_size", 1),
            ("pipeline_microbatches", 1),
        ):
            required = ("max_num_seqs", "block_size", "tensor_parallel_size", "pipeline_parallel_size")
            _check_int(name, getattr(self, name), low, optional=name not in required)
        _check_int("seed", self.seed, 0)
        if self.seed >= 2**64:
            raise ValueError(f"seed={self.seed} must fit in 64 bits: 0 <= seed < 2**64")
        for name in ("cpu_prepack", "compile", "enable_prefix_caching", "enable_chunked_prefill", "cuda_graphs"):
            value = getattr(self, name)
            if not isinstance(value, bool) and not (value is None and name in ("cuda_graphs", "compile")):
                raise TypeError(f"{name}={value!r} must be True or False")
        for name in ("device", "dtype", "mode", "attention_backend", "scheduling_policy"):
            value = getattr(self, name)
            if not isinstance(value, str) and not isinstance(
                value, {"dtype": torch.dtype, "device": torch.device}.get(name, str)
            ):
                raise TypeError(f"{name}={value!r} must be a string")
        timeout = self.batch_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 <= timeout < math.inf:
            raise ValueError(f"batch_timeout={timeout!r} must be a finite number of seconds >= 0")
        if self.mode not in EXECUTION_MODES:
            raise ValueError(f"mode={self.mode!r}; expected one of {EXECUTION_MODES}")
        sizes = self.compile_batch_sizes
        if isinstance(sizes, list):
            self.compile_batch_sizes = sizes = tuple(sizes)
        if (
            not isinstance(sizes, tuple)
            or not sizes
            or any(isinstance(b, bool) or not isinstance(b, int) or not 1 <= b <= 256 for b in sizes)
        ):
            raise ValueError(f"compile_batch_sizes={sizes!r} must be a non-empty tuple of row counts from 1 to 256")
        if self.compile and self.mode == "naive":
            raise ValueError("compile=True needs mode='paged' or 'contiguous' (the naive engine has no decode step)")
        if self.cuda_graphs and self.compile:
            raise ValueError("compile=True and cuda_graphs=True are two decode fast paths (CPU, CUDA): choose one")
        if self.cuda_graphs and self.mode != "paged":
            raise ValueError(f"cuda_graphs=True needs mode='paged' (got mode={self.mode!r})")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy={self.scheduling_policy!r}; expected one of {SCHEDULING_POLICIES}")
        memory = self.kv_cache_memory
        if memory is not None:
            # An int is bytes, a float a fraction of free memory: 1 means one byte, 1.0 all of it.
            if isinstance(memory, bool) or not isinstance(memory, (int, float)):
                raise ValueError(f"kv_cache_memory={memory!r} must be bytes (int) or a fraction of free memory (float)")
            if isinstance(memory, float) and not 0.0 < memory <= 1.0:
                raise ValueError(
                    f"kv_cache_memory={memory} as a fraction of free memory must be in (0, 1] (bytes are an int)"
                )
            if isinstance(memory, int) and memory < 1:
                raise ValueError(f"kv_cache_memory={memory} bytes must be positive")
        if self.dtype != "auto":
            parse_dtype(self.dtype)
        if self.quantization is not None and not isinstance(self.quantization, str):
            raise TypeError(f"quantization={self.quantization!r} must be a string or None")
        _check_int("quantization_group_size", self.quantization_group_size, 1, optional=True)
        check_quantization(self.quantization, self.quantization_group_size)
        self.speculative = SpeculativeConfig.from_dict(self.speculative_config)
        if self.speculative is not None and self.compile:
            raise ValueError("speculative_config cannot be combined with compile=True: its verify steps are not "
                             "single-token decode steps, the ones compile=True compiles")  # fmt: skip
        if self.speculative is not None and self.mode != "paged":
            raise ValueError(f"speculative_config needs mode='paged' (got mode={self.mode!r})")
        if self.sparsity is not None and self.sparsity not in SPARSITY_METHODS:
            raise ValueError(f"sparsity={self.sparsity!r}: expected one of {SPARSITY_METHODS} (or None)")
        if self.sparsity is not None and self.compile:
            raise ValueError(f"sparsity={self.sparsity!r} cannot be combined with compile=True")
        if not isinstance(self.kv_cache_dtype, str) or self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r}: expected one of {KV_CACHE_DTYPES}")
        if self.kv_cache_dtype != "auto" and self.mode != "paged":
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} needs mode='paged' (got mode={self.mode!r})")
        if self.world_size > 1:
            self._check_parallel()
        if self.weight_offload is not None:
            if self.weight_offload not in ("host", "disk"):
                raise ValueError(f"weight_offload={self.weight_offload!r}: expected 'host', 'disk' or None")
            clash = [n for n in ("quantization", "sparsity", "speculative_config") if getattr(self, n) is not None]
            if clash or self.compile or self.world_size > 1:
                what = clash[0] if clash else "compile" if self.compile else "tensor/pipeline parallelism"
                raise ValueError(f"weight_offload={self.weight_offload!r} cannot be combined with {what}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend={self.attention_backend!r}; expected one of {ATTENTION_BACKENDS}")
        if self.attention_backend == "cpu":
            if self.mode != "paged":
                raise ValueError(
                    f"attention_backend='cpu' is a paged decode kernel: it needs mode='paged' (got {self.mode!r})"
                )
            if str(self.device).split(":")[0] not in ("auto", "cpu"):
                raise ValueError(f"attention_backend='cpu' runs on the CPU, not on device={self.device!r}")
            if self.kv_cache_dtype != "auto":
                raise ValueError(
                    f"attention_backend='cpu' reads fp32/bf16/fp16 pools, not kv_cache_dtype={self.kv_cache_dtype!r}: "
                    "use 'sdpa' (or 'auto')"
                )
        if self.attention_backend == "triton":
            if self.mode != "paged":
                raise ValueError(f"attention_backend='triton' needs mode='paged' (got mode={self.mode!r})")
            if not triton_available():
                raise ValueError("attention_backend='triton' needs the triton package: pip install triton")

    @property
    def world_size(self) -> int:
        """Worker processes holding the model: ``tensor_parallel_size × pipeline_parallel_size``."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def _check_parallel(self) -> None:
        sizes = (
            f"tensor_parallel_size={self.tensor_parallel_size}, pipeline_parallel_size={self.pipeline_parallel_size}"
        )
        if self.mode != "paged":
            raise ValueError(f"{sizes} needs mode='paged' (got mode={self.mode!r})")
        for name in ("speculative_config", "quantization", "sparsity"):
            if getattr(self, name) is not None:
                raise ValueError(f"{name}={getattr(self, name)!r} cannot be combined with {sizes} yet")
        if self.cuda_graphs or self.compile:
            what = "cuda_graphs=True" if self.cuda_graphs else "compile=True"
            raise ValueError(f"{what} cannot be combined with {sizes} yet")
        if self.world_size > 64:
            raise ValueError(f"{sizes} asks for {self.world_size} worker processes; at most 64")

    @property
    def token_budget(self) -> int:
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return 512 if self.enable_chunked_prefill else 4096

    def resolve_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        try:
            device = torch.device(self.device)
        except RuntimeError:
            raise ValueError(f"device={self.device!r} is not a torch device") from None
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device={self.device!r} requested but CUDA is not available")
        return device

    def resolve_dtype(self, model: ModelConfig, device: torch.device) -> torch.dtype:
        """``auto``: the checkpoint's half-precision type if it has one (bf16 on CPU), else fp32."""
        if self.dtype != "auto":
            return parse_dtype(self.dtype)
        stored = model.torch_dtype.replace("torch.", "")
        if stored in ("bfloat16", "float16"):
            return torch.bfloat16 if device.type == "cpu" else DTYPES[stored]
        return torch.float32
