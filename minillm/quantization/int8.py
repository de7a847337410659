"""int8 weight-only quantization: one symmetric scale per output channel.

Each row ``w`` of a weight matrix (one output channel) is stored as ``round(w / s)`` in
``[-127, 127]`` with ``s = max|w| / 127``, so ``w ≈ q · s``. One scale per row keeps a row
with large weights from crushing the resolution of the others (a single per-tensor scale
would), and it factors out of the matmul: ``x · (q·s)ᵀ = (x · qᵀ) · s``.

On CPU, PyTorch's ``_weight_int8pack_mm`` multiplies activations by the int8 matrix directly
(dequantizing in registers), reading half the bytes of bf16: for a few rows (decode) it is
about 2× faster than bf16. It is a matrix-*vector* kernel, though: measured on a 2-core AMD
EPYC, from ~32 rows on it is slower than dequantizing the whole matrix and calling bf16
``F.linear`` (512 rows: 7.4 ms against 2.5 ms), so a prefill takes that route. On CUDA the
layer calls our Triton kernel (``triton_matmul.int8_matmul``: reads the int8 matrix and
dequantizes in registers). Elsewhere the layer dequantizes and calls ``F.linear`` — also the
numerical reference the fast kernels are tested against.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

import minillm.hooks as hooks
from minillm.config import triton_available
from minillm.quantization.saved import LoadsSavedTensors

GEMV_ROWS = 32  # from this many rows on, dequantize + F.linear beats the int8 GEMV kernel (see above)


@functools.cache
def _triton_installed() -> bool:
    return triton_available()


def use_triton(x: torch.Tensor) -> bool:
    """Whether a quantized layer multiplies ``x`` with our Triton kernels: on CUDA (where PyTorch
    ships triton). The CPU engine keeps PyTorch's CPU kernels; it never routes through the interpreter."""
    return x.device.type == "cuda" and _triton_installed()


@hooks.reference("quantize_int8")  # Int8Method.process_weights calls it through the hook (chapter 07)
def quantize_int8(weight: torch.Tensor, row_absmax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight[out, in]`` → ``(q int8 [out, in], scale fp32 [out])`` with ``weight ≈ q * scale[:, None]``.

    ``row_absmax``: each row's largest ``|w|`` when ``weight`` holds only some of each row's
    columns (a row-parallel shard, ``Linear.full_row_absmax``) — the whole row's, so the shard is
    rounded exactly as the whole matrix is and the ranks' int8 values are the one-process ones."""
    w = weight.detach().float()
    absmax = w.abs().amax(dim=1) if row_absmax is None else row_absmax.float()
    scale = absmax.clamp(min=1e-12) / 127.0
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (q.float() * scale[:, None]).to(dtype)


class Int8Method(LoadsSavedTensors):
    """A linear layer stored as int8 with per-output-channel scales."""

    name = "int8"

    def validate(self, layer, name: str) -> None:
        if layer.weight is None or layer.weight.dim() != 2:
            raise ValueError(f"{name}: int8 needs the loaded 2-D weight (was the layer already converted?)")

    @staticmethod
    def scale_for(scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Scales are kept in the activations' dtype (the kernel wants them so); fp16 keeps fp32."""
        return scale.to(dtype if dtype != torch.float16 else torch.float32)

    def process_weights(self, layer) -> None:
        self.validate(layer, repr(layer))
        row_absmax = layer.full_row_absmax()  # None unless the layer holds a row-parallel slice
        # One argument unless sliced: the hook's signature (chapter 07 plugs a one-argument quantizer in).
        q, scale = hooks.quantize_int8(layer.weight) if row_absmax is None else quantize_int8(layer.weight, row_absmax)
        self.install(layer, q, scale)

    def install(self, layer, q: torch.Tensor, scale: torch.Tensor) -> None:
        """Hold ``q`` and ``scale`` (quantized now, or loaded from a quantized checkpoint)."""
        device, layer.dtype = layer.weight.device, layer.weight.dtype
        layer.qweight = q.to(device=device, dtype=torch.int8)
        layer.scales = self.scale_for(scale, layer.dtype).to(device)
        layer.weight = None  # a tied head's matrix stays alive through the embedding until it reads from here

    def saved_shapes(self, layer) -> dict[str, tuple[int, ...]]:
        return {"qweight": (layer.out_features, layer.in_features), "scales": (layer.out_features,)}

    def install_saved(self, layer, saved: dict[str, torch.Tensor]) -> None:
        self.install(layer, saved["qweight"], saved["scales"])

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        if use_triton(x):
            return self.apply_triton(layer, x)
        rows = x.reshape(-1, layer.in_features)
        if x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float32) and rows.shape[0] < GEMV_ROWS:
            y = torch._weight_int8pack_mm(rows, layer.qweight, layer.scales.to(x.dtype))
        else:
            y = F.linear(rows, dequantize_int8(layer.qweight, layer.scales.float(), x.dtype))
        if layer.bias is not None:
            y = y + layer.bias
        return y.view(*x.shape[:-1], layer.out_features)

    def apply_triton(self, layer, x: torch.Tensor) -> torch.Tensor:
        """The CUDA path: the Triton kernel on ``qweight`` and ``scales`` as held. ``apply`` takes it
        only on CUDA; tests call it directly on CPU, where it runs under Triton's interpreter."""
        # deferred: triton: imported only when a Triton matmul runs
        from minillm.quantization.triton_matmul import int8_matmul

        y = int8_matmul(x.reshape(-1, layer.in_features), layer.qweight, layer.scales)
        if layer.bias is not None:
            y = y + layer.bias
        return y.view(*x.shape[:-1], layer.out_features)

    def embedding_rows(self, layer, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` dequantized, ``q[id] · scale[id]``: a tied embedding's lookup (a gather of
        a few rows per step, so embedding from the int8 head costs no speed)."""
        return layer.qweight[ids].to(layer.dtype) * layer.scales[ids].to(layer.dtype).unsqueeze(-1)

    def held_tensors(self, layer) -> list[torch.Tensor]:
        return [t for t in (layer.qweight, layer.scales, layer.bias) if t is not None]


def int8_table(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` rounded as an int8 head holds it, in its own dtype: every row equal to
    ``Int8Method.embedding_rows`` of that head."""
    q, scale = quantize_int8(weight)
    dtype = weight.dtype
    return q.to(dtype) * Int8Method.scale_for(scale, dtype).to(dtype).unsqueeze(-1)


def share_int8_head_as_embedding(model) -> None:
    """A tied model whose head is int8 embeds with the head's int8 rows, holding no float copy.

    The tied embedding *is* the head matrix (SmolLM2-135M: 49152 × 576, 28% of the parameters);
    once the head is int8, its embedding reads its rows through the head
    (``Embedding.read_rows_from``). A first pipeline stage holds the embedding without the head:
    it keeps its table, rounded to the same int8 values, so its tokens' rows are the ones the
    one-process model reads."""
    embed, head = model.embed_tokens, model.lm_head
    if not model.config.tie_word_embeddings or embed is None or embed.weight is None:
        return
    if head is not None and head.method.name == "int8":
        embed.read_rows_from(head)
    elif head is None:
        with torch.no_grad():
            embed.weight.copy_(int8_table(embed.weight))
