"""Load a Hugging Face safetensors folder (single file or sharded) into ``LlamaForCausalLM``.

The loader maps checkpoint names onto our modules and fills the fused projections slice by
slice, checking every shape. Anything missing, surplus, misshapen or unreadable is reported
with the tensor and file it concerns — a half-loaded model that silently generates garbage
is the worst possible failure for a learner.

A **shard** (tensor / pipeline parallelism, ``parallel=``) reads only its part: its layers'
tensors, and of each split matrix only its rows or columns — safetensors reads a slice
without the rest (``CheckpointSlice``), so no rank ever holds a full matrix it does not need.

A **quantized** checkpoint (``minillm quantize``) goes the same way: each linear layer is first
given the method its tensors were saved in (``quantization.checkpoint.prepare_quantized``), then
its saved tensors (``qweight``, ``scales``, ...) enter through its ``weight_loader`` like any other.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from minillm.config import ModelConfig
from minillm.errors import ModelLoadError
from minillm.layers import Linear
from minillm.layers.tensor_parallel import SINGLE, ParallelContext
from minillm.models.llama import LlamaForCausalLM
from minillm.quantization.checkpoint import prepare_quantized, quantization_config

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
    for f in files:  # a FIFO, socket or device would block the read (a hang, not an error)
        if not f.is_file():
            raise ModelLoadError(f"{f}: not a regular file; weights must be plain files (or links to them)")
    return files


class NonFiniteTensor(ValueError):
    pass


class CheckpointSlice:
    """A checkpoint tensor not read yet: ``.shape``, ``.narrow(dim, start, length)`` (still
    unread) and ``.load()`` (reads just that part, checked for NaN/inf)."""

    def __init__(self, source, shape: tuple[int, ...], index: tuple[slice, ...] = ()):
        self.source, self.shape, self.index = source, tuple(shape), index

    def narrow(self, dim: int, start: int, length: int) -> CheckpointSlice:
        index = list(self.index) + [slice(None)] * (len(self.shape) - len(self.index))
        base = index[dim].start or 0
        index[dim] = slice(base + start, base + start + length)
        shape = list(self.shape)
        shape[dim] = length
        return CheckpointSlice(self.source, tuple(shape), tuple(index))

    def load(self) -> torch.Tensor:
        tensor = self.source[self.index] if self.index else self.source[:]
        if tensor.is_floating_point() and not _all_finite(tensor):
            raise NonFiniteTensor(f"holds {int((~torch.isfinite(tensor)).sum())} NaN/inf value(s): a corrupt checkpoint")
        return tensor


def _all_finite(tensor: torch.Tensor) -> bool:
    """No NaN and no ±inf in ``tensor``. Its smallest and largest values say it: ``aminmax``
    propagates NaN and shows an infinity at either end, in one pass that allocates nothing;
    ``isfinite(t).all()`` writes a bool for every element first, about 30× slower on a bf16
    table (``benchmarks/bench_finite_check.py``), which was ~0.5 s of every SmolLM2 load."""
    if tensor.numel() == 0:
        return True
    try:
        lo, hi = torch.aminmax(tensor)
    except (RuntimeError, NotImplementedError):  # a dtype without CPU aminmax (float8): in float32
        return bool(torch.isfinite(tensor.float()).all())
    return bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))


def _copy_into(module, param: str, shard: str | None, tensor: CheckpointSlice) -> None:
    """One checkpoint tensor into its place; ``ValueError`` (naming the shapes) if it does not fit."""
    if isinstance(module, Linear) or hasattr(module, "weight_loader"):
        module.weight_loader(param, tensor, shard)
        return
    dest = getattr(module, param)
    if tuple(tensor.shape) != tuple(dest.shape):
        raise ValueError(f"has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
    with torch.no_grad():
        dest.copy_(tensor.load())


def _plain_in_quantized(module, param: str, shard: str | None) -> bool:
    """Does a quantized checkpoint still hold this target as a plain tensor under its Hugging
    Face name? Not a linear layer's (saved in its method's format, under our names), nor a table
    no longer held (a tied embedding reading its int8 head's rows)."""
    return not isinstance(module, Linear) and getattr(module, param) is not None


def _elsewhere(name: str, model: LlamaForCausalLM) -> bool:
    """Does tensor ``name`` belong to another pipeline stage than ``model``'s?"""
    if model.parallel.pp_size == 1:
        return False
    match = _LAYER.match(name)
    if match:
        return int(match.group(1)) not in model.layer_range
    return name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")


def load_model(
    folder: str | Path,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    max_positions: int | None = None,
    parallel: ParallelContext = SINGLE,
) -> LlamaForCausalLM:
    """Build the decoder for ``folder/config.json`` (only ``parallel``'s shard of it) and fill
    it from the folder's safetensors."""
    folder = Path(folder)
    config = ModelConfig.from_folder(folder)
    device = torch.device(device)
    with torch.device("meta"):  # no time wasted on random init of weights we overwrite
        model = LlamaForCausalLM(config, parallel)
    # Cast on the meta device, then allocate: each tensor is allocated once, in its final dtype
    # (allocating first gave fp32 tensors, then copied them: 539 vs 8 ms for SmolLM2 in bf16,
    # ``benchmarks/bench_model_alloc.py``, AMD EPYC, 2 threads).
    model = model.to(dtype).to_empty(device=device)
    model.tie_weights()  # to_empty gives each module its own tensor: share the head again

    targets = model.checkpoint_targets()

    qc = quantization_config(folder)
    if qc is not None and parallel != SINGLE:
        raise ModelLoadError(f"{folder}: a quantized checkpoint cannot be loaded as a tensor/pipeline-parallel shard yet")
    if qc is not None:  # each linear layer takes its saved method first; its saved tensors then go in like any
        saved = prepare_quantized(model, folder, qc)
        targets = {name: t for name, t in targets.items() if _plain_in_quantized(*t)} | saved
    for path in safetensors_files(folder):
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():
                    if name.endswith(_IGNORED_SUFFIXES):
                        continue
                    if name == "lm_head.weight" and config.tie_word_embeddings:
                        continue  # some tied checkpoints store a copy; ours is the embedding
                    target = targets.pop(name, None)
                    if target is None and _elsewhere(name, model):
                        continue  # another pipeline stage's
                    if target is None:
                        raise ModelLoadError(f"{path}: unexpected tensor {name!r} for a {config.model_type} model")
                    lazy = f.get_slice(name)
                    try:
                        _copy_into(*target, CheckpointSlice(lazy, lazy.get_shape()))
                    except NonFiniteTensor as err:
                        raise ModelLoadError(f"{path}: tensor {name!r} {err}") from None
                    except ValueError as err:
                        raise ModelLoadError(f"{path}: tensor {name!r} {err} from config.json") from None
        except SafetensorError as err:
            raise ModelLoadError(f"{path}: corrupt or unreadable safetensors file ({err})") from None
        except OSError as err:
            raise ModelLoadError(f"{path}: cannot read weights ({err})") from None
    if targets:
        missing = sorted(targets)
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        kind = "quantized checkpoint" if qc is not None else "checkpoint"
        raise ModelLoadError(f"{folder}: incomplete {kind}, {len(missing)} tensor(s) missing: {shown}")
    model.init_rope(max_positions or config.max_position_embeddings)
    return model.eval()
