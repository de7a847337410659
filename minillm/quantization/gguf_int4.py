"""Our SmolLM2 file's own 4-bit blocks, loaded as int4 weights without quantizing again.

The SmolLM2-135M this course ships is a llama.cpp GGUF file whose decoder weights are stored
as ``Q4_1``: blocks of 32 consecutive input weights of a row, each block 20 bytes — an fp16
scale ``d``, an fp16 minimum ``m`` and 16 bytes of 4-bit values ``q`` with ``w = q · d + m``.
That is exactly our ``int4`` format at ``group_size=32`` (asymmetric, a scale and a minimum per
group), so the blocks can become int4 layers as they are: the weights the engine multiplies are
the file's, bit for bit, with no round trip through bf16 and no second rounding. (The
converted HF folder the rest of the course loads rounds each ``q · d + m`` to bf16.)

In a block, byte ``j`` holds weight ``j`` in its low nibble and weight ``j + 16`` in its high
nibble (llama.cpp's ``block_q4_1``; not adjacent pairs as ``pack_int4`` stores them). Rows of
the query and key matrices are also permuted by llama.cpp's converter for its rotary
embedding layout; the same row permutation the float conversion undoes is applied to the
blocks (a row's groups move with it).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader

from minillm.assets import _field, _hf_name, _unpermute_rope
from minillm.quantization.checkpoint import _linear_layers

Q4_1_BLOCK = 32  # weights per block
Q4_1_BYTES = 20  # fp16 d, fp16 m, 16 bytes of nibbles


def q4_1_blocks(raw: np.ndarray, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Q4_1 tensor's bytes ``[rows, cols/32 · 20]`` → ``(q uint8 [rows, cols], d fp32
    [rows, cols/32], m fp32 [rows, cols/32])`` with ``w = q · d + m`` per block."""
    if cols % Q4_1_BLOCK:
        raise ValueError(f"Q4_1 rows hold whole blocks of {Q4_1_BLOCK}, got {cols} columns")
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(rows, cols // Q4_1_BLOCK, Q4_1_BYTES)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    nibbles = blocks[..., 4:]
    q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).reshape(rows, cols)
    return torch.from_numpy(q), torch.from_numpy(d), torch.from_numpy(m)


def gguf_int4_layers(gguf_file: str | Path, model) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Every decoder linear layer of ``model`` (our module names, fused shards concatenated in
    the layer's order) as ``(q, scale, minimum)`` read from the GGUF file's Q4_1 blocks.
    Raises ``ValueError`` naming a tensor that is not Q4_1 or a layer the file does not cover."""
    reader = GGUFReader(str(gguf_file))
    n_heads = int(_field(reader, "llama.attention.head_count"))
    n_kv = int(_field(reader, "llama.attention.head_count_kv", n_heads))
    targets = model.checkpoint_targets()
    names = {layer: name for name, layer in _linear_layers(model).items() if name != "lm_head"}
    parts: dict[str, dict[str | None, tuple]] = {name: {} for name in names.values()}
    for t in reader.tensors:
        target = targets.get(_hf_name(t.name))
        if target is None or target[0] not in names:
            continue
        if t.tensor_type.name != "Q4_1":
            raise ValueError(f"{gguf_file}: tensor {t.name!r} is {t.tensor_type.name}, not Q4_1")
        rows, cols = int(t.shape[1]), int(t.shape[0])  # GGUF lists the fastest dimension first
        q, d, m = q4_1_blocks(t.data, rows, cols)
        heads = n_heads if t.name.endswith("attn_q.weight") else n_kv if t.name.endswith("attn_k.weight") else 0
        if heads:
            q, d, m = (torch.from_numpy(_unpermute_rope(x.numpy(), heads).copy()) for x in (q, d, m))
        module, _, shard = target
        parts[names[module]][shard] = (q, d, m)
    out = {}
    for layer, name in names.items():
        order = list(layer.shards)  # {None: rows} for an unfused layer
        missing = [s for s in order if s not in parts[name]]
        if missing:
            raise ValueError(f"{gguf_file}: no Q4_1 tensor for {name} (shard {missing[0]!r})")
        out[name] = tuple(torch.cat([parts[name][s][i] for s in order]) for i in range(3))
    return out
