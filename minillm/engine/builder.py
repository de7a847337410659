"""The one place that turns an ``EngineConfig`` into a working engine's parts.

Which scheduler, which runner, which KV cache, which attention backend, and which fast paths
(CPU weight prepacking, ``torch.compile``, CUDA graphs) — every such decision is made here,
once, so the engine's step loop never asks what mode it is in:

    naive       Scheduler(static) + NoBlockPool  + NaiveRunner
    contiguous  Scheduler(static) + NoBlockPool  + ContiguousRunner   (+ compile)
    paged       Scheduler(policy) + BlockManager + PagedRunner + PagedKVCache (+ CUDA graphs | compiled decode)
    parallel    Scheduler(policy) + BlockManager + DistributedRunner (shards and pools in workers)
"""

from __future__ import annotations

import os
import sys
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.distributed as dist

from minillm.assets import cache_dir, resolve_model
from minillm.attention.cpu_paged import kernel_unavailable_reason, start_building
from minillm.attention.precision import decode_attention_dtype as measured_choice
from minillm.config import EngineConfig, KVCacheDtype, ModelConfig, Where, check_compatible, environment, refusal
from minillm.engine.scheduler import Scheduler
from minillm.kvcache.addressing import blocks_for, kv_bytes_per_token
from minillm.kvcache.block_manager import BlockManager
from minillm.kvcache.paged import PagedKVCache
from minillm.kvcache.unpaged import NoBlockPool
from minillm.layers.cpu_prepack import release_plain_weights
from minillm.layers.tensor_parallel import heads_of_rank, stage_layers
from minillm.machine import triton_available
from minillm.models import load_model
from minillm.models.llama import LlamaForCausalLM
from minillm.parallel.executor import DistributedRunner, InProcessRunner
from minillm.parallel.worker import ShardSpec, ShardWorker, shard_quantization
from minillm.runtime.background_compile import BackgroundBuild, CompileJob, load_packages_on_disk
from minillm.runtime.compiled_decode import CompiledDecode
from minillm.runtime.contiguous_runner import ContiguousRunner
from minillm.runtime.cuda_graphs import DecodeGraphs
from minillm.runtime.fast_path import DecodeFastPath
from minillm.runtime.model_setup import configure_model
from minillm.runtime.naive_runner import NaiveRunner
from minillm.runtime.paged_runner import PagedRunner
from minillm.runtime.runner import ModelRunner
from minillm.runtime.thread_governor import configured_threads
from minillm.speculative.draft_model import DraftModelProposer, check_same_tokenizer
from minillm.speculative.eagle import EagleProposer, load_eagle_head
from minillm.speculative.speculator import NoSpeculation, Speculator
from minillm.tokenizer import Tokenizer

CPU_DEFAULT_KV_BYTES = 1 << 30


@dataclass
class EngineParts:
    scheduler: Scheduler
    runner: ModelRunner
    attention_backend: str
    block_manager: BlockManager | None = None  # the paged pool's
    kv_cache: PagedKVCache | None = None
    graphs: DecodeFastPath | None = None  # the decode fast path, if any
    speculator: Speculator | NoSpeculation = field(default_factory=NoSpeculation)
    resolved: Resolved | None = None  # what the engine's auto choices became


@dataclass(frozen=True)
class Decision:
    """A default decided for this engine, and why (truthy when on)."""

    on: bool
    reason: str

    def __bool__(self) -> bool:
        return self.on


@dataclass
class Resolved:
    """What an engine actually runs, after every ``auto``/``None`` choice was made — so a
    learner can print it (``LLMEngine.resolved``) rather than guess from the defaults."""

    device: str
    dtype: str
    attention_backend: str
    decode_attention_dtype: str  # what paged decode attention computes in
    compile: bool
    compile_reason: str
    decode_fast_path: str  # "compiled (256,)", "cuda graphs", or "none (eager)"
    kv_cache_dtype: KVCacheDtype
    num_kv_blocks: int | None  # the paged pool's, in this process (None: no pool here)
    # speculative decoding: the method, and how many tokens it proposes — what the governor has
    # measured to pay at each batch size so far (speculative/governor.py), updated as it runs
    speculation: str = "off"
    # the declared environment variables that are set, with where each value came from
    # (config/environment.py): MINILLM_COMPILE=0 explains compile=False, for one
    environment: str = field(default_factory=environment.describe)

    def __str__(self) -> str:
        rows = [(k, getattr(self, k)) for k in self.__dataclass_fields__]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:{width}s}  {v}" for k, v in rows)


