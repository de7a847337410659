"""The paged engine's single-sequence decode step compiled with ``torch.compile`` (CPU).

Eagerly, one decode step of a small model is ~500 small PyTorch operations around its matrix
products; on a laptop CPU their dispatch overhead is as large as the useful work, and
oneDNN's bf16 GEMV reads the weights well below the memory bandwidth. Compiling with
*freezing* and *max-autotune* fixes both at once: the weights are folded into the graph as
constants, inductor packs them for its own generated C++ GEMM micro-kernels (picked by timing
each shape), and the operations around them fuse into a few loops.

A compiled graph is traced for fixed shapes, while a paged step's shapes change every step
(ragged batches, growing contexts, decode buckets). So the compiled step reads a *static*
layout (``StaticDecodeStep``): the row's blocks as a window ``block_tables[1, W]`` padded with
the null block and its length as a tensor that masks the padding; the window width ``W`` is a
dynamic dimension, so one graph serves every context length without recompiling.

What is compiled, and why only that — each measured on SmolLM2-135M bf16, 2-core AMD EPYC
(``benchmarks/bench_generate.py``):

- single-sequence decode steps (batch 1: chat, notebooks, a learner's laptop): 2.6× eager;
- batches stay eager: a graph with a dynamic batch size loses the generated GEMMs (they need
  a static row count) and ran slower than eager; a graph per padded batch size would cost a
  full compile each;
- prompt steps stay eager: few, long, and dominated by large matrix products.

The price is the compile itself, about 1-1.5 minutes on 2 cores, paid **at every start**: torch
cannot yet keep a graph whose frozen constants include oneDNN-packed weights in its on-disk
cache, so only the generated C++ is reused from ``<cache>/inductor``. Hence ``compile=True``
is opt-in and the engine says what it is doing while it compiles.
"""

from __future__ import annotations

import os
import sys
import time

import torch

from minillm.attention.layout import KVPool, StepLayout
from minillm.engine.runner import ChunkInput
from minillm.kvcache import addressing
from minillm.kvcache.paged import PagedKVCache
from minillm.models.llama import LlamaForCausalLM

# The narrowest block window compiled: the compiler specialises dynamic sizes 0 and 1, so a
# 1-block window would trace a second graph.
MIN_WINDOW = 2


def identity_guards_only(entries) -> list[bool]:
    """Which of the compiler's guards to check before every call: all of them except the
    metadata checks on the model's own modules and parameters (~500 of them, ~0.9 ms of a
    ~10 ms step), which cannot change under a compiled engine. The identity checks stay —
    among them the KV pool's tensors, one pool per engine — so a second engine in the same
    process gets its own graph with its own frozen weights, never the first one's."""
    return [
        entry.guard_type == "ID_MATCH" or not entry.orig_guard.source.is_unspecialized_nn_module() for entry in entries
    ]


COMPILE_OPTIONS = {
    "guard_filter_fn": identity_guards_only,
    # Round half-precision intermediates where eager PyTorch does, so the compiled step's
    # numbers stay close to the eager engine's.
    "emulate_precision_casts": True,
    # Time inductor's generated C++ GEMMs against ATen's for every weight shape, keep the fastest.
    "max_autotune": True,
    "max_autotune_gemm_backends": "CPP,ATEN",
}


class CompiledDecode:
    """Single-sequence decode steps of a paged CPU engine through one compiled graph."""

    def __init__(self, model: LlamaForCausalLM, cache: PagedKVCache, window: int | None):
        self.cache = cache
        self.module = StaticDecodeModule(model, KVPool.of(cache), window)
        self.compiled = torch.compile(self.module, fullgraph=True, options=COMPILE_OPTIONS)
        self.compile_seconds: float | None = None

    def supports(self, chunks: list[ChunkInput]) -> bool:
        """A decode step of exactly one sequence."""
        return len(chunks) == 1 and chunks[0].is_decode

    def compile(self, progress: bool = True) -> float:
        """Trace and compile now, on a dummy row pointed at the null block, so no request waits
        for the compiler; say so on stderr while it runs. Returns the seconds it took."""
        if progress:
            folder = os.environ.get("TORCHINDUCTOR_CACHE_DIR", "inductor's default folder")
            print(f"minillm: compiling the decode step (about 1-2 minutes on a small CPU; C++ cached in {folder}) ...",
                  end="", file=sys.stderr, flush=True)  # fmt: skip
        start = time.perf_counter()
        null = self.cache.null_block
        self.run([ChunkInput("__compile__", [0], 0, 1, [null])], write=False)
        self.compile_seconds = time.perf_counter() - start
        if progress:
            print(f" done in {self.compile_seconds:.0f} s", file=sys.stderr, flush=True)
        return self.compile_seconds

    def run(self, chunks: list[ChunkInput], write: bool = True) -> torch.Tensor:
        """Logits ``[1, V]`` for one sequence's decode step. ``write=False`` (the warm-up row)
        sends the new K/V to the null block."""
        (c,) = chunks
        bs, null = self.cache.block_size, self.cache.null_block
        width = max(MIN_WINDOW, addressing.blocks_for(c.start + 1, bs))
        (table,) = addressing.padded_block_tables([c.block_table], width, null)
        slot = addressing.slot_mapping(c.block_table, c.start, 1, bs)[0] if write else null * bs
        inputs = (
            torch.tensor([[c.token_ids[0]]]),
            torch.tensor([[c.start]]),
            torch.tensor([slot]),
            torch.tensor([table]),
            torch.tensor([c.start + 1]),
        )
        # "maybe": dynamic, but the compiler may bound it (a longer window then traces once more).
        torch._dynamo.maybe_mark_dynamic(inputs[3], 1)
        # Freezing is read before torch.compile's own options apply, so it is switched on here;
        # no_grad, not inference_mode: compiled graphs refuse inference tensors.
        with torch.no_grad(), torch._inductor.config.patch(freezing=True):
            return self.compiled(*inputs)


class StaticDecodeModule(torch.nn.Module):
    """The model's forward pass over a static decode layout built from five tensors. A module
    (not a function), so that compiling with freezing sees the model's weights as parameters
    and folds them in as constants."""

    def __init__(self, model: LlamaForCausalLM, pool: KVPool, window: int | None):
        super().__init__()
        self.model, self.pool, self.window = model, pool, window

    def forward(self, input_ids, positions, slot_mapping, block_tables, context_lens) -> torch.Tensor:
        layout = StepLayout(
            input_ids=input_ids,
            positions=positions,
            slot_mapping=slot_mapping,
            query_lens=[],  # a static step keeps its lengths in context_lens_tensor only
            context_lens=[],
            block_tables=block_tables,
            num_decodes=0,
            logit_index=None,
            pool=self.pool,
            window=self.window,
            context_lens_tensor=context_lens,
            static_decode=True,
        )
        return self.model._forward(layout)[0]  # [1, B, V] -> [B, V]
