"""Quantized checkpoints: quantize once, save, and load without quantizing again.

``minillm quantize MODEL --method int4 --out DIR`` writes a folder that ``LLM(DIR)`` loads as
it is: ``config.json`` with a ``quantization_config`` (method, group size, what the LM head
holds), the tokenizer files, and ``model.safetensors`` holding

- the norms (and an untied model's embedding) in the model's dtype, under their Hugging Face
  names — a tied model embeds from its int8 head, so its float embedding is not written;
- every linear layer under *our* module names (fused ``qkv_proj`` and ``gate_up_proj``, as the
  engine runs them): ``<name>.qweight`` (int8) and ``<name>.scales`` for int8 and w8a8 layers,
  ``<name>.int4`` (two values per byte), ``<name>.int4_scale`` and ``<name>.int4_min`` (fp32,
  one per group) for int4 and awq layers, ``<name>.inv_scale`` (``1/s`` per input channel: AWQ's
  scale, or SmoothQuant's smoothing for w8a8 — the stored weights are ``W · s``), and
  ``<name>.bias`` where there is one. The LM head is int8.

The calibrated methods (awq, w8a8) calibrate once, when the checkpoint is written: loading it
needs neither the calibration text nor its minute of activation statistics.

Loading goes the way every tensor goes into a layer: ``prepare_quantized`` gives each linear
layer the method it was saved in *before* loading, then the loader hands each saved tensor to
the layer's ``weight_loader`` (which passes it to the method, ``saved.py``). Every tensor is
checked before the model is returned: a missing, surplus or misshapen one is a
``ModelLoadError`` naming it. The values are the ones saved, bit for bit, so a loaded model
computes exactly what the model that was quantized in memory computes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

import minillm.hooks as hooks
from minillm.config import INT4_METHODS, QUANTIZATION_METHODS, check_quantization
from minillm.errors import ModelLoadError
from minillm.layers.linear import Linear
from minillm.quantization import default_group_size
from minillm.quantization.awq import AWQInt4Method, awq_scales
from minillm.quantization.calibration import calibration_ids
from minillm.quantization.int4 import Int4Method, quantize_int4
from minillm.quantization.int8 import Int8Method, quantize_int8, share_int8_head_as_embedding
from minillm.quantization.w8a8 import W8A8Method, w8a8_scales

FORMAT = "minillm"


def _linear_layers(model) -> dict:
    return {name: m for name, m in model.named_modules() if isinstance(m, Linear)}


def save_quantized(model, model_dir: str | Path, out_dir: str | Path, method: str, group_size: int | None = None,
                   dtype: str = "bf16", tokenizer=None, int4_layers: dict | None = None) -> Path:  # fmt: skip
    """Quantize ``model`` (loaded from the checkpoint in ``model_dir``, in ``dtype``) with
    ``method`` and write it, with ``model_dir``'s config and tokenizer, to ``out_dir``. The
    calibrated methods (awq, w8a8) calibrate on the shipped text, tokenized with ``tokenizer``.
    ``int4_layers`` (int4 only): each decoder layer's ``(q, scale, minimum)`` already quantized
    elsewhere (``gguf_int4.py``), written as they are."""
    check_quantization(method, group_size)
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    if method in INT4_METHODS and group_size is None:
        group_size = default_group_size(model)
    layers = _linear_layers(model)
    decoder = [layer for name, layer in layers.items() if name != "lm_head"]
    for name, layer in layers.items():  # every shape checked before anything is written
        if name != "lm_head":
            (Int4Method(group_size) if method in INT4_METHODS else Int8Method()).validate(layer, name)
    if int4_layers is not None and method != "int4":
        raise ValueError(f"int4_layers are int4 weights: method must be 'int4', not {method!r}")
    smoothing = _calibrate(model, method, decoder, group_size, tokenizer)
    tensors: dict[str, torch.Tensor] = {}
    for hf_name, (module, param, _) in model.checkpoint_targets().items():
        if module not in layers.values() and not (module is model.embed_tokens and model.config.tie_word_embeddings):
            tensors[hf_name] = getattr(module, param).detach().contiguous()  # a tied embedding is the int8 head
    for name, layer in layers.items():
        weight = layer.weight.detach()
        if layer in smoothing:  # the stored matrix is W · s; the layer divides x by s at run time
            s = smoothing[layer]
            # exactly the in-memory methods' arithmetic, so a loaded model is bit-identical to it
            weight = weight * s.to(weight.dtype) if method == "awq" else weight.float() * s
            tensors[f"{name}.inv_scale"] = (1.0 / s).float()
        if method in ("int8", "w8a8") or name == "lm_head":
            q, scale = quantize_int8(weight)
            if method == "int8" or name == "lm_head":
                scale = Int8Method.scale_for(scale, layer.weight.dtype)
            tensors[f"{name}.qweight"], tensors[f"{name}.scales"] = q, scale
        else:
            q, scale, low = int4_layers[name] if int4_layers is not None else quantize_int4(weight, group_size)
            tensors[f"{name}.int4"], tensors[f"{name}.int4_scale"], tensors[f"{name}.int4_min"] = (
                hooks.pack_int4(q),
                scale,
                low,
            )
        if layer.bias is not None:
            tensors[f"{name}.bias"] = layer.bias.detach().contiguous()
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out_dir / "model.safetensors"))
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": FORMAT,
        "method": method,
        "group_size": group_size if method in INT4_METHODS else None,
        "lm_head": "int8",
        "dtype": dtype,
    }
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for extra in model_dir.iterdir():  # tokenizer and generation config
        if (
            extra.is_file()
            and extra.suffix in (".json", ".txt", ".model")
            and extra.name
            not in (
                "config.json",
                "model.safetensors.index.json",
            )
        ):
            shutil.copy2(extra, out_dir / extra.name)
    return out_dir


def _calibrate(model, method: str, decoder: list, group_size: int | None, tokenizer) -> dict:
    """The per-input-channel ``s`` of every decoder layer for awq / w8a8 (the same search the
    engine runs when it quantizes in memory), else nothing."""
    if method not in ("awq", "w8a8"):
        return {}
    ids = calibration_ids(tokenizer)
    found = awq_scales(model, decoder, group_size, ids) if method == "awq" else w8a8_scales(model, decoder, ids)
    return {layer: s for layer, (s, _) in found.items()}


def quantization_config(folder: str | Path) -> dict | None:
    """The folder's ``quantization_config`` if it is a checkpoint this module wrote, else None;
    a quantization config of another kind is refused by name."""
    try:
        config = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    qc = config.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict) or qc.get("quant_method") != FORMAT:
        kind = qc.get("quant_method") if isinstance(qc, dict) else qc
        raise ModelLoadError(f"{folder}: quantization_config of kind {kind!r} is not supported (only {FORMAT!r})")
    return qc


def prepare_quantized(model, folder: Path, qc: dict) -> dict[str, tuple]:
    """Before loading: give each linear layer of ``model`` the method its tensors were saved in
    (``Linear.set_method(..., from_checkpoint=True)``) and a tied embedding its int8 head's rows.
    Returns the targets of the saved tensors, ``"<layer>.<tensor>" → (layer, tensor, None)``,
    for the loader to hand to each layer's ``weight_loader`` — the one road into a layer. A bad
    ``quantization_config`` is a ``ModelLoadError``."""
    method, group = qc.get("method"), qc.get("group_size")
    if method not in QUANTIZATION_METHODS:
        raise ModelLoadError(f"{folder}: quantization_config method {method!r} is not one of {QUANTIZATION_METHODS}")
    if method in INT4_METHODS and not (isinstance(group, int) and group > 0):
        raise ModelLoadError(f"{folder}: quantization_config group_size {group!r} is not a positive integer")
    targets: dict[str, tuple] = {}
    for name, layer in _linear_layers(model).items():
        saved = _saved_method(method if name != "lm_head" else "int8", group)
        layer.set_method(saved, from_checkpoint=True)
        for tensor in saved.saved_shapes(layer):
            targets[f"{name}.{tensor}"] = (layer, tensor, None)
        if layer.bias is not None:  # saved fused (all shards in order), in the model's dtype
            targets[f"{name}.bias"] = (layer, "bias", None)
    share_int8_head_as_embedding(model)
    return targets


def _saved_method(method: str, group: int | None):
    """The method a layer saved as ``method`` loads into; int4 bytes are unpacked through the
    ``unpack_int4`` hook, looked up at each call (chapter 07 reads a checkpoint back with the
    learner's unpacking)."""
    def unpack(packed: torch.Tensor) -> torch.Tensor:
        return hooks.unpack_int4(packed)

    if method == "int8":
        return Int8Method()
    if method == "int4":
        return Int4Method(group, unpack)
    return AWQInt4Method(group, unpack=unpack) if method == "awq" else W8A8Method()
