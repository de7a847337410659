"""Ready a loaded model to run: the one sequence every model the engine runs goes through.

The engine's own model (``engine/builder.py``), a speculative draft model (same file) and every
parallel worker's shard (``parallel/worker.py``) are set up the same way, in the same order:
the attention backend first (and the dtype paged decode attention computes in; with it the fused
element-wise kernels, for the Triton backend on a GPU), then the sliding
window, then the linear layers' weight methods — last, because prepacking and quantization
replace the plain weights the earlier steps do not need, and a compiled decode step (built after
this) folds in whatever storage the methods chose.
"""

from __future__ import annotations

import torch

from minillm.config import EngineConfig
from minillm.models.llama import LlamaForCausalLM
from minillm.runtime.weight_methods import apply_weight_methods


def configure_model(
    model: LlamaForCausalLM,
    weights: EngineConfig,
    backend: str,
    window: int | None,
    attention_dtype: torch.dtype | None = None,
    tokenizer=None,
) -> None:
    """Set ``model``'s attention ``backend`` (computing decode attention in ``attention_dtype``;
    None: the model's dtype), its sliding ``window``, and the weight methods ``weights`` asks for
    (``quantization``, ``sparsity``, ``cpu_prepack``, ``weight_offload``, ``compile``;
    ``tokenizer``: for calibration)."""
    model.set_attention_backend(backend, attention_dtype)
    model.set_fused_kernels(backend == "triton" and model.device.type == "cuda")
    model.sliding_window = window
    apply_weight_methods(weights, model, model.device, model.dtype, tokenizer)
