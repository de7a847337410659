"""Chapter 01's sampler exercise: ``sample(logits, params, generators, seen)`` — one token per row
of a batch, each request by its own settings (the repetition penalty over what it has seen,
argmax when greedy, else a draw from its filtered distribution with its own generator).

The engine draws by the exponential race — ``argmax(probs / noise)`` with ``noise`` drawn
``Exp(1)`` from the request's generator — so that a seeded request gets the same tokens in any
batch and in every engine (``SamplingParams.seed``). The check therefore asks for exactly the
engine's tokens: on a hand-made batch of five rows (greedy, greedy with a penalty, sampled,
sampled with top-k and a penalty, sampled with min-p) over 40 seeds, with a diagnosis of the
first row that differs; then in the engine, requests mixing all of it against the package's.
"""

from __future__ import annotations

import torch

import minillm.hooks as hooks
from minillm.course.checks.common import DEFAULT_MODEL
from minillm.course.results import CheckFailed, check

VOCAB, SEEDS = 12, 40
RACE = (
    "draw as the engine does: probs = the row's filtered logits (filtered_logits(row, [params])).softmax(-1), "
    "noise = torch.empty_like(probs).exponential_(generator=generators[i]), token = argmax(probs / noise) — the "
    "exponential race, so that a seed gives the same token in any batch and engine"
)


def _batch():
    """(logits [7, V], params, seen, what each row is)."""
    from minillm import SamplingParams

    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(7, VOCAB, generator=gen) - 1.0  # below zero: the rows' own top values set the stage
    logits[1, 4], logits[1, 9] = 2.0, 1.8  # seen 9 is second: a penalty that multiplies would crown it
    logits[2, 6], logits[2, 2] = 2.2, 2.0  # seen 6 is first: dethroned by a 2.0 penalty (2.2 / 2 < 2.0)
    logits[3, 3], logits[3, 11] = 3.0, 2.5  # seen twice: once / 1.1 keeps it first, twice does not
    logits[5, :4] = -torch.tensor([0.5, 1.0, 1.5, 2.0])  # negative logits among the seen tokens
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, repetition_penalty=1.5),
        SamplingParams(temperature=0.0, repetition_penalty=2.0),
        SamplingParams(temperature=0.0, repetition_penalty=1.1),
        SamplingParams(temperature=0.8, seed=1),
        SamplingParams(temperature=1.0, top_k=3, repetition_penalty=1.3, seed=2),
        SamplingParams(temperature=1.2, min_p=0.2, repetition_penalty=1.2, seed=3),
    ]
    seen = [[5], [9, 0], [6, 6, 7], [3, 3, 8], [1, 2], [0, 1, 2, 3, int(logits[5].argmax())], []]
    what = [f"row {i} ({d})" for i, d in enumerate([
        "greedy",
        f"greedy, repetition_penalty=1.5, seen {seen[1]}",
        f"greedy, repetition_penalty=2.0, seen {seen[2]}",
        f"greedy, repetition_penalty=1.1, seen {seen[3]}",
        "temperature 0.8",
        f"top_k=3, repetition_penalty=1.3, seen {seen[5]}",
        "temperature 1.2, min_p=0.2, repetition_penalty=1.2, nothing seen",
    ])]  # fmt: skip
    return logits, params, seen, what


def _generators(seed: int, rows: int = 7) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(seed * 10 + i) for i in range(rows)]


def _penalized(logits: torch.Tensor, seen: list[int], penalty: float) -> torch.Tensor:
    ids = torch.tensor(sorted(set(seen)), dtype=torch.long)  # long even when nothing was seen (an empty row)
    out = logits.clone()
    out[ids] = torch.where(out[ids] > 0, out[ids] / penalty, out[ids] * penalty)
    return out


def _greedy_hint(row: int, got: int, logits: torch.Tensor, params, seen) -> str:
    p = params[row]
    if p.repetition_penalty == 1.0:
        return "a greedy request (temperature 0) is never drawn: its token is the argmax of its logits"
    raw = logits[row]
    ids = sorted(set(seen[row]))
    wrong_way = raw.clone()
    wrong_way[ids] = raw[ids] * p.repetition_penalty
    if got == int(wrong_way.argmax()) != int(raw.argmax()):
        return "the penalty made a seen token more likely: divide positive logits by it, multiply negative ones"
    if got == int(raw.argmax()):
        return (
            f"token {got} is the argmax before the penalty: apply the repetition penalty first, to every token the "
            f"request has seen ({ids}), greedy or not"
        )
    counted = raw.clone()
    for t in seen[row]:
        counted[t] = counted[t] / p.repetition_penalty if counted[t] > 0 else counted[t] * p.repetition_penalty
    if got == int(counted.argmax()):
        return "a token seen twice was penalized twice: penalize each seen token once (a set of ids)"
    return (
        "a greedy request (temperature 0) is never drawn: its token is the argmax of its logits after the penalty "
        "(positive logits / penalty, negative * penalty, each seen token once)"
    )


