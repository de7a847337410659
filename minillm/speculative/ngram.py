"""Prompt lookup: proposals copied from earlier text of the same request, no model at all.

When a request's output repeats its input — summarising, extracting, editing, answering with
quotes, code that reuses names — the tokens after the latest n-gram often already appeared after
the same n-gram earlier. Find the most recent earlier occurrence of the last ``n`` tokens
(longest ``n`` first, from ``prompt_lookup_max`` down to ``prompt_lookup_min``) and propose the
``k`` tokens that followed it (Saxena, 2023, *Prompt Lookup Decoding*; vLLM's ``ngram`` method).
Nothing is proposed when nothing matches, and the step is a plain decode.
"""

from __future__ import annotations

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
