"""Prompt lookup: proposals copied from earlier text of the same request, no model at all.

When a request's output repeats its input — summarising, extracting, editing, answering with
quotes, code that reuses names — the tokens after the latest n-gram often already appeared after
the same n-gram earlier. Find the most recent earlier occurrence of the last ``n`` tokens
(longest ``n`` first, from ``prompt_lookup_max`` down to ``prompt_lookup_min``) and propose the
``k`` tokens that followed it (Saxena, 2023, *Prompt Lookup Decoding*; vLLM's ``ngram`` method).
Nothing is proposed when nothing matches, and the step is a plain decode.

How far to guess (``prompt_lookup_scaled``, on by default): a match of one token is weak
evidence — after "the" almost anything may follow — and a match of four is strong: the text is
being copied. So the engine proposes up to 1, 2, 4, 8 tokens after a match of 1, 2, 3, 4 tokens
(``reach``, capped at ``k``), not always ``k``. Replayed on SmolLM2-135M's own answers
(``benchmarks/probe_ngram_policy.py``, 2026-12-07), the doubling made 1.41 tokens a verify step
on held-out chats with 0.89 proposals a step (always 4: 1.45 with 1.69; always 8: 1.48 with
2.74), and 3.08 on requests that copy their prompt with 3.33 proposals (always 8: 3.20 with 6.81;
always 4: 2.61 with 3.63): nearly the longest guesses' tokens at a third to a half of their verify rows, which
cost little with AMX and more without (``docs/benchmarks.md``).
"""

from __future__ import annotations

import numpy as np

import minillm.hooks as hooks


@hooks.reference("propose_ngram")  # the speculator calls it through the hook (chapter 08)
def propose_ngram(tokens: list[int], k: int, max_n: int = 4, min_n: int = 1) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of ``tokens``' last n-gram."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n :]
        first = suffix[0]
        for start in range(length - n - 1, -1, -1):  # the most recent earlier match wins
            if tokens[start] == first and tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


class TokenArrays:
    """Each speculating request's tokens as one NumPy array, grown as its tokens come, so that
    finding a step's match (``match_length``) costs the comparison — 3 µs at 600 tokens, 6 µs at
    1,500 — and not joining and converting the whole text from its Python lists every step: 18
    and 43 µs, which at 8 sequences is 0.8-2% of a 17 ms decode step, where speculation that does
    not pay must cost nothing (Intel Xeon, 2026-12-07; ``benchmarks/bench_match_length.py``).
    A request's tokens are only ever appended; a new ``Sequence`` object under the same id (a
    request resumed another way) starts its array afresh. ``release`` drops a finished,
    aborted or preempted request's array."""

    def __init__(self):
        self._arrays: dict = {}  # request id -> (the Sequence, its array, output tokens in it)

    def of(self, seq) -> np.ndarray:
        """``seq``'s prompt and output tokens, as an array (a view: valid until the next call)."""
        prompt, out = seq.prompt_token_ids, seq.output_token_ids
        total, entry = len(prompt) + len(out), self._arrays.get(seq.request_id)
        if entry is None or entry[0] is not seq or entry[2] > len(out):
            array, done = np.empty(max(64, 2 * total), np.int64), 0
            array[: len(prompt)] = prompt
        else:
            _, array, done = entry
            if total > len(array):
                grown = np.empty(2 * total, np.int64)
                grown[: len(prompt) + done] = array[: len(prompt) + done]
                array = grown
        if len(out) > done:
            array[len(prompt) + done : total] = out[done:]
        self._arrays[seq.request_id] = (seq, array, len(out))
        return array[:total]

    def release(self, request_id) -> None:
        self._arrays.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._arrays)


def match_length(tokens: list[int] | np.ndarray, max_n: int = 4, min_n: int = 1) -> int:
    """The ``n`` of the n-gram ``propose_ngram`` would match (0: none): the longest suffix of
    ``tokens``, ``min_n`` to ``max_n`` long, that also occurs earlier with a token after it.

    Vectorized: every earlier position of the last token, narrowed one token further back at a
    time — so a step with no match (about half of a chat's) costs one comparison over the text,
    not ``propose_ngram``'s Python scan of it once per ``n``."""
    length = len(tokens)
    top = min(max_n, length - 1)
    if top < min_n or top < 1:
        return 0
    text = np.asarray(tokens)
    ends = np.flatnonzero(text[: length - 1] == text[-1])  # where an earlier occurrence could end
    n = 0
    while len(ends) and n < top:
        n += 1
        if n == top:
            break
        ends = ends[ends >= n]
        ends = ends[text[ends - n] == text[length - 1 - n]]  # one token further back still agrees
    return n if n >= min_n else 0


def reach(n: int, k: int) -> int:
    """How many tokens to guess after a match of ``n`` tokens: 1, 2, 4, 8, ... — up to ``k``."""
    return min(k, 1 << (n - 1)) if n > 0 else 0


COPYING = 3  # a match this long (4 guesses' reach) says the text is being copied


def kind_of_text(matches: list[int]) -> str | None:
    """What prompt lookup can tell of a step's text before it proposes, from the match lengths
    of the sequences that may speculate: ``"copying"`` when one of them matches ``COPYING``
    tokens or more, ``"free text"`` when any matches at all, None when none does (nothing to
    propose). With ``prompt_lookup_max`` below ``COPYING`` every match is free text.

    Why the governor (governor.py) measures the two apart: how much proposing pays depends on
    the text more than on anything else — on requests that copy their prompt, guessing 8 tokens
    made 3.2 tokens a verify step against 1.5 on chat (``probe_ngram_policy.py``) — and one
    measurement, learnt on one kind of text, was carried into the other: prompt lookup with k = 8
    decoded copying requests at batch 1 at 2.12x the default engine measuring the two together,
    2.61x apart; an EAGLE tree engine, whose copying sequences get prompt lookup's chain instead
    of a tree, learnt at batch 8 that proposing pays on copies and decoded chat at 0.92x the
    default engine, 0.95x with the kinds apart (trees only: 0.96-0.98x). Prompt lookup alone at
    batch 8 — one proposer for both kinds, several texts in a step — served copies better with one
    measurement (1.35x against 1.23x labelled "copying" when any sequence copies, 1.23x against
    1.06x on copy-then-explain requests labelled by the majority), so the speculator asks for the
    kinds apart there only at batch 1 (``bench_eagle_tree.py --copy [--batch 8]``, Intel Xeon,
    2026-12-07/08, docs/benchmarks.md, stop 77)."""
    if not any(matches):
        return None
    return "copying" if any(n >= COPYING for n in matches) else "free text"
