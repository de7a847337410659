"""Chapter 08's whole piece: the speculative decoding loop — propose, verify in one pass, accept,
roll back — as ``propose_ngram(tokens, k, max_n=4) -> list[int]`` (prompt lookup) and
``speculative_decode(model, prompt_ids, max_new_tokens, k, eos_token_id=None) -> (tokens, passes)``.

The proposer is compared first with the package's on hand-made sequences, one rule each (the
longest n-gram first, its most recent earlier occurrence, at most k tokens, never the suffix
matching itself, nothing when nothing repeats) and on random ones, and a mismatch is named by
the rule it breaks. The loop runs the real model against one KV cache (``forward_step``), so
every pass it makes is watched (a forward pre-hook records where each pass starts and how many
tokens it feeds):

1. **the passes** — the prefill writes the whole prompt once; each later pass feeds the last
   emitted token and at most ``k`` proposals, starting exactly where the kept tokens end (the
   rollback: a rejected proposal's K/V is overwritten by the next pass), always into the same
   cache; the passes the learner reports are the passes that ran;
2. **the tokens** — equal to plain greedy decoding on an answer that repeats itself (where prompt
   lookup guesses well, so most passes must keep several tokens) and on one that does not, for
   several lengths and ``k``;
3. **the end of the answer** — the repeating answer again (its first tokens in the prompt) with an
   EOS: a token of it chosen where a pass keeps several tokens and the EOS is not the last of
   them (a loop that looks only at the last kept token runs past it), then the prefill's own
   token (the answer is that one token, with no verify pass). The answer ends with the EOS, and
   no pass runs after it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from minillm.course.checks.common import engine
from minillm.course.results import CheckError, CheckFailed, check

MODEL = "tiny-shakespeare-8m"
#: The 8M model's greedy answer to this repeats itself ("And, as the king, and the king..."): prompt
#: lookup finds most of it in the tokens so far (48 tokens in 23 passes at k=4).
REPEATING = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n\nFirst Citizen:\n"
PLAIN = "KING.\nNow is the winter"
#: (prompt, new tokens, k)
RUNS = [(REPEATING, 48, 4), (PLAIN, 17, 3), (REPEATING, 9, 8)]
#: The EOS runs continue the repeating answer after its first EOS_AFTER tokens, given in the prompt: passes
#: then copy tokens the answer has not made yet, so an EOS can come before a pass's last kept token.
EOS_AFTER = 12


def _lookup(
    tokens: list[int], k: int, max_n: int, longest_first=True, most_recent=True, self_match=False, extra=0
) -> list[int]:
    """Prompt lookup with its rules switched: the package's when every switch is at its default."""
    length = len(tokens)
    sizes = range(min(max_n, length - 1), 0, -1)
    for n in sizes if longest_first else reversed(sizes):
        suffix = tokens[length - n :]
        starts = range(length - n - (0 if self_match else 1), -1, -1)
        for start in starts if most_recent else reversed(starts):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k + extra]
    return []


#: (tokens, k, max_n, what the case shows)
PROPOSALS = [
    ([5, 6, 7, 8], 3, 4, "nothing repeats: no proposal"),
    ([7], 3, 4, "a single token has nothing before it: no proposal"),
    ([1, 2, 3, 9, 9, 3, 4, 1, 2, 3], 4, 4, "the last 3 tokens (1 2 3) occurred before: what followed them"),
    ([1, 2, 5, 6, 2, 7, 8, 1, 2], 2, 4, "2 occurs twice, but 1 2 (two tokens) only once: the longest n-gram wins"),
    ([3, 1, 4, 3, 1, 5, 3, 1], 3, 4, "3 1 occurred twice: the most recent occurrence's continuation"),
    ([4, 5, 6, 7, 8, 9, 1, 4], 3, 4, "k = 3: at most 3 tokens"),
    ([2, 3, 4, 2, 3], 8, 4, "the match's continuation runs into the end: fewer than k tokens"),
    ([9, 8, 7, 6, 1, 9, 8, 7, 6], 2, 2, "max_n = 2: n-grams of at most 2 tokens (7 6), however long the repeat"),
    ([6, 6, 6, 6], 2, 4, "6 6 6 repeats itself: the most recent earlier match, not the suffix itself"),
    ([1, 9, 2, 9, 3, 9], 3, 1, "max_n = 1: the last token's most recent earlier occurrence"),
]


