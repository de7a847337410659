"""The paged engine's decode steps compiled ahead of time (CPU), kept on disk, loaded in a second.

Eagerly, one decode step of a small model is ~500 small PyTorch operations around its matrix
products; on a laptop CPU their dispatch overhead is as large as the useful work, and
oneDNN's bf16 GEMV reads the weights well below the memory bandwidth. Compiling with
*freezing* and *max-autotune* fixes both at once: the weights are folded into the graph as
constants, inductor packs them for its own generated C++ GEMM micro-kernels (picked by timing
each shape), and the operations around them fuse into a few loops.

A compiled graph is traced for fixed shapes, while a paged step's shapes change every step
(ragged batches, growing contexts). So the compiled step reads a *static* layout: each row's
blocks as a window ``block_tables[B, W]`` padded with the null block, and its length as a
tensor. The window width ``W`` is a dynamic dimension — one graph serves every context length.
There is one graph per bound in ``batch_sizes``, and a batch runs in the smallest graph that
fits. By default there is one, for every batch of 1-256 rows (and, in bf16 on a CPU without AMX,
a 1-row graph beside it: ``default_batch_sizes``): its row count is a dynamic
dimension too (inductor's generated GEMMs handle it; a single row is padded to two, the
fewest a free dimension takes), and its rows attend *in place* through the C++ paged kernel,
called inside the graph as an operator (``minillm::paged_decode``, ``StaticKernelDecodeStep``):
each row over exactly its own keys. Graphs of 8, 16, ... rows attending over the window lost to
it (``benchmarks/results/compiled-rows-*``): they made every row pay for the longest and every
batch pad up to a fixed row count. A 1-row graph attending in plain PyTorch over the window
(gather → matmul → mask → softmax → matmul, ``StaticDecodeStep``; what a graph bounded at 1 row
does) decoded one row slower with AMX and faster without it, hence the CPU-dependent default.
Over an 8-bit pool, which the kernel does not read, graphs still attend over the window, and
batches are padded: by default a 1-row and an 8-row graph there.

On a CPU with AVX-512 BF16 and no AMX (AMD Zen 4 and later), the free-row graphs of a bf16
model also multiply through our own kernel (``layers/cpu_bf16_rows.py``, an operator in the
graph): the compiler's GEMMs for a few rows there compute in fp32 or call oneDNN's small-M path.
SmolLM2-135M on an AMD EPYC (Zen 4, 2 threads), median TPOT of 3 alternating rounds: 2 rows 18.1
→ 12.9 ms, 4 rows 16.9 → 14.0, 8 rows 22.0 → 18.4 (1.40×, 1.17×, 1.19× by the rounds' ratios);
16 rows 34.1 → 33.3, rounds 1.02-1.24× (``benchmarks/bench_bf16_rows.py``, ``results/bf16-rows-2026-12-07-*``).

Speculative decoding's verify steps run here too: a verify chunk (a sequence's last token and
its k proposals, logits wanted at each) becomes k + 1 decode rows of that sequence, each at its
own position with its own context length (``fast_path.token_rows``), so speculation stacks on
the compiled step instead of turning it off.

Prompt steps stay eager: they are dominated by large matrix products. Quantized linear layers
compile too: their matmuls (``_weight_int8pack_mm`` for int8, ``_weight_int4pack_mm_for_cpu``
for int4 and AWQ in bf16, W8A8's int8 × int8 product) are calls inside the graph, with the
quantized weights folded in as constants. (An fp32 int4 layer dequantizes before its product —
``quantization/int4.py`` says why — and the compiler folds that into an fp32 constant: the graph
of an fp32 int4 engine holds dense weights.)

The graphs are compiled with AOTInductor (``torch.export`` + ``aoti_compile_and_package``)
into a package file under ``<cache>/compiled/``, named by a digest of everything the compiled
code depends on — the weights, the pool's dtype and head layout, the block size, the sliding window,
the attention's compute dtype, the CPU, the thread count, torch's version and minillm's own
source. An engine never waits for them: it answers eagerly while a low-priority worker process
compiles the missing packages (``background_compile.py``, ``compile_worker.py``; 87-102 s
for SmolLM2-135M's one graph in bf16, Intel Xeon, 2 cores, one run each of ``minillm warmup``
and ``benchmarks/bench_first_start.py``), and swaps each graph in
at a step boundary as it loads (~1-2 s per package on a warm machine; ``benchmarks/bench_first_start.py``).
(``torch.compile``'s own on-disk cache cannot keep a frozen graph whose
constants are oneDNN-packed weights, so it would recompile at every start.)

The KV pool is an input of the compiled graph, written in place, and its number of slots is a
free dimension, so one package serves every engine of that model and block size, whatever its
pool size (``max_num_seqs``, ``max_model_len``, ``kv_cache_memory``). Each package holds its
own copy of the frozen weights (~270 MB for SmolLM2-135M in bf16, on disk and in memory); only
the ``KEEP_PACKAGES`` most recently used packages are kept on disk.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import sys
import threading
import time
import warnings
from pathlib import Path

import torch

import minillm.hooks as hooks
from minillm import native_build, trusted_cache
from minillm.assets import cache_dir
from minillm.attention import cpu_paged
from minillm.attention.cpu_paged import POOL_DTYPES  # also declares the kernel's operator
from minillm.attention.layout import KVPool, StepLayout
from minillm.kvcache import addressing
from minillm.kvcache.paged import PagedKVCache
from minillm.layers import cpu_bf16_rows
from minillm.layers.exact_top import refine_top_logits
from minillm.machine import machine_description
from minillm.models.llama import LlamaForCausalLM
from minillm.native_build import isa_on_this_thread
from minillm.runtime.block_table_rows import BlockTableRows
from minillm.runtime.fast_path import pad_decode_rows, pad_table_rows, runs_as_rows, token_rows
from minillm.runtime.runner import ChunkInput, long_tensor
from minillm.runtime.thread_governor import configured_threads

# The narrowest block window compiled: the tracer specialises dynamic sizes 0 and 1.
MIN_WINDOW = 2
# The fewest rows of a graph with a free row count (the tracer specialises sizes 0 and 1), and
# the row count it is autotuned for (inductor picks each GEMM's kernel for an example size).
MIN_ROWS = 2
ROW_HINT = 8
MAX_WINDOW = 2**20  # blocks per row: far beyond any context a CPU decodes
MAX_POOL_BLOCKS = 2**31 // 1024  # slots stay int32-indexable for block sizes up to 1024
# One graph for every batch of 1-256 rows (a single row is padded to MIN_ROWS). Whether a 1-row
# graph over the window beside it decodes one row faster depends on the CPU, measured in bf16 by
# benchmarks/bench_compiled_rows.py (TPOT at batch 1, one graph against 1-row graph): Intel Xeon
# with AMX 18.7 against 28.6 ms (2026-12-02), AMD EPYC Zen 4 without AMX 15.4 against 11.6 ms
# (2026-12-05). So a bf16 engine on a CPU without AMX gets both (``default_batch_sizes``).
BATCH_SIZES = (256,)
NO_AMX_BATCH_SIZES = (1, 256)
WINDOW_BATCH_SIZES = (1, 8)  # over an 8-bit pool, whose graphs pad a batch up to their row count


def cpu_has_amx() -> bool:
    """Whether this CPU has AMX's bf16 tiles (Intel Xeon since Sapphire Rapids; not the usual
    laptop CPU)."""
    caps = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
    return bool(caps.get("amx_bf16", False))


def attends_in_place(cache: PagedKVCache) -> bool:
    """Whether graphs over ``cache`` can attend in place through the C++ kernel (an operator in
    the graph), which reads the model's own pool dtypes but not an 8-bit pool."""
    return not cache.kv_cache_dtype.quantized and cache.dtype in POOL_DTYPES


