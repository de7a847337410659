"""Regional compilation, tried: one decoder layer compiled once and reused by all of them.

    python benchmarks/profile_regional_compile.py           # SmolLM2-135M bf16, 2 threads

PyTorch's recipe (https://docs.pytorch.org/tutorials/recipes/regional_aot.html) compiles one
layer with ``aot_inductor.package_constants_in_so=False`` and loads the package once per layer,
each with that layer's weights (``load_constants``). This script does it for a decode step
whose rows attend in place (the operator the default graph calls), and prints:

- the layer's compile time, unfrozen — and whether a *frozen* layer can be reused at all
  (freezing turns the weights into packed constants computed at compile time, which
  ``load_constants`` cannot supply for another layer: it prints the error);
- one decode step through the 30 reused layers (embedding, final norm and head eager), against
  the eager step and against the default whole-model graph (frozen, with the engine's options),
  loaded from ``<cache>/compiled`` when one is there.
"""

from __future__ import annotations

import argparse
import glob
import os
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path

import torch

import minillm.attention.cpu_paged  # noqa: F401  (registers the kernel's operator)
from minillm.assets import resolve_model
from minillm.attention import get_backend
from minillm.attention.layout import KVPool, StepLayout
from minillm.config import ModelConfig
from minillm.kvcache.paged import PagedKVCache
from minillm.machine import machine_description
from minillm.models import load_model
from minillm.runtime.compile_worker import cache_inductor_templates
from minillm.runtime.compiled_decode import INDUCTOR_OPTIONS, packages_dir

BLOCK = 16


class Region(torch.nn.Module):
    """One decoder layer over a static decode step, its K/V pool passed in."""

    def __init__(self, layer, null_block: int, dtype: torch.dtype):
        super().__init__()
        self.layer, self.null_block, self.dtype = layer, null_block, dtype

    def forward(self, x, cos, sin, slot_mapping, block_tables, context_lens, k, v):
        n = self.layer.attn.layer_index + 1  # the layer reads its own index of the pool's lists
        pool = KVPool([k] * n, [v] * n, BLOCK, self.null_block, None, None, self.dtype, "auto")
        layout = StepLayout(
            input_ids=None, positions=None, slot_mapping=slot_mapping, query_lens=[], context_lens=[],
            block_tables=block_tables, num_decodes=0, logit_index=None, pool=pool,
            context_lens_tensor=context_lens, static_decode=True, in_place_decode=True,
        )  # fmt: skip
        return self.layer(x, cos, sin, get_backend("cpu").paged_step(layout))


def compile_layer(region: Region, args: tuple, options: dict, path: Path) -> float:
    rows = torch.export.Dim("rows", min=2, max=256)
    width = torch.export.Dim("blocks", min=2, max=2**20)
    slots = {0: BLOCK * torch.export.Dim("pool_blocks", min=2, max=2**21)}
    shapes = ({1: rows}, {1: rows}, {1: rows}, {0: rows}, {0: rows, 1: width}, {0: rows}, slots, slots)
    start = time.perf_counter()
    with torch.no_grad():
        program = torch.export.export(region, args, dynamic_shapes=shapes, strict=False)
        torch._inductor.aoti_compile_and_package(program, package_path=str(path), inductor_configs=options)
    return time.perf_counter() - start