def _diagnose_proposer(propose_ngram) -> None:
    import random

    from minillm.speculative import propose_ngram as package

    cases = list(PROPOSALS)
    rng = random.Random(8)
    for _ in range(200):  # random sequences over a small vocabulary, where n-grams repeat often
        tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 14))]
        cases.append((tokens, rng.randrange(1, 6), rng.randrange(1, 5), "a random sequence"))
    slips = [
        (dict(longest_first=False), "the shortest n-gram was tried first: try n from max_n down to 1, the longest "
         "first — a longer match is the better guess"),
        (dict(most_recent=False), "the oldest occurrence was used: search backwards from the end, the most recent "
         "earlier occurrence first"),
        (dict(self_match=True), "the last n tokens matched themselves (a match starting at len(tokens) - n): an "
         "occurrence must start before that, at len(tokens) - n - 1 at the latest"),
        (dict(extra=1), "one token more than k: propose at most k"),
    ]  # fmt: skip
    for tokens, k, max_n, what in cases:
        given = list(tokens)
        got = propose_ngram(given, k, max_n)
        if given != tokens:
            raise CheckFailed(f"propose_ngram changed the tokens it was given ({tokens}): only read them")
        want = package(list(tokens), k, max_n)
        if got == want:
            continue
        if not isinstance(got, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in got):
            raise CheckFailed(f"propose_ngram({tokens}, k={k}, max_n={max_n}) returned {got!r:.60}: return a list of "
                              "token ids (an empty list when nothing repeats)")  # fmt: skip
        shown = f"propose_ngram({tokens}, k={k}, max_n={max_n}) returned {got}, expected {want} ({what})"
        named = [message for switches, message in slips if got == _lookup(tokens, k, max_n, **switches) and got]
        if got == [] and want and propose_ngram([5, 5], 2, 4) == []:
            named.insert(0, "even [5, 5] gets no proposal: the last n tokens matched themselves (a match starting at "
                         "len(tokens) - n proposes nothing) — an occurrence must start at len(tokens) - n - 1 at the "
                         "latest")  # fmt: skip
        elif got == [] and want:
            named.insert(0, "no proposal, though an n-gram at the end occurred before: when the longest n finds "
                         "nothing, go on with n - 1, down to 1")  # fmt: skip
        if len(got) > k:
            named.insert(0, f"{len(got)} tokens for k={k}: propose at most k")
        if max_n < len(tokens) - 1 and got == _lookup(tokens, k, len(tokens)):
            named.insert(0, "an n-gram longer than max_n was matched: n goes from min(max_n, len(tokens) - 1) down")
        raise CheckFailed(f"{shown}: {named[0]}" if named else shown)


def _greedy(llm, ids: list[int], n: int) -> list[int]:
    from minillm import SamplingParams

    return llm.generate([ids], SamplingParams(max_tokens=n, ignore_eos=True))[0].token_ids


def _pair(got) -> tuple[list[int], int]:
    if not (isinstance(got, tuple) and len(got) == 2):
        raise CheckFailed(f"speculative_decode returned {type(got).__name__} {got!r:.60}; return a pair "
                          "(tokens, passes): the new tokens and how many forward passes made them")  # fmt: skip
    tokens, passes = got
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise CheckFailed(f"the tokens should be a list of ints, got {tokens!r:.60}")
    return tokens, passes


def _result(got, prompt: list[int], n: int) -> tuple[list[int], int]:
    tokens, passes = _pair(got)
    if len(tokens) == len(prompt) + n and tokens[: len(prompt)] == prompt:
        raise CheckFailed(f"speculative_decode returned the {len(prompt)} prompt tokens followed by the new ones: "
                          "return only the new tokens")  # fmt: skip
    if len(tokens) != n:
        raise CheckFailed(f"speculative_decode returned {len(tokens)} tokens for max_new_tokens={n}: a pass may "
                          f"accept more than are still wanted — keep exactly {n}")  # fmt: skip
    return tokens, passes


@dataclass
class _Pass:
    start: int
    ids: list[int]
    cache: object


