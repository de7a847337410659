"""MHA, GQA and MQA side by side: KV bytes per token, and decode time against context length.

The variants differ only in how many K/V heads the query heads share. Fewer K/V heads means a
smaller cache (``2 × layers × kv_heads × head_dim × bytes`` per token) and, at long contexts,
a faster decode step — a decode step reads the whole cache, and past a few thousand tokens
that read rivals reading the weights. The timing builds models of one shape with random
weights (speed does not depend on what the weights are) and times real decode steps of the
engine against a cache filled to each length.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, replace

import torch

from minillm.config import ModelConfig
from minillm.kvcache.addressing import kv_bytes_per_token


@dataclass
class VariantTiming:
    kv_heads: int
    context: int
    batch: int
    step_ms: float
    kv_bytes_per_token: int


def variant_name(kv_heads: int, heads: int) -> str:
    if kv_heads == heads:
        return f"MHA ({heads} KV heads)"
    if kv_heads == 1:
        return "MQA (1 KV head)"
    return f"GQA ({kv_heads} KV heads)"


def synthetic_config(
    hidden: int = 512, heads: int = 8, kv_heads: int = 8, layers: int = 4, vocab: int = 4096
) -> ModelConfig:
    return ModelConfig.from_dict(
        dict(
            model_type="llama",
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=hidden * 3,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            max_position_embeddings=65536,
        )
    )


@torch.inference_mode()
def time_decode_step(
    config: ModelConfig, context: int, batch: int, dtype=torch.float32, device="cpu", repeats: int = 5
) -> float:
    """Median milliseconds of one decode step of ``batch`` sequences at ``context`` tokens."""
    from minillm.kvcache import ContiguousKVCache
    from minillm.models.llama import ForwardBatch, LlamaForCausalLM

    device = torch.device(device)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()
    model.init_rope(context + 1)
    cache = ContiguousKVCache(config, batch, context + 1, dtype, device)
    ids = torch.zeros((batch, 1), dtype=torch.long, device=device)
    positions = torch.full((batch, 1), context, device=device)
    step = ForwardBatch(ids, positions, cache, kv_len=context + 1, same_start=context)
    times = []
    for i in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        model(step)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i:  # the first run warms up
            times.append(1000 * (time.perf_counter() - start))
    return statistics.median(times)


def measure_variants(
    kv_heads: tuple[int, ...] = (8, 2, 1),
    contexts: tuple[int, ...] = (256, 1024, 4096),
    batch: int = 8,
    hidden: int = 512,
    heads: int = 8,
    layers: int = 4,
    dtype=torch.float32,
    device="cpu",
    repeats: int = 5,
) -> list[VariantTiming]:
    base = synthetic_config(hidden, heads, heads, layers)
    rows = []
    for kv in kv_heads:
        config = replace(base, num_kv_heads=kv)
        for context in contexts:
            ms = time_decode_step(config, context, batch, dtype, device, repeats)
            rows.append(VariantTiming(kv, context, batch, ms, kv_bytes_per_token(config, dtype)))
    return rows


def variants_figure(timings: list[VariantTiming], heads: int = 8):
    """KV bytes per token (left) and decode step time against context (right), per variant."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    import minillm.viz.style as style

    fig = make_subplots(rows=1, cols=2, subplot_titles=("KV cache per token", "decode step vs context length"))
    variants = sorted({t.kv_heads for t in timings}, reverse=True)
    colors = ["#636efa", "#ef553b", "#00cc96", "#ab63fa", "#ffa15a"]
    for i, kv in enumerate(variants):
        rows = sorted((t for t in timings if t.kv_heads == kv), key=lambda t: t.context)
        name, color = variant_name(kv, heads), colors[i % len(colors)]
        fig.add_trace(
            go.Bar(x=[name], y=[rows[0].kv_bytes_per_token / 1024], name=name, showlegend=False, marker_color=color),
            row=1,
            col=1,
        )
        fig.add_trace(
            go.Scatter(
                x=[t.context for t in rows],
                y=[t.step_ms for t in rows],
                mode="lines+markers",
                name=name,
                line_color=color,
            ),
            row=1,
            col=2,
        )
    fig.update_yaxes(title_text="KiB per token", row=1, col=1)
    fig.update_xaxes(title_text="context (tokens)", type="log", row=1, col=2)
    fig.update_yaxes(title_text="ms per step", row=1, col=2)
    title, height = "MHA vs GQA vs MQA", 420
    fig.update_annotations(font_size=14)  # the subplot titles
    fig.update_layout(
        template="plotly_white",
        height=height,
        title=style.title(title),
        legend=style.legend_under_title(title, height),
        margin=dict(l=70, r=30, t=style.top_margin(title, legend=True, extra=style.LINE * 14 + 4), b=style.X_AXIS),
    )
    return fig
