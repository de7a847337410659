"""K/V head pooling, a checkpoint surgery: turn a model's K/V heads into fewer, shared ones (MHA → GQA → MQA).

Grouped-query attention lets ``G`` query heads share one K/V head, cutting the KV cache by
``G``. A model trained with more K/V heads can be converted without retraining by
**mean-pooling** each group of K/V projection matrices into one (Ainslie et al., *GQA*, 2023,
who then "uptrain" briefly to recover quality). The query heads keep their order: query head
``h`` used K/V head ``h // (H / KV)`` and now uses ``h // (H / KV')`` — the pooled head of the
group its old head belonged to. What pooling costs in quality is the chapter's measurement.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

from minillm.config import ModelConfig


def pool_kv_heads(model_dir: str | Path, out_dir: str | Path, num_kv_heads: int) -> Path:
    """Write a copy of the HF folder ``model_dir`` with ``num_kv_heads`` K/V heads to ``out_dir``."""
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    config = ModelConfig.from_folder(model_dir)
    old = config.num_kv_heads
    if num_kv_heads < 1 or old % num_kv_heads or config.num_heads % num_kv_heads:
        raise ValueError(
            f"num_kv_heads={num_kv_heads} must divide the model's {old} K/V heads and {config.num_heads} query heads"
        )
    group = old // num_kv_heads
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_dir}: no .safetensors files to convert")
    out_dir.mkdir(parents=True, exist_ok=True)
    for path in files:
        tensors = load_file(str(path))
        for name, tensor in tensors.items():
            if name.endswith(("self_attn.k_proj.weight", "self_attn.v_proj.weight")):
                t = tensor.float().view(num_kv_heads, group, config.head_dim, -1).mean(dim=1)
                tensors[name] = t.reshape(num_kv_heads * config.head_dim, -1).to(tensor.dtype)
            elif name.endswith(("self_attn.k_proj.bias", "self_attn.v_proj.bias")):
                t = tensor.float().view(num_kv_heads, group, config.head_dim).mean(dim=1)
                tensors[name] = t.reshape(-1).to(tensor.dtype)
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