def default_batch_sizes(cache: PagedKVCache) -> tuple[int, ...]:
    """The graphs an engine compiles when ``compile_batch_sizes`` is not given (see ``BATCH_SIZES``):
    over an 8-bit pool a 1-row and an 8-row window graph; else one 1-256-row graph, and for a
    bf16 pool on a CPU without AMX a 1-row graph beside it (one more package to compile and to
    hold in memory — about the weights' size — for a ~1.3× faster single row there)."""
    if not attends_in_place(cache):
        return WINDOW_BATCH_SIZES
    if cache.dtype == torch.bfloat16 and not cpu_has_amx():
        return NO_AMX_BATCH_SIZES
    return BATCH_SIZES
KEEP_PACKAGES = 6  # newest package files kept in <cache>/compiled (each holds the model's weights)

INDUCTOR_OPTIONS = {
    # Fold the weights in as constants, packed for the generated GEMMs.
    "freezing": True,
    # Time inductor's generated C++ GEMMs against ATen's for every weight shape, keep the fastest.
    "max_autotune": True,
    "max_autotune_gemm_backends": "CPP,ATEN",
    # Round half-precision intermediates where eager PyTorch does, so the compiled step's
    # numbers stay close to the eager engine's.
    "emulate_precision_casts": True,
    # Compile quietly: the autotuner's per-shape timing tables are for compiler developers.
    "max_autotune_report_choices_stats": False,
    "autotune_num_choices_displayed": 0,
}


