"""Sampling parameters and the sampler that turns logits into the next token.

The pipeline, applied per row of a batch with that row's own parameters:

    logits → repetition penalty → (greedy: argmax)
           → / temperature → top-k → top-p → min-p → sample with the request's own RNG

Temperature, top-k and top-p are hook ``filter_logits`` (chapter 01's exercise plugs into it),
called once per group of rows that share those settings.

Each request owns a ``torch.Generator``. Sampling uses the "exponential race": draw
``E_i ~ Exp(1)`` for every token and pick ``argmax p_i / E_i``, which selects token ``i`` with
probability exactly ``p_i``. Because the noise comes from the request's generator only, the
same seed gives the same tokens whether the request runs alone or in a batch of strangers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

import minillm.hooks as hooks
from minillm.outputs import TokenLogprob

MAX_LOGPROBS = 20  # OpenAI's limit for top_logprobs
MAX_N = 16  # parallel samples per request
# top_k beyond any vocabulary is refused (a 64-bit value overflowed the sampler's tensors); up
# to this bound, a top_k at or above the model's vocabulary keeps every token (the sampler
# clamps it to the vocabulary it sees).
MAX_TOP_K = 2**31 - 1


@dataclass
class SamplingParams:
    """How to choose tokens for one request. Defaults: greedy, 64 new tokens.

    ``temperature=0`` is greedy decoding. ``top_k=0``, ``top_p=1``, ``min_p=0`` and
    ``repetition_penalty=1`` disable those filters. ``stop`` strings end generation and are
    cut from the text; ``stop_token_ids`` (and the model's EOS unless ``ignore_eos``) end it
    and are kept in ``token_ids`` but not in ``text``.

    ``logprobs``: None returns none; ``k`` in 0..20 returns, per output token, its
    log-probability and the ``k`` most likely alternatives (OpenAI's ``top_logprobs``, vLLM's
    ``logprobs``; see ``TokenLogprob``). ``n``: parallel samples of the prompt, which is
    prefilled once and shared copy-on-write (paged engine only). Sample ``i`` draws from a
    generator seeded with ``seed + i``, so with a seed it is exactly the completion a request
    with ``n=1, seed=seed + i`` gets; greedy samples are all the same.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int = 64
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None
    n: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    def validate(self) -> None:
        def number(name: str) -> float:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
                raise ValueError(f"{name}={value!r} must be a number")
            return float(value)

        if number("temperature") < 0 or math.isinf(self.temperature):
            raise ValueError(f"temperature={self.temperature} must be >= 0 and finite (0 = greedy)")
        if not 0 < number("top_p") <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if not 0 <= number("min_p") <= 1:
            raise ValueError(f"min_p={self.min_p} must be in [0, 1]")
        if number("repetition_penalty") <= 0 or math.isinf(self.repetition_penalty):
            raise ValueError(f"repetition_penalty={self.repetition_penalty} must be > 0 and finite")
        for name in ("top_k", "max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name}={value!r} must be an integer")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0 (0 disables it)")
        if self.top_k > MAX_TOP_K:
            raise ValueError(f"top_k={self.top_k} is larger than any vocabulary: at most {MAX_TOP_K} (0 disables it)")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens} must be >= 1")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(f"stop_token_ids must be non-negative integers, got {t!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed={self.seed!r} must be an integer or None")
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise ValueError(f"seed={self.seed} must fit in 64 bits: 0 <= seed < 2**64")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos={self.ignore_eos!r} must be True or False")
        k = self.logprobs
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_LOGPROBS):
            raise ValueError(f"logprobs={k!r} must be None or an integer in [0, {MAX_LOGPROBS}]")
        if isinstance(self.n, bool) or not isinstance(self.n, int) or not 1 <= self.n <= MAX_N:
            raise ValueError(f"n={self.n!r} must be an integer in [1, {MAX_N}]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


# --------------------------------------------------------------------------------------------
# Logit processors. Each takes float logits [B, V] and per-row parameters, and returns logits
# with excluded tokens set to -inf. They are pure functions so tests can feed them
# constructed logits.
# --------------------------------------------------------------------------------------------

NEG_INF = float("-inf")


def apply_repetition_penalty(logits: torch.Tensor, seen: list[Sequence[int]], penalty: torch.Tensor) -> torch.Tensor:
    """CTRL-style penalty on every token already in the prompt or output (as HF does it):
    positive logits are divided by ``penalty``, negative ones multiplied, so either way the
    token becomes less likely for ``penalty > 1``."""
    out = logits.clone()
    for row, ids in enumerate(seen):
        p = float(penalty[row])
        if p == 1.0 or not ids:
            continue
        idx = torch.as_tensor(sorted(set(ids)), device=logits.device)
        vals = out[row, idx]
        out[row, idx] = torch.where(vals > 0, vals / p, vals * p)
    # A tiny penalty can push a logit past float32's range; keep it finite (it stays the largest).
    return out.clamp_(max=torch.finfo(out.dtype).max)


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep the ``k`` largest logits of each row (``k = 0``: keep all). Ties with the k-th are kept.

    The k-th largest value comes from ``topk`` of the largest ``k`` asked for, not from sorting
    the whole row: the same value (it is unique, whatever the order of ties), at a fraction of
    the cost for a 49,152-token vocabulary."""
    vocab = logits.shape[-1]
    k = torch.where(top_k <= 0, vocab, top_k.clamp(max=vocab)).to(torch.long)
    largest = logits.topk(int(k.max()), dim=-1).values
    kth = largest.gather(-1, (k - 1).unsqueeze(-1))
    return logits.masked_fill(logits < kth, NEG_INF)


# The nucleus is looked for among each row's most likely TOP_P_HEAD tokens first (apply_top_p).
TOP_P_HEAD = 1024


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Nucleus: keep the smallest set of most likely tokens whose probability reaches ``top_p``.

    A token is kept when the probability mass of the tokens ranked above it is still below
    ``top_p``; the most likely token is always kept (even when ``top_p`` underflows to 0).

    Sorting a whole row of a 49,152-token vocabulary to find a nucleus of a few hundred tokens
    was most of a sampled step's cost on a CPU (``benchmarks/bench_sampler.py``). So each row's
    ``TOP_P_HEAD`` most likely tokens come first (``topk``, in order): when they hold ``top_p``
    of the mass, every token outside them has at least that mass ranked above it and is dropped,
    and inside them the rule is computed on exactly the sums a whole sort would give. Only a
    row whose head holds less is sorted whole.
    """
    probs = logits.softmax(dim=-1)
    vocab = probs.shape[-1]
    head, order = probs.topk(min(TOP_P_HEAD, vocab), dim=-1)
    drop, reached = _outside_nucleus(head, order, top_p, vocab)
    short = (~reached & (top_p < 1.0)).nonzero().flatten() if head.shape[-1] < vocab else order[:0, 0]
    if len(short):  # the nucleus reaches past the head: these rows are sorted whole
        ranked, ranked_order = probs[short].sort(dim=-1, descending=True)
        drop[short] = _outside_nucleus(ranked, ranked_order, top_p[short], vocab)[0]
    drop &= (top_p < 1.0).unsqueeze(-1)
    return logits.masked_fill(drop, NEG_INF)


def _outside_nucleus(ranked: torch.Tensor, order: torch.Tensor, top_p: torch.Tensor, vocab: int):
    """For probabilities ``ranked[R, n]`` (descending) of tokens ``order``: which of the ``vocab``
    tokens fall outside the nucleus (every token not in ``order`` does), and whether the ``n``
    ranked tokens hold ``top_p`` of the mass."""
    cumulative = ranked.cumsum(dim=-1)
    drop_ranked = cumulative - ranked >= top_p.unsqueeze(-1)
    drop_ranked[..., 0] = False
    drop = torch.ones(ranked.shape[0], vocab, dtype=torch.bool, device=ranked.device)
    return drop.scatter_(-1, order, drop_ranked), cumulative[..., -1] >= top_p


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below ``min_p`` times the most likely token's."""
    probs = logits.softmax(dim=-1)
    threshold = probs.max(dim=-1, keepdim=True).values * min_p.unsqueeze(-1)
    return logits.masked_fill(probs < threshold, NEG_INF)


@hooks.reference("filter_logits")
def filter_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Temperature, then top-k, then top-p, for rows ``logits[R, V]`` that share these settings.

    Dividing by the temperature happens after subtracting each row's maximum, so every value
    is <= 0 and the top one is exactly 0: a tiny temperature sends the others to -inf (greedy,
    the limit it should be) instead of overflowing the top one to inf and the softmax to NaN.
    Top-p sees the distribution top-k left (renormalised), which is why the order matters.
    """
    logits = (logits - logits.max(dim=-1, keepdim=True).values) / temperature
    rows = logits.shape[:-1]
    if top_k > 0:
        logits = apply_top_k(logits, torch.full(rows, top_k, device=logits.device))
    if top_p < 1.0:
        logits = apply_top_p(logits, torch.full(rows, top_p, device=logits.device))
    return logits


_TINY_TEMPERATURE, _HUGE_TEMPERATURE = torch.finfo(torch.float32).tiny, 1e30


def filtered_logits(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution each sampled row draws from: hook ``filter_logits`` (temperature,
    top-k, top-p), then min-p.

    Rows are grouped by their (temperature, top_k, top_p), and each group is filtered in one
    call: a batch whose requests share their settings — the usual case — costs one batched
    filter, not one per row. The temperature is clamped into float32's normal range first
    (a validated temperature may be 5e-324 or 1e300, which float32 reads as 0 or inf), and a
    top_k of the vocabulary or more is no filter at all (0).
    """
    groups: dict[tuple[float, int, float], list[int]] = {}
    vocab = logits.shape[-1]
    for row, p in enumerate(params):
        temperature = min(max(p.temperature or 1.0, _TINY_TEMPERATURE), _HUGE_TEMPERATURE)
        top_k = 0 if p.top_k >= vocab else p.top_k  # keeping the whole vocabulary is no filter
        groups.setdefault((temperature, top_k, p.top_p), []).append(row)
    if len(groups) == 1:
        (settings,) = groups
        out = hooks.filter_logits(logits, *settings)
    else:
        out = torch.empty_like(logits)
        for settings, rows in groups.items():
            index = torch.tensor(rows, device=logits.device)
            out[index] = hooks.filter_logits(logits[index], *settings)
    if any(p.min_p > 0.0 for p in params):
        out = apply_min_p(out, torch.tensor([p.min_p for p in params], device=logits.device))
    return out


_NUMPY_ARGMAX_DTYPES = (torch.float32, torch.float64, torch.float16)


def argmax_rows(x: torch.Tensor) -> list[int]:
    """The argmax of each row of ``x[R, V]``: the first of equal maxima, and a row's first NaN
    if it has one — torch's rule, which NumPy's argmax follows too.

    Why NumPy on a CPU: torch's CPU argmax is not vectorized (torch 2.13) while its amax is, and
    NumPy's argmax is. For a batch of 256 rows of a 49,152-token vocabulary, one thread, torch
    takes ~10 ms and NumPy ~2 ms; for 4,096 tokens ~0.9 ms and ~0.08 ms
    (``benchmarks/bench_step_overhead.py`` prints both). A greedy step pays it every token."""
    if x.device.type == "cpu" and x.dtype in _NUMPY_ARGMAX_DTYPES and x.dim() == 2:
        return x.detach().numpy().argmax(axis=1).tolist()
    return x.argmax(dim=-1).tolist()


@hooks.reference("sample")
def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator],
    seen: list[Sequence[int]] | None = None,
) -> list[int]:
    """Choose one token per row of ``logits[B, V]``."""
    logits = logits.float()
    if seen is not None and any(p.repetition_penalty != 1.0 for p in params):
        penalty = torch.tensor([p.repetition_penalty for p in params])
        logits = apply_repetition_penalty(logits, seen, penalty)
    tokens = argmax_rows(logits)
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if sampled:
        rows = filtered_logits(logits[sampled], [params[i] for i in sampled])
        probs = rows.softmax(dim=-1)
        # Each row's noise from its own request's generator (a row of its own, so it is the
        # same draw whatever else is in the batch); one argmax over all of them.
        noise = torch.empty_like(probs)
        for j, i in enumerate(sampled):
            noise[j].exponential_(generator=generators[i])
        for i, token in zip(sampled, argmax_rows(probs / noise)):
            tokens[i] = token
    return tokens


def token_logprobs(logits: torch.Tensor, token_ids: list[int], num_top: list[int]) -> list[TokenLogprob]:
    """Row ``i`` of raw ``logits[R, V]``: the log-probability of ``token_ids[i]`` and the
    ``num_top[i]`` most likely tokens. ``log_softmax`` in fp32 of the model's own logits (no
    penalty, temperature or filter: see ``TokenLogprob``); the caller passes only the rows of
    requests that asked, so the others cost nothing."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(-1, torch.tensor(token_ids, device=logp.device).unsqueeze(-1)).squeeze(-1).tolist()
    k = min(max(num_top, default=0), logp.shape[-1])
    top_values, top_ids = logp.topk(k, dim=-1) if k else (logp[:, :0], logp[:, :0])
    top_values, top_ids = top_values.tolist(), top_ids.tolist()
    return [
        TokenLogprob(t, lp, [(int(i), v) for i, v in zip(top_ids[r][:m], top_values[r][:m])])
        for r, (t, lp, m) in enumerate(zip(token_ids, chosen, num_top))
    ]
