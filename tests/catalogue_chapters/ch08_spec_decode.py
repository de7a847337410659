"""Chapter 08's speculative decoding loop (``check_speculative_decode``): right answers written
independently, and the wrong ones a learner writes, one slip each (``decode_with(...)``)."""

from __future__ import annotations

from check_catalogue import right, wrong

from minillm.course import forward_step, new_cache
from minillm.speculative import propose_ngram
from minillm.speculative.acceptance import accept_greedy as _accept  # the loop is the subject here

SD = "check_speculative_decode"


def decode_with(**slip):
    """The reference loop with one of a learner's slips switched on."""

    def speculative_decode(model, prompt_ids, max_new_tokens, k):
        ids = prompt_ids if slip.get("mutates_prompt") else list(prompt_ids)
        cache = new_cache(model, len(ids) + max_new_tokens + 64)
        logits = forward_step(model, list(ids), 0, cache)
        if not slip.get("drops_prefill_token"):
            ids.append(int(logits[0 if slip.get("first_row") else -1].argmax()))
        passes, start = 1, len(ids) - 1
        while len(ids) - len(prompt_ids) < max_new_tokens + (1 if slip.get("one_more") else 0):
            drafts = [] if slip.get("never_proposes") else propose_ngram(ids, 100 if slip.get("uncapped") else k)
            if slip.get("new_cache"):
                cache = new_cache(model, len(ids) + max_new_tokens + 64)
            if slip.get("recompute"):
                logits = forward_step(model, ids + drafts, 0, cache)[len(ids) - 1 :]
            elif slip.get("drafts_only") and drafts:
                logits = forward_step(model, drafts, len(ids), cache)  # the last token's K/V never written
            else:
                begin = start if slip.get("no_rollback") else len(ids) - 1
                logits = forward_step(model, [ids[-1]] + drafts, begin, cache)
                start = begin + 1 + len(drafts)
            passes += 1
            target = logits.argmax(-1).tolist()
            if slip.get("accept_all"):
                ids += drafts + [target[len(drafts)]] if len(target) > len(drafts) else drafts
            elif slip.get("shifted"):
                ids += _accept(target[1:] + target[-1:], drafts)
            elif slip.get("drafts_only") and drafts:
                ids += _accept([ids[-1]] + target, drafts)
            else:
                ids += _accept(target, drafts)
        new = ids[len(prompt_ids) :]
        if slip.get("echo"):
            return ids[: len(prompt_ids) + max_new_tokens], passes
        if slip.get("no_trim"):
            return new, passes
        return new[:max_new_tokens], passes - 1 if slip.get("no_prefill_count") else passes

    return speculative_decode


right(SD, decode_with())


def speculative_decode_positions(model, prompt_ids, max_new_tokens, k):
    """Tracks the cache's valid length in a variable instead of reading len(tokens)."""
    tokens = list(prompt_ids)
    cache = new_cache(model, len(tokens) + max_new_tokens + k + 1)
    valid = 0  # positions whose K/V the cache holds for the kept tokens
    passes = 0
    pending = tokens
    while len(tokens) < len(prompt_ids) + max_new_tokens:
        guesses = propose_ngram(tokens, k) if valid else []
        feed = pending + guesses
        logits = forward_step(model, feed, valid, cache)
        passes += 1
        best = logits.argmax(-1).tolist()[len(pending) - 1 :]
        kept = 0
        while kept < len(guesses) and guesses[kept] == best[kept]:
            kept += 1
        new = guesses[:kept] + [best[kept]]
        valid += len(pending) + kept  # the fed tokens that stay: the pending ones and the accepted guesses
        tokens += new
        pending = [new[-1]]
    return tokens[len(prompt_ids) : len(prompt_ids) + max_new_tokens], passes


right(SD, speculative_decode_positions)

wrong(SD, "return only the new tokens", decode_with(echo=True))
wrong(SD, "keep exactly 48", decode_with(no_trim=True))
wrong(SD, "changed the prompt_ids list", decode_with(mutates_prompt=True))
wrong(SD, "no proposal was ever accepted", decode_with(never_proposes=True))
wrong(SD, "at most k proposals", decode_with(uncapped=True))
wrong(SD, "ran against a new cache", decode_with(new_cache=True))
wrong(SD, "recomputing the whole sequence", decode_with(recompute=True))
wrong(SD, "that is the rollback", decode_with(no_rollback=True))
wrong(SD, "a pass starts with the last kept token", decode_with(drafts_only=True))
wrong(SD, "keep a proposal only while it equals the target's argmax", decode_with(accept_all=True))
wrong(SD, "keep a proposal only while it equals the target's argmax", decode_with(shifted=True))
wrong(SD, "the prefill counts as one", decode_with(no_prefill_count=True))
wrong(SD, "plain greedy decoding gives", decode_with(first_row=True))
wrong(SD, "the prefill's last row already gives the first new token", decode_with(drops_prefill_token=True))
wrong(SD, "the last pass ran after all", decode_with(one_more=True))