def packages_dir() -> Path:
    return cache_dir() / "compiled"


#: The hooks a compiled decode step traces into its graph (attention's K/V gather, the 8-bit
#: pool's quantize-on-write, the reference attention): their implementation is fixed at compile time.
TRACED_HOOKS = ("gather_kv", "quantize_kv", "torch_attention")


class CompiledDecode:
    """Pure decode steps of up to ``max(batch_sizes)`` rows through compiled graphs, one per
    batch size (a batch is padded up to the next one): a ``DecodeFastPath``."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        cache: PagedKVCache,
        window: int | None,
        compute_dtype: torch.dtype,
        batch_sizes: tuple[int, ...] | None = None,
    ):
        # Rows attend in place through the C++ kernel, an operator in the graph, in every graph
        # bounded above MIN_ROWS — which then takes any row count up to its bound (``free_rows``). Not over an
        # 8-bit pool, which the kernel does not read: those graphs attend over a window, padded.
        self.in_place = attends_in_place(cache)
        if batch_sizes is None:
            batch_sizes = default_batch_sizes(cache)
        if not batch_sizes or any(b < 1 for b in batch_sizes):
            raise ValueError(f"compile_batch_sizes={batch_sizes!r}: expected positive row counts")
        self.cache, self.window, self.compute_dtype = cache, window, compute_dtype
        self.batch_sizes = tuple(sorted(set(batch_sizes)))
        self.pool_tensors = pool_tensors(KVPool.of(cache))
        self.module = StaticDecodeModule(model, KVPool.of(cache), window).eval()
        self.in_place_module = StaticDecodeModule(model, KVPool.of(cache), window, in_place=True).eval()
        self.graphs: dict[int, object] = {}  # batch size -> loaded graph, swapped in at step boundaries
        self._offered: dict[int, object] = {}  # loaded by another thread, not yet swapped in
        self._offer_lock = threading.Lock()
        self.compile_seconds: dict[int, float] = {}  # batch size -> seconds it took to compile (not load)
        self.load_seconds: dict[int, float] = {}  # batch size -> seconds to load its package
        self.build = None  # the BackgroundBuild getting the graphs ready behind a running engine
        self._operators_registered = False  # the C++ kernels of the operators our graphs call (prepare_operators)
        # Read once: the packages' names and what they hold must not follow a later change of the variable.
        self.rows_kernel_cpu = cpu_bf16_rows.cpu_supports()
        self.last_hidden: torch.Tensor | None = None  # the last run's rows' hidden states

    returns_hidden = True  # each run also leaves its rows' last hidden states (``last_hidden``)

    def supports(self, chunks: list[ChunkInput]) -> bool:
        """A step of decode rows — speculative verify chunks included, each token a row
        (``fast_path.token_rows``) — whose row count has a graph loaded. Called at the start of
        every step, so graphs a background build offered since the last step are swapped in here,
        at a step boundary, never in the middle of one."""
        self.swap_in()
        if not all(runs_as_rows(c) for c in chunks):
            return False
        batch = self.rows_for(sum(c.num_tokens for c in chunks))
        if batch is not None and not self.free_rows(batch) and any(c.tree_parents is not None for c in chunks):
            return False  # a graph over a window has no ancestor bits: the eager step verifies the tree
        return batch is not None

    def rows_for(self, n: int) -> int | None:
        """The smallest loaded graph's row count that fits ``n`` rows (None: none does)."""
        return next((b for b in sorted(self.graphs) if b >= n), None)

    def free_rows(self, batch: int) -> bool:
        """Whether the graph for ``batch`` takes any row count from ``MIN_ROWS`` to ``batch``
        (its rows attend in place), rather than exactly ``batch`` rows (padded up to it). A bound
        of ``MIN_ROWS`` itself leaves nothing to be free."""
        return self.in_place and batch > MIN_ROWS

    def describe(self, batch: int) -> str:
        """The rows the graph for ``batch`` takes, in words: "1-row", "2-8-row", "1-256-row"."""
        if not self.free_rows(batch):
            return f"{batch}-row"
        lowest = max((b for b in self.batch_sizes if b < batch), default=0) + 1
        return f"{lowest}-{batch}-row"

    def rows_kernel_here(self, batch: int) -> bool:
        """Whether the graph for ``batch`` multiplies its rows through our bf16 kernel
        (``layers/cpu_bf16_rows.py``): a free-row graph of a bf16 model (its pool's dtype; the
        attention may compute in fp32) on a CPU with AVX-512 BF16 and no AMX
        (``MINILLM_CPU_BF16_ROWS``). Decided from the CPU alone, so that a package's name is known
        without building the kernel on the engine's thread; a package so named always holds the
        kernel. Under ``auto`` a kernel that cannot be built is dropped before anything compiles
        (``drop_rows_kernel_if_unbuildable``); under ``1`` compiling and loading such a package
        fail, with the reason, and the engine decodes eagerly."""
        return self.free_rows(batch) and self.cache.dtype == torch.bfloat16 and self.rows_kernel_cpu

    def drop_rows_kernel_if_unbuildable(self) -> bool:
        """Under ``MINILLM_CPU_BF16_ROWS=auto``, where the kernel cannot be built here (a compiler
        without AVX-512 BF16's intrinsics, say), name and compile the graphs without it; called
        on the build's thread (the first call builds the kernel: seconds of ``g++`` on a cold
        cache), not the engine's. True when it dropped it (the package names change)."""
        if self.rows_kernel_cpu and not cpu_bf16_rows.required() and cpu_bf16_rows.unavailable_reason() is not None:
            self.rows_kernel_cpu = False
            return True
        return False

    def _check_rows_kernel(self, batch: int) -> None:
        """``RuntimeError`` when the graph for ``batch`` calls the kernel and it cannot run here."""
        reason = cpu_bf16_rows.unavailable_reason() if self.rows_kernel_here(batch) else None
        if reason is not None:
            raise RuntimeError(f"the bf16 rows kernel cannot run here ({reason}); MINILLM_CPU_BF16_ROWS=0 "
                               "compiles the decode step without it")  # fmt: skip

    def swap_in(self) -> None:
        """Start using the graphs offered since the last call (and say, once, if the background
        build failed: decode then stays eager)."""
        failure = self.build.take_failure() if self.build is not None else None
        if failure:
            warnings.warn(f"minillm: the compiled decode step is not available: {failure}", stacklevel=3)
        if self._offered:
            with self._offer_lock:
                self.graphs.update(self._offered)
                self._offered.clear()

    def prepare_operators(self) -> None:
        """Build (once per cache) and register (once per process) the C++ kernels of the operators
        a graph here calls — one with a free row count: ``minillm::paged_decode``, and
        ``minillm::linear_bf16_rows`` where it multiplies through our kernel — before such a graph
        is loaded, so that no graph is running while the dispatcher changes. Called by the
        background build first, by ``prepare``, and before packages on disk are loaded
        (``load_packages_on_disk``). Where the library or a registration fails, the operators'
        Python functions serve (about 1 ms a step slower), said once."""
        free = [b for b in self.batch_sizes if self.free_rows(b)]
        if not free or self._operators_registered:
            return
        self._operators_registered = True
        failure = native_build.build_operators()
        if failure is None and not cpu_paged.operator_in_cpp():
            failure = f"registering minillm::paged_decode failed ({cpu_paged.kernel_unavailable_reason()})"
        if failure is None and any(self.rows_kernel_here(b) for b in free) and not cpu_bf16_rows.operator_in_cpp():
            failure = "registering minillm::linear_bf16_rows failed"
        if failure is not None:
            warnings.warn(f"minillm: our operators' C++ kernels are not in use ({failure}); the compiled step "
                          "calls their Python functions (about 1 ms a step slower)", stacklevel=2)  # fmt: skip

    def offer(self, batch: int, graph) -> None:
        """Hand over a loaded graph from another thread (``background_compile.py``); the next
        step's ``supports`` swaps it in."""
        with self._offer_lock:
            self._offered[batch] = graph

    def check_hooks(self) -> None:
        """Refuse while a course hook the graph would trace is overridden: the package would bake
        the learner's function in, for every later engine that loads it."""
        active = [name for name in TRACED_HOOKS if hooks.current(name) is not hooks.default(name)]
        if active:
            raise RuntimeError(f"hook override(s) {active} active: a compiled decode step would keep them")

    def package_paths(self) -> dict[int, Path]:
        """Each batch size's package file (weights fingerprinted once for all of them)."""
        weights = weights_digest(self.module.model)
        return {b: packages_dir() / f"decode-b{b}-{self.digest(weights, b)}.pt2" for b in self.batch_sizes}

    def prepare(self, progress: bool = True) -> None:
        """Load each batch size's package, compiling the ones not yet on disk, in this process,
        before returning: for an engine built without a checkpoint folder a worker could rebuild
        the model from (engines built by ``LLMEngine`` build in the background instead,
        ``background_compile.py``)."""
        self.check_hooks()
        self.drop_rows_kernel_if_unbuildable()
        self.prepare_operators()
        for batch, path in self.package_paths().items():
            if not self.try_load(batch, path):
                self.compile_seconds[batch] = self.compile_package(batch, path, progress)
                self.load(batch, path)
        self.swap_in()
        prune_packages(KEEP_PACKAGES)

    def try_load(self, batch: int, path: Path) -> bool:
        """Load ``path`` if it is on disk; a truncated, replaced or foreign file is deleted (to be
        compiled again). A folder other users could write to raises ``UnsafeCacheError``; a
        package that calls the bf16 rows kernel where it cannot run raises ``RuntimeError`` (the
        file is kept: it is this process that cannot run it)."""
        if not path.is_file():
            return False
        self._check_rows_kernel(batch)  # raised, not "compile it again": the package is fine, this process is not
        try:
            self.load(batch, path)
            return True
        except trusted_cache.UnsafeCacheError:
            raise  # not ours to delete: the user must fix the folder (the message says how)
        except Exception as error:
            warnings.warn(f"minillm: {path} could not be loaded ({error}); compiling it again", stacklevel=2)
            trusted_cache.forget(path)
            return False

    def load(self, batch: int, path: Path) -> object:
        """Load one package — only from a private folder, and only if it is the file recorded
        when it was built (``trusted_cache.py``) — and offer its graph (swapped in at the next
        step boundary)."""
        self._check_rows_kernel(batch)  # builds (or finds) the kernel's library before the graph calls it
        trusted_cache.check_tree(path.parent)  # every folder in it: the kernel's is one
        if not trusted_cache.verified(path):
            raise ValueError("it is not the file recorded when it was built (replaced, truncated, or older)")
        start = time.perf_counter()
        graph = load_package(path)
        self.load_seconds[batch] = time.perf_counter() - start
        os.utime(trusted_cache.record_of(path))  # newest first when old packages are pruned (not the package:
        # touching it would move the fingerprint its record holds, and the next load would hash it again)
        self.offer(batch, graph)
        return graph

    def compile_package(self, batch: int, path: Path, progress: bool = True) -> float:
        """Compile one package unless another process did while we waited for its lock; the
        seconds it took (0 when it was already there)."""
        trusted_cache.private_dir(path.parent)
        lock = path.with_suffix(".lock")
        with open(lock, "w") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)  # two engines of one model compile it once
            try:
                if path.is_file():
                    return 0.0
                return self._compile(batch, path, progress)
            finally:
                lock.unlink(missing_ok=True)

    def digest(self, weights: str, batch: int) -> str:
        """What the compiled code depends on, hashed: a change to any of it compiles anew."""
        machine = machine_description(torch.device("cpu"))
        key = {
            "weights": weights,
            "pool": [(tuple(t.shape[1:]), str(t.dtype)) for t in self.pool_tensors],  # any number of slots
            "block_size": self.cache.block_size,
            "kv_cache_dtype": self.cache.kv_cache_dtype,
            "window": self.window,
            "compute_dtype": str(self.compute_dtype),
            "batch": batch,
            "attention": "in place" if self.free_rows(batch) else "window",
            "bf16 rows kernel": self.rows_kernel_here(batch),
            "cpu": [machine["cpu"], machine["cpu_flags"]],
            # The generated loops are parallelised for this many (not for a count the thread
            # governor lowered for a moment: thread_governor.py).
            "threads": configured_threads(),
            "torch": torch.__version__,
            "source": source_digest(),
            "options": repr(sorted(INDUCTOR_OPTIONS.items())),
        }
        return hashlib.blake2b(json.dumps(key, sort_keys=True).encode(), digest_size=10).hexdigest()

    def _compile(self, batch: int, path: Path, progress: bool) -> float:
        if progress:
            print(f"minillm: compiling the {self.describe(batch)} decode step (first start with "
                  f"this model on this machine; 1-2 minutes on a small CPU; kept in {path.parent}) ...",
                  end="", file=sys.stderr, flush=True)  # fmt: skip
        start = time.perf_counter()
        free = self.free_rows(batch)
        example_rows = min(batch, ROW_HINT) if free else batch
        example = [ChunkInput("__compile__", [0], 0, 1, [self.cache.null_block])] * example_rows
        tables = torch.full((example_rows, self.window_blocks(example)), self.cache.null_block, dtype=torch.long)
        inputs = self.inputs(example, tables, example_rows, write=False)
        # Free dimensions: the window's width, and the pool's size (one package serves every pool
        # size: a few multiples of the block size in a test, gigabytes on a server) — and the
        # row count, in a graph whose rows attend in place.
        width = torch.export.Dim("blocks", min=MIN_WINDOW, max=MAX_WINDOW)
        slots = {0: self.cache.block_size * torch.export.Dim("pool_blocks", min=2, max=MAX_POOL_BLOCKS)}
        pools = [slots] * len(self.pool_tensors)
        if free:
            r = torch.export.Dim("rows", min=MIN_ROWS, max=batch)
            shapes = ({1: r}, {1: r}, {0: r}, {0: r, 1: width}, {0: r}, {0: r}, pools)
        else:
            shapes = (None, None, None, {1: width}, None, None, pools)
        module = self.in_place_module if free else self.module
        self._check_rows_kernel(batch)
        trusted_cache.private_dir(path.parent)
        partial = path.with_name(f"{path.stem}.{os.getpid()}.partial.pt2")
        try:
            with torch.no_grad(), warnings.catch_warnings(), cpu_bf16_rows.in_traced_graph(self.rows_kernel_here(batch)):
                # torch's own code trips its own deprecation warning while autotuning: not for the user.
                warnings.filterwarnings("ignore", message="TypedStorage is deprecated")
                program = torch.export.export(module, inputs, dynamic_shapes=shapes, strict=False)
                torch._inductor.aoti_compile_and_package(
                    program, package_path=str(partial), inductor_configs=dict(INDUCTOR_OPTIONS)
                )
            trusted_cache.record(partial, as_=path)  # its hash first: a loader never finds it unrecorded
            partial.replace(path)  # atomic: another process never loads half a package
            trusted_cache.record(path)  # again, with the renamed file's fingerprint: a warm load need not re-hash it
        finally:
            partial.unlink(missing_ok=True)
        seconds = time.perf_counter() - start
        if progress:
            print(f" done in {seconds:.0f} s", file=sys.stderr, flush=True)
        return seconds

    def window_blocks(self, chunks: list[ChunkInput]) -> int:
        """Blocks per row of the step's static window: enough for its longest row."""
        return max(MIN_WINDOW, *(addressing.blocks_for(c.start + 1, self.cache.block_size) for c in chunks))

    def inputs(self, chunks: list[ChunkInput], tables: torch.Tensor, batch: int, write: bool = True) -> tuple:
        """The static layout of a decode step — ``tables[rows, window]`` its block tables — padded
        to ``batch`` rows by the padding rule (``fast_path.py``)."""
        null = self.cache.null_block
        rows = pad_decode_rows(chunks, batch, self.cache.block_size, null, write, tables)
        return (
            long_tensor(rows.input_ids)[None],
            long_tensor(rows.positions)[None],
            long_tensor(rows.slot_mapping),
            pad_table_rows(tables, batch, null),
            long_tensor(rows.context_lens),
            long_tensor(rows.visible),
            self.pool_tensors,
        )

    def run(self, chunks: list[ChunkInput], block_tables: BlockTableRows) -> torch.Tensor:
        """Logits ``[rows, V]``, a row per token of ``chunks`` (``block_tables``: the runner's).
        A verify chunk's tokens are rows of its sequence, each with its own position, slot and
        context length (and, for a tree's nodes, ancestor bits), all over the sequence's one
        block table."""
        rows = token_rows(chunks)
        batch = self.rows_for(len(rows))
        padded = max(len(rows), MIN_ROWS) if self.free_rows(batch) else batch
        tables = block_tables.gather(chunks, self.window_blocks(rows))  # a row per sequence
        if len(rows) > len(chunks):
            tables = tables.repeat_interleave(torch.tensor([c.num_tokens for c in chunks]), dim=0)
        inputs = self.inputs(rows, tables, padded)
        with torch.no_grad():
            logits, hidden = self.graphs[batch](*inputs)
        self.last_hidden = hidden[: len(rows)]  # every row's last hidden state (a feature-level draft's input)
        # A traced graph cannot pick its rows' near-ties out: decided here in fp32, as the eager step does.
        model = self.module.model
        return refine_top_logits(logits[: len(rows)], self.last_hidden, model.lm_head, model.norm)


