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

    def speculative_decode(model, prompt_ids, max_new_tokens, k, eos_token_id=None):
        eos = None if slip.get("ignores_eos") else eos_token_id
        ids = prompt_ids if slip.get("mutates_prompt") else list(prompt_ids)
        cache = new_cache(model, len(ids) + max_new_tokens + 64)
        logits = forward_step(model, list(ids), 0, cache)
        if not slip.get("drops_prefill_token"):
            ids.append(int(logits[0 if slip.get("first_row") else -1].argmax()))
        passes, start = 1, len(ids) - 1
        while len(ids) - len(prompt_ids) < max_new_tokens + (1 if slip.get("one_more") else 0):
            if ids[-1] == eos and not slip.get("eos_not_at_prefill"):
                break
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
                kept = _accept(target, drafts)
                if eos in kept and not slip.get("eos_last_only"):
                    kept = kept[: kept.index(eos) + (0 if slip.get("drops_eos") else 1)]
                ids += kept
                if eos in kept[-1:] or (slip.get("drops_eos") and eos in _accept(target, drafts)):
                    break
        new = ids[len(prompt_ids) :]
        if slip.get("echo"):
            return ids[: len(prompt_ids) + max_new_tokens], passes
        if slip.get("no_trim"):
            return new, passes
        return new[:max_new_tokens], passes - 1 if slip.get("no_prefill_count") else passes

    return speculative_decode


def propose_lookup(tokens, k, max_n=4):
    """Right, written independently: the n-grams as tuples, the latest occurrence by rindex-like search."""
    for n in range(min(max_n, len(tokens) - 1), 0, -1):
        tail = tuple(tokens[-n:])
        for start in reversed(range(len(tokens) - n)):
            if tuple(tokens[start : start + n]) == tail:
                return list(tokens[start + n : start + n + k])
    return []


def propose_with(**slip):
    """The prompt lookup with one of a learner's slips switched on."""

    def propose(tokens, k, max_n=4):
        if slip.get("sorts"):
            tokens.sort()  # "tidy up" the caller's list
        top = min(max_n, len(tokens) - 1)
        if slip.get("ignores_max_n"):
            top = len(tokens) - 1
        sizes = list(range(top, 0, -1))
        if slip.get("shortest_first"):
            sizes.reverse()
        for n in sizes:
            suffix = tokens[len(tokens) - n :]
            last = len(tokens) - n - (0 if slip.get("self_match") else 1)
            starts = range(0, last + 1) if slip.get("oldest_first") else range(last, -1, -1)
            for start in starts:
                if tokens[start : start + n] == suffix:
                    begin = start + n + (1 if slip.get("skips_one") else 0)  # "the token after the match"
                    found = tokens[begin : begin + k + (1 if slip.get("one_more") else 0)]
                    if slip.get("tuple"):
                        return tuple(found)
                    return found[:-1] if slip.get("one_less") and len(found) == k else found
            if slip.get("gives_up"):
                return []
        return None if slip.get("none") else []

    return propose


right(SD, propose_lookup, decode_with())


def speculative_decode_positions(model, prompt_ids, max_new_tokens, k, eos_token_id=None):
    """Tracks the cache's valid length in a variable instead of reading len(tokens)."""
    tokens = list(prompt_ids)
    cache = new_cache(model, len(tokens) + max_new_tokens + k + 1)
    valid = 0  # positions whose K/V the cache holds for the kept tokens
    passes = 0
    pending = tokens
    while len(tokens) < len(prompt_ids) + max_new_tokens:
        if passes and tokens[-1] == eos_token_id:
            break
        guesses = propose_ngram(tokens, k) if valid else []
        feed = pending + guesses
        logits = forward_step(model, feed, valid, cache)
        passes += 1
        best = logits.argmax(-1).tolist()[len(pending) - 1 :]
        kept = 0
        while kept < len(guesses) and guesses[kept] == best[kept]:
            kept += 1
        new = guesses[:kept] + [best[kept]]
        if eos_token_id in new:  # the answer's end: nothing after it
            new = new[: new.index(eos_token_id) + 1]
        valid += len(pending) + kept  # the fed tokens that stay: the pending ones and the accepted guesses
        tokens += new
        pending = [new[-1]]
    return tokens[len(prompt_ids) : len(prompt_ids) + max_new_tokens], passes


