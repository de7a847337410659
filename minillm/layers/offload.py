"""Offloading: run a model whose weights do not fit the device — the last resort.

Every other way to fit a model (quantization, chapter 07; tensor or pipeline parallelism, this
chapter) keeps the weights where the compute is. Offloading keeps them somewhere bigger and
slower and moves each layer in just before it runs, so every decode step must move *all* the
weights across the slow link: the step time becomes ``weight bytes / link bandwidth``. For a
GPU over PCIe (~25-60 GB/s against ~4800 GB/s of HBM) that is ~100x slower; for a CPU reading
from an SSD, slower still. It is worth it only when nothing else fits (FlexGen, Sheng et al.,
2023, arXiv:2303.06865, makes the most of it by batching very large batches offline).

Two mechanisms:

- ``stream_layers(model, device)``: each decoder layer's weights live in host memory (pinned
  for fast copies on CUDA) and are copied to ``device`` right before the layer runs, dropped
  right after (forward hooks). Device memory holds one layer's weights at a time.
- ``memory_map_weights(model, path)``: the weights are saved once to ``path`` and mapped from
  it (``torch.load(mmap=True)``): the OS pages each layer in from disk when it is read and may
  drop it again under memory pressure. ``evict_page_cache(model, path)`` drops the pages, as
  memory pressure would, so a measurement can see the cold case.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import torch
from torch import nn

from minillm.layers.linear import PLAIN


def _plain_only(model) -> None:
    packed = [layer for layer in model.linear_layers() if layer.method is not PLAIN]
    if packed:
        raise ValueError(
            f"offloading moves plain weight tensors; {len(packed)} linear layer(s) use {packed[0].method.name!r} "
            "storage (load with cpu_prepack=False and no quantization)"
        )


def stream_layers(model, device: torch.device | str) -> list:
    """Keep each decoder layer's weights in host memory and copy them to ``device`` only while
    that layer runs. Returns the hook handles (``handle.remove()`` undoes the hooks)."""
    _plain_only(model)
    device = torch.device(device)
    handles = []
    for layer in model.layers:
        host = {}
        for name, param in layer.named_parameters():
            tensor = param.detach().to("cpu")
            host[name] = tensor.pin_memory() if device.type == "cuda" else tensor.clone()
            param.data = host[name]
        params = dict(layer.named_parameters())

        def bring_in(module, args, params=params, host=host):
            for name, param in params.items():
                param.data = host[name].to(device, non_blocking=True)

        def send_back(module, args, output, params=params, host=host):
            for name, param in params.items():
                param.data = host[name]  # the device copy is freed

        handles += [layer.register_forward_pre_hook(bring_in), layer.register_forward_hook(send_back)]
    return handles


def memory_map_weights(model: nn.Module, path: str | Path) -> int:
    """Save ``model``'s weights to ``path`` and replace them by views of the file mapped into
    memory. Returns the bytes mapped."""
    _plain_only(model)
    path = Path(path)
    state = {name: t.detach().contiguous() for name, t in model.state_dict().items()}
    torch.save(state, path)
    mapped = torch.load(path, mmap=True, weights_only=True)
    model.load_state_dict(mapped, assign=True)
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    unique = {t.data_ptr(): t.numel() * t.element_size() for t in mapped.values()}  # a tied head once
    return sum(unique.values())


def evict_page_cache(model: nn.Module, path: str | Path) -> None:
    """Drop the memory-mapped weights' pages, as memory pressure would: unmap them from this
    process (``madvise(MADV_DONTNEED)``: the next touch faults) and drop them from the OS's file
    cache (``posix_fadvise(DONTNEED)``: the fault reads the disk). Linux only."""
    libc = ctypes.CDLL(None, use_errno=True)
    page = os.sysconf("SC_PAGE_SIZE")
    ranges = _mapped_ranges(path)
    for tensor in model.state_dict().values():
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
