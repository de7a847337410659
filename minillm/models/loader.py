"""Load a Hugging Face safetensors folder (single file or sharded) into ``LlamaForCausalLM``.

The loader maps checkpoint names onto our modules and fills the fused projections slice by
slice, checking every shape. Anything missing, surplus, misshapen or unreadable is reported
with the tensor and file it concerns — a half-loaded model that silently generates garbage
is the worst possible failure for a learner.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from minillm.config import ModelConfig
from minillm.errors import ModelLoadError
from minillm.models.llama import LlamaForCausalLM

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")

#: Checkpoint tensors we know and deliberately do not load (recomputed at run time).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def safetensors_files(folder: Path) -> list[Path]:
    """The weight files of a folder: the shards named by the index, or ``*.safetensors``."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as err:
            raise ModelLoadError(f"{index}: unreadable shard index ({err})") from None
        files = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{index} lists shard(s) that do not exist: {', '.join(missing)}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder}: no *.safetensors weight files found")
    return files


class _Target:
    """Where one checkpoint tensor goes: a parameter, optionally a row slice of it."""

    def __init__(self, param: torch.Tensor, start: int | None = None, stop: int | None = None):
        self.param, self.start, self.stop = param, start, stop

    def view(self) -> torch.Tensor:
        return self.param if self.start is None else self.param[self.start : self.stop]


def _targets(model: LlamaForCausalLM) -> dict[str, _Target]:
    """Checkpoint name → destination, including the slices of the fused projections."""
    cfg = model.config
    q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    out = {
        "model.embed_tokens.weight": _Target(model.embed_tokens.weight),
        "model.norm.weight": _Target(model.norm.weight),
    }
    if model.lm_head is not None:
        out["lm_head.weight"] = _Target(model.lm_head.weight)
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        qkv = layer.attn.qkv_proj
        spans = {"q": (0, q), "k": (q, q + kv), "v": (q + kv, q + 2 * kv)}
        for name, (a, b) in spans.items():
            out[f"{p}self_attn.{name}_proj.weight"] = _Target(qkv.weight, a, b)
            if qkv.bias is not None:
                out[f"{p}self_attn.{name}_proj.bias"] = _Target(qkv.bias, a, b)
        out[f"{p}self_attn.o_proj.weight"] = _Target(layer.attn.o_proj.weight)
        out[f"{p}mlp.gate_proj.weight"] = _Target(layer.mlp.gate_up_proj.weight, 0, inter)
        out[f"{p}mlp.up_proj.weight"] = _Target(layer.mlp.gate_up_proj.weight, inter, 2 * inter)
        out[f"{p}mlp.down_proj.weight"] = _Target(layer.mlp.down_proj.weight)
        out[f"{p}input_layernorm.weight"] = _Target(layer.input_norm.weight)
        out[f"{p}post_attention_layernorm.weight"] = _Target(layer.post_attn_norm.weight)
    return out


def load_model(
    folder: str | Path,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    max_positions: int | None = None,
) -> LlamaForCausalLM:
    """Build the decoder for ``folder/config.json`` and fill it from the folder's safetensors."""
    folder = Path(folder)
    config = ModelConfig.from_folder(folder)
    device = torch.device(device)
    with torch.device("meta"):  # no time wasted on random init of weights we overwrite
        model = LlamaForCausalLM(config)
    model = model.to_empty(device=device).to(dtype)

    targets = _targets(model)
    for path in safetensors_files(folder):
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():
                    if name.endswith(_IGNORED_SUFFIXES):
                        continue
                    if name == "lm_head.weight" and model.lm_head is None:
                        continue  # some tied checkpoints store a copy; ours is the embedding
                    target = targets.pop(name, None)
                    if target is None:
                        raise ModelLoadError(f"{path}: unexpected tensor {name!r} for a {config.model_type} model")
                    tensor = f.get_tensor(name)
                    dest = target.view()
                    if tuple(tensor.shape) != tuple(dest.shape):
                        raise ModelLoadError(
                            f"{path}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                            f"expected {tuple(dest.shape)} from config.json"
                        )
                    with torch.no_grad():
                        dest.copy_(tensor)
        except SafetensorError as err:
            raise ModelLoadError(f"{path}: corrupt or unreadable safetensors file ({err})") from None
        except OSError as err:
            raise ModelLoadError(f"{path}: cannot read weights ({err})") from None
    if targets:
        missing = sorted(targets)
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ModelLoadError(f"{folder}: incomplete checkpoint, {len(missing)} tensor(s) missing: {shown}")
    model.init_rope(max_positions or config.max_position_embeddings)
    return model.eval()