right(SD, propose_lookup, speculative_decode_positions)

wrong(SD, "return only the new tokens", propose_lookup, decode_with(echo=True))
wrong(SD, "keep exactly 48", propose_lookup, decode_with(no_trim=True))
wrong(SD, "changed the prompt_ids list", propose_lookup, decode_with(mutates_prompt=True))
wrong(SD, "no proposal was ever accepted", propose_lookup, decode_with(never_proposes=True))
wrong(SD, "at most k proposals", propose_lookup, decode_with(uncapped=True))
wrong(SD, "ran against a new cache", propose_lookup, decode_with(new_cache=True))
wrong(SD, "recomputing the whole sequence", propose_lookup, decode_with(recompute=True))
wrong(SD, "that is the rollback", propose_lookup, decode_with(no_rollback=True))
wrong(SD, "a pass starts with the last kept token", propose_lookup, decode_with(drafts_only=True))
wrong(SD, "keep a proposal only while it equals the target's argmax", propose_lookup, decode_with(accept_all=True))
wrong(SD, "keep a proposal only while it equals the target's argmax", propose_lookup, decode_with(shifted=True))
wrong(SD, "the prefill counts as one", propose_lookup, decode_with(no_prefill_count=True))
wrong(SD, "plain greedy decoding gives", propose_lookup, decode_with(first_row=True))
wrong(SD, "the prefill's last row already gives the first new token", propose_lookup, decode_with(drops_prefill_token=True))
wrong(SD, "the last pass ran after all", propose_lookup, decode_with(one_more=True))
wrong(SD, "the shortest n-gram was tried first", propose_with(shortest_first=True), decode_with())
wrong(SD, "the oldest occurrence was used", propose_with(oldest_first=True), decode_with())
wrong(SD, "the last n tokens matched themselves", propose_with(self_match=True), decode_with())
wrong(SD, "propose at most k", propose_with(one_more=True), decode_with())
wrong(SD, "an n-gram longer than max_n was matched", propose_with(ignores_max_n=True), decode_with())
wrong(SD, "changed the tokens it was given", propose_with(sorts=True), decode_with())
wrong(SD, "return a list of token ids", propose_with(tuple=True), decode_with())
wrong(SD, "return a list of token ids", propose_with(none=True), decode_with())
wrong(SD, "expected [9, 9, 3, 4]", propose_with(one_less=True), decode_with())
wrong(SD, "go on with n - 1, down to 1", propose_with(gives_up=True), decode_with())
wrong(SD, "expected [9, 9, 3, 4]", propose_with(skips_one=True), decode_with())
wrong(SD, "expected [", lambda tokens, k, max_n=4: tokens[-k:], decode_with())
wrong(SD, "your loop went on after the EOS", propose_lookup, decode_with(ignores_eos=True))
wrong(SD, "not only the last: keep it, cut what follows", propose_lookup, decode_with(eos_last_only=True))
wrong(SD, "check the prefill's token before the first verify pass", propose_lookup, decode_with(eos_not_at_prefill=True))
wrong(SD, "you dropped the EOS itself", propose_lookup, decode_with(drops_eos=True))


def decode_without_eos(model, prompt_ids, max_new_tokens, k):
    """The loop as it was before the EOS: no eos_token_id parameter."""
    return decode_with()(model, prompt_ids, max_new_tokens, k)


wrong(SD, "add the parameter eos_token_id=None", propose_lookup, decode_without_eos)
