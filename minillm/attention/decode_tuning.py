"""Which paged-decode kernel runs a shape, and with which launch settings: chosen by measuring.

A decode step's attention reads every cached K/V byte once, so it should run near the GPU's
memory bandwidth. How near depends on settings no single choice gets right everywhere: how many
programs share the streaming multiprocessors (batch × KV heads × context splits), how many keys
one loop iteration loads (``BLOCK_N``), and how many warps and pipeline stages hide the memory
latency. One run on an H200 found the fixed setting of the first Triton kernel (``BLOCK_N`` 32,
4 warps, two programs per multiprocessor) at 0.5-12% of copy bandwidth, and 2.3-2.6× slower than
gathering the blocks and calling PyTorch's SDPA.

So, as Triton's ``@triton.autotune`` does for one kernel and vLLM's attention backends do across
kernels, the engine keeps a small **search space** — our kernel's settings, and the gather +
SDPA path as one more candidate — and on a GPU **times every candidate once per shape bucket**
(batch and longest context, each rounded up to a power of two), keeping the fastest. The choice
is then never slower than gather + SDPA at a shape it has measured. Rules:

- measuring happens outside CUDA-graph capture (the graph runner's warm-up pass measures; a
  capture that finds no decision uses the default and decides nothing);
- a candidate that fails to launch (too many resources for this GPU) is skipped, not fatal;
- on a CPU there is nothing to measure: Triton's interpreter runs the default, which is what the
  tests check bit for bit against the reference — and every setting in the space is tested
  there too, so whatever the GPU picks computes the same numbers.

``benchmarks/bench_gpu.py`` prints the space's timings for its decode shapes.
"""

from __future__ import annotations

import functools
import statistics
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import torch

from minillm.attention.paged import decode_mask


@dataclass(frozen=True)
class DecodeConfig:
    """Launch settings of ``paged_decode``'s Triton kernel."""

    block_n: int = 32  # keys per loop iteration
    num_warps: int = 4
    num_stages: int = 3  # software pipelining of the loads (Triton's default)
    programs_per_sm: int = 2  # split-K target: enough context splits to give each SM this many programs
    # The query group's scores and weighted values as matrix products (``tl.dot``, the group padded
    # to 16 rows, bf16/fp16 operands on a GPU) rather than fp32 broadcast multiply-adds, whose
    # [group, BLOCK_N, head_dim] products filled the registers: the first H200 run's kernel read
    # 12% of the copy bandwidth at 64 × 4k (benchmarks/results/gpu-2026-12-04/).
    tensor_cores: bool = True

    def __str__(self) -> str:
        dot = "" if self.tensor_cores else " broadcast"
        return f"BLOCK_N={self.block_n} warps={self.num_warps} stages={self.num_stages} programs/SM={self.programs_per_sm}{dot}"


GATHER_SDPA = "gather+sdpa"  # the other candidate: gather the blocks into a padded batch, then SDPA

DEFAULT = DecodeConfig()
# Small on purpose: every distinct (BLOCK_N, warps, stages) is one more Triton compile at first use.
SEARCH_SPACE: tuple[DecodeConfig, ...] = (
    DEFAULT,
    *(DecodeConfig(block_n, warps, 2, per_sm) for block_n in (64, 128) for warps in (4, 8) for per_sm in (2, 8)),
)


def shape_bucket(batch: int, max_context: int, *details: Hashable) -> tuple:
    """The key a decision is kept under: batch and longest context rounded up to powers of two
    (contexts from 256), plus whatever else changes the kernel (heads, dtype, 8-bit pool, window)."""
    return (_pow2(max(batch, 1)), _pow2(max(max_context, 256)), *details)


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def cuda_timer(fn: Callable[[], object], repeats: int = 5, warmup: int = 2) -> float:
    """Median seconds of ``fn()`` on the current CUDA stream, measured with events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return statistics.median(times)


class MeasuredChoice:
    """The fastest of ``candidates`` per key, timed once (module docstring). ``timer`` measures a
    callable in seconds; None means "nothing to measure here" and the first candidate serves."""

    def __init__(self, candidates: Sequence, timer: Callable[[Callable[[], object]], float] | None = None):
        if not candidates:
            raise ValueError("a measured choice needs at least one candidate")
        self.candidates, self.timer = tuple(candidates), timer
        self.decided: dict[Hashable, object] = {}
        self.timings: dict[Hashable, dict[object, float]] = {}  # what each decision rested on

    def pick(self, key: Hashable, run: Callable[[object], object], candidates: Sequence | None = None):
        """The candidate to use for ``key``; ``run(candidate)`` runs one (for timing).
        ``candidates`` narrows the set for this key (e.g. no gather + SDPA for an 8-bit pool)."""
        if key in self.decided:
            return self.decided[key]
        pool = tuple(candidates) if candidates is not None else self.candidates
        if self.timer is None or _capturing():
            return pool[0]
        times = {}
        for candidate in pool:
            try:
                times[candidate] = self.timer(functools.partial(run, candidate))
            except Exception:  # noqa: BLE001 - e.g. Triton's OutOfResources on a smaller GPU
                if candidate is pool[0]:
                    raise  # the default must run
                times[candidate] = float("inf")
        best = min(times, key=times.get)
        self.decided[key], self.timings[key] = best, times
        return best


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def default_timer(device: torch.device):
    """CUDA events on a GPU; on anything else, nothing to measure (see ``MeasuredChoice``)."""
    return cuda_timer if device.type == "cuda" else None


_DECODE_CHOICES: dict[torch.device, MeasuredChoice] = {}


def decode_choice(device: torch.device) -> MeasuredChoice:
    """The process's decode decisions for ``device`` (kept for the process's life: a shape's
    best kernel does not change while it runs)."""
    if device not in _DECODE_CHOICES:
        _DECODE_CHOICES[device] = MeasuredChoice((*SEARCH_SPACE, GATHER_SDPA), default_timer(device))
    return _DECODE_CHOICES[device]


def gather_sdpa_decode(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    block_size: int,
    window: int | None = None,
) -> torch.Tensor:
    """The other candidate: ``q[B, H, D]`` against the pool (``[num_slots, KV, D]``) by gathering
    each row's blocks (``block_tables[B, W]``) into a padded ``[B, KV, W·block_size, D]`` batch,
    masking keys past ``context_lens`` (and before the window), and calling SDPA with GQA.
    Shapes come from the tensors only, so a CUDA graph can capture it. Returns ``[B, H, D]``."""
    b, width = block_tables.shape
    slots, kv_heads, dim = k_pool.shape
    blocks = block_tables.reshape(-1).long()
    k = k_pool.view(slots // block_size, block_size, kv_heads, dim).index_select(0, blocks)
    v = v_pool.view(slots // block_size, block_size, kv_heads, dim).index_select(0, blocks)
    k = k.view(b, width * block_size, kv_heads, dim).transpose(1, 2)
    v = v.view(b, width * block_size, kv_heads, dim).transpose(1, 2)
    mask = decode_mask(context_lens, width * block_size, window)
    out = torch.nn.functional.scaled_dot_product_attention(
        q[:, :, None], k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=scale, enable_gqa=True
    )
    return out[:, :, 0]