class _RecordedISA:
    """Stands in for inductor's ``VecISA`` where only its name is read."""

    def __init__(self, name: str):
        self.name = name

    def __str__(self) -> str:
        return self.name.lower()


def load_package(path: Path):
    """``torch._inductor.aoti_load_package(path)`` without inductor's instruction-set probes.

    Loading a package compares the instruction set it was built for with this machine's, and
    inductor names this machine's by compiling and ``dlopen``-ing a probe library per candidate,
    each in a new Python process: about 1 s of a warm engine's start (AMD EPYC, 2 cores), for a
    comparison that can only log a warning. Our package names already hold the CPU's model and
    flags (``digest``), so a package on disk was built for this CPU: while it loads, on this thread
    only, the machine's instruction set is answered with the one the package records. Any other
    thread, and any other PyTorch (other private names), gets inductor's own answer."""
    import torch._inductor  # deferred: torch._inductor takes 1.3 s to import; only a compile needs it

    try:
        # deferred: torch._inductor takes 1.3 s to import; only a compile needs it
        from torch._inductor import cpu_vec_isa

        recorded = torch._C._aoti.AOTIModelPackageLoader.load_metadata_from_package(str(path), "model")
        name = recorded["AOTI_CPU_ISA"]
    except (AttributeError, ImportError, KeyError, RuntimeError):
        return torch._inductor.aoti_load_package(str(path))
    with isa_on_this_thread(cpu_vec_isa, _RecordedISA(name)):
        try:
            return torch._inductor.aoti_load_package(str(path))
        except Exception:  # noqa: BLE001 (a PyTorch that reads more of the ISA than its name: its own way)
            pass
    return torch._inductor.aoti_load_package(str(path))


