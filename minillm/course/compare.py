"""How checks compare a learner's results with the reference's, shared by every chapter's checks.

Each helper raises ``CheckFailed`` with a message that says *where* the first difference is (a
token index, a tensor index, the call that returned the wrong int) — the start of every hint.
"""

from __future__ import annotations

import torch

from minillm.course.results import CheckFailed


def int_cases(fn, name: str, cases, arg_names: tuple[str, ...]) -> None:
    """Unit cases of a function that returns an int: ``cases`` are ``(*args, expected, why)``."""
    for *args, expected, why in cases:
        got = fn(*args)
        if not isinstance(got, int) or isinstance(got, bool):
            raise CheckFailed(f"{name} should return an int, got {type(got).__name__}: {got!r}")
        if got != expected:
            call = ", ".join(f"{a}={v}" for a, v in zip(arg_names, args))
            raise CheckFailed(f"{name}({call}) returned {got}, expected {expected}: {why}")


def compare_tokens(got, expected: list[int], what: str, hint: str) -> None:
    """``got`` must be ``expected``, a list of Python ints: name the first token that differs."""
    if not isinstance(got, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in got):
        raise CheckFailed(f"{what} should return a list of Python ints, got {type(got).__name__}: {got!r:.80}")
    for i, (a, b) in enumerate(zip(got, expected)):
        if a != b:
            raise CheckFailed(
                f"{what}: token {i} is {a}, the reference engine produced {b} (first {i} tokens agree). Hint: {hint}"
            )
    if len(got) != len(expected):
        raise CheckFailed(f"{what} returned {len(got)} tokens, expected {len(expected)}. Hint: {hint}")


def compare_requests(got: list, expected: list[list[int]], what: str, hint: str) -> None:
    """Each request's tokens (``got[i]``, a list of ints) must be ``expected[i]``: name the
    request and its first differing token (``what`` may use ``{i}`` for the request's index)."""
    for i, (tokens, reference) in enumerate(zip(got, expected)):
        compare_tokens(tokens, reference, what.format(i=i), hint)


def compare_tensors(got, expected: torch.Tensor, what: str, atol: float = 1e-5, nan_hint: str = "") -> None:
    """``got`` must match ``expected`` in type, shape, dtype and values (within ``atol``); a NaN
    or inf where the reference is finite is named with ``nan_hint``."""
    if not isinstance(got, torch.Tensor):
        raise CheckFailed(f"{what} should be a torch.Tensor, got {type(got).__name__}")
    if tuple(got.shape) != tuple(expected.shape):
        raise CheckFailed(f"{what} has shape {tuple(got.shape)}, expected {tuple(expected.shape)}")
    if got.dtype != expected.dtype:
        raise CheckFailed(f"{what} has dtype {got.dtype}, expected {expected.dtype}")
    got_f, exp_f = got.detach().float().cpu(), expected.detach().float().cpu()
    bad = ~torch.isfinite(got_f) & torch.isfinite(exp_f)
    if bool(bad.any()):
        where = tuple(int(i) for i in torch.nonzero(bad)[0])
        raise CheckFailed(
            f"{what} has {got_f[where].item()} at index {where} (and {int(bad.sum()) - 1} more non-finite values) "
            f"where the reference is {exp_f[where].item():.5g}" + (f". Hint: {nan_hint}" if nan_hint else "")
        )
    diff = (got_f - exp_f).abs().nan_to_num(0.0)
    worst = float(diff.max()) if diff.numel() else 0.0
    if worst > atol:
        where = tuple(int(i) for i in torch.nonzero(diff == worst)[0])
        raise CheckFailed(
            f"{what} differs from the reference by up to {worst:.3g} at index {where}: "
            f"got {got_f[where].item():.5g}, expected {exp_f[where].item():.5g}"
        )


def name_the_slip(got, expected: torch.Tensor, slips, atol: float = 1e-5, equal_nan: bool = False) -> bool:
    """When ``got`` is a tensor of ``expected``'s shape and dtype with other values, raise the
    message of the first of ``slips`` — ``(what a known mistake computes, its message)`` pairs,
    best given as a generator so that each is computed only if reached — whose values it has.

    Returns True when ``got`` differs and matches none (the caller may diagnose further), False
    when it is right or not comparable (``compare_tensors`` then names the shape or dtype)."""
    if not (isinstance(got, torch.Tensor) and got.shape == expected.shape and got.dtype == expected.dtype):
        return False
    if torch.allclose(got, expected, atol=atol):
        return False
    for value, message in slips:  # equal_nan: a mistake that makes a row NaN is named by its NaN too
        if torch.allclose(got, value, atol=atol, equal_nan=equal_nan):
            raise CheckFailed(message)
    return True
