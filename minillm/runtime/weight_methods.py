"""How a model's linear layers hold their weights — pruned, quantized, prepacked, compiled, or
offloaded — decided once after loading. Used by the engine's builder and by each parallel
worker for its shard."""

from __future__ import annotations

import os

import torch

from minillm.assets import cache_dir
from minillm.config import EngineConfig
from minillm.layers import cpu_prepack, cpu_upcast
from minillm.layers.cpu_prepack import CPUPrepackMethod
from minillm.layers.cpu_upcast import CPUUpcastMethod
from minillm.layers.linear import PLAIN
from minillm.layers.offload import memory_map_weights, stream_layers
from minillm.models.llama import LlamaForCausalLM
from minillm.quantization import prune, quantize_model
from minillm.quantization.sparsity import SemiStructuredMethod


def apply_weight_methods(
    config: EngineConfig, model: LlamaForCausalLM, device: torch.device, dtype, tokenizer=None
) -> None:
    """How the linear layers hold their weights: pruned (``sparsity``), quantized
    (``quantization``), then — for the layers left in plain storage — the compressed 2:4 format
    on a GPU that has sparse kernels, or oneDNN prepacking on CPU (or, for half precision on a
    CPU without half-precision kernels, many rows multiplied in fp32); then compilation."""
    saved = {layer.method.name for layer in model.linear_layers()} - {PLAIN.name}
    if config.quantization is not None and saved:
        raise ValueError(
            f"quantization={config.quantization!r}: this checkpoint is already quantized ({', '.join(sorted(saved))}); "
            "load it without quantization="
        )
    if config.sparsity is not None and saved:
        raise ValueError(f"sparsity={config.sparsity!r}: this checkpoint is already quantized; prune before quantizing")
    if config.sparsity is not None:  # on the float weights, before quantization rounds them
        prune(model, config.sparsity, tokenizer=tokenizer)
    if config.quantization is not None:  # before prepacking: quantized layers keep their own kernels
        quantize_model(model, config.quantization, config.quantization_group_size, tokenizer=tokenizer)
    if config.sparsity is not None and config.quantization is None:
        for layer in model.linear_layers():
            if layer.method is PLAIN and layer is not model.lm_head and SemiStructuredMethod.supported(layer):
                layer.set_method(SemiStructuredMethod())
    # Through the modules, not names bound at import: a test (or a learner) swaps these probes.
    prepack = config.cpu_prepack and device.type == "cpu" and cpu_prepack.prepack_available(dtype)
    upcast = config.cpu_prepack and device.type == "cpu" and not prepack and cpu_upcast.half_gemm_is_slow(dtype)
    if config.weight_offload is not None:  # a method around each layer's own; packed tensors are opaque
        _offload(config, model, device)
        prepack = upcast = False
    contiguous_compile = config.compile and config.mode == "contiguous"
    if contiguous_compile and dtype != torch.float32:
        prepack = False  # the contiguous step compiles whole: packed half-precision kernels are opaque there
    if prepack:
        # compile=True (paged) also keeps each plain matrix, for the compiled decode step to fold
        # in and pack its own way (layers/cpu_prepack.py): ~3x the weight memory in all.
        keep_plain = config.compile and config.mode == "paged"
        for layer in model.linear_layers():
            if layer.method is PLAIN:
                layer.set_method(CPUPrepackMethod(keep_plain_for_compile=keep_plain))
    if upcast:  # layers/cpu_upcast.py: oneDNN cannot pack half precision on this CPU
        for layer in model.linear_layers():
            if layer.method is PLAIN:
                layer.set_method(CPUUpcastMethod())
    if contiguous_compile:
        # Measured on CPU: fp32 runs batched steps fastest on prepacked weights and
        # single-sequence steps fastest compiled; half precision fastest compiled throughout.
        model.compile_decode(single_row_only=prepack)


def _offload(config: EngineConfig, model: LlamaForCausalLM, device: torch.device) -> None:
    if config.weight_offload == "host":
        stream_layers(model, device)
        return
    if device.type != "cpu":
        raise ValueError("weight_offload='disk' maps the weights for the CPU to read; use 'host' on a GPU")
    folder = cache_dir() / "offload"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"weights-{os.getpid()}-{id(model)}.pt"
    try:
        memory_map_weights(model, path)
    finally:
        path.unlink(missing_ok=True)  # the mapping keeps the file alive; nothing is left on disk after the process
