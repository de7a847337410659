"""Chapter 01's sampler (``check_sample``): two right answers written independently, and the wrong
ones a learner writes, one slip each (``sample_with``)."""

from __future__ import annotations

import torch
from check_catalogue import right, wrong

from minillm.sampling import filtered_logits

SA = "check_sample"


def sample_with(**slip):
    """The penalty-argmax-race sampler, with one learner's slip switched on."""

    def sample(logits, params, generators, seen=None):
        logits = logits.float() if slip.get("in_place") else logits.float().clone()
        for i, p in enumerate(params):
            if slip.get("ignores_none"):
                history = seen[i]
            elif seen is None:
                continue
            else:
                history = seen[i]
            if p.repetition_penalty == 1.0 or not history or (slip.get("sampled_only") and p.greedy):
                continue
            if slip.get("filter_first") and not p.greedy:
                continue  # penalized below, after filtering
            ids = list(history) if slip.get("each_time") else sorted(set(history))
            for t in ids:
                v = float(logits[i, t])
                if slip.get("wrong_way"):
                    logits[i, t] = v * p.repetition_penalty
                else:
                    logits[i, t] = v / p.repetition_penalty if v > 0 else v * p.repetition_penalty
        tokens = logits.argmax(dim=-1).tolist()
        for i, p in enumerate(params):
            if p.greedy and not slip.get("samples_greedy"):
                continue
            row = logits[i : i + 1]
            if slip.get("no_filter"):
                probs = row[0].softmax(dim=-1)
            else:
                probs = filtered_logits(row, [p])[0].softmax(dim=-1)
            if slip.get("filter_first") and p.repetition_penalty != 1.0 and seen is not None and seen[i]:
                ids = torch.tensor(sorted(set(seen[i])))
                probs = probs.clone()
                probs[ids] = probs[ids] / p.repetition_penalty
            generator = generators[0] if slip.get("one_generator") else generators[i]
            if slip.get("multinomial"):
                tokens[i] = int(torch.multinomial(probs, 1, generator=generator))
            elif slip.get("global_rng"):
                tokens[i] = int((probs / torch.empty_like(probs).exponential_()).argmax())
            elif slip.get("times_noise"):
                tokens[i] = int((probs * torch.empty_like(probs).exponential_(generator=generator)).argmax())
            else:
                tokens[i] = int((probs / torch.empty_like(probs).exponential_(generator=generator)).argmax())
        return torch.tensor(tokens) if slip.get("tensor") else tokens

    return sample


def sample_batched(logits, params, generators, seen=None):
    """Right, written differently: the penalty as a masked multiply, the sampled rows filtered together."""
    out = logits.to(torch.float32).clone()
    if seen is not None:
        for i, p in enumerate(params):
            if p.repetition_penalty != 1.0 and len(seen[i]):
                mask = torch.zeros(out.shape[-1], dtype=torch.bool)
                mask[list(seen[i])] = True
                factor = torch.where(out[i] > 0, 1 / p.repetition_penalty, p.repetition_penalty)
                out[i] = torch.where(mask, out[i] * factor, out[i])
    chosen = out.argmax(-1).tolist()
    drawn = [i for i, p in enumerate(params) if p.temperature != 0]
    if drawn:
        probs = filtered_logits(out[drawn], [params[i] for i in drawn]).softmax(-1)
        for row, i in zip(probs, drawn):
            noise = torch.empty_like(row).exponential_(generator=generators[i])
            chosen[i] = int(torch.argmax(row / noise))
    return chosen


right(SA, sample_with())
right(SA, sample_batched)
right(SA, sample_with(multinomial=True))  # torch.multinomial draws one token by the same exponential race
wrong(SA, "is the argmax before the penalty", sample_with(sampled_only=True))
wrong(SA, "the penalty made a seen token more likely", sample_with(wrong_way=True))
wrong(SA, "penalized twice", sample_with(each_time=True))
wrong(SA, "changed the logits it was given", sample_with(in_place=True))
wrong(SA, "the engine draws", sample_with(global_rng=True))
wrong(SA, "the engine draws", sample_with(one_generator=True))
wrong(SA, "the engine draws", sample_with(times_noise=True))
wrong(SA, "which the row's settings exclude", sample_with(no_filter=True))
wrong(SA, "is never drawn", sample_with(samples_greedy=True))
wrong(SA, "return a list of Python ints", sample_with(tensor=True))
wrong(SA, "your code raised TypeError", sample_with(ignores_none=True))
wrong(SA, "which the row's settings exclude", sample_with(filter_first=True))
