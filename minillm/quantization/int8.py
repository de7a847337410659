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

from minillm.config import triton_available

GEMV_ROWS = 32  # from this many rows on, dequantize + F.linear beats the int8 GEMV kernel (see above)


@functools.cache
def _triton_installed() -> bool:
    return triton_available()


def use_triton(x: torch.Tensor) -> bool:
    """Whether a quantized layer multiplies ``x`` with our Triton kernels: on CUDA (where PyTorch
    ships triton). The CPU engine keeps PyTorch's CPU kernels; it never routes through the interpreter."""
    return x.device.type == "cuda" and _triton_installed()


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight[out, in]`` → ``(q int8 [out, in], scale fp32 [out])`` with ``weight ≈ q * scale[:, None]``."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (q.float() * scale[:, None]).to(dtype)


class Int8Method:
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
        q, scale = quantize_int8(layer.weight)
        self.install(layer, q, scale)

    def install(self, layer, q: torch.Tensor, scale: torch.Tensor) -> None:
        """Hold ``q`` and ``scale`` (quantized now, or loaded from a quantized checkpoint)."""
        device, layer.dtype = layer.weight.device, layer.weight.dtype
        layer.qweight = q.to(device=device, dtype=torch.int8)
        layer.scales = self.scale_for(scale, layer.dtype).to(device)
        layer.weight = None  # a tied head's matrix stays alive through the embedding
        layer.method = self

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
        from minillm.quantization.triton_matmul import int8_matmul

        y = int8_matmul(x.reshape(-1, layer.in_features), layer.qweight, layer.scales)
        if layer.bias is not None:
            y = y + layer.bias
        return y.view(*x.shape[:-1], layer.out_features)

    def held_tensors(self, layer) -> list[torch.Tensor]:
        return [t for t in (layer.qweight, layer.scales, layer.bias) if t is not None]


class TiedInt8Embedding(torch.nn.Module):
    """The embedding of a tied model read from its int8 LM head: one int8 matrix, two uses.

    A tied model's embedding table *is* its head matrix (SmolLM2-135M: 49152 × 576, 28% of the
    parameters). Once the head is int8, keeping a bf16 copy only for the embedding would hold
    the same numbers twice; instead a token's embedding is its head row dequantized,
    ``q[id] · scale[id]`` — a gather of a few rows per step, so no speed is lost.
    """

    def __init__(self, head):
        super().__init__()
        if getattr(head, "qweight", None) is None:
            raise ValueError("TiedInt8Embedding needs an int8 LM head (Int8Method installed)")
        self._head = [head]  # a reference, not a submodule: its tensors are counted once
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        head = self._head[0]
        return head.qweight[ids].to(head.dtype) * head.scales[ids].to(head.dtype).unsqueeze(-1)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, rows of the int8 LM head"


def share_int8_head_as_embedding(model) -> None:
    """For a tied model whose head is int8: drop the float embedding, embed from the head."""
    if model.config.tie_word_embeddings and model.lm_head.method.name == "int8":
        model.embed_tokens = TiedInt8Embedding(model.lm_head)