def median_ms(fn, n: int = 15) -> float:
    with torch.no_grad():
        fn(), fn()
        times = []
        for _ in range(n):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    cache_inductor_templates()  # as the compile worker does
    dtype = torch.bfloat16
    folder = resolve_model(args.model)
    config = ModelConfig.from_folder(folder)
    model = load_model(folder, dtype, torch.device("cpu"), max_positions=2048)
    model.set_attention_backend("cpu")
    cache = PagedKVCache(config, 32 * 7 + 1, BLOCK, dtype, torch.device("cpu"), "auto")  # 32 rows of 7 blocks
    for t in cache.k_slots + cache.v_slots:
        t.normal_()

    def step_inputs(rows: int):
        ids = torch.arange(rows)[None] + 100
        positions = torch.full((1, rows), 100)
        tables = torch.arange(rows * 7).view(rows, 7)
        slots = tables[:, 6] * BLOCK + 4
        return ids, positions, slots, tables, torch.full((rows,), 101)

    ids, positions, slots, tables, lens = step_inputs(8)
    cos, sin = model.rope.lookup(positions, dtype)
    x = model.embed_tokens(ids)
    example = (x, cos, sin, slots, tables, lens, cache.k_slots[0], cache.v_slots[0])
    plain = {**INDUCTOR_OPTIONS, "freezing": False, "aot_inductor.package_constants_in_so": False}
    with tempfile.TemporaryDirectory() as tmp:
        frozen = {**INDUCTOR_OPTIONS, "aot_inductor.package_constants_in_so": False}
        frozen_seconds = compile_layer(Region(model.layers[0], cache.null_block, dtype).eval(), example, frozen,
                                       Path(tmp) / "frozen.pt2")  # fmt: skip
        graph = torch._inductor.aoti_load_package(str(Path(tmp) / "frozen.pt2"))
        try:
            graph.load_constants({f"layer.{k}": v for k, v in model.layers[1].state_dict().items()},
                                 check_full_update=True, user_managed=True)  # fmt: skip
            frozen_reuse = "reusable"
        except RuntimeError as error:
            frozen_reuse = f"not reusable: {error}"
        print(f"frozen layer: compiled in {frozen_seconds:.0f} s; {frozen_reuse}", flush=True)
        path = Path(tmp) / "layer.pt2"
        seconds = compile_layer(Region(model.layers[0], cache.null_block, dtype).eval(), example, plain, path)
        print(f"unfrozen layer: compiled in {seconds:.1f} s", flush=True)
        layers = []
        for layer in model.layers:
            graph = torch._inductor.aoti_load_package(str(path))
            graph.load_constants({f"layer.{k}": v for k, v in layer.state_dict().items()},
                                 check_full_update=True, user_managed=True)  # fmt: skip
            layers.append(graph)

    whole = sorted(glob.glob(str(packages_dir() / "decode-b256-*.pt2")), key=os.path.getmtime)
    whole_graph = torch._inductor.aoti_load_package(whole[-1]) if whole else None
    pool = [*cache.k_slots, *cache.v_slots]
    machine = machine_description(torch.device("cpu"))
    print(f"\n{machine['cpu']} ({', '.join(machine['cpu_flags'])}), {args.threads} threads, {args.model} bf16")
    print("\n| rows | eager step ms | 30 reused layers ms | whole-model graph ms | max abs logit difference, reused vs eager |")
    print("|---:|---:|---:|---:|---:|")
    def head(h):
        return model.lm_head(model.norm(h.flatten(0, 1))).float()

    def eager(ids, cos, sin, slots, tables, lens):
        h = model.embed_tokens(ids)
        for i, layer in enumerate(model.layers):
            h = Region(layer, cache.null_block, dtype)(h, cos, sin, slots, tables, lens,
                                                      cache.k_slots[i], cache.v_slots[i])  # fmt: skip
        return head(h)

    def regional(ids, cos, sin, slots, tables, lens):
        h = model.embed_tokens(ids)
        for i, graph in enumerate(layers):
            h = graph(h, cos, sin, slots, tables, lens, cache.k_slots[i], cache.v_slots[i])
        return head(h)

    for rows in (2, 8, 32):
        ids, positions, slots, tables, lens = step_inputs(rows)
        cos, sin = model.rope.lookup(positions, dtype)
        step = (ids, cos, sin, slots, tables, lens)
        with torch.no_grad():  # the same step, up to bf16 rounding (over a pool of random keys and values)
            a, b = regional(*step), eager(*step)
            differ = f"{(a - b).abs().max().item():.2f} of {b.abs().max().item():.1f}"
        whole_ms = "-"
        if whole_graph is not None:
            whole_ms = f"{median_ms(partial(whole_graph, ids, positions, slots, tables, lens, pool)):.2f}"
        print(f"| {rows} | {median_ms(partial(eager, *step)):.2f} | {median_ms(partial(regional, *step)):.2f} | "
              f"{whole_ms} | {differ} |", flush=True)  # fmt: skip

if __name__ == "__main__":
    main()