@contextlib.contextmanager
def _passes(model, limit: int, n: int):
    """Every forward pass of ``model`` against a cache: where it starts and what it feeds (a
    forward pre-hook: nothing of the model is replaced). More than ``limit`` passes is a runaway."""
    passes: list[_Pass] = []

    def record(module, args):
        batch = args[0]
        if batch.cache is not None:
            passes.append(_Pass(int(batch.positions[0, 0]), batch.input_ids[0].tolist(), batch.cache))
        if len(passes) > limit:
            raise CheckFailed(f"your loop ran more than {limit} passes for {n} tokens: does every pass keep at least "
                              "one token (the target's own, at the first mismatch)?")  # fmt: skip

    handle = model.register_forward_pre_hook(record)
    try:
        yield passes
    finally:
        handle.remove()


def _check_passes(calls: list[_Pass], prompt: list[int], tokens: list[int], passes, k: int, what: str,
                  stop: str = "max_new_tokens are kept") -> None:  # fmt: skip
    if not calls:
        raise CheckFailed("your loop never ran the model against a cache: use forward_step(model, ids, start, cache)")
    first = calls[0]
    if (first.start, len(first.ids)) != (0, len(prompt)):
        raise CheckFailed(f"{what}: the first pass fed positions {first.start}..{first.start + len(first.ids) - 1}; "
                          f"the prefill feeds the whole prompt, positions 0..{len(prompt) - 1}, once")  # fmt: skip
    full, written = prompt + tokens, len(prompt)
    for i, call in enumerate(calls[1:], start=1):
        if call.start > written:
            raise CheckFailed(f"{what}: pass {i} started at position {call.start}, but no pass had written position "
                              f"{written}: a pass starts with the last kept token, at its own position len(ids) - 1 "
                              "(its K/V is not in the cache yet), then the proposals")  # fmt: skip
        written = max(written, call.start + len(call.ids))
        if call.cache is not first.cache:
            raise CheckFailed(f"{what}: pass {i} ran against a new cache: create the cache once, before the loop")
        if call.start == 0:
            raise CheckFailed(f"{what}: pass {i} started again at position 0, recomputing the whole sequence: feed only "
                              "the last token and the proposals, at the positions after the kept ones")  # fmt: skip
        if len(call.ids) > k + 1:
            raise CheckFailed(f"{what}: pass {i} fed {len(call.ids)} tokens with k={k}: the last token and at most k "
                              "proposals (propose_ngram(ids, k) gives at most k)")  # fmt: skip
        prev = calls[i - 1]
        if i >= 2 and call.start == prev.start + len(prev.ids) and full[prev.start : call.start] != prev.ids:
            raise CheckFailed(
                f"{what}: pass {i} started at position {call.start}, right after every token pass {i - 1} fed, though "
                f"you kept fewer of them: the next pass starts after the tokens *kept* (len(ids) - 1 once the "
                "accepted ones are appended), and so overwrites the rejected proposals' K/V — that is the rollback"
            )
        if call.start < len(full) and call.ids[0] != full[call.start]:
            raise CheckFailed(f"{what}: pass {i} fed token {call.ids[0]} at position {call.start}, where the sequence "
                              f"holds {full[call.start]}: a pass starts with the last kept token, at its own position "
                              "len(ids) - 1 (its K/V is not in the cache yet)")  # fmt: skip
    if len(calls) > 1 and calls[1].start < len(prompt):
        raise CheckFailed(f"{what}: pass 1 fed position {calls[1].start} again, which the prefill wrote: the prefill's "
                          "last row already gives the first new token — append it, then verify from there")  # fmt: skip
    if len(calls) > 1 and calls[-1].start >= len(prompt) + len(tokens) - 1:
        raise CheckFailed(f"{what}: the last pass ran after all {len(tokens)} tokens were made (it started at "
                          f"position {calls[-1].start}): stop as soon as {stop}")  # fmt: skip
    if passes != len(calls):
        raise CheckFailed(f"{what}: you reported {passes} passes, and {len(calls)} forward passes ran (the prefill "
                          "counts as one)")  # fmt: skip


def _kept_runs(prompt: list[int], answer: list[int], k: int) -> list[range]:
    """Which answer indices each verify pass keeps when prompt lookup proposes and greedy acceptance
    keeps (the answer is greedy decoding's, so the target's choices are known without the model)."""
    from minillm.speculative import propose_ngram

    runs, made = [], 1  # the prefill made answer[0]
    while made < len(answer):
        drafts = propose_ngram(prompt + answer[:made], k)
        agree = next((i for i, d in enumerate(drafts) if made + i >= len(answer) or d != answer[made + i]), len(drafts))
        kept = min(agree + 1, len(answer) - made)
        runs.append(range(made, made + kept))
        made += kept
    return runs


