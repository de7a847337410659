"""Chapter 07 (quantization): per-channel int8 weights, and the KV cache's int8 quantize-on-write."""

from __future__ import annotations

import math

import torch

import minillm.hooks as hooks
from minillm.course.checks.ch07_common import (
    PROMPTS,
    QUANT_MODEL,
    STEPS,
    check_rounding,
    greedy_tokens,
    quantized_pair,
    tensors_near,
)
from minillm.course.compare import compare_tokens
from minillm.course.results import CheckFailed, check

# Exercise 1: per-output-channel symmetric int8
# ---------------------------------------------------------------------------------------------


def _int8_test_weight() -> torch.Tensor:
    """48 output rows × 80 inputs (not square: a scale per column has the wrong length)."""
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(48, 80, generator=gen) * 0.05
    w[5] *= 30  # a loud output row: one scale for the whole matrix would crush the others
    w[11, 3] = -3 * float(w[11].abs().max())  # this row's largest magnitude is negative
    return w


def _diagnose_int8_scale(scale: torch.Tensor, w: torch.Tensor) -> None:
    out, cols = w.shape
    w_dtype = w.dtype
    w = w.double()  # the exact values, whatever the weight's dtype
    absmax = w.abs().amax(dim=1)
    expected = absmax / 127
    if scale.numel() == 1:
        raise CheckFailed(
            f"scale has shape {tuple(scale.shape)}: one scale for the whole matrix (per-tensor). Row 5 of the "
            "test weight is 30× louder than the rest and would leave them a few levels each: return one scale "
            f"per output row, shape ({out},)"
        )
    if tuple(scale.shape) == (cols,):
        raise CheckFailed(
            f"scale has shape ({cols},), one per input column: reduce over dim=1 (the input features) to get one "
            f"scale per output row, shape ({out},) — w.abs().amax(dim=1)"
        )
    if tuple(scale.shape) == (out, 1):
        raise CheckFailed(
            f"scale has shape ({out}, 1): return it as a 1-D tensor of shape ({out},) (amax(dim=1) without "
            "keepdim, or .squeeze(1)) — the engine's int8 kernel takes one scale per output row"
        )
    if tuple(scale.shape) != (out,):
        raise CheckFailed(f"scale has shape {tuple(scale.shape)}, expected ({out},): one scale per output row")
    if not scale.is_floating_point():
        raise CheckFailed(f"scale is {scale.dtype}: it is a real number per row (float32)")
    if torch.finfo(scale.dtype).bits < 32:
        bits = 1 - round(math.log2(torch.finfo(scale.dtype).eps))  # significant bits: 8 in bfloat16
        raise CheckFailed(
            f"with a {w_dtype} weight, scale is {scale.dtype}: compute in float32 (w = weight.float()) and return "
            f"float32 scales — {scale.dtype} keeps only {bits} significant bits, so the scale is off by up to a few "
            "tenths of a percent and w / scale, computed in it too, lands on many wrong levels"
        )
    if tensors_near(scale, torch.full_like(scale, float(w.abs().max()) / 127)):
        raise CheckFailed(
            "every row has the same scale, max|W| / 127 of the whole matrix (per-tensor): row 5 is 30× louder "
            "than the rest and leaves them a few levels each. Take the max over each row: w.abs().amax(dim=1)"
        )
    if tensors_near(scale, w.amax(dim=1) / 127) and not tensors_near(scale, expected):
        raise CheckFailed(
            "scale is the largest *value* of each row / 127, not its largest *magnitude*: in row 11 the biggest "
            "weight is negative and would be clipped. Use w.abs().amax(dim=1) / 127"
        )
    for divisor, why in (
        (128, "the largest weight then maps to ±128, and +128 does not fit int8's [-127, 127]"),
        (255, "255 is the top of an unsigned byte; the symmetric range is ±127, so half the levels go unused"),
        (1, "then every weight maps into [-1, 1] and q holds only -1, 0, 1"),
    ):
        if tensors_near(scale, absmax / divisor):
            raise CheckFailed(f"scale is max|w| / {divisor} per row: {why}. Divide by 127")
    if tensors_near(scale, 127 / absmax):
        raise CheckFailed(
            "scale is 127 / max|w| per row, the inverse of the scale: the engine dequantizes with "
            "weight ≈ q * scale[:, None], so scale = max|w| / 127 (and q = round(w / scale))"
        )
    if not tensors_near(scale, expected):
        r = int((scale.double() - expected.double()).abs().argmax())
        extra = ""
        if w_dtype != torch.float32:
            extra = (
                f". With a {w_dtype} weight, compute in float32 (weight.float()): in {w_dtype} the arithmetic rounds"
            )
        raise CheckFailed(
            f"row {r}'s scale is {float(scale[r]):.6g}, expected max|w| / 127 = {float(expected[r]):.6g}{extra}"
        )


