"""Offloading: run a model whose weights do not fit the device — the last resort.

Every other way to fit a model (quantization, chapter 07; tensor or pipeline parallelism, this
chapter) keeps the weights where the compute is. Offloading keeps them somewhere bigger and
slower and moves each layer in just before it runs, so every decode step must move *all* the
weights across the slow link: the step time becomes ``weight bytes / link bandwidth``. For a
GPU over PCIe (~25-60 GB/s against ~4800 GB/s of HBM) that is ~100x slower; for a CPU reading
from an SSD, slower still. It is worth it only when nothing else fits (FlexGen, Sheng et al.,
2023, arXiv:2303.06865, makes the most of it by batching very large batches offline).

Two mechanisms:

- ``stream_layers(model, device)``: every decoder linear layer gets an ``OffloadMethod``, a
  weight method wrapped around the one it had (plain, or int8 / int4 storage): the layer's
  tensors live in host memory (pinned for fast copies on CUDA) and are copied to ``device``
  around each matmul, dropped right after. Device memory holds one layer's matrix at a time.
  Being a method, offloading goes through the same seam as every other way of storing a weight:
  nothing is hooked around the model.
- ``memory_map_weights(model, path)``: the weights are saved once to ``path`` and mapped from
  it (``torch.load(mmap=True)``): the OS pages each layer in from disk when it is read and may
  drop it again under memory pressure. ``evict_page_cache(model, path)`` drops the pages, as
  memory pressure would, so a measurement can see the cold case. A quantized layer's tensors
  are mapped with the rest.

Both move ordinary tensors: a layer whose method holds opaque ones (oneDNN's prepacked layout,
a sparse tensor subclass) is refused by name.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import torch
from torch import nn

from minillm.layers.linear import Linear


def movable_tensors(layer: Linear, name: str) -> dict[str, torch.Tensor]:
    """The tensors ``layer``'s method holds, by attribute, when each is an ordinary tensor
    (``ValueError`` naming the layer ``name`` otherwise)."""
    held = layer.method.held_tensors(layer)
    by_name = layer.held_by_name()
    if len(by_name) != len(held) or any(t.is_mkldnn or t.layout != torch.strided for t in by_name.values()):
        raise ValueError(
            f"offloading moves ordinary weight tensors; {name} uses {layer.method.name!r} storage, which holds "
            "opaque ones (load with cpu_prepack=False and no sparse kernels)"
        )
    return by_name


def _put(layer: Linear, name: str, tensor: torch.Tensor) -> None:
    """Hold ``tensor`` under ``name``: a parameter keeps its identity (a tied one stays tied)."""
    param = layer._parameters.get(name)
    if param is not None:
        param.data = tensor
    else:
        setattr(layer, name, tensor)


class OffloadMethod:
    """The layer's own method (``inner``, already holding its storage) with that storage kept in
    host memory and brought to ``device`` only around each ``apply``."""

    def __init__(self, inner, device: torch.device | str, layer_name: str = "layer"):
        self.inner, self.device, self.layer_name = inner, torch.device(device), layer_name
        self.name = f"{inner.name}, offloaded"

    def process_weights(self, layer: Linear) -> None:
        """Move the inner method's tensors to host memory (the inner method converted them
        already: this wraps, it does not convert again)."""
        layer.host_tensors = {}
        for name, tensor in movable_tensors(layer, self.layer_name).items():
            host = tensor.detach().to("cpu")
            host = host.pin_memory() if self.device.type == "cuda" else host.clone()
            _put(layer, name, host)
            layer.host_tensors[name] = host

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        for name, host in layer.host_tensors.items():
            _put(layer, name, host.to(self.device, non_blocking=True))
        try:
            return self.inner.apply(layer, x)
        finally:
            for name, host in layer.host_tensors.items():
                _put(layer, name, host)  # the device copy is freed

    def held_tensors(self, layer: Linear) -> list[torch.Tensor]:
        return self.inner.held_tensors(layer)  # the host copies, between calls


def stream_layers(model, device: torch.device | str) -> list[Linear]:
    """Keep each decoder linear layer's weights in host memory and copy them to ``device`` only
    while that layer multiplies (``OffloadMethod`` around its method). Every layer is checked
    before any is changed. Returns the layers offloaded."""
    layers = [(name, m) for name, m in model.layers.named_modules() if isinstance(m, Linear)]
    for name, layer in layers:
        movable_tensors(layer, f"layers.{name}")
    for name, layer in layers:
        layer.set_method(OffloadMethod(layer.method, device, f"layers.{name}"))
    return [layer for _, layer in layers]


def memory_map_weights(model: nn.Module, path: str | Path) -> int:
    """Save ``model``'s weights to ``path`` and replace them by views of the file mapped into
    memory: its parameters and buffers, and the tensors each linear layer's method holds (an int8
    layer's ``qweight`` and ``scales``). Returns the bytes mapped."""
    path = Path(path)
    held = {}  # "<layer>.<attribute>" → tensor, for what a method holds outside the state dict
    for name, layer in model.named_modules():
        if isinstance(layer, Linear):
            extra = {a: t for a, t in movable_tensors(layer, name).items() if a not in layer._parameters}
            held.update({f"{name}.{a}": t for a, t in extra.items()})
    state = {name: t.detach().contiguous() for name, t in model.state_dict().items()}
    torch.save({"state": state, "held": {k: t.detach().contiguous() for k, t in held.items()}}, path)
    mapped = torch.load(path, mmap=True, weights_only=True)
    model.load_state_dict(mapped["state"], assign=True)
    for key, tensor in mapped["held"].items():
        layer_name, attribute = key.rsplit(".", 1)
        setattr(model.get_submodule(layer_name), attribute, tensor)
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    tensors = [*mapped["state"].values(), *mapped["held"].values()]
    unique = {t.data_ptr(): t.numel() * t.element_size() for t in tensors}  # a tied head once
    return sum(unique.values())


def evict_page_cache(model: nn.Module, path: str | Path) -> None:
    """Drop the memory-mapped weights' pages, as memory pressure would: unmap them from this
    process (``madvise(MADV_DONTNEED)``: the next touch faults) and drop them from the OS's file
    cache (``posix_fadvise(DONTNEED)``: the fault reads the disk). Linux only."""
    libc = ctypes.CDLL(None, use_errno=True)
    page = os.sysconf("SC_PAGE_SIZE")
    ranges = _mapped_ranges(path)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    for tensor in [*model.state_dict().values(), *(t for m in linears for t in m.held_by_name().values())]:
        if not any(lo <= tensor.data_ptr() < hi for lo, hi in ranges):
            continue  # not one of the mapped weights: MADV_DONTNEED would zero ordinary memory
        start = tensor.data_ptr() - tensor.data_ptr() % page
        length = tensor.data_ptr() + tensor.numel() * tensor.element_size() - start
        libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), 4)  # MADV_DONTNEED
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _mapped_ranges(path: str | Path) -> list[tuple[int, int]]:
    """Address ranges where this process maps ``path`` (from ``/proc/self/maps``)."""
    target = str(Path(path).resolve())
    ranges = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].strip() == target:
                lo, hi = parts[0].split("-")
                ranges.append((int(lo, 16), int(hi, 16)))
    return ranges


def is_memory_mapped(tensor: torch.Tensor, path: str | Path) -> bool:
    """Is ``tensor``'s data inside this process's mapping of ``path``?"""
    return any(lo <= tensor.data_ptr() < hi for lo, hi in _mapped_ranges(path))
