"""Chapter 10's checks: the streaming detokenizer's step, first on hand-made token streams, then
plugged into the engine while it streams SmolLM2's answers; the response cache's key, first on
constructed request bodies, then plugged into a live server and driven with the official
``openai`` client."""

from __future__ import annotations

import copy

import minillm.hooks as hooks
from minillm.course.results import CheckError, CheckFailed, check, learner_cause

MODEL = "tiny-shakespeare-8m"
GREEDY = {"model": MODEL, "prompt": "KING.\nNow is", "max_tokens": 8, "temperature": 0, "stop": ["\n\n"]}


def _key(cache_key, endpoint: str, body: dict, what: str):
    got = cache_key(endpoint, copy.deepcopy(body))  # a crash is reported by @check, with the learner's frames
    if got is not None and not isinstance(got, str):
        returned = f"cache_key returned {type(got).__name__} {got!r:.60} for {what}"
        if isinstance(got, (bytes, bytearray)):
            raise CheckFailed(
                f"{returned}: .digest() returns bytes, and cache_key must return a str (or None) — use "
                "h.hexdigest(), the same digest as text, or return the canonical text itself"
            )
        if isinstance(got, int) and not isinstance(got, bool):
            raise CheckFailed(
                f"{returned}; return a string (or None): a hash() number can collide between different requests, "
                "and differs between processes"
            )
        raise CheckFailed(f"{returned}; return a string (or None), e.g. endpoint + json.dumps(..., sort_keys=True)")
    return got


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Who is the king?"}], "max_tokens": 8,
        "temperature": 0}  # fmt: skip


#: Fields of a completion request that change a greedy answer, beyond the ones checked by name above:
#: a key over a fixed list of fields ("model", "prompt", "max_tokens", ...) drops them, and then a request
#: that may not stop at the end-of-text token, or that penalises repeats, gets another request's answer.
ANSWER_FIELDS = {
    "ignore_eos": True,  # the answer runs on past the end-of-text token
    "repetition_penalty": 1.3,  # a repeated token's logit is divided down
}


def _differs(cache_key, change: dict, field: str, endpoint: str = "/v1/completions", base_body: dict = GREEDY,
             base_endpoint: str = "/v1/completions") -> None:  # fmt: skip
    base = _key(cache_key, base_endpoint, base_body, "a greedy request")
    other = _key(cache_key, endpoint, base_body | change, f"a greedy request with another {field}")
    if base is None or other is None:
        what = "a greedy chat request" if "messages" in base_body else "a greedy request"
        raise CheckFailed(f"cache_key returned None for {what} (temperature 0): those are the ones to cache")
    if other == base:
        raise CheckFailed(
            f"two requests that differ only in {field} got the same key, so the second would be answered with "
            f"the first one's response: {field} changes the answer and must be part of the key"
        )


