"""Widgets and plots (plotly + ipywidgets) that show the engine's memory and time.

Every function returns a plain ``plotly.graph_objects.Figure`` (or an ipywidgets container
around one), built from numbers the engine really produced, so they are testable outside a
notebook and work the same on CPU and CUDA.
"""

from minillm.viz.kv_memory import KV_PRESETS, KVPreset, kv_cache_bytes, kv_memory_figure, kv_memory_widget
from minillm.viz.quant import (
    bits_per_weight,
    fake_quantize,
    layer_error_heatmap,
    quant_tradeoff,
    quant_tradeoff_figure,
    quantized_weight_bytes,
)
from minillm.viz.roofline import MachinePeaks, RooflinePoint, measure_machine, measure_step_points, roofline_figure
from minillm.viz.serving import (
    batching_segments,
    batching_timeline,
    block_table_explorer,
    compare_timelines,
    latency_percentiles,
)
from minillm.viz.spec import (
    expected_tokens_per_pass,
    modelled_speedup,
    spec_batch_figure,
    spec_k_figure,
    spec_steps_figure,
    spec_timeline,
    speculation_explorer,
    speculation_figure,
    trace_speculation,
)
from minillm.viz.timeline import latency_timeline

__all__ = [
    "KV_PRESETS",
    "KVPreset",
    "MachinePeaks",
    "RooflinePoint",
    "batching_segments",
    "batching_timeline",
    "bits_per_weight",
    "block_table_explorer",
    "compare_timelines",
    "expected_tokens_per_pass",
    "fake_quantize",
    "kv_cache_bytes",
    "kv_memory_figure",
    "kv_memory_widget",
    "latency_percentiles",
    "latency_timeline",
    "layer_error_heatmap",
    "measure_machine",
    "measure_step_points",
    "modelled_speedup",
    "quant_tradeoff",
    "quant_tradeoff_figure",
    "quantized_weight_bytes",
    "roofline_figure",
    "spec_batch_figure",
    "spec_k_figure",
    "spec_steps_figure",
    "spec_timeline",
    "speculation_explorer",
    "speculation_figure",
    "trace_speculation",
]