def pool_tensors(pool: KVPool) -> list[torch.Tensor]:
    """The pool's tensors in a fixed order — the compiled graph's last input."""
    scales = (pool.k_scales or []) + (pool.v_scales or [])
    return [*pool.k_slots, *pool.v_slots, *scales]


class StaticDecodeModule(torch.nn.Module):
    """The model's forward pass over a static decode layout built from five tensors and the
    pool's. A module (not a function), so that exporting it sees the model's weights as
    parameters, which freezing folds in as constants."""

    def __init__(self, model: LlamaForCausalLM, pool: KVPool, window: int | None, in_place: bool = False):
        super().__init__()
        self.model, self.pool, self.window, self.in_place = model, pool, window, in_place

    def forward(self, input_ids, positions, slot_mapping, block_tables, context_lens, visible, pool_tensors) -> torch.Tensor:
        layers = len(self.pool.k_slots)
        scaled = self.pool.k_scales is not None
        pool = KVPool(
            list(pool_tensors[:layers]),
            list(pool_tensors[layers : 2 * layers]),
            self.pool.block_size,
            self.pool.null_block,
            list(pool_tensors[2 * layers : 3 * layers]) if scaled else None,
            list(pool_tensors[3 * layers :]) if scaled else None,
            self.pool.dtype,
            self.pool.kv_cache_dtype,
        )
        layout = StepLayout(
            input_ids=input_ids,
            positions=positions,
            slot_mapping=slot_mapping,
            query_lens=[],  # a static step keeps its lengths in context_lens_tensor only
            context_lens=[],
            block_tables=block_tables,
            num_decodes=0,
            logit_index=None,
            pool=pool,
            window=self.window,
            context_lens_tensor=context_lens,
            static_decode=True,
            in_place_decode=self.in_place,
            visible=visible,  # a tree's node rows see their ancestors only (in place; ``supports_trees``)
        )
        logits, hidden = self.model.forward_with_hidden(layout)
        return logits[0], hidden  # [1, B, V] -> [B, V]; [B, hidden]


