"""Which request made a step fail: each open request's own processing, probed alone.

A step samples every running request at once, so one request whose own settings the sampler
cannot apply would fail the step for all of them — and a client that repeats it would deny
service to everyone. Validation bounds every field (``SamplingParams.validate``), but the
per-request work can still raise: a course hook a learner overrode, a corner no bound
foresaw. So when a step raises, ``EngineClient`` asks ``culprits``: each open request's
per-request work — the repetition penalty over its own tokens, temperature / top-k / top-p /
min-p, a draw from a copy of its own generator, its logprobs — runs alone on a row of made-up
logits. A request whose probe raises is a culprit: it alone ends, with a ``RequestFailed``
naming the setting whose default makes the probe pass; the others simply run the step again.
A step that fails with no culprit is the engine's fault, and every request is told (the old
behaviour, the only honest one then).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable

import torch

from minillm.errors import RequestFailed
from minillm.sampling import SamplingParams, sample, token_logprobs

# The settings a probe tries at their default to name the one that fails (stop strings and
# max_tokens never reach the sampler).
PROBED = ("top_k", "top_p", "min_p", "temperature", "repetition_penalty", "logprobs", "seed")


def _run(params: SamplingParams, generator: torch.Generator, seen: list[int], vocab_size: int) -> None:
    logits = torch.linspace(-4.0, 4.0, vocab_size).unsqueeze(0)  # distinct values: every filter has work to do
    copy = torch.Generator(device=generator.device)
    copy.set_state(generator.get_state())  # the real one must not advance
    (token,) = sample(logits, [params], [copy], seen=[seen] if params.repetition_penalty != 1.0 else None)
    if params.logprobs is not None:
        token_logprobs(logits, [token], [params.logprobs])


def probe(params: SamplingParams, generator: torch.Generator, seen: list[int], vocab_size: int) -> RequestFailed | None:
    """None if this request's own processing runs; else why not, naming the setting."""
    try:
        _run(params, generator, seen, vocab_size)
        return None
    except Exception as error:  # noqa: BLE001 (any failure of its own processing is the request's)
        cause = f"{type(error).__name__}: {error}"
    defaults = {f.name: f.default for f in dataclasses.fields(SamplingParams)}
    for name in PROBED:
        if getattr(params, name) == defaults[name]:
            continue
        try:
            _run(dataclasses.replace(params, **{name: defaults[name]}), generator, seen, vocab_size)
        except Exception:  # noqa: BLE001
            continue
        return RequestFailed(
            f"this request's {name}={getattr(params, name)!r} could not be applied ({cause}); "
            "the other requests were not affected",
            param=name,
        )
    return RequestFailed(f"this request's sampling failed ({cause}); the other requests were not affected")


def culprits(engine) -> dict[Hashable, RequestFailed]:
    """The open requests of ``engine`` whose own processing fails, with why (empty: none does)."""
    vocab_size = engine.model_config.vocab_size
    found: dict[Hashable, RequestFailed] = {}
    for request_id, seq in list(engine.requests.items()):
        error = probe(seq.params, seq.generator, seq.token_ids, vocab_size)
        if error is not None:
            found[request_id] = error
    return found