def free_memory_bytes(device: torch.device) -> int | None:
    """Memory free for the KV pool right now: CUDA's free memory, or the OS's available RAM
    (None where the OS does not say, e.g. without /proc or ``SC_AVPHYS_PAGES``)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def prepare_process() -> None:
    """The process-wide set-up an engine needs, done when the first is built (importing minillm
    sets nothing): Triton's interpreter where there is no GPU (``environment.choose_triton_mode``),
    and inductor's on-disk cache in the project's cache folder — set before anything
    asks inductor for its folder (it fixes the default on first use) — so the minute a compile
    costs is paid once per machine, not once per start (``runtime/compiled_decode.py``). A
    folder the user chose is kept (``config/environment.py``)."""
    environment.set_default("TORCHINDUCTOR_CACHE_DIR", str(cache_dir() / "inductor"))
    environment.choose_triton_mode()  # before a compile or the kernel's build imports triton


def start_kernel_build(config: EngineConfig, device: torch.device) -> None:
    """Start building the CPU decode kernel now when ``resolve_backend`` may pick it (the paged
    CPU engine on one process, ``auto`` or ``cpu`` backend, a plain pool): on a cold cache its
    build takes seconds, which then pass while the tokenizer and the weights load."""
    wanted = config.attention_backend == "cpu" or (config.attention_backend == "auto" and not config.kv_cache_dtype.quantized)
    if wanted and device.type == "cpu" and config.mode == "paged" and config.world_size == 1:
        start_building()


def resolve_backend(config: EngineConfig, device: torch.device) -> str:
    """``auto`` → ``triton`` for the paged engine on CUDA (when Triton is installed; its kernels
    read an 8-bit pool too), ``cpu`` for the paged engine on CPU with a plain pool (when its C++
    decode kernel builds here: else a warning, and ``sdpa``), else ``sdpa``."""
    if config.attention_backend == "cpu":
        check_compatible(config, Where(device.type, "cpu"))
        reason = kernel_unavailable_reason()
        if reason:
            raise RuntimeError(f"attention_backend='cpu': the C++ decode kernel did not build here ({reason})")
    if config.attention_backend != "auto":
        return config.attention_backend
    if config.mode != "paged" or device.type not in ("cpu", "cuda"):
        return "sdpa"
    if device.type == "cuda":
        return "triton" if triton_available() else "sdpa"
    if config.kv_cache_dtype.quantized:  # the kernel reads plain pools; the reference dequantizes 8-bit ones
        return "sdpa"
    reason = kernel_unavailable_reason()
    if reason:
        warnings.warn(
            f"the CPU paged decode kernel did not build ({reason}); using attention_backend='sdpa'", stacklevel=3
        )
        return "sdpa"
    return "cpu"


def build_engine_parts(
    config: EngineConfig,
    model: LlamaForCausalLM,
    model_config: ModelConfig,
    max_model_len: int,
    window: int | None,
    tokenizer=None,
    model_dir: str | Path | None = None,
) -> EngineParts:
    """Configure ``model`` (backend, window, fast paths) and build what runs it. ``model_dir``:
    the checkpoint ``model`` was loaded from, for a background compile to rebuild it from (without
    one, a compiled decode step is built in this process before the engine starts)."""
    device, dtype = model.device, model.dtype
    backend = resolve_backend(config, device)
    check_compatible(config, Where(device.type, backend))  # the rules that needed the device and backend
    compile_by_choice = config.compile is not None  # else a default: a failed compile falls back to eager
    decision = Decision(bool(config.compile), "asked for (compile=True)" if config.compile else "compile=False")
    if not compile_by_choice:
        decision = compile_by_default(config, model, backend)
        config = replace(config, compile=decision.on)
    attention_dtype = decode_attention_dtype(config, model_config, device, dtype)
    configure_model(model, config, backend, window, attention_dtype, tokenizer)

    def resolved(graphs=None, num_blocks=None) -> Resolved:
        return resolve_choices(config, decision, device, dtype, backend, attention_dtype, graphs, num_blocks)

    if config.mode != "paged":  # one static batch at a time, whole prompts, no pool to manage
        runner = NaiveRunner(model) if config.mode == "naive" else ContiguousRunner(model)
        unbounded = config.max_num_seqs * max_model_len
        scheduler = Scheduler(NoBlockPool(), "static", config.max_num_seqs, unbounded, enable_chunked_prefill=False)
        return EngineParts(scheduler, runner, backend, resolved=resolved())
    num_blocks = num_kv_blocks(config, model_config, max_model_len, device, dtype)  # after the weights loaded
    block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
    kv_cache = PagedKVCache(model_config, num_blocks, config.block_size, dtype, device, config.kv_cache_dtype)
    scheduler = paged_scheduler(config, block_manager, window)
    graphs = decode_fast_path(config, model, kv_cache, backend, max_model_len, window, compile_by_choice,
                              model_dir, attention_dtype)  # fmt: skip
    runner = PagedRunner(model, kv_cache, window, graphs)
    speculator = build_speculator(config, model_config, tokenizer, device, dtype, max_model_len, num_blocks, backend,
                                  model)  # fmt: skip
    parts = EngineParts(scheduler, runner, backend, block_manager, kv_cache, graphs, speculator)
    parts.resolved = resolved(graphs, num_blocks)
    return parts


def resolve_choices(config: EngineConfig, decision: Decision, device: torch.device, dtype: torch.dtype, backend: str,
                    attention_dtype, graphs, num_blocks: int | None) -> Resolved:  # fmt: skip
    """What the built engine runs; a default compile that failed (no graphs) reads as off, with why."""
    if decision.on and config.mode == "paged" and not isinstance(graphs, CompiledDecode):
        decision = Decision(False, "the compile failed; running eagerly (see the warning)")
    return Resolved(
        device=str(device),
        dtype=str(dtype).removeprefix("torch."),
        attention_backend=backend,
        decode_attention_dtype=str(attention_dtype or dtype).removeprefix("torch."),
        compile=decision.on,
        compile_reason=decision.reason,
        decode_fast_path=fast_path_name(graphs, config),
        kv_cache_dtype=config.kv_cache_dtype,
        num_kv_blocks=num_blocks,
    )


def fast_path_name(graphs, config: EngineConfig | None = None) -> str:
    """How pure decode steps run, in words."""
    if config is not None and config.mode == "contiguous" and config.compile:
        return "torch.compile (the contiguous engine's steps)"
    if isinstance(graphs, CompiledDecode):
        return f"compiled {graphs.batch_sizes}"
    if isinstance(graphs, DecodeGraphs):
        return "cuda graphs" if graphs.capture else "static padded steps (cuda_graphs on a CPU)"
    return "none (eager)"


def paged_scheduler(config: EngineConfig, block_manager: BlockManager, window: int | None) -> Scheduler:
    """The paged engine's scheduler over ``block_manager``, as ``config`` asks."""
    return Scheduler(
        block_manager,
        policy=config.scheduling_policy,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.token_budget,
        enable_chunked_prefill=config.enable_chunked_prefill,
        batch_timeout=config.batch_timeout,
        window=window,
    )


