"""K/V head pooling, a checkpoint surgery: turn a model's K/V heads into fewer, shared ones (MHA → GQA → MQA).

Grouped-query attention lets ``G`` query heads share one K/V head, cutting the KV cache by
``G``. A model trained with more K/V heads can be converted without retraining by
**mean-pooling** each group of K/V projection matrices into one (Ainslie et al., *GQA*, 2023,
who then "uptrain" briefly to recover quality). The query heads keep their order: query head
``h`` used K/V head ``h // (H / KV)`` and now uses ``h // (H / KV')`` — the pooled head of the
group its old head belonged to. What pooling costs in quality is the chapter's measurement.

The arithmetic on one projection is ``pool_heads``, the hook chapter 05's exercise plugs into:
``pool_kv_heads`` calls it through ``minillm.hooks`` for every K and V projection (and bias).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

import minillm.hooks as hooks
from minillm.config import ModelConfig


@hooks.reference("pool_heads")
def pool_heads(weight: torch.Tensor, num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """``weight[H*D, in]`` (H = ``num_heads`` heads of D rows each, in head order) → ``[KV*D, in]``:
    pooled head ``j`` is the mean of heads ``j*G .. j*G+G-1`` (G = H / KV). Consecutive heads,
    because query head ``h`` of a GQA model uses K/V head ``h // G``: the query heads that used
    heads ``j*G ..`` before all use pooled head ``j`` after. The mean is taken in fp32 and cast
    back to the weight's dtype, so a bf16 checkpoint loses no precision to the sum."""
    rows, cols = weight.shape
    head_dim, group = rows // num_heads, num_heads // num_kv_heads
    pooled = weight.float().view(num_kv_heads, group, head_dim, cols).mean(dim=1)
    return pooled.reshape(num_kv_heads * head_dim, cols).to(weight.dtype)


def pool_kv_heads(model_dir: str | Path, out_dir: str | Path, num_kv_heads: int) -> Path:
    """Write a copy of the HF folder ``model_dir`` with ``num_kv_heads`` K/V heads to ``out_dir``."""
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    config = ModelConfig.from_folder(model_dir)
    old = config.num_kv_heads
    if num_kv_heads < 1 or old % num_kv_heads or config.num_heads % num_kv_heads:
        raise ValueError(
            f"num_kv_heads={num_kv_heads} must divide the model's {old} K/V heads and {config.num_heads} query heads"
        )
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_dir}: no .safetensors files to convert")
    out_dir.mkdir(parents=True, exist_ok=True)
    for path in files:
        tensors = load_file(str(path))
        for name, tensor in tensors.items():
            if name.endswith(("self_attn.k_proj.weight", "self_attn.v_proj.weight")):
                tensors[name] = _pooled(tensor, old, num_kv_heads, name)
            elif name.endswith(("self_attn.k_proj.bias", "self_attn.v_proj.bias")):
                # a bias is one column of per-row values: pooled exactly like the weight's rows
                tensors[name] = _pooled(tensor[:, None], old, num_kv_heads, name)[:, 0]
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(out_dir / path.name), metadata={"format": "pt"})
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():  # tensor names and files are unchanged; only sizes shrank
        shutil.copy(index, out_dir / index.name)
    raw = json.loads((model_dir / "config.json").read_text())
    raw["num_key_value_heads"] = num_kv_heads
    (out_dir / "config.json").write_text(json.dumps(raw, indent=2))
    for extra in model_dir.iterdir():  # tokenizer, generation config, card...
        if extra.is_file() and extra.suffix != ".safetensors" and extra.name not in ("config.json", index.name):
            shutil.copy(extra, out_dir / extra.name)
    return out_dir


def _pooled(tensor: torch.Tensor, num_heads: int, num_kv_heads: int, name: str) -> torch.Tensor:
    """``hooks.pool_heads`` on one tensor, its result checked before it is written: a wrong shape
    would only surface later, as a confusing load error of the converted checkpoint."""
    out = hooks.pool_heads(tensor, num_heads, num_kv_heads)
    expected = (tensor.shape[0] // num_heads * num_kv_heads, tensor.shape[1])
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != expected:
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"pooling {name} gave {got}, expected {expected} ({num_heads} → {num_kv_heads} heads)")
    return out