def _check_int8_values(fn, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    given = w.clone()
    q, scale = quantized_pair(fn(given), "quantize_per_channel")
    if not torch.equal(given, w):
        raise CheckFailed(
            "quantize_per_channel changed the weight it was given (an in-place operation such as w /= scale or "
            "w.div_(...)): the caller's weight must stay as it was — and weight.float() is no copy when the weight "
            "is already float32, it returns the same tensor. Compute out of place: w / scale[:, None]"
        )
    if tuple(q.shape) == (w.shape[0],) and tuple(scale.shape) == tuple(w.shape):
        raise CheckFailed(
            f"quantize_per_channel returned (scale, q): the first element has shape ({w.shape[0]},) and the second "
            f"{tuple(w.shape)} — return them in the order (q, scale)"
        )
    if q.dtype == torch.uint8:
        raise CheckFailed(
            "q is torch.uint8, an unsigned byte (0..255): every negative level wraps around (-3 becomes 253). "
            "Symmetric quantization needs the signed torch.int8 (-127..127)"
        )
    if q.is_floating_point():
        raise CheckFailed(
            f"q is {q.dtype}: store the rounded values as int8 (.to(torch.int8)) — a float q takes 4 bytes a "
            "weight, so nothing is saved"
        )
    if q.dtype != torch.int8:
        raise CheckFailed(f"q is {q.dtype}, expected torch.int8 (one byte per weight)")
    if tuple(q.shape) != tuple(w.shape):
        raise CheckFailed(f"q has shape {tuple(q.shape)}, expected {tuple(w.shape)} (the weight's)")
    exact = w.double() / w.abs().amax(dim=1).double()[:, None] * 127
    if tuple(scale.shape) == (w.shape[0],) and bool(((q.double() < 0) & (exact > 64)).any()):
        r, c = (int(i) for i in torch.nonzero((q < 0) & (exact > 64))[0])
        raise CheckFailed(
            f"q[{r}, {c}] = {int(q[r, c])} for a large positive weight ({float(w[r, c]):.4g}): a value above 127 "
            "wrapped around to a negative number when it was cast to int8. Divide by 127 and clamp to "
            "[-127, 127] before the cast"
        )
    _diagnose_int8_scale(scale, w)
    extra = ""
    if w.dtype != torch.float32:
        extra = f". With a {w.dtype} weight, compute in float32 (weight.float()): in {w.dtype} the arithmetic rounds"
    check_rounding(q, w.double() / scale.double()[:, None], "quantize_per_channel", -127, 127, extra)
    return q, scale


@check
def check_quantize_per_channel(quantize_per_channel, model: str = QUANT_MODEL) -> str:
    """``quantize_per_channel(weight[out, in]) -> (q int8 [out, in], scale [out])``, ``weight ≈ q * scale[:, None]``."""
    from minillm import LLM
    from minillm.assets import heldout_text
    from minillm.tools.evaluation import perplexity

    _check_int8_values(quantize_per_channel, _int8_test_weight())
    _check_int8_values(quantize_per_channel, torch.randn(64, 32, generator=torch.Generator().manual_seed(8)) * 0.02)
    _check_int8_values(quantize_per_channel, _int8_test_weight().to(torch.bfloat16))  # a bf16 checkpoint's weight

    calls = []

    def learner_quantize(weight):  # hook quantize_int8: what Int8Method.process_weights calls for every layer
        calls.append(tuple(weight.shape))
        q, scale = quantize_per_channel(weight)
        return q, scale.float()

    with hooks.override(quantize_int8=learner_quantize):
        learner = LLM(model, dtype="fp32", quantization="int8")
    if not calls:
        raise RuntimeError("the engine's int8 layers no longer call hook quantize_int8")
    reference = LLM(model, dtype="fp32", quantization="int8")
    plain = LLM(model, dtype="fp32")
    ids = plain.tokenizer.encode(heldout_text())[:1025]
    ppl = {name: perplexity(llm.model, ids) for name, llm in (("yours", learner), ("int8", reference), ("fp32", plain))}
    if abs(ppl["yours"] / ppl["int8"] - 1) > 0.005:
        raise CheckFailed(
            f"on your int8 weights the model's held-out perplexity is {ppl['yours']:.2f}, the package's int8 gives "
            f"{ppl['int8']:.2f} (fp32: {ppl['fp32']:.2f}): more than 0.5% apart"
        )
    for n, (got, ref) in enumerate(zip(greedy_tokens(learner), greedy_tokens(reference))):
        compare_tokens(got, ref, f"prompt {n} on your int8 weights", "compare your q and scale with quantize_int8's")
    fp32_mb, int8_mb = plain.model_config.num_params * 4 / 1e6, learner.model.weight_bytes() / 1e6
    return (
        f"your int8 quantizer ran on all {len(calls)} linear layers of the {model.split('-')[-1].upper()} model "
        f"({int8_mb:.1f} MB of weights held, {fp32_mb:.1f} MB in fp32): held-out perplexity {ppl['yours']:.2f} "
        f"(fp32 {ppl['fp32']:.2f}), {len(PROMPTS)}×{STEPS} greedy tokens identical to the package's int8 engine"
    )


# ---------------------------------------------------------------------------------------------


# Exercise 4: the KV cache's quantize-on-write
# ---------------------------------------------------------------------------------------------


def _kv_test_input(dtype=torch.float32) -> torch.Tensor:
    """[6 tokens, 3 K/V heads, 32 dims] with a loud (token, head) and negative extremes."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(6, 3, 32, generator=gen)
    x[2, 1] *= 40  # one loud head of one token
    x[4, :, 0] = -9.0  # token 4's largest magnitude is negative in every head
    x[0] *= 0.05  # a quiet token
    x[5, 2] *= 1e-4  # a tensors_near-silent head: its largest magnitude is ~3e-4 (a floor on max|x| would swallow it)
    return x.to(dtype)


def _check_kv(fn, x: torch.Tensor, label: str) -> None:
    from minillm.kvcache.quantization import quantize_kv

    tokens, heads, dim = x.shape
    q, scale = quantized_pair(fn(x.clone()), "quantize_kv_on_write")
    if q.is_floating_point():
        raise CheckFailed(f"{label}: q is {q.dtype}: store int8 (.to(torch.int8)) — the pool holds one byte per value")
    if q.dtype != torch.int8:
        raise CheckFailed(f"{label}: q is {q.dtype}, expected torch.int8")
    if tuple(q.shape) != tuple(x.shape):
        raise CheckFailed(f"{label}: q has shape {tuple(q.shape)}, expected {tuple(x.shape)} (x's)")
    absmax = x.float().abs().amax(dim=-1)
    if scale.numel() == 1 or tensors_near(scale, torch.full_like(absmax, float(absmax.max()) / 127)):
        raise CheckFailed(
            f"{label}: one scale for all of x (per-tensor): token 2's loud head would leave every other token and "
            "head a few levels. One scale per (token, head): reduce over the last dim only"
        )
    if tuple(scale.shape) == (tokens,) or (
        tuple(scale.shape) == (tokens, heads) and tensors_near(scale, absmax.amax(dim=1, keepdim=True).expand(-1, heads) / 127)
    ):
        raise CheckFailed(
            f"{label}: one scale per token, shared by its {heads} heads: token 2's loud head costs its other heads "
            "their precision. One scale per (token, head): x.abs().amax(dim=-1), shape [tokens, heads]"
        )
    if tuple(scale.shape) == (heads,) or (
        tuple(scale.shape) == (tokens, heads) and tensors_near(scale, absmax.amax(dim=0, keepdim=True).expand(tokens, -1) / 127)
    ):
        raise CheckFailed(
            f"{label}: one scale per head over all the tokens written together: a token's scale must depend on it "
            "alone — tokens arrive a few at a time, and a later, louder token cannot rescale what is already "
            "stored. Reduce over the last dim only: shape [tokens, heads]"
        )
    if tuple(scale.shape) == (tokens, heads, 1):
        raise CheckFailed(
            f"{label}: scale has shape {tuple(scale.shape)}: the pool stores one number per (token, head), shape "
            f"({tokens}, {heads}) — amax(dim=-1) without keepdim"
        )
    if tuple(scale.shape) != (tokens, heads):
        raise CheckFailed(f"{label}: scale has shape {tuple(scale.shape)}, expected ({tokens}, {heads})")
    if scale.dtype != torch.float32:
        raise CheckFailed(
            f"{label}: scale is {scale.dtype}: the pool stores float32 scales, whatever the model's dtype — compute "
            "them from x.float()"
        )
    expected = quantize_kv(x, "int8")[1]
    extra = ""
    if x.dtype != torch.float32:
        extra = f". With a {x.dtype} x, compute in float32 (x.float()): in {x.dtype} the arithmetic itself rounds"
    if tensors_near(scale, x.float().amax(dim=-1) / 127) and not tensors_near(scale, expected):
        raise CheckFailed(
            f"{label}: scale is the largest *value* / 127, not the largest *magnitude*: token 4's extreme is "
            "negative and would be clipped. Use x.abs().amax(dim=-1) / 127"
        )
    for divisor, why in (
        (128, "the largest value then maps to ±128, which int8's symmetric [-127, 127] cannot hold"),
        (255, "255 is the top of an unsigned byte; int8's symmetric range is ±127"),
        (1, "then every value maps into [-1, 1]"),
    ):
        if tensors_near(scale, absmax / divisor):
            raise CheckFailed(f"{label}: scale is max|x| / {divisor}: {why}. Divide by 127")
    wrong = ~torch.isclose(scale.double(), expected.double(), rtol=1e-4, atol=1e-12)
    offset = scale.double() * 127 - absmax.double()  # an epsilon added to max|x| shows as a constant offset
    added = bool(wrong.any()) and float(offset.min()) > 0 and torch.allclose(offset, offset.mean(), rtol=1e-2)
    floored = bool(wrong.any()) and bool((absmax[wrong] < 1e-2).all()) and bool((scale[wrong] > expected[wrong]).all())
    if added or floored:
        t, h = (int(i) for i in torch.nonzero(absmax == absmax.min())[0])
        raise CheckFailed(
            f"{label}: the scale of token {t}, head {h} — a head whose values are all below "
            f"{float(absmax[t, h]):.1e} — is {float(scale[t, h]):.3g}, expected max|x| / 127 = "
            f"{float(expected[t, h]):.3g}: a floor (or epsilon) on max|x| that large maps the whole head to a "
            "few levels, its precision gone. Guard only against max|x| = 0 (a floor far below any real value, "
            "such as 1e-8)"
        )
    if not tensors_near(scale, expected):
        t, h = (int(i) for i in torch.nonzero((scale - expected).abs() == (scale - expected).abs().max())[0])
        raise CheckFailed(
            f"{label}: the scale of token {t}, head {h} is {float(scale[t, h]):.6g}, expected max|x| / 127 = "
            f"{float(expected[t, h]):.6g}{extra}"
        )
    check_rounding(q, x.double() / scale.double()[..., None], label, -127, 127, extra)


@check
def check_quantize_kv(quantize_kv_on_write, model: str = QUANT_MODEL) -> str:
    """``quantize_kv_on_write(x[tokens, kv_heads, head_dim]) -> (q int8, scale fp32 [tokens, kv_heads])``."""
    from minillm import LLM

    _check_kv(quantize_kv_on_write, _kv_test_input(), "quantize_kv_on_write")
    _check_kv(quantize_kv_on_write, _kv_test_input(torch.bfloat16), "with a bfloat16 x")

    original, writes = hooks.current("quantize_kv"), []

    def learner_write(x, kind="int8"):  # hook quantize_kv: what the paged write path calls
        if kind != "int8":
            return original(x, kind)
        writes.append(x.shape[0])
        return quantize_kv_on_write(x)

    memory = 2_000_000
    # compile=False: every decode step must run your write path, not one compiled into a graph.
    args = dict(dtype="fp32", attention_backend="torch", kv_cache_memory=memory, block_size=16, compile=False)
    learner = LLM(model, kv_cache_dtype="int8", **args)
    with hooks.override(quantize_kv=learner_write):
        got = greedy_tokens(learner)
    if not writes:
        raise RuntimeError("the paged KV write path no longer calls hook quantize_kv")
    expected = greedy_tokens(LLM(model, kv_cache_dtype="int8", **args))
    for n, (a, b) in enumerate(zip(got, expected)):
        compare_tokens(a, b, f"prompt {n} on your int8 KV cache", "compare your q and scale with quantize_kv's")
    blocks = learner.engine.memory_report()["kv_pool_blocks"]
    plain_blocks = LLM(model, **args).engine.memory_report()["kv_pool_blocks"]
    return (
        f"your quantize-on-write stored every key and value of {len(PROMPTS)} requests ({len(writes)} writes): "
        f"{len(PROMPTS)}×{STEPS} greedy tokens identical to the package's int8 KV cache, and the same "
        f"{memory / 1e6:.0f} MB pool holds {blocks} blocks of 16 tokens instead of {plain_blocks} in fp32"
    )