@check
def check_cache_key(cache_key, model: str = MODEL) -> str:
    """``cache_key(endpoint, body) -> str | None``: the exact-match key of a cacheable request."""
    endpoint = "/v1/completions"
    if _key(cache_key, endpoint, GREEDY, "a greedy request") is None:
        raise CheckFailed("cache_key returned None for a greedy request (temperature 0): those are the ones to cache")
    if _key(cache_key, endpoint, GREEDY | {"temperature": 0.7}, "a sampled request") is not None:
        raise CheckFailed(
            "cache_key gave a key to a sampled request (temperature 0.7): the cache would repeat one random "
            "answer forever. Only temperature 0 is deterministic"
        )
    no_temperature = {k: v for k, v in GREEDY.items() if k != "temperature"}
    if _key(cache_key, endpoint, no_temperature, "a request without temperature") is not None:
        raise CheckFailed(
            "cache_key gave a key to a request with no temperature field: the OpenAI API's default temperature is "
            "1, so that request samples. Treat a missing temperature as 1, not 0"
        )
    if _key(cache_key, endpoint, GREEDY | {"stream": True}, "a streamed request") is not None:
        raise CheckFailed(
            "cache_key gave a key to a streamed request (stream: true): the cache holds whole JSON responses, "
            "and a streaming client expects server-sent events. Return None for streams"
        )
    reordered = dict(reversed(list(GREEDY.items())))
    if _key(cache_key, endpoint, reordered, "the same request, fields in another order") != _key(
        cache_key, endpoint, GREEDY, "a greedy request"
    ):
        raise CheckFailed(
            "the same request with its JSON fields in another order got another key: JSON objects are unordered, "
            "so make the key canonical (e.g. json.dumps(..., sort_keys=True))"
        )
    if _key(cache_key, endpoint, GREEDY | {"user": "alice"}, "a request with a user field") != _key(
        cache_key, endpoint, GREEDY, "a greedy request"
    ):
        raise CheckFailed(
            'adding "user": "alice" changed the key: user only identifies the caller and cannot change the '
            "answer, so leave it out of the key (the same goes for stream_options)"
        )
    _differs(cache_key, {"prompt": "ROMEO.\n"}, "prompt")
    _differs(cache_key, {"max_tokens": 9}, "max_tokens")
    _differs(cache_key, {"stop": ["."]}, "stop")
    _differs(cache_key, {"model": "tiny-shakespeare-1m"}, "model")
    _differs(cache_key, {}, "endpoint", endpoint="/v1/chat/completions")
    _differs(cache_key, {"stop": ["\n\n", "."]}, "stop (one more stop string)")
    _differs(cache_key, {"n": 3}, "n (how many completions)")
    _differs(cache_key, {"logprobs": 2}, "logprobs")
    for field, value in ANSWER_FIELDS.items():
        _differs(cache_key, {field: value}, field)
    chat = "/v1/chat/completions"
    other_chat = {"messages": [{"role": "user", "content": "Who is the queen?"}]}
    _differs(cache_key, other_chat, "messages (another chat)", chat, CHAT, chat)
    longer = {"messages": [*CHAT["messages"], {"role": "assistant", "content": "Richard."},
                           {"role": "user", "content": "And his brother?"}]}  # fmt: skip
    _differs(cache_key, longer, "messages (the same chat, one turn longer)", chat, CHAT, chat)
    _differs(cache_key, {"n": 2}, "n in a chat request", chat, CHAT, chat)
    _differs(cache_key, {"logprobs": True, "top_logprobs": 2}, "logprobs in a chat request", chat, CHAT, chat)
    _differs(cache_key, {"max_completion_tokens": 3}, "max_completion_tokens in a chat request", chat, CHAT, chat)
    for field, value in ANSWER_FIELDS.items():
        _differs(cache_key, {field: value}, f"{field} in a chat request", chat, CHAT, chat)
    return _live(cache_key, model)


