"""How a model spreads over devices: weights and KV cache per device, communication per token,
the largest batch at a context length, and a bandwidth-bound decode estimate — for tensor
parallelism (TP: every layer's matrices split across ``tp`` devices) and pipeline parallelism
(PP: the layers split into ``pp`` stages).

The arithmetic, per decode step of a batch of ``b`` sequences:

- **weights per device**: decoder weights ÷ (tp × pp); the embedding and LM head are split
  over the TP ranks (vocabulary-parallel) and live on the first / last stage;
- **KV per token per device**: ``2 × (layers / pp) × kv_heads_per_rank × head_dim × bytes``,
  where ``kv_heads_per_rank = kv_heads / tp`` — or 1 when there are fewer K/V heads than TP
  ranks, because each rank then holds a *replica* of the head its query heads need (the
  memory does not shrink past that point);
- **TP communication**: two all-reduces per layer (after attention's output projection and
  after the MLP's down projection) of ``b × hidden × bytes``; a ring all-reduce sends
  ``2 (tp − 1) / tp`` times the message from every device, and pays a fixed latency each time;
- **time per step** (a lower bound): reading this device's weights and the batch's KV cache
  at the memory bandwidth, or the FLOPs at the peak rate, whichever is longer — plus the
  all-reduces. Pipeline stages run one after another for a single sequence, so PP adds no
  speed to one request's decode; it adds capacity (and throughput once micro-batches fill
  every stage).

Device figures are the vendors' datasheets (NVIDIA H100 SXM and H200 SXM: HBM bandwidth,
dense bf16 tensor-core rate, NVLink 4 at 450 GB/s per direction); model shapes are the
published configs. These are bounds and plans, not measurements: real decode reaches some
fraction of the bandwidth bound (``efficiency``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from minillm.layers.tensor_parallel import heads_of_rank, stage_layers


@dataclass(frozen=True)
class ModelShape:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied_embeddings: bool = False

    @property
    def params_per_layer(self) -> int:
        attention = (
            self.hidden * self.head_dim * (self.heads + 2 * self.kv_heads) + self.heads * self.head_dim * self.hidden
        )
        return attention + 3 * self.hidden * self.intermediate + 2 * self.hidden  # + two RMSNorm weights

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2)

    @property
    def params(self) -> int:
        return self.layers * self.params_per_layer + self.embedding_params + self.hidden


@dataclass(frozen=True)
class Device:
    name: str
    memory_gb: float  # usable HBM, GB (1e9 bytes)
    bandwidth_gbs: float  # HBM, GB/s
    bf16_tflops: float  # dense
    link_gbs: float  # per direction, per device, to the others in the node
    link_latency_us: float = 10.0  # one small all-reduce across a node (order of magnitude)


MODELS = {
    m.name: m
    for m in [
        ModelShape("SmolLM2-135M", 30, 576, 9, 3, 64, 1536, 49152, tied_embeddings=True),
        ModelShape("Llama-2-7B", 32, 4096, 32, 32, 128, 11008, 32000),
        ModelShape("Llama-2-70B", 80, 8192, 64, 8, 128, 28672, 32000),
        ModelShape("Llama-3.1-405B", 126, 16384, 128, 8, 128, 53248, 128256),
    ]
}

DEVICES = {
    d.name: d
    for d in [
        Device("H100 SXM 80GB", 80, 3350, 989, 450),
        Device("H200 SXM 141GB", 141, 4800, 989, 450),
    ]
}

DTYPE_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "int8": 1.0, "int4": 0.5}


@dataclass
class Plan:
    model: str
    device: str
    tp: int
    pp: int
    weight_dtype: str
    kv_dtype: str
    context: int
    weights_per_device_gb: float
    kv_per_token_per_device_bytes: float
    kv_heads_per_rank: int
    kv_replication: int  # how many ranks hold each K/V head
    free_for_kv_gb: float
    max_batch: int  # sequences of ``context`` tokens that fit (0: the weights alone do not fit)
    allreduce_bytes_per_token: float  # sent by each device per decoded token, all layers of its stage
    step_ms_batch1: float  # bandwidth/compute bound + all-reduces, one sequence at ``context``
    tok_s_batch1: float
    fits: bool


def _check(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer")


def plan(
    model: str | ModelShape,
    device: str | Device,
    tp: int = 1,
    pp: int = 1,
    weight_dtype: str = "bf16",
    kv_dtype: str = "bf16",
    context: int = 4096,
    memory_utilization: float = 0.9,
) -> Plan:
    """The plan for ``model`` on ``tp × pp`` devices of kind ``device`` (see the module docstring)."""
    m = MODELS[model] if isinstance(model, str) else model
    d = DEVICES[device] if isinstance(device, str) else device
    for name, value in (("tp", tp), ("pp", pp), ("context", context)):
        _check(name, value)
    # The engine's own rules (ValueError for a layout it cannot take); the fullest rank and stage count.
    kv_heads_per_rank = max(len(heads_of_rank(m.heads, m.kv_heads, r, tp)[1]) for r in range(tp))
    layers_per_stage = max(len(stage_layers(m.layers, pp, s)) for s in range(pp))
    for name, value in (("weight_dtype", weight_dtype), ("kv_dtype", kv_dtype)):
        if value not in DTYPE_BYTES:
            raise ValueError(f"{name}={value!r} is not one of {sorted(DTYPE_BYTES)}")
    wb, kb = DTYPE_BYTES[weight_dtype], DTYPE_BYTES[kv_dtype]
    # The largest stage: its decoder layers plus the (vocabulary-split) embedding or LM head.
    stage_params = layers_per_stage * m.params_per_layer / tp + m.vocab * m.hidden / tp
    if pp == 1:
        stage_params += (m.embedding_params - m.vocab * m.hidden) / tp
    weights = stage_params * wb
    replication = max(1, tp // m.kv_heads)
    kv_per_token = 2 * layers_per_stage * kv_heads_per_rank * m.head_dim * kb
    usable = d.memory_gb * 1e9 * memory_utilization
    free = usable - weights
    max_batch = max(0, math.floor(free / (kv_per_token * context))) if free > 0 else 0
    # Two all-reduces per layer of one token's hidden state; a ring sends 2(tp-1)/tp of it per device.
    allreduce = 2 * layers_per_stage * m.hidden * wb * (2 * (tp - 1) / tp) if tp > 1 else 0.0
    # Batch 1: every stage runs in turn (the token passes through all of them).
    read = weights + kv_per_token * context
    flops = 2 * stage_params
    stage_s = max(read / (d.bandwidth_gbs * 1e9), flops / (d.bf16_tflops * 1e12))
    comm_s = allreduce / (d.link_gbs * 1e9) + (2 * layers_per_stage * d.link_latency_us * 1e-6 if tp > 1 else 0.0)
    step_s = pp * (stage_s + comm_s)
    return Plan(
        m.name, d.name, tp, pp, weight_dtype, kv_dtype, context, weights / 1e9, kv_per_token, kv_heads_per_rank,
        replication, max(0.0, free) / 1e9, max_batch, allreduce, 1e3 * step_s, 1 / step_s, free > 0,
    )  # fmt: skip


def table(plans: list[Plan]) -> str:
    head = (f"{'model':<16}{'device':<16}{'TP×PP':>6}{'dtype':>7}{'weights/dev':>12}{'KV/token/dev':>13}"
            f"{'max batch':>10}{'AR/token':>10}{'bound tok/s':>12}")  # fmt: skip
    lines = [head]
    for p in plans:
        lines.append(
            f"{p.model:<16}{p.device:<16}{f'{p.tp}×{p.pp}':>6}{p.weight_dtype:>7}{p.weights_per_device_gb:10.1f}GB"
            f"{p.kv_per_token_per_device_bytes / 1e3:11.1f}kB{p.max_batch if p.fits else 'no fit':>10}"
            f"{p.allreduce_bytes_per_token / 1e3:8.0f}kB{p.tok_s_batch1:12.0f}"
        )
    return "\n".join(lines)