def folded_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor the compiled graph folds in, by name: parameters, buffers, and tensors held
    as plain attributes (an int8 layer's ``qweight`` and ``scales``, the rotary tables, whose
    length follows ``max_model_len``). oneDNN-packed copies are left out: each is a packed
    copy of a plain matrix listed under its own name."""
    out = {}
    holders = [*model.named_modules(), ("rope", getattr(model, "rope", None))]
    for prefix, module in [(p, m) for p, m in holders if m is not None]:
        held = vars(module)
        if isinstance(module, torch.nn.Module):
            held = {**held, **module._parameters, **module._buffers}
        for name, tensor in sorted((k, v) for k, v in held.items() if isinstance(v, torch.Tensor)):
            if not tensor.is_mkldnn:
                out[f"{prefix}.{name}"] = tensor
    return out


def weights_digest(model: torch.nn.Module) -> str:
    """A hash of every tensor the compiled graph folds in (``folded_tensors``; ~0.4 s for
    SmolLM2-135M in bf16) — and the model's config."""
    h = hashlib.blake2b(digest_size=16)
    h.update(repr(getattr(model, "config", None)).encode())
    for name, tensor in folded_tensors(model).items():
        t = tensor.detach().contiguous()
        h.update(f"{name}{tuple(t.shape)}{t.dtype}".encode())
        h.update(t.view(-1).view(torch.uint8).numpy().data if t.numel() else b"")
    return h.hexdigest()


