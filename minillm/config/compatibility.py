"""Which engine options combine, and why not: one table that the config, the builder and the
command line all read.

Each ``Rule`` names the options it concerns, says when a configuration breaks it, and gives the
reason a learner reads in the ``ValueError``. Some rules depend on what ``auto`` resolves to —
the device (``device="auto"`` is CUDA when there is a GPU) or the attention backend. Such a rule
is checked when the config is made if those are already known (given explicitly), and again by
the builder once it has resolved them (``Where``): the rule is written once either way.

The builder's defaults ask the same table: ``compile=None`` turns compile on only where no rule
refuses ``compile=True`` (``refusal(config, where, compile=True)``), so what is refused when
asked for and what is skipped by default can never disagree. ``python -m minillm.config`` prints
the table.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from minillm.config.options import KVCacheDtype


@dataclass(frozen=True)
class Where:
    """What the engine runs on, where known: ``device`` the device type ("cpu", "cuda"), and
    ``backend`` the attention backend ("sdpa", "cpu", "triton", ...); None: not resolved yet.
    ``deployment``: what is being built — "engine" (one ``LLMEngine``), "disaggregated" (a
    prefill and a decode worker, ``cluster/disagg.py``); None: not said (``LLM`` builds
    replicas for ``data_parallel_size`` > 1, else one engine)."""

    device: str | None = None
    backend: str | None = None
    deployment: str | None = None

    @classmethod
    def of(cls, config) -> Where:
        """What the config itself already says (explicit choices, not ``auto``)."""
        device = str(config.device).split(":")[0]
        backend = config.attention_backend
        return cls(None if device == "auto" else device, None if backend == "auto" else backend)


@dataclass(frozen=True)
class Rule:
    """``options`` do not combine when ``breaks(config, where)``; ``reason(config, where)`` says why."""

    options: tuple[str, ...]
    breaks: Callable[[Any, Where], bool]
    reason: Callable[[Any, Where], str]
    summary: str  # one line for the printed table


class _With:
    """``config`` seen with some fields replaced (``compile=True``), without re-validating it."""

    def __init__(self, config, changes: dict):
        self._config, self._changes = config, changes

    def __getattr__(self, name):
        if name in self._changes:
            return self._changes[name]
        return getattr(self._config, name)

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


def _sizes(c) -> str:
    return f"tensor_parallel_size={c.tensor_parallel_size}, pipeline_parallel_size={c.pipeline_parallel_size}"


_OFFLOAD_CLASHES = ("quantization", "sparsity", "speculative_config")


def _offload_clash(c) -> str | None:
    """The first option that weight offloading cannot be combined with, if any."""
    clash = [n for n in _OFFLOAD_CLASHES if getattr(c, n) is not None]
    if clash:
        return clash[0]
    return "compile" if c.compile else "tensor/pipeline parallelism" if c.world_size > 1 else None


#: Quantization methods that run under tensor parallelism (each rank quantizes its own slices).
TP_QUANTIZATION = ("int8", "int4")

RULES: tuple[Rule, ...] = (
    Rule(
        ("compile", "mode"),
        lambda c, w: bool(c.compile) and c.mode == "naive",
        lambda c, w: "compile=True needs mode='paged' or 'contiguous' (the naive engine has no decode step)",
        "compile needs a decode step: not with mode='naive'",
    ),
    Rule(
        ("cuda_graphs", "compile"),
        lambda c, w: bool(c.cuda_graphs and c.compile),
        lambda c, w: "compile=True and cuda_graphs=True are two decode fast paths (CPU, CUDA): choose one",
        "compile (CPU) and cuda_graphs (CUDA) are two decode fast paths: one at a time",
    ),
    Rule(
        ("cuda_graphs", "mode"),
        lambda c, w: bool(c.cuda_graphs) and c.mode != "paged",
        lambda c, w: f"cuda_graphs=True needs mode='paged' (got mode={c.mode!r})",
        "cuda_graphs replays the paged decode step: mode='paged' only",
    ),
    Rule(
        ("speculative_config", "mode"),
        lambda c, w: c.speculative_config is not None and c.mode != "paged",
        lambda c, w: f"speculative_config needs mode='paged' (got mode={c.mode!r})",
        "speculation rolls back paged blocks: mode='paged' only",
    ),
    Rule(
        ("sparsity", "compile"),
        lambda c, w: c.sparsity is not None and bool(c.compile),
        lambda c, w: f"sparsity={c.sparsity!r} cannot be combined with compile=True",
        "2:4 sparse weights are not compiled",
    ),
    Rule(
        ("kv_cache_dtype", "mode"),
        lambda c, w: KVCacheDtype(c.kv_cache_dtype).quantized and c.mode != "paged",
        lambda c, w: f"kv_cache_dtype={c.kv_cache_dtype!r} needs mode='paged' (got mode={c.mode!r})",
        "an 8-bit KV pool is a paged pool: mode='paged' only",
    ),
    Rule(
        ("tensor_parallel_size", "pipeline_parallel_size", "mode"),
        lambda c, w: c.world_size > 1 and c.mode != "paged",
        lambda c, w: f"{_sizes(c)} needs mode='paged' (got mode={c.mode!r})",
        "parallel workers hold paged pools: mode='paged' only",
    ),
    Rule(
        ("tensor_parallel_size", "pipeline_parallel_size", "speculative_config"),
        lambda c, w: c.world_size > 1 and c.speculative_config is not None,
        lambda c, w: f"speculative_config={c.speculative_config!r} cannot be combined with {_sizes(c)} yet",
        "speculation with parallel workers: not yet",
    ),
    Rule(
        ("tensor_parallel_size", "pipeline_parallel_size", "quantization"),
        lambda c, w: c.world_size > 1 and c.quantization not in (None, *TP_QUANTIZATION),
        lambda c, w: f"quantization={c.quantization!r} cannot be combined with {_sizes(c)} yet "
        f"(int8 and int4 can: each rank quantizes its own slices)",
        f"parallel workers quantize {' and '.join(TP_QUANTIZATION)} only",
    ),
    Rule(
        ("tensor_parallel_size", "pipeline_parallel_size", "sparsity"),
        lambda c, w: c.world_size > 1 and c.sparsity is not None,
        lambda c, w: f"sparsity={c.sparsity!r} cannot be combined with {_sizes(c)} yet",
        "2:4 sparsity with parallel workers: not yet",
    ),
    Rule(
        ("tensor_parallel_size", "pipeline_parallel_size", "compile", "cuda_graphs"),
        lambda c, w: c.world_size > 1 and bool(c.cuda_graphs or c.compile),
        lambda c, w: f"{'cuda_graphs=True' if c.cuda_graphs else 'compile=True'} cannot be combined with "
        f"{_sizes(c)} yet",
        "decode fast paths with parallel workers: not yet",
    ),
    Rule(
        ("weight_offload", *_OFFLOAD_CLASHES, "compile", "tensor_parallel_size"),
        lambda c, w: c.weight_offload is not None and _offload_clash(c) is not None,
        lambda c, w: f"weight_offload={c.weight_offload!r} cannot be combined with {_offload_clash(c)}",
        "offloaded weights stay plain and resident in one process: no quantization, sparsity, "
        "speculation, compile or parallel workers",
    ),
    Rule(
        ("weight_offload", "device"),
        lambda c, w: c.weight_offload == "disk" and w.device not in (None, "cpu"),
        lambda c, w: "weight_offload='disk' maps the weights for the CPU to read; use 'host' on a GPU",
        "weight_offload='disk' is for the CPU",
    ),
    Rule(
        ("attention_backend", "mode"),
        lambda c, w: c.attention_backend == "cpu" and c.mode != "paged",
        lambda c, w: f"attention_backend='cpu' is a paged decode kernel: it needs mode='paged' (got {c.mode!r})",
        "attention_backend='cpu' is a paged kernel: mode='paged' only",
    ),
    Rule(
        ("attention_backend", "device"),
        lambda c, w: c.attention_backend == "cpu" and w.device not in (None, "cpu"),
        lambda c, w: f"attention_backend='cpu' runs on the CPU, not on device={c.device!r}"
        + (f" (resolved to {w.device!r})" if str(c.device) == "auto" else ""),
        "attention_backend='cpu' runs on the CPU",
    ),
    Rule(
        ("attention_backend", "kv_cache_dtype"),
        lambda c, w: c.attention_backend == "cpu" and KVCacheDtype(c.kv_cache_dtype).quantized,
        lambda c, w: f"attention_backend='cpu' reads fp32/bf16/fp16 pools, not kv_cache_dtype={c.kv_cache_dtype!r}: "
        "use 'sdpa' (or 'auto')",
        "attention_backend='cpu' reads plain pools: kv_cache_dtype='auto' only",
    ),
    Rule(
        ("attention_backend", "mode"),
        lambda c, w: c.attention_backend == "triton" and c.mode != "paged",
        lambda c, w: f"attention_backend='triton' needs mode='paged' (got mode={c.mode!r})",
        "attention_backend='triton' is the paged engine's: mode='paged' only",
    ),
    Rule(
        ("compile", "device", "attention_backend"),
        lambda c, w: bool(c.compile) and c.mode == "paged" and (w.device not in (None, "cpu") or w.backend == "triton"),
        lambda c, w: "compile=True compiles the paged engine's decode step for the CPU; on CUDA the decode "
        "fast path is cuda_graphs=True (with attention_backend='triton')",
        "compile compiles the paged CPU decode step: not on CUDA or with attention_backend='triton'",
    ),
    Rule(
        ("cuda_graphs", "attention_backend"),
        lambda c, w: bool(c.cuda_graphs) and w.backend not in (None, "triton"),
        lambda c, w: f"cuda_graphs=True needs attention_backend='triton' (got {w.backend!r}): the graph "
        "replays the Triton decode kernels, whose shapes do not change between steps",
        "cuda_graphs replays the Triton kernels: attention_backend='triton' only",
    ),
    Rule(
        ("data_parallel_size", "tensor_parallel_size", "pipeline_parallel_size"),
        lambda c, w: c.data_parallel_size > 1 and c.world_size > 1,
        lambda c, w: f"data_parallel_size={c.data_parallel_size} cannot be combined with tensor/pipeline "
        f"parallelism yet ({_sizes(c)}): a replica's own workers would be children of a daemonic process",
        "replicas of parallel engines: not yet",
    ),
    Rule(
        ("router_policy", "data_parallel_size"),
        lambda c, w: c.router_policy is not None and c.data_parallel_size == 1,
        lambda c, w: f"router_policy={c.router_policy!r} needs data_parallel_size > 1 (one engine has nothing "
        "to route between)",
        "a router picks between replicas: data_parallel_size > 1 only",
    ),
    Rule(
        ("mode", "enable_prefix_caching", "kv_cache_dtype"),
        lambda c, w: w.deployment == "disaggregated"
        and (c.mode != "paged" or not c.enable_prefix_caching or KVCacheDtype(c.kv_cache_dtype).quantized),
        lambda c, w: "disaggregation lands the K/V in the decode worker's prefix cache: it needs mode='paged', "
        f"enable_prefix_caching=True and kv_cache_dtype='auto' (got mode={c.mode!r}, enable_prefix_caching="
        f"{c.enable_prefix_caching}, kv_cache_dtype={c.kv_cache_dtype!r})",
        "disaggregated workers hand K/V over through the prefix cache: paged, prefix caching on, plain pools",
    ),
    Rule(
        ("tensor_parallel_size", "pipeline_parallel_size", "speculative_config"),
        lambda c, w: w.deployment == "disaggregated" and (c.world_size > 1 or c.speculative_config is not None),
        lambda c, w: "disaggregation runs one whole model per worker: no tensor/pipeline parallelism, no speculation",
        "disaggregated workers are one whole model each: no parallel workers, no speculation",
    ),
    Rule(
        ("data_parallel_size",),
        lambda c, w: c.data_parallel_size > 1 and w.deployment in ("engine", "disaggregated"),
        lambda c, w: f"data_parallel_size={c.data_parallel_size} runs that many engines: "
        + ("LLMEngine is one engine — use LLM(model, data_parallel_size=N) offline, or minillm serve "
           "--data-parallel-size N" if w.deployment == "engine" else "a disaggregated pair is one engine of each kind"),
        "replicas are LLM's (or minillm serve's): not one LLMEngine, not a disaggregated pair",
    ),
    Rule(
        ("device",),
        lambda c, w: w.deployment == "disaggregated" and w.device not in (None, "cpu"),
        lambda c, w: "DisaggregatedLLM runs its workers on the CPU (gloo); device must be 'cpu'",
        "disaggregated workers run on the CPU",
    ),
)


def refusal(config, where: Where | None = None, **changes) -> str | None:
    """The reason the first rule broken by ``config`` (with ``changes``, e.g. ``compile=True``)
    gives, or None when every rule holds. Rules whose ``where`` is unknown yet hold for now."""
    where = where or Where.of(config)
    seen = _With(config, changes) if changes else config
    for rule in RULES:
        if rule.breaks(seen, where):
            return rule.reason(seen, where)
    return None


def check_compatible(config, where: Where | None = None) -> None:
    """``ValueError`` with the reason of the first rule ``config`` breaks."""
    reason = refusal(config, where)
    if reason is not None:
        raise ValueError(reason)


def table() -> str:
    """The rules as a plain-text table: options, and what the rule says."""
    return "\n".join(f"{r.summary}\n    ({', '.join(r.options)})" for r in RULES)
