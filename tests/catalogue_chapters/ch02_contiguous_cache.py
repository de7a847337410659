"""Chapter 02's batch cache (``check_contiguous_cache``): two right answers written independently,
and the wrong ones a learner writes, one slip each (``cache_with``)."""

from __future__ import annotations

import torch
from check_catalogue import right, wrong

CC = "check_contiguous_cache"


def cache_with(**slip):
    """The slab-per-K-and-V class, with one learner's slip switched on."""

    class ContiguousKVCache:
        def __init__(self, config, batch_size, max_len, dtype, device):
            shape = (config.num_layers, batch_size, config.num_kv_heads, max_len, config.head_dim)
            make = torch.empty if slip.get("empty") else torch.zeros
            self.k = make(shape, dtype=dtype, device=device)
            self.v = make(shape, dtype=dtype, device=device)
            if slip.get("shared_slab"):
                self.v = self.k

        def write(self, layer, positions, k, v, same_start=None):
            batch = positions.shape[0]
            if slip.get("all_rows"):
                batch = self.k.shape[1]
            layer = 0 if slip.get("layer_zero") else layer
            if same_start is not None and not slip.get("always_slice"):
                t = k.shape[2]
                start = 0 if slip.get("slice_from_zero") else same_start
                self.k[layer, :batch, :, start : start + t] = k
                self.v[layer, :batch, :, start : start + t] = v
                return
            if slip.get("always_slice"):
                start = int(positions[0, 0])
                self.k[layer, :batch, :, start : start + k.shape[2]] = k
                self.v[layer, :batch, :, start : start + k.shape[2]] = v
                return
            rows = torch.arange(batch)[:, None]
            self.k[layer][rows, :, positions] = k.transpose(1, 2)
            self.v[layer][rows, :, positions] = (k if slip.get("keys_twice") else v).transpose(1, 2)

        def read(self, layer, batch, length):
            if slip.get("copies"):
                return self.k[layer, :batch, :, :length].clone(), self.v[layer, :batch, :, :length].clone()
            if slip.get("all_rows_read"):
                return self.k[layer, :, :, :length], self.v[layer, :, :, :length]
            if slip.get("swapped"):
                return self.v[layer, :batch, :, :length], self.k[layer, :batch, :, :length]
            end = length - 1 if slip.get("short") else length
            return self.k[layer, :batch, :, :end], self.v[layer, :batch, :, :end]

        def move_row(self, src, dst, length):
            if slip.get("no_move"):
                return
            if slip.get("move_swapped"):
                src, dst = dst, src
            if slip.get("move_one_layer"):
                self.k[0, dst, :, :length] = self.k[0, src, :, :length]
                self.v[0, dst, :, :length] = self.v[0, src, :, :length]
                return
            self.k[:, dst, :, :length] = self.k[:, src, :, :length]
            self.v[:, dst, :, :length] = self.v[:, src, :, :length]

    return ContiguousKVCache


class CacheByLayers:
    """Right, written differently: one tensor per layer (a list), narrow() for views, index_copy_ for rows."""

    def __init__(self, config, batch_size, max_len, dtype, device):
        shape = (batch_size, config.num_kv_heads, max_len, config.head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]

    def write(self, layer, positions, k, v, same_start=None):
        for b in range(positions.shape[0]):  # row by row: each row's positions may differ
            for cache, new in ((self.keys[layer], k), (self.values[layer], v)):
                cache[b].index_copy_(1, positions[b], new[b])

    def read(self, layer, batch, length):
        return self.keys[layer].narrow(0, 0, batch).narrow(2, 0, length), self.values[layer].narrow(0, 0, batch).narrow(
            2, 0, length
        )

    def move_row(self, src, dst, length):
        for cache in (*self.keys, *self.values):
            cache[dst, :, :length] = cache[src, :, :length]


right(CC, cache_with())
right(CC, CacheByLayers)
wrong(CC, "a new cache holds zeros", cache_with(empty=True))
wrong(CC, "(they are the other tensor's: keys and values swapped)", cache_with(swapped=True))
wrong(CC, "each layer has its own K/V", cache_with(layer_zero=True))
wrong(CC, "gets its token at position 6", cache_with(slice_from_zero=True))
wrong(CC, "each row's tokens go to its own positions", cache_with(always_slice=True))
wrong(CC, "your code raised RuntimeError: The expanded size of the tensor (3)", cache_with(all_rows=True))
wrong(CC, "move_row(src, dst, length) copies positions", cache_with(no_move=True))
wrong(CC, "move_row(src, dst, length) copies positions", cache_with(move_swapped=True))
wrong(CC, "in every layer", cache_with(move_one_layer=True))
wrong(CC, "read returned a copy", cache_with(copies=True))
wrong(CC, "expected (3, 2, 8, 4) [batch, kv_heads, length, head_dim]", cache_with(short=True))
wrong(CC, "expected (2, 2, 4, 4): the first `batch` rows", cache_with(all_rows_read=True))
wrong(CC, "layer 0's keys differ", cache_with(shared_slab=True))
wrong(CC, "values differ", cache_with(keys_twice=True))
