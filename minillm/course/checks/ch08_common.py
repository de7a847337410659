"""Shared by chapter 08's checks: the target and draft models, the engines with a draft, greedy runs."""

from __future__ import annotations

TARGET, DRAFT = "tiny-shakespeare-8m", "tiny-shakespeare-1m"
K = 4
PROMPTS = ["KING.\nNow is the winter of our discontent", "ROMEO.\nBut soft, what light", "HAMLET.\nTo be, or not"]
STEPS = 32


def spec_engine(spec: dict | None = None, **options):
    from minillm import LLM

    return LLM(TARGET, dtype="fp32", speculative_config=spec, **options)


def draft_spec(k: int = K) -> dict:
    # always k proposals: the checks compare runs proposal for proposal, and the governor's choices
    # (speculative/governor.py) follow the machine's timing, not the learner's code
    return {"method": "draft", "model": DRAFT, "num_speculative_tokens": k, "adaptive": False}


def greedy_outputs(llm, prompts=PROMPTS, steps: int = STEPS):
    from minillm import SamplingParams

    return llm.generate(prompts, SamplingParams(max_tokens=steps, ignore_eos=True))


def is_int_list(x) -> bool:
    return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def spec_summary(outs) -> tuple[int, int, int, int]:
    tokens = sum(len(o.token_ids) for o in outs)
    passes = sum(o.metrics.num_forward_passes for o in outs)
    proposed = sum(o.metrics.spec_proposed for o in outs)
    accepted = sum(o.metrics.spec_accepted for o in outs)
    return tokens, passes, proposed, accepted
