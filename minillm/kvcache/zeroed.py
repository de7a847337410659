"""Zero-filled KV memory that costs nothing until it is used.

A KV pool must start zeroed: attention multiplies the slots a sequence does not own by a
probability of exactly 0, and 0 × NaN — from uninitialised memory — would still be NaN. But
``torch.zeros`` writes every byte at once: on a CPU the default pool is 1 GiB, and writing it
faults in every page before the engine answers (measured on a 2-core AMD EPYC VM: 1.6 s per
512 MiB tensor, 3.2 s per engine start, the largest single cost of starting an engine in a
notebook). Most of a pool is never touched in a lesson.

The operating system already has what we need: an anonymous private mapping (``mmap``) reads as
zeros, and a page gets physical memory — zeroed by the kernel — only when first written. So on
a CPU a large pool is a tensor over such a mapping (page-aligned, so as aligned as
``torch.zeros``'s memory); the engine's start-up no longer pays for the whole pool, and a process
holding several engines holds only the K/V they wrote. Small tensors, other devices and
systems without anonymous mappings get ``torch.zeros``.
"""

from __future__ import annotations

import math
import mmap

import torch

# Below this, torch.zeros is as fast as a mapping (and keeps small tensors in the allocator).
ON_DEMAND_MIN_BYTES = 1 << 20


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A contiguous tensor of zeros; on a CPU, over memory the kernel zeroes page by page on
    first write (module docstring)."""
    device = torch.device(device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    anonymous = getattr(mmap, "MAP_ANONYMOUS", None)
    if device.type != "cpu" or anonymous is None or nbytes < ON_DEMAND_MIN_BYTES:
        return torch.zeros(shape, dtype=dtype, device=device)
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | anonymous, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    # frombuffer keeps ``mapping`` alive for as long as the tensor (or a view of it) lives.
    return torch.frombuffer(mapping, dtype=torch.uint8).view(dtype).view(shape)
