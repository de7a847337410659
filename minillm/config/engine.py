"""``EngineConfig``: the knobs of a running engine, each checked once, where it is set.

Every field carries its own documentation and command-line flag in its metadata (``option``):
``minillm generate/serve/chat/batch`` generate their engine flags from it (``minillm/cli.py``),
so an option is declared in one place. A field's own value is checked in ``__post_init__``;
whether options *combine* is the compatibility table's question (``compatibility.py``).
"""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from minillm.config.compatibility import Where, check_compatible
from minillm.config.memory import parse_memory
from minillm.config.model import DTYPES, ModelConfig, parse_dtype
from minillm.config.options import (
    ATTENTION_BACKENDS,
    DEPRECATED_MODES,
    EXECUTION_MODES,
    KV_CACHE_DTYPES,
    QUANTIZATION_METHODS,
    ROUTER_POLICIES,
    SCHEDULING_POLICIES,
    SPARSITY_METHODS,
    KVCacheDtype,
    SpeculativeConfig,
    check_int,
    check_quantization,
)
from minillm.machine import triton_available

WEIGHT_OFFLOAD = ("host", "disk")


def option(default: Any, help: str, *, flag: str | None = None, choices=None, parse=None, cli: bool = True,
           metavar: str | None = None):  # fmt: skip
    """A config field with its documentation and command-line flag. ``flag``: the flag's name
    (default ``--field-name``); for a ``True``-by-default bool, the flag that turns it off
    (``--no-...``); for ``compile``'s three states, ``auto``/``on``/``off``. ``parse``: turns the
    flag's text into the value (a ``ValueError`` is reported as a bad argument). ``cli=False``:
    not on the command line (the CLI has its own flag of that name, or it is for code only)."""
    meta = {"help": help, "flag": flag, "choices": choices, "parse": parse, "cli": cli, "metavar": metavar}
    return field(default=default, metadata=meta)


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as err:
        raise ValueError(f"not JSON ({err}): {text!r}") from None
    if not isinstance(value, dict):
        raise ValueError(f"expected a JSON object, got {text!r}")
    return value


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

    Choices left to ``auto``/``None`` (device, dtype, attention backend, compile) are resolved
    when the engine is built; ``LLMEngine.resolved`` says what they became and why.
    """

    device: str = option("auto", "cpu | cuda | auto (default: auto)")
    dtype: str = option("auto", "fp32 | bf16 | fp16 | auto (default: auto: the checkpoint's half type, bf16 on CPU)")
    max_model_len: int | None = option(None, "context limit (default: the model's)", parse=int)
    max_num_seqs: int = option(64, "most requests running at once", parse=int)
    mode: str = option("paged", "execution mode (kv_cache: old name of contiguous)",
                       choices=(*EXECUTION_MODES, *DEPRECATED_MODES))  # fmt: skip
    num_threads: int | None = option(None, "CPU threads for torch", flag="--threads", parse=int)
    # runtime/thread_governor.py: two threads on a 2-core laptop with one core taken by another
    # process decode ~5x slower than one thread (every parallel region waits for the descheduled one).
    adapt_threads: bool = option(True, "run steps on fewer CPU threads while other processes keep cores busy "
                                 "(Linux)", flag="--no-adapt-threads")  # fmt: skip
    seed: int = option(0, "the engine's seed (requests without their own seed draw from it)", cli=False)
    attention_backend: str = option("auto", "attention kernels (default: auto)", choices=ATTENTION_BACKENDS)
    cpu_prepack: bool = option(True, "oneDNN-prepacked linears on CPU where supported, else half-precision batches in fp32 (measured faster)",
                               flag="--no-cpu-prepack")  # fmt: skip
    # Compile the decode step: the paged engine's on CPU (runtime/compiled_decode.py: graphs compiled once
    # per machine and kept on disk), or the contiguous engine's steps (torch.compile at every start).
    compile: bool | None = option(
        None,
        "compiled CPU decode steps (auto: on for a paged CPU engine of a model with >= 64 MiB of weights "
        "where nothing rules it out; the first start on a machine compiles for minutes, later starts load "
        "the graphs from the cache)",
        choices=("auto", "on", "off"),
    )
    compile_batch_sizes: tuple[int, ...] | None = option(
        None, "the paged engine's compiled decode graphs, by the most rows each takes: a batch runs in the "
        "smallest that fits (a 1-row graph exactly; a larger one any row count up to its bound, or, over an 8-bit "
        "KV cache, padded up to it). Default: (256,), one graph for every batch of 1-256 rows — (1, 256) in bf16 "
        "on a CPU without AMX, where a 1-row graph decodes one row faster; (1, 8) over an 8-bit KV cache",
        cli=False,
    )
    quantization: str | None = option(
        None,
        "quantized linear layers: weight-only int8/int4/awq, or int8 weights and activations (default: none)",
        choices=QUANTIZATION_METHODS,
    )
    quantization_group_size: int | None = option(
        None, "int4 group size: 32 | 64 | 128 | 256 (default: 32, which keeps quality)", parse=int
    )
    sparsity: str | None = option(
        None,
        "prune the decoder's linear layers to 2 of every 4 weights, by magnitude or Wanda scores (default: none)",
        choices=SPARSITY_METHODS,
    )
    kv_cache_dtype: KVCacheDtype = option("auto", "KV pool storage (default: the model's dtype; int8/fp8 with "
                                          "scales)", choices=KV_CACHE_DTYPES)  # fmt: skip
    scheduling_policy: str = option("continuous", "batching policy", choices=SCHEDULING_POLICIES)
    block_size: int = option(16, "KV block size in tokens (paged mode)", parse=int)
    kv_cache_memory: int | float | None = option(
        None, "KV pool size: bytes (2e9, 2GB, 1.5GiB) or a fraction of free memory (0.5, 50%%)", parse=parse_memory
    )
    enable_prefix_caching: bool = option(True, "disable prefix caching", flag="--no-prefix-caching")
    enable_chunked_prefill: bool = option(True, "prefill whole prompts in one step", flag="--no-chunked-prefill")
    max_num_batched_tokens: int | None = option(
        None, "per-step token budget (default: 512 with chunked prefill, else 4096)", parse=int
    )
    batch_timeout: float = option(0.05, "seconds the dynamic policy waits for a full batch", cli=False)
    sliding_window: int | None = option(
        None, "attend to the last W keys only (overrides the model's own window)", cli=False
    )
    # None: on when CUDA and the Triton backend are both in use. True on a CPU runs the same padded path eagerly.
    cuda_graphs: bool | None = option(
        None, "decode steps as CUDA graphs, padded to captured batch sizes (paged + triton backend)", cli=False
    )
    # Per-step records (``engine.step_records``, read by run reports and the widgets) are kept
    # in a ring of this many steps, so a long-running server does not grow without bound.
    max_step_records: int | None = option(10_000, "per-step records kept (0: none; None: all)", cli=False)
    # vLLM's shape: {"method": "draft", "model": NAME_OR_PATH, "num_speculative_tokens": k} or
    # {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": n}. Checked into a
    # SpeculativeConfig (``speculative`` below).
    speculative_config: dict | None = option(
        None,
        "speculative decoding, as JSON: '{\"method\": \"ngram\", \"num_speculative_tokens\": 4}' or "
        "'{\"method\": \"draft\", \"model\": \"NAME_OR_PATH\", \"num_speculative_tokens\": 4}'",
        parse=_json_object,
    )
    # Parallelism (chapter 09): worker processes (gloo on CPU, NCCL on CUDA); the scheduler stays in
    # this process. kv_cache_memory is then per worker (each holds its K/V heads of its stage's
    # layers); a fraction is of the free memory each worker's share of the host (CPU) or of its GPU.
    tensor_parallel_size: int = option(1, "split every layer over this many worker processes", parse=int)
    pipeline_parallel_size: int = option(1, "split the layers into this many stages (processes)", parse=int)
    pipeline_microbatches: int | None = option(
        None, "micro-batches a pipeline cuts each step into (default: one per stage)", cli=False
    )
    # Data parallelism (chapter 09): ``LLM(model, data_parallel_size=N)`` runs N replicas of the
    # whole engine, each in its own process, behind a router (minillm/cluster/replicas.py); each
    # replica's own engine has data_parallel_size 1. ``minillm serve`` has its own flags of these names.
    data_parallel_size: int = option(1, "replicas of the whole engine, each in its own process", cli=False)
    router_policy: str | None = option(
        None, "how prompts are routed over the replicas (default with data_parallel_size > 1: prefix_aware)",
        choices=ROUTER_POLICIES, cli=False,
    )  # fmt: skip
    # The last resort when the weights do not fit (minillm/layers/offload.py).
    weight_offload: str | None = option(
        None,
        "stream the weights per layer: host (kept in host memory) or disk (memory-mapped from a file, CPU)",
        choices=WEIGHT_OFFLOAD,
    )

    def __post_init__(self) -> None:
        if self.mode in DEPRECATED_MODES:
            new = DEPRECATED_MODES[self.mode]
            warnings.warn(f"mode={self.mode!r} is deprecated; use mode={new!r}", DeprecationWarning, stacklevel=4)
            self.mode = new
        self._check_values()
        self.speculative = SpeculativeConfig.from_dict(self.speculative_config)
        check_compatible(self, Where.of(self))  # the rest once the builder has resolved device and backend

    def _check_values(self) -> None:
        """Each field on its own: types first, so a wrong one is named here rather than failing
        deep inside the engine; then ranges and the option lists."""
        required = ("max_num_seqs", "block_size", "tensor_parallel_size", "pipeline_parallel_size")
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
            check_int(name, getattr(self, name), low, optional=name not in required)
        check_int("seed", self.seed, 0)
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
        if sizes is not None and (
            not isinstance(sizes, tuple)
            or not sizes
            or any(isinstance(b, bool) or not isinstance(b, int) or not 1 <= b <= 256 for b in sizes)
        ):
            raise ValueError(f"compile_batch_sizes={sizes!r} must be a non-empty tuple of row counts from 1 to 256")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy={self.scheduling_policy!r}; expected one of {SCHEDULING_POLICIES}")
        self._check_memory()
        if self.dtype != "auto":
            parse_dtype(self.dtype)
        if self.quantization is not None and not isinstance(self.quantization, str):
            raise TypeError(f"quantization={self.quantization!r} must be a string or None")
        check_int("quantization_group_size", self.quantization_group_size, 1, optional=True)
        check_quantization(self.quantization, self.quantization_group_size)
        if self.sparsity is not None and self.sparsity not in SPARSITY_METHODS:
            raise ValueError(f"sparsity={self.sparsity!r}: expected one of {SPARSITY_METHODS} (or None)")
        self.kv_cache_dtype = KVCacheDtype(self.kv_cache_dtype)  # checked: ValueError naming the choices
        if self.world_size > 64:
            raise ValueError(
                f"tensor_parallel_size={self.tensor_parallel_size}, pipeline_parallel_size="
                f"{self.pipeline_parallel_size} asks for {self.world_size} worker processes; at most 64"
            )
        size = self.data_parallel_size
        if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= 64:
            raise ValueError(f"data_parallel_size={size!r} must be an integer from 1 to 64")
        if self.router_policy is not None and self.router_policy not in ROUTER_POLICIES:
            raise ValueError(f"router_policy={self.router_policy!r}; expected one of {ROUTER_POLICIES} (or None)")
        if self.weight_offload is not None and self.weight_offload not in WEIGHT_OFFLOAD:
            raise ValueError(f"weight_offload={self.weight_offload!r}: expected 'host', 'disk' or None")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend={self.attention_backend!r}; expected one of {ATTENTION_BACKENDS}")
        if self.attention_backend == "triton" and not triton_available():
            raise ValueError("attention_backend='triton' needs the triton package: pip install triton")

    def _check_memory(self) -> None:
        memory = self.kv_cache_memory
        if memory is None:
            return
        # An int is bytes, a float a fraction of free memory: 1 means one byte, 1.0 all of it.
        if isinstance(memory, bool) or not isinstance(memory, (int, float)):
            raise ValueError(f"kv_cache_memory={memory!r} must be bytes (int) or a fraction of free memory (float)")
        if isinstance(memory, float) and not 0.0 < memory <= 1.0:
            raise ValueError(f"kv_cache_memory={memory} as a fraction of free memory must be in (0, 1] (bytes are an int)")
        if isinstance(memory, int) and memory < 1:
            raise ValueError(f"kv_cache_memory={memory} bytes must be positive")

    @property
    def world_size(self) -> int:
        """Worker processes holding the model: ``tensor_parallel_size × pipeline_parallel_size``."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

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
