"""Shared by chapter 07's checks: the quantization model, its prompts and greedy tokens, and the
rounding diagnosis every quantizer's values get."""

from __future__ import annotations

import torch

from minillm.course.results import CheckFailed

QUANT_MODEL = "tiny-shakespeare-8m"  # trained here in fp32: quantization error is its own, not inherited
PROMPTS = ["KING.\nNow is the winter of our discontent", "ROMEO.\nBut soft, what light", "HAMLET.\nTo be, or not"]
STEPS = 32


def greedy_tokens(llm, prompts=PROMPTS, steps: int = STEPS) -> list[list[int]]:
    from minillm import SamplingParams

    return [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=steps, ignore_eos=True))]


def quantized_pair(out, name: str, first: str = "q") -> tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(out, tuple) or len(out) != 2:
        raise CheckFailed(f"{name} should return a tuple ({first}, scale), got {type(out).__name__}")
    for part, label in zip(out, (first, "scale")):
        if not isinstance(part, torch.Tensor):
            raise CheckFailed(f"{name}: {label} should be a torch.Tensor, got {type(part).__name__}")
    return out


def tensors_near(a: torch.Tensor, b: torch.Tensor, rtol: float = 1e-4) -> bool:
    return a.shape == b.shape and bool(torch.allclose(a.double(), b.double(), rtol=rtol, atol=1e-12))


def check_rounding(q: torch.Tensor, exact: torch.Tensor, where: str, low: int, high: int, extra: str = "") -> None:
    """``q`` must be ``exact`` (= x / scale) rounded to the nearest integer within [low, high]."""
    qf = q.double()
    if bool((qf < low).any()) or bool((qf > high).any()):
        bad = tuple(int(i) for i in torch.nonzero((qf < low) | (qf > high))[0])
        raise CheckFailed(
            f"{where}: q{list(bad)} = {int(qf[bad])} is outside [{low}, {high}]: clamp after rounding "
            f"(torch.clamp(q, {low}, {high}))"
        )
    diff = qf - exact.clamp(low, high)
    toward_zero = bool((diff * exact.sign() <= 1e-4).all()) and bool((diff.abs() < 1 + 1e-3).all())
    if toward_zero and bool((diff.abs() > 0.5 + 1e-3).any()):
        raise CheckFailed(
            f"{where}: q is x / scale truncated toward zero (what .to(torch.int8) does to a float), so the "
            "error reaches a whole step: round to the nearest integer first (torch.round)"
        )
    for sign, name in ((-1, "down (torch.floor)"), (1, "up (torch.ceil)")):
        one_way = bool((diff * sign >= -1e-4).all()) and bool((diff.abs() < 1 + 1e-3).all())
        if one_way and bool((diff.abs() > 0.5 + 1e-3).any()):
            raise CheckFailed(
                f"{where}: q is x / scale rounded {name}: every value moves the same way, by up to a whole step, "
                "so the levels are biased — round to the nearest integer (torch.round), an error of at most half "
                "a step"
            )
    off = diff.abs()
    if bool((off > 0.5 + 1e-3).any()):
        bad = tuple(int(i) for i in torch.nonzero(off == off.max())[0])
        raise CheckFailed(
            f"{where}: q{list(bad)} = {int(qf[bad])} but x / scale = {float(exact[bad]):.3f} there: q must be "
            "x / scale rounded to the nearest integer (torch.round), an error of at most half a step" + extra
        )