def build_parallel_parts(
    config: EngineConfig, model_config: ModelConfig, model_dir, max_model_len: int, window: int | None
) -> EngineParts:
    """The scheduler and block manager here; the model, split ``tensor_parallel_size`` ×
    ``pipeline_parallel_size`` ways, in worker processes (``minillm.parallel``). Every rank's
    pool has the same number of blocks — as many as the fullest rank's share of ``kv_cache_memory``
    holds — so a block id means the same slot on every rank."""
    device = config.resolve_device()
    dtype = config.resolve_dtype(model_config, device)
    tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
    kv_heads = max(len(heads_of_rank(model_config.num_heads, model_config.num_kv_heads, r, tp)[1]) for r in range(tp))
    layers = max(len(stage_layers(model_config.num_layers, pp, s)) for s in range(pp))
    if device.type == "cuda" and torch.cuda.device_count() < config.world_size:
        raise ValueError(f"{config.world_size} workers need as many GPUs; this machine has {torch.cuda.device_count()}")
    shard_config = replace(model_config, num_kv_heads=kv_heads, num_layers=layers)
    # Worker pools on one host share its memory; on GPUs each has its own device (measured here
    # before the shards load: a GPU's weights are not yet subtracted — see the README's limits).
    share = config.world_size if device.type == "cpu" else 1
    num_blocks = num_kv_blocks(config, shard_config, max_model_len, device, dtype, share)
    block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
    scheduler = paged_scheduler(config, block_manager, window)
    backend = resolve_backend(config, device)
    check_compatible(config, Where(device.type, backend))
    group = config.quantization_group_size
    if config.quantization is not None:  # refused here, naming the layer and slice, not inside a worker
        group = shard_quantization(model_config, tp, config.quantization, group)
    spec = ShardSpec(
        model_dir=str(model_dir),
        dtype=str(dtype).removeprefix("torch."),
        device=str(device),
        max_model_len=max_model_len,
        window=window,
        attention_backend=backend,
        cpu_prepack=config.cpu_prepack,
        num_blocks=num_blocks,
        block_size=config.block_size,
        kv_cache_dtype=config.kv_cache_dtype,
        tp_size=tp,
        pp_size=pp,
        num_microbatches=config.pipeline_microbatches or pp,
        threads=config.num_threads or max(1, (os.cpu_count() or 1) // config.world_size),
        quantization=config.quantization,
        quantization_group_size=group,
    )
    comm = "nccl" if device.type == "cuda" else "gloo"
    if launched_by_torchrun():
        runner = _join_torchrun(spec, comm)
    else:
        runner = DistributedRunner(spec, backend=comm)
    reason = refusal(config, Where(device.type, backend), compile=True) or "not with parallel workers"
    resolved = resolve_choices(config, Decision(False, reason), device, dtype, backend, None, None, num_blocks)
    resolved.decode_fast_path = "none (eager, in the workers)"
    return EngineParts(scheduler, runner, backend, block_manager, resolved=resolved)


def launched_by_torchrun() -> bool:
    """``torchrun`` (torch.distributed.run) started this process as one of several ranks."""
    return environment.is_set("TORCHELASTIC_RUN_ID") and int(environment.get("WORLD_SIZE")) > 1


def _join_torchrun(spec, comm: str):
    """Every rank runs the same program; here they part ways. Rank 0 keeps the engine (driver
    and rank 0 in one process); every other rank serves steps inside this call and, when rank
    0 closes its engine, exits — so a script's later lines run on rank 0 only."""
    world, rank = int(environment.get("WORLD_SIZE")), int(environment.get("RANK"))
    if world != spec.world_size:
        raise ValueError(
            f"torchrun started {world} processes but tensor_parallel_size x pipeline_parallel_size = {spec.world_size}"
        )
    if not dist.is_initialized():
        dist.init_process_group(comm)  # address, port, rank and size from torchrun's environment
    worker = ShardWorker(spec, rank)
    if rank == 0:
        return InProcessRunner(worker)
    worker.gather_descriptions()
    worker.serve()
    dist.destroy_process_group()
    sys.exit(0)


def build_speculator(config: EngineConfig, model_config: ModelConfig, tokenizer, device, dtype, max_model_len: int,
                     num_blocks: int, backend: str, target=None) -> Speculator | NoSpeculation:  # fmt: skip
    """``speculative_config`` → the proposer and verifier. The draft model's pool gets as many
    blocks as the target's plus room for every sequence's k look-ahead tokens."""
    spec = config.speculative
    if spec is None:
        return NoSpeculation()
    draft = None
    if spec.method == "draft":
        folder = resolve_model(spec.model)
        draft_config = ModelConfig.from_folder(folder)
        check_same_tokenizer(Tokenizer(folder), tokenizer, draft_config, model_config, spec.model)
        if draft_config.max_position_embeddings < max_model_len:
            raise ValueError(
                f"speculative_config model={spec.model!r} handles {draft_config.max_position_embeddings} positions, "
                f"fewer than the target's max_model_len={max_model_len}: lower max_model_len"
            )
        model = load_model(folder, dtype, device, max_positions=max_model_len)
        draft_weights = EngineConfig(cpu_prepack=config.cpu_prepack, quantization=spec.quantization)
        configure_model(model, draft_weights, backend, model.sliding_window, tokenizer=Tokenizer(folder))
        extra = config.max_num_seqs * blocks_for(spec.num_speculative_tokens + 1, config.block_size)
        draft = DraftModelProposer(model, draft_config, config.block_size, num_blocks + extra)
    elif spec.method == "eagle":
        draft = EagleProposer(load_eagle_head(resolve_model(spec.model), target))
    return Speculator(spec, max_model_len, draft)


def num_kv_blocks(
    config: EngineConfig, model_config: ModelConfig, max_model_len: int, device: torch.device, dtype, share: int = 1
) -> int:
    """Blocks in the pool: ``kv_cache_memory`` bytes, or that fraction of free memory, never
    more than the device has free (a pool that cannot be allocated is an error now, not an
    out-of-memory crash later). ``share``: pools that will split this memory (parallel workers
    on one host), so each counts 1/share of what is free."""
    block_bytes = config.block_size * kv_bytes_per_token(model_config, dtype, config.kv_cache_dtype)
    memory = config.kv_cache_memory
    available = free_memory_bytes(device)
    if available is not None:
        available //= share
    if available is None and isinstance(memory, float):
        raise ValueError(f"kv_cache_memory={memory}: this system does not report free memory; give bytes instead")
    if isinstance(memory, float):
        budget = int(memory * available)
    elif isinstance(memory, int):
        budget = memory
        if available is not None and budget > available:
            raise ValueError(
                f"kv_cache_memory={memory} bytes asks for more than the {available:,} bytes free on {device}"
                + (f" for each of {share} workers" if share > 1 else "")
                + " (pass fewer bytes, or a fraction such as 0.5)"
            )
    elif device.type == "cuda":
        budget = int(0.9 * available)
    else:
        full = config.max_num_seqs * blocks_for(max_model_len, config.block_size) * block_bytes
        budget = min(full, CPU_DEFAULT_KV_BYTES, available // 2 if available is not None else full)
    num_blocks = budget // block_bytes
    if num_blocks < 1:
        raise ValueError(
            f"kv_cache_memory={memory!r} gives {budget} bytes, less than one KV block "
            f"({block_bytes} bytes = {config.block_size} tokens x {block_bytes // config.block_size} bytes/token)"
        )
    return num_blocks


def decode_attention_dtype(config: EngineConfig, model_config: ModelConfig, device, dtype) -> torch.dtype | None:
    """fp32 decode attention over a half-precision pool where this CPU computes it faster
    (measured once per machine: ``attention/precision.py``); None: the model's dtype."""
    if config.mode != "paged" or config.attention_backend == "triton":
        return None
    heads, kv_heads = model_config.num_heads, model_config.num_kv_heads
    choice = measured_choice(dtype, device, heads, kv_heads, model_config.head_dim)
    return None if choice == dtype else choice


# The smallest model (weight bytes) compiled by default. The course's tiny models decode fast enough
# eagerly that the first start's compile is not repaid in a notebook: tiny-shakespeare-8m in fp32
# (32 MB) decodes 237 tok/s eager and 1188 compiled at batch 1 on 2 cores, but compiles for 82 s —
# ~24,000 tokens before it pays (benchmarks/results/generate-tiny-shakespeare-8m-*).
COMPILE_BY_DEFAULT_MIN_BYTES = 64 * 2**20


def compile_by_default(config: EngineConfig, model, backend: str) -> Decision:
    """``compile=None``: compile the paged engine's decode steps on CPU (their graphs are kept on
    disk, so only the first start on a machine pays) where the compatibility table allows
    ``compile=True`` with the rest of the config, the weights are a kind measured faster compiled,
    and the model is big enough to repay the compile — unless ``MINILLM_COMPILE=0``."""
    if environment.get("MINILLM_COMPILE") == "0":
        return Decision(False, "MINILLM_COMPILE=0")
    if config.mode != "paged":
        return Decision(False, f"compile by default covers the paged engine's decode steps (mode={config.mode!r})")
    if config.cuda_graphs:
        return Decision(False, "cuda_graphs=True is this engine's decode fast path")
    refused = refusal(config, Where(model.device.type, backend), compile=True)
    if refused is not None:
        return Decision(False, refused)
    # Every quantized method compiles (compile=True); on by default where measured faster than eager:
    # int8 and int4 (benchmarks/results/generate-int8-*, generate-int4-*). AWQ and W8A8: not measured.
    if config.quantization not in (None, "int8", "int4"):
        return Decision(False, f"quantization={config.quantization!r} compiles when asked (compile=True) but "
                               "is not measured faster compiled, so not by default")  # fmt: skip
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    if weight_bytes < COMPILE_BY_DEFAULT_MIN_BYTES:
        return Decision(False, f"{weight_bytes / 2**20:.0f} MiB of weights decode fast enough eagerly: a compile "
                               f"is repaid only from {COMPILE_BY_DEFAULT_MIN_BYTES // 2**20} MiB")  # fmt: skip
    return Decision(True, "the default for the paged CPU engine (compile=False turns it off)")


def decode_fast_path(
    config: EngineConfig,
    model,
    kv_cache,
    backend: str,
    max_model_len: int,
    window,
    compile_by_choice: bool = True,
    model_dir: str | Path | None = None,
    attention_dtype: torch.dtype | None = None,
) -> DecodeFastPath | None:
    """Pure decode steps through CUDA graphs (CUDA + Triton) or compiled (CPU), else eager.

    A compiled step is built in the background (``runtime/background_compile.py``) when the
    checkpoint's ``model_dir`` is known (a worker rebuilds the model from it, set up the same way:
    ``attention_dtype`` as ``configure_model`` got it), so the engine answers eagerly at once;
    else here, before the engine starts. ``compile_by_choice=False``: compiling is only the default, so if it
    cannot start (a course hook the graph would trace is overridden) the engine warns and runs
    eagerly instead of refusing to start."""
    if config.compile:  # the paged CPU engine's (the compatibility table refused the rest)
        compute_dtype = model.attention_backend.decode_dtype or kv_cache.dtype  # as StaticDecodeStep computes
        compiled = CompiledDecode(model, kv_cache, window, compute_dtype, config.compile_batch_sizes)
        try:
            compiled.check_hooks()
            if model_dir is None:
                compiled.prepare()
            else:
                paths = {b: str(p) for b, p in compiled.package_paths().items()}
                job = CompileJob(str(model_dir), config, model.dtype, backend, window, attention_dtype, compute_dtype,
                                 max_model_len, compiled.batch_sizes, configured_threads(), paths)  # fmt: skip
        except Exception as error:
            if compile_by_choice:
                raise
            warnings.warn(
                f"minillm: compiling the decode step failed ({type(error).__name__}: {error}); running it eagerly "
                "(compile=False skips the attempt)",
                stacklevel=2,
            )
            compiled = None
        if compiled is not None and model_dir is not None:
            load_packages_on_disk(compiled, job)
            compiled.build = BackgroundBuild(compiled, job)  # releases the plain weights when it is done
        else:
            release_plain_weights(model)
        return compiled
    wanted = config.cuda_graphs
    if wanted is None:
        wanted = kv_cache.k.device.type == "cuda" and backend == "triton"
    if not wanted:
        return None
    graphs = DecodeGraphs(
        model, kv_cache, config.max_num_seqs, max_model_len, window, capture=kv_cache.k.device.type == "cuda"
    )
    if graphs.capture:
        graphs.capture_all()
    return graphs
