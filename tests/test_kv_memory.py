"""The KV pool's memory: zeroed, yet paid for only where written (kvcache/zeroed.py)."""

import gc
import os
import sys
from types import SimpleNamespace

import pytest
import torch

from minillm.kvcache.paged import PagedKVCache
from minillm.kvcache.zeroed import ON_DEMAND_MIN_BYTES, zeroed

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("shape", [(4, 3), (2, 33, 16, 3, 64)])  # below and above ON_DEMAND_MIN_BYTES
def test_zeroed_is_zeros_of_the_asked_shape_and_dtype(shape, dtype):
    t = zeroed(shape, dtype, "cpu")
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous() and t.device.type == "cpu"
    assert t.data_ptr() % 64 == 0  # as aligned as the allocator's memory (vectorised kernels)
    assert torch.equal(t.float(), torch.zeros(shape))


def test_a_view_keeps_the_memory_alive_after_the_pool_is_dropped():
    pool = zeroed((64, 16, 3, 64, 8), torch.float32, "cpu")
    assert pool.nbytes >= ON_DEMAND_MIN_BYTES
    view = pool[5].flatten(0, 1)
    del pool
    gc.collect()
    view[7].fill_(3.0)
    assert float(view.sum()) == 3.0 * view[7].numel()
    assert float(view[6].abs().sum()) == 0.0


@linux_only
def test_a_large_pool_costs_only_the_pages_written():
    """A 1 GiB SmolLM2-shaped pool: allocating it must not fault in 1 GiB (torch.zeros does)."""
    config = SimpleNamespace(num_layers=30, num_kv_heads=3, head_dim=64)  # SmolLM2-135M's K/V shape
    before = rss_bytes()
    cache = PagedKVCache(config, num_blocks=2800, block_size=16, dtype=torch.bfloat16, device=torch.device("cpu"))
    assert cache.nbytes > 1_000_000_000
    allocated = rss_bytes() - before
    cache.k_slots[0][:16].fill_(1.0)  # one block of one layer written: one block's pages resident
    assert allocated < 64 * 2**20, f"allocating the pool made {allocated / 2**20:.0f} MiB resident"
    assert float(cache.k[0, 1].abs().sum()) == 0.0 and float(cache.k[0, 0].sum()) == 16 * 3 * 64
