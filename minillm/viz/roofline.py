"""The roofline: is a step limited by arithmetic or by memory traffic?

A kernel doing ``F`` FLOPs while moving ``B`` bytes has arithmetic intensity ``I = F / B``.
Its speed cannot exceed ``min(peak_flops, bandwidth × I)``. Decode multiplies every weight by
one token per sequence (I ≈ 1 FLOP/byte in bf16): it sits on the sloped, memory-bound part.
Prefill multiplies every weight by hundreds of tokens: it reaches the flat, compute-bound part.

We measure this machine's roof with two micro-benchmarks (a large copy, a large matmul)
rather than trusting a datasheet, then place real prefill and decode steps of the engine on it.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch


@dataclass
class MachinePeaks:
    device: str
    dtype: str
    bandwidth_gbs: float  # measured bytes moved per second (read + write), GB/s
    flops_tflops: float  # measured matmul rate, TFLOP/s

    @property
    def ridge_intensity(self) -> float:
        """FLOPs per byte where the memory roof meets the compute roof."""
        return self.flops_tflops * 1e12 / (self.bandwidth_gbs * 1e9)


@dataclass
class RooflinePoint:
    name: str
    flops: float
    bytes: float
    seconds: float

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes

    @property
    def achieved_tflops(self) -> float:
        return self.flops / self.seconds / 1e12


def _median_time(fn, repeats: int, sync) -> float:
    fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_machine(
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    copy_mb: int = 256,
    matmul_n: int = 1024,
    repeats: int = 5,
) -> MachinePeaks:
    """Bandwidth from a large tensor copy; FLOP rate from a square matmul. Takes about a second."""
    device = torch.device(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if device.type == "cuda":
        copy_mb, matmul_n = max(copy_mb, 1024), max(matmul_n, 8192)
    src = torch.empty(copy_mb * 2**20 // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    t_copy = _median_time(lambda: dst.copy_(src), repeats, sync)
    a = torch.randn(matmul_n, matmul_n, device=device).to(dtype)
    b = torch.randn(matmul_n, matmul_n, device=device).to(dtype)
    t_mm = _median_time(lambda: a @ b, repeats, sync)
    return MachinePeaks(
        device=str(device),
        dtype=str(dtype).replace("torch.", ""),
        bandwidth_gbs=2 * src.nbytes / t_copy / 1e9,
        flops_tflops=2 * matmul_n**3 / t_mm / 1e12,
    )


def step_cost(config, dtype_bytes: float, tokens: int, batch: int, context: int) -> tuple[float, float]:
    """FLOPs and bytes of one forward step: weights read once, 2 FLOPs per weight per token, plus
    attention over ``context`` cached positions (read K/V, q·k and p·v)."""
    weight_bytes = config.num_params * dtype_bytes
    kv_per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim * dtype_bytes
    attention_flops = 4 * config.num_layers * config.num_heads * config.head_dim * tokens * context
    flops = 2 * config.num_params * tokens + attention_flops
    bytes_moved = weight_bytes + kv_per_token * batch * context
    return flops, bytes_moved


def measure_step_points(
    llm, prompt_lens=(16, 128, 512), decode_batches=(1, 8), context: int = 128, repeats: int = 3
) -> list[RooflinePoint]:
    """Time real prefill and decode steps of ``llm``'s model and cost them with ``step_cost``."""
    from minillm.kvcache import ContiguousKVCache
    from minillm.models.llama import ForwardBatch

    model, device = llm.model, llm.device
    dtype_bytes = torch.empty((), dtype=llm.dtype).element_size()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    points = []
    for n in prompt_lens:
        ids = torch.randint(0, llm.model_config.vocab_size, (1, n), device=device)
        pos = torch.arange(n, device=device)[None]
        last = torch.tensor([n - 1], device=device)

        def prefill(ids=ids, pos=pos, last=last, n=n):
            cache = ContiguousKVCache(model.config, 1, n, llm.dtype, device)
            model(ForwardBatch(ids, pos, cache, kv_len=n, logit_index=last, same_start=0))

        seconds = _median_time(prefill, repeats, sync)
        flops, nbytes = step_cost(llm.model_config, dtype_bytes, n, 1, n // 2)
        points.append(RooflinePoint(f"prefill {n} tokens", flops, nbytes, seconds))
    for b in decode_batches:
        cache = ContiguousKVCache(model.config, b, context + 1, llm.dtype, device)
        ids = torch.zeros(b, 1, dtype=torch.long, device=device)
        pos = torch.full((b, 1), context, device=device)

        def decode(ids=ids, pos=pos, cache=cache):
            model(ForwardBatch(ids, pos, cache, kv_len=context + 1, same_start=context))

        seconds = _median_time(decode, repeats, sync)
        flops, nbytes = step_cost(llm.model_config, dtype_bytes, b, b, context)
        points.append(RooflinePoint(f"decode batch {b}", flops, nbytes, seconds))
    return points


def roofline_figure(peaks: MachinePeaks, points: list[RooflinePoint] = ()):
    import plotly.graph_objects as go

    lo = min([0.1] + [p.intensity / 2 for p in points])
    hi = max([peaks.ridge_intensity * 20] + [p.intensity * 2 for p in points])
    xs = [lo * (hi / lo) ** (i / 100) for i in range(101)]
    roof = [min(peaks.flops_tflops, peaks.bandwidth_gbs * 1e9 * x / 1e12) for x in xs]
    fig = go.Figure(go.Scatter(x=xs, y=roof, mode="lines", name="roof (measured)", line=dict(color="black")))
    for p in points:
        kind = "prefill" if p.name.startswith("prefill") else "decode"
        fig.add_trace(
            go.Scatter(
                x=[p.intensity],
                y=[p.achieved_tflops],
                mode="markers+text",
                text=[p.name],
                textposition="top center",
                name=p.name,
                marker=dict(size=11, symbol="circle" if kind == "prefill" else "diamond"),
            )
        )
    fig.update_layout(
        title=(
            f"Roofline on {peaks.device} ({peaks.dtype}): {peaks.bandwidth_gbs:.0f} GB/s, "
            f"{peaks.flops_tflops * 1000:.0f} GFLOP/s, ridge at {peaks.ridge_intensity:.0f} FLOP/byte"
        ),
        xaxis=dict(title="arithmetic intensity (FLOP / byte)", type="log"),
        yaxis=dict(title="achieved TFLOP/s", type="log"),
        template="plotly_white",
        showlegend=False,
    )
    return fig
