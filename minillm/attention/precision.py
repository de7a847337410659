"""Which dtype to compute decode attention in, chosen per machine by measuring.

A bf16 model keeps a bf16 KV pool (half the bytes of fp32). Whether attention should also
*compute* in bf16 depends on the CPU: with AMX tiles (recent Xeons) bf16 matmuls are fast;
without them — AMD EPYC, most laptops — PyTorch's bf16 SDPA for a decode step runs several
times slower than fp32 on the same data, upcast included. No CPU flag tells the whole story
(the kernels PyTorch picks change between versions), so we time both on the model's own head
layout once, keep fp32 only when it wins clearly, and remember the answer per machine in the
project's cache folder — so every engine on a machine makes the same choice, run after run
(tokens do not depend on the noise of one start-up).

On a GPU and for fp32 models there is nothing to choose: the model's dtype is used.
"""

from __future__ import annotations

import json
import os
import statistics
import time

import torch
import torch.nn.functional as F

from minillm.assets import cache_dir
from minillm.machine import machine_description

# fp32 must be this much faster to be chosen: a near-tie keeps the model's dtype.
MARGIN = 1.2


def decode_attention_dtype(
    model_dtype: torch.dtype, device: torch.device, num_heads: int, num_kv_heads: int, head_dim: int
) -> torch.dtype:
    """The dtype decode attention should compute in on this machine (see the module docstring)."""
    if device.type != "cpu" or model_dtype == torch.float32:
        return model_dtype
    key = f"{_machine_key()}|{model_dtype}|{num_heads}x{num_kv_heads}x{head_dim}"
    decision = _load().get(key)
    if decision is None:
        timings = measure_decode_attention(model_dtype, num_heads, num_kv_heads, head_dim)
        choice = (
            "float32" if timings["float32"] * MARGIN < timings[str(model_dtype).removeprefix("torch.")] else "model"
        )
        decision = _save(key, {"choice": choice, "ms": timings})
    return torch.float32 if decision["choice"] == "float32" else model_dtype


def measure_decode_attention(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, batch: int = 8, context: int = 512
) -> dict[str, float]:
    """Median ms of one decode attention call (``batch`` rows × ``context`` keys, with a mask as
    ragged batches have) computed in ``dtype`` and in fp32 — the fp32 time includes upcasting
    the gathered K/V, as the engine must."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(batch, num_heads, 1, head_dim, generator=g).to(dtype)
    k = torch.randn(batch, num_kv_heads, context, head_dim, generator=g).to(dtype)
    v = torch.randn(batch, num_kv_heads, context, head_dim, generator=g).to(dtype)
    mask = (torch.arange(context)[None] < torch.randint(context // 2, context + 1, (batch, 1), generator=g))[
        :, None, None
    ]
    gqa = num_heads != num_kv_heads

    def run(compute: torch.dtype):
        def call():
            F.scaled_dot_product_attention(
                q.to(compute), k.to(compute), v.to(compute), attn_mask=mask, enable_gqa=gqa
            ).to(dtype)

        return call

    calls = {str(dtype).removeprefix("torch."): run(dtype), "float32": run(torch.float32)}
    samples: dict[str, list[float]] = {name: [] for name in calls}
    with torch.inference_mode():
        for call in calls.values():
            call()  # warm-up: kernel selection, allocator
        for _ in range(15):  # interleaved, so machine noise hits both alike
            for name, call in calls.items():
                start = time.perf_counter()
                call()
                samples[name].append(1000 * (time.perf_counter() - start))
    return {name: statistics.median(ms) for name, ms in samples.items()}


def _machine_key() -> str:
    m = machine_description(torch.device("cpu"))
    return f"{m['cpu']}|{','.join(m['cpu_flags'])}|torch {m['torch']}|{torch.get_num_threads()} threads"


def _path():
    return cache_dir() / "machine" / "attention_dtype.json"


def _load() -> dict:
    """The remembered decisions; a missing, unreadable or malformed file counts as none."""
    try:
        decisions = json.loads(_path().read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(decisions, dict):
        return {}
    return {k: v for k, v in decisions.items() if isinstance(v, dict) and v.get("choice") in ("float32", "model")}


def _save(key: str, decision: dict) -> dict:
    """Remember ``decision`` under ``key`` and return the decision that stands: if another
    engine recorded one first (two first starts at once), its choice wins, so engines on the
    machine decide alike. A read-only cache folder: measured again at the next start."""
    path = _path()
    decisions = _load()
    decision = decisions.setdefault(key, decision)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.{time.monotonic_ns()}.tmp")
        tmp.write_text(json.dumps(decisions, indent=1))
        tmp.replace(path)  # atomic: a concurrent engine reads the old file or the new one
    except OSError:
        pass
    return decision