def copy_folded_tensors(model: torch.nn.Module, saved: dict[str, torch.Tensor]) -> None:
    """Overwrite ``model``'s folded tensors with ``saved`` (another process's, same set-up):
    calibrated quantization (AWQ, W8A8) searches scales over float results that differ in the
    last bit between processes (MKL's kernels depend on memory alignment), so a model rebuilt
    from the checkpoint is not bit-for-bit the engine's."""
    mine = folded_tensors(model)
    if mine.keys() != saved.keys():
        raise RuntimeError(f"the rebuilt model holds other tensors than the engine's: {sorted(mine.keys() ^ saved.keys())[:5]}")
    with torch.inference_mode():  # some are inference tensors (computed under inference mode)
        for name, tensor in mine.items():
            if tensor.shape != saved[name].shape or tensor.dtype != saved[name].dtype:
                raise RuntimeError(f"{name}: {tuple(saved[name].shape)} {saved[name].dtype} in the engine, "
                                   f"{tuple(tensor.shape)} {tensor.dtype} rebuilt")  # fmt: skip
            tensor.copy_(saved[name])


_SOURCE_DIGEST: str | None = None


def source_digest() -> str:
    """A hash of minillm's own source: code that changes what the model computes compiles anew."""
    global _SOURCE_DIGEST
    if _SOURCE_DIGEST is None:
        h = hashlib.blake2b(digest_size=16)
        root = Path(__file__).resolve().parent.parent
        for path in sorted([*root.rglob("*.py"), *root.rglob("*.cpp")]):  # a kernel's layout is in its .cpp
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
        _SOURCE_DIGEST = h.hexdigest()
    return _SOURCE_DIGEST


def prune_packages(keep: int, folder: Path | None = None) -> None:
    """Delete all but the ``keep`` most recently used packages (each holds a model's weights)
    in ``folder`` (default: ``packages_dir()``)."""
    folder = folder or packages_dir()
    if not folder.is_dir():
        return
    def last_used(package: Path) -> float:  # its record's time: a load touches that (CompiledDecode.load)
        record = trusted_cache.record_of(package)
        return (record if record.exists() else package).stat().st_mtime

    packages = sorted((p for p in folder.glob("decode-*.pt2") if ".partial" not in p.name), key=last_used, reverse=True)
    for old in packages[keep:]:
        trusted_cache.forget(old)