def _live(cache_key, model: str) -> str:
    """Plug the key into a real server and count the cache's hits through the openai client."""
    import httpx
    import openai

    from minillm.server import ServerThread, build_app, build_engines
    from minillm.server.response_cache import ResponseCache

    cache = ResponseCache(8, key=cache_key)
    engines = build_engines([model], dtype="fp32", kv_cache_memory=8_000_000)
    with ServerThread(build_app(engines, cache)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        args = {k: v for k, v in GREEDY.items()} | {"model": model}
        first = client.completions.create(**args).choices[0].text
        second = client.completions.create(**args).choices[0].text
        if cache.hits != 1 or second != first:
            raise CheckFailed(f"in the live server the repeated greedy request was not served from the cache "
                              f"(hits: {cache.hits})")  # fmt: skip
        raw = httpx.post(server.url + "/v1/completions", json=dict(reversed(list(args.items()))), timeout=60)
        if raw.status_code != 200 or cache.hits != 2:
            raise CheckFailed("in the live server the same request in another field order missed the cache")
        for _ in range(2):
            client.completions.create(**(args | {"temperature": 1.0, "seed": 3}))
        if cache.hits != 2:
            raise CheckFailed("in the live server a sampled request was answered from the cache")
        for change, what in (({"n": 3}, "n=3"), ({"logprobs": 2}, "logprobs=2"), ({"stop": ["."]}, 'stop ["."]')):
            out = client.completions.create(**(args | change))
            if cache.hits != 2:
                raise CheckFailed(
                    f"in the live server the greedy request with {what} was answered from the cache of the one "
                    f"without: {what} changes the answer, so it must change the key"
                )
            if "n" in change and len(out.choices) != change["n"]:
                raise CheckFailed(f"in the live server a request with n=3 got {len(out.choices)} choices back")
    return (
        f"your key tells apart chats, n, logprobs and stop strings; in a live server a repeated greedy request "
        f"and its reordered twin were answered from the cache ({cache.hits} hits, {cache.misses} misses), sampled "
        "requests and requests with another n, logprobs or stop never"
    )


# ---- the streaming detokenizer ----------------------------------------------------------------------------

#: A toy tokenizer's vocabulary: token id -> its bytes. Like byte-level BPE, a token may hold part of a
#: UTF-8 character (or the end of one and the start of the next); like SentencePiece, a decode drops the
#: leading space of its text. Token 0 is a special token, which a decode skips (skip_special_tokens).
TOY_VOCAB: dict[int, bytes] = {
    0: b"<|end|>", 1: b" I", 2: b" am", 3: b" here", 4: b"caf", 5: b"\xc3", 6: b"\xa9", 7: b" au", 8: b" lait",
    9: b"The", 10: b" sea", 11: b"\xf0", 12: b"\x9f", 13: b"\x8c", 14: b"\x8a", 15: b"\x80", 16: b" ok",
    17: b"\xa9\xe6", 18: b"\x9d\xb1\xe4", 19: b"\xba\xac", 20: b"!",
}  # fmt: skip
TOY_SPECIAL = {0}

#: Hand-made streams: what each shows, and its token ids. The first reads "I am here".
TOY_STREAMS = [
    ("three words (' I', ' am', ' here')", [1, 2, 3]),
    ("'café au lait', its é split over two tokens", [4, 5, 6, 7, 8]),
    ("' I', a special token, ' am'", [1, 0, 2]),
    ("'café東京!', whose tokens cut characters (é|東 share one, so do 東|京)", [4, 5, 17, 18, 19, 20]),
    ("' I', a byte that is no UTF-8 character's (0x80), ' ok'", [1, 15, 16]),
    ("'The sea🌊', the emoji's 4 bytes in 4 tokens at the very end", [9, 10, 11, 12, 13, 14]),
]


def toy_decode(ids) -> str:
    """The toy tokenizer's ``decode(ids)``: the tokens' bytes as UTF-8 (an incomplete or invalid sequence
    becomes U+FFFD, as in Hugging Face's decode), special tokens skipped, one leading space dropped."""
    if isinstance(ids, (int, str, bytes)) or not hasattr(ids, "__iter__"):
        raise TypeError(f"decode takes a list of token ids, got {type(ids).__name__} {ids!r:.40}")
    text = b"".join(TOY_VOCAB[int(i)] for i in ids if int(i) not in TOY_SPECIAL).decode("utf-8", errors="replace")
    return text[1:] if text.startswith(" ") else text


def _show_tokens(decode, ids) -> str:
    """Token ids as their text (``' am'``); a toy token that holds part of a character as its bytes (``<C3>``)."""
    if decode is not toy_decode:
        return "[" + ", ".join(repr(decode([i])) for i in ids) + "]"
    shown = []
    for i in ids:
        text = TOY_VOCAB[i].decode("utf-8", errors="replace")
        if i in TOY_SPECIAL:
            shown.append("<special>")
        elif "\ufffd" in text:
            shown.append("<" + " ".join(f"{b:02X}" for b in TOY_VOCAB[i]) + ">")
        else:
            shown.append(repr(text))
    return "[" + ", ".join(shown) + "]"


def _step_result(got, what: str) -> tuple[str, int, int]:
    if not isinstance(got, (tuple, list)) or len(got) != 3:
        raise CheckFailed(
            f"detokenize_step returned {type(got).__name__} {got!r:.60} for {what}; return the tuple "
            "(delta, prefix_offset, read_offset)"
        )
    delta, prefix, read = got
    if not isinstance(delta, str):
        raise CheckFailed(
            f"detokenize_step returned {delta!r:.40} ({type(delta).__name__}) as the delta for {what}: the delta is "
            "the new text, a str — return (delta, prefix_offset, read_offset) in that order"
        )
    for name, value in (("prefix_offset", prefix), ("read_offset", read)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise CheckFailed(
                f"detokenize_step returned {value!r:.40} ({type(value).__name__}) as {name} for {what}: offsets are "
                "int positions in ids"
            )
    return delta, prefix, read


def _explain(decode, ids, state, got, want, what: str) -> str:
    """Why the learner's step ``got`` differs from the reference's ``want``: name the mistake."""
    prefix, read = state
    n = len(ids)
    before, after = decode(ids[prefix:read]), decode(ids[prefix:])
    delta, want_delta = got[0], want[0]
    head = f"after {what}, with prefix_offset={prefix} and read_offset={read}, you returned {tuple(got)!r}"
    if delta != want_delta:
        if "\ufffd" in delta and "\ufffd" not in want_delta:
            return (
                f"{head}: you emitted U+FFFD (the replacement character) mid-stream. The window "
                f"decode(ids[{prefix}:]) = {after!r} ends in an incomplete UTF-8 character whose other bytes come with "
                "the next token(s): emit nothing and keep the offsets until it is complete"
            )
        if not want_delta:
            if after.endswith("\ufffd"):
                return (
                    f"{head}, but the window decode(ids[{prefix}:]) = {after!r} ends in U+FFFD, an incomplete "
                    "character: emit nothing this step (not even the whole characters before it: they come with it "
                    "once it completes) and keep the offsets"
                )
            return (
                f"{head}, but decode(ids[{prefix}:]) = {after!r} is no longer than decode(ids[{prefix}:{read}]) = "
                f"{before!r}: there is no new text — emit nothing and keep the offsets"
            )
        if not delta:
            if "\ufffd" in after[:-1] and not after.endswith("\ufffd"):
                return (
                    f"{head}: you held back {want_delta!r}. The window {after!r} holds a U+FFFD in the middle — a "
                    "byte that belongs to no character and never will (the full decode shows it too); only a U+FFFD "
                    "at the end of the window means 'wait for the next token'"
                )
            if tuple(got[1:]) == want[1:]:
                return (
                    f"{head}: you moved the offsets on but emitted nothing; the new text is {want_delta!r}, "
                    f"decode(ids[{prefix}:])[len(decode(ids[{prefix}:{read}])):] — check the slice's start"
                )
            if n - read > 1:
                return (
                    f"{head}: you emitted nothing, but {want_delta!r} is new. {n - read} tokens came since "
                    f"read_offset (a held-back character's bytes arrive over several): the window is everything "
                    f"from prefix_offset to the end, ids[{prefix}:]"
                )
            return f"{head}: you emitted nothing, but {want_delta!r} is new (decode(ids[{prefix}:]) = {after!r})"
        alone = decode(ids[-1:])
        if delta == alone and alone != want_delta:
            return (
                f"{head}: the delta {delta!r} is the new token decoded alone; the new text is {want_delta!r}. Decoded "
                "alone a token loses its leading space (a decode drops the space at the start of a text) and its "
                f"bytes' neighbours: decode the window ids[prefix_offset:] and keep what decode(ids[{prefix}:{read}]) "
                "does not have"
            )
        if want_delta.startswith(" ") and delta == want_delta[1:]:
            return (
                f"{head}: the delta {delta!r} lost the leading space of {want_delta!r} — decoded without the context "
                f"ids[{prefix}:{read}] in front, a token's space is dropped (the decode starts a text there)"
            )
        if delta.endswith(want_delta) and len(delta) > len(want_delta):
            return (
                f"{head}: the delta {delta!r} repeats text already shown; only {want_delta!r} is new. The new text is "
                "decode(ids[prefix_offset:])[len(decode(ids[prefix_offset:read_offset])):]"
            )
        return f"{head}: the new text is {want_delta!r}, you emitted {delta!r} (the window decodes to {after!r})"
    if want[1:] == (prefix, read):
        return (
            f"{head}: you moved the offsets to {tuple(got[1:])} while emitting nothing. The held-back bytes must "
            f"stay in the window (prefix_offset={prefix}, read_offset={read}) until the text they start is complete"
        )
    if got[1:] == (prefix, read):
        return (
            f"{head}: after emitting {delta!r} the offsets must move on — prefix_offset to the old read_offset "
            f"({read}) and read_offset to len(ids) ({n}); kept as they are, the next step emits this text again"
        )
    if got[1] == prefix and got[2] == n:
        return (
            f"{head}: prefix_offset stayed at {prefix} after emitting, so the window you decode grows with every "
            f"token and each step re-decodes the whole answer (quadratic in its length). Move it to the old "
            f"read_offset ({read}): the window needs only the tokens of the last text shown"
        )
    return (
        f"{head}: after emitting {delta!r} the offsets must be ({read}, {n}) — prefix_offset = the old read_offset, "
        "read_offset = len(ids), everything shown so far"
    )


def _run_stream(detokenize_step, decode, ids: list[int], name: str) -> list[str]:
    """Feed ``ids`` one token at a time to the learner's step, beside the package's; the learner's deltas,
    or ``CheckFailed`` at the first step whose result differs."""
    reference = hooks.default("detokenize_step")
    state, deltas = (0, 0), []
    for n in range(1, len(ids) + 1):
        what = f"token {n} of {name} {_show_tokens(decode, ids[:n])}"
        window = list(ids[:n])
        try:
            got = detokenize_step(decode, window, *state)
        except Exception as err:
            cause = learner_cause(err)
            if cause is None or isinstance(cause, NotImplementedError):
                raise
            raise CheckFailed(
                f"detokenize_step(decode, {window}, {state[0]}, {state[1]}) raised {type(cause).__name__}: {cause} "
                f"(at {what})"
            ) from None
        if window != ids[:n]:
            raise CheckFailed(
                f"detokenize_step changed ids, from {ids[:n]} to {window}, at {what}: ids are the sequence's tokens, "
                "the detokenizer's own list; read them, slice them, never change them"
            )
        got = _step_result(got, what)
        want = reference(decode, ids[:n], *state)
        if got != want:
            raise CheckFailed(_explain(decode, ids[:n], state, got, want, what))
        state = got[1:]
        deltas.append(got[0])
    return deltas


#: Chat questions whose answers are full of characters that span several tokens.
ASKS = ["Say hello in Japanese.", "Reply with three emojis that describe the sea.",
        "How do you write coffee in French, with the accent?"]  # fmt: skip
REAL_TEXT = "Café au lait, naïve, 東京: 🌊🍵!"


@check
def check_detokenize_step(detokenize_step, model: str = "smollm2-135m") -> str:
    """``detokenize_step(decode, ids, prefix_offset, read_offset) -> (delta, prefix_offset, read_offset)``:
    the text a new token makes visible in a stream."""
    for name, ids in TOY_STREAMS:
        deltas = _run_stream(detokenize_step, toy_decode, ids, name)
        if "".join(deltas) != toy_decode(ids):  # the check's own guard: the streams end on whole characters
            raise CheckError(f"the hand-made stream {name} does not add up to its decode")

    from minillm import LLM, SamplingParams

    with LLM(model, dtype="float32", compile=False, cpu_prepack=False, kv_cache_memory=32_000_000) as llm:
        tokenizer = llm.tokenizer
        real = tokenizer.encode(REAL_TEXT, add_special_tokens=False)
        if "".join(_run_stream(detokenize_step, tokenizer.decode, real, f"{model}'s tokens of {REAL_TEXT!r}")) != (
            REAL_TEXT
        ):
            raise CheckError(f"{model}'s tokens of {REAL_TEXT!r} do not decode to it")
        prompts = [tokenizer.render_chat([{"role": "user", "content": ask}]) for ask in ASKS]
        reference, seen = hooks.default("detokenize_step"), []

        def compared(decode, ids, prefix_offset, read_offset):
            """The learner's step where the engine calls it, beside the package's on the same input. A wrong
            result is replaced by the package's (so the engine runs on) and reported below, with its answer."""
            want = reference(decode, list(ids), prefix_offset, read_offset)
            mine = list(ids)  # the learner's copy: the engine's own list stays whole whatever they do
            try:
                got = detokenize_step(decode, mine, prefix_offset, read_offset)
            except Exception as err:
                cause = learner_cause(err)
                if cause is None or isinstance(cause, NotImplementedError):
                    raise
                got = cause
            seen.append((list(ids), (prefix_offset, read_offset), got, want, mine))
            return got if isinstance(got, tuple) and got == want else want

        with hooks.override(detokenize_step=compared):
            streams = _stream_all(llm, prompts, SamplingParams(max_tokens=12))
        answers = [stream[-1].output for stream in streams]
        if len(seen) < sum(len(a.token_ids) for a in answers) - len(answers):
            raise CheckError(f"the engine called detokenize_step {len(seen)} times for {len(answers)} answers")
        for ids, state, got, want, mine in seen:
            ask = next(a for a, out in zip(ASKS, answers) if out.token_ids[: len(ids)] == ids)
            what = f"token {len(ids)} of {model}'s answer to {ask!r} {_show_tokens(tokenizer.decode, ids)}"
            if isinstance(got, BaseException):
                raise CheckFailed(f"in the engine, detokenize_step raised {type(got).__name__}: {got} (at {what})")
            if mine != ids:
                raise CheckFailed(f"in the engine, detokenize_step changed ids at {what}: read them, never change them")
            got = _step_result(got, what)
            if got != want:
                raise CheckFailed("in the engine, " + _explain(tokenizer.decode, ids, state, got, want, what))
    held = sum(not got[0] for _, _, got, _, _ in seen)
    return (
        f"your deltas match the package's step for step on {len(TOY_STREAMS)} hand-made streams (characters split "
        f"over tokens, a special token, an invalid byte, an emoji at the end) and on {model}'s tokens of "
        f"{REAL_TEXT!r}; in the engine, your function streamed {model}'s answers ({held} of {len(seen)} tokens held "
        f"back mid-character): {', '.join(repr(a.text) for a in answers)}"
    )


def _stream_all(llm, prompts: list[str], params) -> list[list]:
    """Every prompt's stream deltas, the streams advanced in turn (so the engine batches them)."""
    streams = [llm.stream(p, params) for p in prompts]
    out: list[list] = [[] for _ in prompts]
    live = list(range(len(prompts)))
    while live:
        for i in list(live):
            delta = next(streams[i], None)
            if delta is None:
                live.remove(i)
            else:
                out[i].append(delta)
    return out