def _diagnose(sample) -> None:
    from minillm.sampling import filtered_logits

    logits, params, seen, what = _batch()
    given = logits.clone()
    got = sample(given, params, _generators(0), seen)
    if not torch.equal(given, logits):
        raise CheckFailed(
            "sample changed the logits it was given (the repetition penalty, in place?): work on a copy — the engine "
            "reads the same logits again for the requests' logprobs"
        )
    if not isinstance(got, list) or len(got) != 7 or any(isinstance(t, bool) or not isinstance(t, int) for t in got):
        raise CheckFailed(f"sample returned {got!r:.80}: return a list of Python ints, one token per row (7 here)")
    package = hooks.default("sample")
    for seed in range(SEEDS):
        got = sample(logits.clone(), params, _generators(seed), seen)
        want = package(logits.clone(), params, _generators(seed), seen)
        for row, (g, w) in enumerate(zip(got, want)):
            if g == w:
                continue
            if params[row].greedy:
                raise CheckFailed(f"{what[row]}: token {g}, expected {w}: {_greedy_hint(row, g, logits, params, seen)}")
            row_logits = logits[row]
            if params[row].repetition_penalty != 1.0:
                row_logits = _penalized(row_logits, seen[row], params[row].repetition_penalty)
            allowed = torch.isfinite(filtered_logits(row_logits[None], [params[row]])[0])
            if not bool(allowed[g]):
                raise CheckFailed(
                    f"{what[row]}, seed {seed}: drew token {g}, which the row's settings exclude (the allowed tokens "
                    f"are {allowed.nonzero().flatten().tolist()}): sample from filtered_logits(row, [params]) — "
                    "temperature, top-k, top-p and min-p — after the penalty"
                )
            raise CheckFailed(f"{what[row]}, seed {seed}: drew token {g}, the engine draws {w}: {RACE}")

    plain = [0, 4]  # no request of this batch has a penalty: the engine passes seen=None
    got = sample(logits[plain].clone(), [params[i] for i in plain], _generators(0, 2), None)
    want = hooks.default("sample")(logits[plain].clone(), [params[i] for i in plain], _generators(0, 2), None)
    if got != want:
        raise CheckFailed(
            f"with seen=None (the engine passes None when no request of the batch has a penalty), sample returned "
            f"{got}, the engine's sampler {want}: skip the penalty then"
        )


def _requests():
    from minillm import SamplingParams

    prompts = ["ROMEO.\nBut soft, what light", "KING.\nNow is the winter", "HAMLET.\nTo be, or not", "FOOL.\nThe more"]
    params = [
        SamplingParams(max_tokens=16, ignore_eos=True),
        SamplingParams(max_tokens=16, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.9, top_k=20, seed=5),
        SamplingParams(max_tokens=16, ignore_eos=True, temperature=1.1, top_p=0.9, min_p=0.05,
                       repetition_penalty=1.2, seed=6),
    ]  # fmt: skip
    return prompts, params


@check
def check_sample(sample, model: str = DEFAULT_MODEL) -> str:
    """``sample(logits[R, V], params, generators, seen=None) -> list[int]``: the engine's sampler."""
    from minillm import LLM

    _diagnose(sample)
    llm = LLM(model, dtype="fp32", compile=False)
    prompts, params = _requests()
    expected = [o.token_ids for o in llm.generate(prompts, params)]
    calls = []

    def counted(logits, params, generators, seen=None):
        calls.append(len(params))
        return sample(logits, params, generators, seen)

    with hooks.override(sample=counted):
        got = [o.token_ids for o in llm.generate(prompts, params)]
    if not calls:
        raise RuntimeError("the engine sampled without calling hook sample")
    for i, (mine, ref) in enumerate(zip(got, expected)):
        if mine != ref:
            n = next(j for j, (a, b) in enumerate(zip(mine, ref)) if a != b)
            raise CheckFailed(
                f"request {i} ({prompts[i][:12]!r}...) on your sampler differs from the engine's at token {n} "
                f"(got {mine[n]}, expected {ref[n]}): the hand-made batch matched — look at what the engine passes "
                "that it had not: longer seen lists, seen=None when no request has a penalty"
            )
    return (
        f"your sampler chose every token of {len(prompts)} requests in the engine ({sum(calls)} rows over "
        f"{len(calls)} steps: greedy, penalized, top-k, top-p and min-p, seeded) — the engine's tokens exactly"
    )