def _eos_cases(prompt: list[int], answer: list[int], k: int) -> list[tuple[int, str]]:
    """Two EOS tokens for the answer: one its pass keeps with more tokens after it, then the prefill's."""
    inside = [j for run in _kept_runs(prompt, answer, k) for j in run[:-1] if answer[j] not in answer[:j]]
    if not inside:
        raise CheckError("no pass of the repeating answer keeps a new token before another one")
    return [(answer[inside[-1]], "the middle of a pass's kept tokens"), (answer[0], "the prefill's token")]


def _check_eos(model, speculative_decode, prompt: list[int], answer: list[int], k: int) -> None:
    """The answer ends with its EOS, wherever it comes, and no pass runs after it."""
    import inspect

    n, results = len(answer), []
    try:
        inspect.signature(speculative_decode).bind(model, prompt, n, k, eos_token_id=None)
    except TypeError:
        raise CheckFailed("speculative_decode takes the EOS too: add the parameter eos_token_id=None (None: no EOS, "
                          "decode max_new_tokens)") from None  # fmt: skip
    except ValueError:  # no signature to read: the call says it
        pass
    for eos, where in _eos_cases(prompt, answer, k):
        with _passes(model, 4 * (n + 2), n) as calls:
            got = speculative_decode(model, list(prompt), n, k, eos_token_id=eos)
        tokens, passes = _pair(got)
        results.append((eos, where, answer[: answer.index(eos) + 1], tokens, passes, list(calls)))
    ran_on = [(eos, where, want, tokens) for eos, where, want, tokens, _, _ in results
              if len(tokens) > len(want) and tokens[: len(want)] == want]  # fmt: skip
    if len(ran_on) == len(results):
        raise CheckFailed(f"with eos_token_id={ran_on[0][0]} your loop went on after the EOS: the answer ends with "
                          "it — once a pass keeps eos_token_id, cut what follows it and stop (None: no EOS)")  # fmt: skip
    for eos, where, want, tokens, passes, calls in results:
        what = f"{n} tokens with k={k}, eos_token_id={eos} ({where}, new token {len(want) - 1})"
        if tokens == want:
            _check_passes(calls, prompt, tokens, passes, k, what, stop="the EOS is kept")
            continue
        if len(tokens) > len(want) and tokens[: len(want)] == want:
            fix = ("look for eos_token_id among all the tokens a pass keeps, not only the last: keep it, cut what "
                   "follows, and stop" if len(want) > 1 else "check the prefill's token before the first verify "
                   "pass: when it is the EOS, the answer is that one token")  # fmt: skip
            raise CheckFailed(f"{what}: the answer ends with the EOS, and you kept {len(tokens) - len(want)} tokens "
                              f"after it — it was {where}: {fix}")  # fmt: skip
        if tokens == want[:-1]:
            raise CheckFailed(f"{what}: you dropped the EOS itself: it is the answer's last token — keep it, then stop")
        i = next((j for j, (a, b) in enumerate(zip(tokens, want)) if a != b), min(len(tokens), len(want)))
        raise CheckFailed(f"{what}: you returned {len(tokens)} tokens, greedy decoding's answer up to its EOS is "
                          f"{len(want)} (they first differ at token {i}): {want[:i + 2]}...")  # fmt: skip


