"""Chapter 10's check: the response cache's key, first on constructed request bodies, then
plugged into a live server and driven with the official ``openai`` client."""

from __future__ import annotations

import copy

from minillm.course.results import CheckFailed, check

MODEL = "tiny-shakespeare-8m"
GREEDY = {"model": MODEL, "prompt": "KING.\nNow is", "max_tokens": 8, "temperature": 0, "stop": ["\n\n"]}


def _key(cache_key, endpoint: str, body: dict, what: str):
    got = cache_key(endpoint, copy.deepcopy(body))  # a crash is reported by @check, with the learner's frames
    if got is not None and not isinstance(got, str):
        raise CheckFailed(
            f"cache_key returned {type(got).__name__} {got!r:.60} for {what}; return a string (or None): a hash() "
            "number can collide between different requests, and differs between processes"
        )
    return got


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Who is the king?"}], "max_tokens": 8,
        "temperature": 0}  # fmt: skip


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
    chat = "/v1/chat/completions"
    other_chat = {"messages": [{"role": "user", "content": "Who is the queen?"}]}
    _differs(cache_key, other_chat, "messages (another chat)", chat, CHAT, chat)
    longer = {"messages": [*CHAT["messages"], {"role": "assistant", "content": "Richard."},
                           {"role": "user", "content": "And his brother?"}]}  # fmt: skip
    _differs(cache_key, longer, "messages (the same chat, one turn longer)", chat, CHAT, chat)
    _differs(cache_key, {"n": 2}, "n in a chat request", chat, CHAT, chat)
    _differs(cache_key, {"logprobs": True, "top_logprobs": 2}, "logprobs in a chat request", chat, CHAT, chat)
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
