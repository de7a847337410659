"""Which kernel runs a prefill's attention on a GPU: our FlashAttention or PyTorch's SDPA, chosen
by measuring each shape.

Chapter 06 teaches FlashAttention with our Triton kernel (``triton_kernels.flash_attention``),
and the tests hold it to the reference on every odd shape. On a large GPU, though, one H200 run
found it 3-12× slower than ``torch.nn.functional.scaled_dot_product_attention``, whose CUDA
backends (FlashAttention-2, cuDNN) are tuned per architecture. A course keeps its teaching kernel;
an engine runs the faster one. So, as ``decode_tuning.py`` does for decode, the engine times both
once per shape bucket — number of prefills, longest chunk, longest context, each rounded up to a
power of two — and keeps the faster.

The SDPA candidate gathers each prefill's keys (cached prefix and new tokens alike) from the pool,
so it attends over exactly what the kernel would read. It runs one SDPA call per prefill chunk
with a mask for the chunk's offset (a chunk that continues a cached prefix is not top-left
causal) and the sliding window. An 8-bit pool has only our kernel (SDPA would need the blocks
dequantized first). On a CPU nothing is measured: Triton's interpreter runs our kernel, which is
what the tests check.
"""

from __future__ import annotations

import torch

from minillm.attention.decode_tuning import MeasuredChoice, default_timer, shape_bucket

FLASH = "flash"  # triton_kernels.flash_attention, reading the pool in place
GATHER_SDPA_PREFILL = "gather+sdpa"

_PREFILL_CHOICES: dict[torch.device, MeasuredChoice] = {}


def prefill_choice(device: torch.device) -> MeasuredChoice:
    """The process's prefill decisions for ``device`` (our kernel first: the default, and the
    only candidate where nothing is measured)."""
    if device not in _PREFILL_CHOICES:
        _PREFILL_CHOICES[device] = MeasuredChoice((FLASH, GATHER_SDPA_PREFILL), default_timer(device))
    return _PREFILL_CHOICES[device]


def prefill_bucket(query_lens: list[int], context_lens: list[int], *details) -> tuple:
    """Prefills, longest chunk and longest context (powers of two), and what else changes the kernel."""
    return (*shape_bucket(len(query_lens), max(context_lens, default=0)), max(1 << (max(query_lens) - 1).bit_length(), 1),
            *details)  # fmt: skip


def prefill_mask(query_len: int, context_len: int, window: int | None, device) -> torch.Tensor:
    """``[1, 1, n, ctx]``: query ``j`` sits at position ``ctx - n + j`` and sees keys up to it
    (and only its last ``window`` keys with sliding-window attention)."""
    positions = torch.arange(context_len - query_len, context_len, device=device)[:, None]
    keys = torch.arange(context_len, device=device)[None]
    allowed = keys <= positions
    if window is not None:
        allowed = allowed & (keys > positions - window)
    return allowed[None, None]


def gather_sdpa_prefill(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    query_lens: list[int],
    context_lens: list[int],
    block_tables: torch.Tensor,
    scale: float,
    block_size: int,
    window: int | None = None,
) -> torch.Tensor:
    """The SDPA candidate: ``q[N, H, D]`` (the chunks back to back, ``query_lens`` each) against
    each chunk's ``context_lens`` keys, gathered from the pool (``[num_slots, KV, D]``) through
    its row of ``block_tables``. Lengths are host lists, so the loop costs no device sync.
    Returns ``[N, H, D]`` in ``q``'s dtype."""
    slots, kv_heads, dim = k_pool.shape
    k_blocks = k_pool.view(slots // block_size, block_size, kv_heads, dim)
    v_blocks = v_pool.view(slots // block_size, block_size, kv_heads, dim)
    out = torch.empty_like(q)
    start = 0
    for row, (n, ctx) in enumerate(zip(query_lens, context_lens, strict=True)):
        blocks = block_tables[row, : -(-ctx // block_size)].long()
        k = k_blocks.index_select(0, blocks).reshape(-1, kv_heads, dim)[:ctx].transpose(0, 1)
        v = v_blocks.index_select(0, blocks).reshape(-1, kv_heads, dim)[:ctx].transpose(0, 1)
        rows = q[start : start + n].transpose(0, 1)  # [H, n, D]
        mask = prefill_mask(n, ctx, window, q.device)
        attended = torch.nn.functional.scaled_dot_product_attention(
            rows[None], k[None].to(q.dtype), v[None].to(q.dtype), attn_mask=mask, scale=scale, enable_gqa=True
        )
        out[start : start + n] = attended[0].transpose(0, 1)
        start += n
    return out