def _in_the_engine(propose_ngram) -> str:
    """The proposer as the engine's (hook ``propose_ngram``, speculative_config ngram): the same
    tokens and the same accepted proposals as with the package's."""
    import minillm.hooks as hooks
    from minillm import LLM, SamplingParams
    from minillm.course.plugs import ngram_proposer

    # always k = 4: the two runs are compared proposal for proposal (no governor, whose choices follow
    # timing), and the learner's proposer is asked for k on every step, as vLLM's ngram asks (the
    # engine's default guesses less after a short match: fewer, smaller calls to check)
    llm = LLM(MODEL, dtype="fp32", attention_backend="torch", speculative_config={"method": "ngram",
              "num_speculative_tokens": 4, "adaptive": False, "prompt_lookup_scaled": False})  # fmt: skip
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    prompts = [REPEATING, PLAIN]
    expected = llm.generate(prompts, params)
    calls = []
    mine = ngram_proposer(propose_ngram)

    def counted(tokens, k, max_n=4, min_n=1):
        calls.append(k)
        return mine(tokens, k, max_n, min_n)

    with hooks.override(propose_ngram=counted):
        got = llm.generate(prompts, params)
    if not calls:
        raise RuntimeError("the engine's ngram speculator did not call hook propose_ngram")
    for o, e in zip(got, expected):
        mine_counts = (o.metrics.spec_proposed, o.metrics.spec_accepted)
        if o.token_ids != e.token_ids or mine_counts != (e.metrics.spec_proposed, e.metrics.spec_accepted):
            raise CheckFailed(
                f"as the engine's proposer (speculative_config ngram, k=4) yours proposed/accepted {mine_counts} and "
                f"the package's {(e.metrics.spec_proposed, e.metrics.spec_accepted)}: the hand-made sequences "
                "matched — look at what the engine passes (the prompt and every token so far, max_n=4)"
            )
    accepted = sum(o.metrics.spec_accepted for o in got)
    proposed = sum(o.metrics.spec_proposed for o in got)
    return f"as the engine's proposer ({len(calls)} calls) yours had {accepted} of {proposed} proposals accepted, as the package's"


@check
def check_speculative_decode(propose_ngram, speculative_decode, model: str = MODEL) -> str:
    """``propose_ngram(tokens, k, max_n=4) -> list[int]`` and
    ``speculative_decode(model, prompt_ids, max_new_tokens, k, eos_token_id=None) -> (tokens, passes)``."""
    _diagnose_proposer(propose_ngram)
    llm = engine(model, "contiguous")
    summary, answers = [], []
    for text, n, k in RUNS:
        prompt = llm.tokenizer.encode(text)
        expected = _greedy(llm, prompt, n)
        given = list(prompt)
        limit = 4 * (n + 2)

        with _passes(llm.model, limit, n) as calls:
            try:
                got = speculative_decode(llm.model, given, n, k)
            except Exception:
                if given != prompt:  # the likelier cause of what it raised
                    raise CheckFailed("speculative_decode changed the prompt_ids list it was given (appending to it?): "
                                      "copy it first, ids = list(prompt_ids)") from None  # fmt: skip
                raise
        what = f"{n} tokens with k={k} after {text[:18]!r}..."
        if given != prompt:
            raise CheckFailed(f"speculative_decode changed the prompt_ids list it was given ({what})")
        tokens, passes = _result(got, prompt, n)
        _check_passes(calls, prompt, tokens, passes, k, what)
        if tokens != expected:
            i = next(j for j, (a, b) in enumerate(zip(tokens, expected)) if a != b)
            raise CheckFailed(f"{what}: token {i} is {tokens[i]}, plain greedy decoding gives {expected[i]}: "
                              "keep a proposal only while it equals the target's argmax at its position (row i of the pass's logits "
                              "checks proposal i), then add the target's own token at the first mismatch (or after "
                              "the last proposal)")  # fmt: skip
        summary.append((text is REPEATING, n, k, passes))
        answers.append((prompt, expected, k))
    prompt, expected, k = answers[0]
    prompt = prompt + expected[:EOS_AFTER]  # the answer's start in the prompt: lookup copies new tokens from it
    _check_eos(llm.model, speculative_decode, prompt, _greedy(llm, prompt, 24), k)
    engine_line = _in_the_engine(propose_ngram)
    repeating = [(n, p) for rep, n, k, p in summary if rep]
    if all(p >= n for n, p in repeating):
        raise CheckFailed(
            f"on an answer that repeats itself your loop made {repeating[0][1]} passes for {repeating[0][0]} tokens: "
            "no proposal was ever accepted. Propose with your propose_ngram(ids, k) — the prompt and the tokens so "
            "far — and keep the proposals the target agrees with"
        )
    n, p = repeating[0]
    return (
        f"your prompt lookup proposed what the package's does on {len(PROPOSALS)} hand-made and 200 random "
        f"sequences; your loop gave greedy decoding's tokens exactly, {n} of them in {p} passes (prefill included) "
        "where the answer repeats itself, every pass feeding the last token and at most k proposals right after "
        f"the kept tokens, into one cache, and ending with an EOS in a pass's kept tokens and at the prefill; "
        f"{engine_line}"
    )
