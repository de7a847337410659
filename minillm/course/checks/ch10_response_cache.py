"""Chapter 10's response-cache exercise: ``ResponseCache`` — the server's exact-match cache of whole
greedy responses as a class: a bounded LRU (entries and bytes), copies in and out, counters.

The diagnosis drives a fresh instance per scene with hand-made keys and responses, each scene one
rule: refuse a capacity or byte budget below 1; a miss counts and returns None; a hit returns an
equal response and counts; what ``get`` returns and what ``put`` was given are copies (the server
sets a hit's ``id`` and ``created``); the least recently *used* entry goes first; putting a key
again replaces it; the byte budget counts the UTF-8 JSON of key and response and evicts down to it;
an entry over a quarter of the budget is not kept (and evicts nothing). Then the class serves in a
live server (through hook ``response_cache``'s place: ``build_app(engines, cache)``), driven with
the official ``openai`` client.
"""

from __future__ import annotations

import json

from minillm.course.checks.ch10_server import GREEDY, MODEL
from minillm.course.results import CheckFailed, check, learner_cause, learner_function


def size_of(key: str, response: dict) -> int:
    """What an entry costs against the byte budget: its key and its response as UTF-8 JSON."""
    return len(key.encode()) + len(json.dumps(response, ensure_ascii=False).encode())


class GradedCache:
    """The learner's cache with its methods run as the learner's code: what ``get``, ``put`` or
    ``len`` raise is reported as theirs (the check wraps only the class it is given)."""

    def __init__(self, inner):
        self.inner = inner

    def get(self, key: str):
        return learner_function(self.inner.get)(key)

    def put(self, key: str, response: dict) -> None:
        learner_function(self.inner.put)(key, response)

    def __len__(self) -> int:
        return learner_function(lambda: len(self.inner))()

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def _refuses(ResponseCache, args: dict, what: str) -> None:
    try:
        ResponseCache(**args)
    except Exception as err:
        raised = learner_cause(err) or err
        if isinstance(raised, ValueError):
            return
        if isinstance(raised, NotImplementedError):
            raise  # not written yet: the check says "not attempted"
        raise CheckFailed(
            f"ResponseCache({', '.join(f'{k}={v}' for k, v in args.items())}) raised {type(raised).__name__}: "
            f"{raised} — {what}"
        ) from None
    raise CheckFailed(f"ResponseCache({', '.join(f'{k}={v}' for k, v in args.items())}) was accepted: {what}")


def _counts(cache, hits: int, misses: int, after: str) -> None:
    got = (getattr(cache, "hits", None), getattr(cache, "misses", None))
    if got != (hits, misses):
        raise CheckFailed(
            f"after {after}, (cache.hits, cache.misses) is {got}, expected {(hits, misses)}: every get counts as a "
            "hit (an entry was there) or a miss (None), nothing else does — the server's metrics read them"
        )


def _has(cache, key: str, want: dict | None, after: str, why: str) -> None:
    got = cache.get(key)
    if got != want:
        shown = "None (not kept)" if got is None else f"{got!r:.60}"
        raise CheckFailed(f"after {after}, get({key!r}) returned {shown}, expected {want!r:.60}: {why}")


def _diagnose(learners_class) -> None:
    def ResponseCache(*args, **kwargs):
        return GradedCache(learners_class(*args, **kwargs))

    _refuses(learners_class, {"capacity": 0}, "a cache that can hold nothing is a mistake in the server's "
             "settings — raise ValueError naming capacity")  # fmt: skip
    _refuses(learners_class, {"capacity": 4, "max_bytes": 0}, "a byte budget below 1 holds nothing — raise ValueError")
    for args in ({"capacity": 1}, {"capacity": 4, "max_bytes": 1}):
        try:
            learners_class(**args)
        except Exception as err:
            raised = learner_cause(err) or err
            if isinstance(raised, NotImplementedError):
                raise
            raise CheckFailed(
                f"ResponseCache({', '.join(f'{k}={v}' for k, v in args.items())}) raised {type(raised).__name__}: "
                f"{raised} — 1 is the smallest allowed capacity and byte budget (refuse only values below 1)"
            ) from None

    def key_fn(endpoint, body):
        return endpoint + json.dumps(body, sort_keys=True)

    cache = ResponseCache(4, key=key_fn)
    if getattr(cache, "key", None) is not key_fn:
        raise CheckFailed("ResponseCache(4, key=f).key is not f: keep the key function you are given as self.key")
    if not callable(getattr(ResponseCache(4), "key", None)):
        raise CheckFailed("ResponseCache(4).key is not a function: without key=..., use your cache_key")
    if cache.get("a") is not None:
        raise CheckFailed("get('a') on an empty cache did not return None")
    _counts(cache, 0, 1, "one get on an empty cache")
    if len(cache) != 0:
        raise CheckFailed(f"len() of a cache with nothing put in it is {len(cache)}")
    response = {"id": "cmpl-1", "choices": [{"text": "Hello", "index": 0}]}
    cache.put("a", response)
    _has(cache, "a", response, "put('a', r)", "a put entry is found again by its key")
    _counts(cache, 1, 1, "a miss, a put and a hit")
    got = cache.get("a")
    got["id"] = "cmpl-99"
    got["choices"][0]["text"] = "changed"
    _has(cache, "a", response, "changing what get('a') returned", "the server sets a hit's id and created on "
         "what get returns — return a copy (copy.deepcopy: the choices are nested), not the kept dict")  # fmt: skip
    given = {"choices": [{"text": "mine"}]}
    cache.put("b", given)
    given["choices"][0]["text"] = "edited later"
    _has(cache, "b", {"choices": [{"text": "mine"}]}, "put('b', r) and then changing r",
         "keep a copy of what put is given (copy.deepcopy): the caller may go on using its dict")  # fmt: skip
    if len(cache) != 2:
        raise CheckFailed(f"len() after putting 'a' and 'b' is {len(cache)}, expected 2")

    lru = ResponseCache(2)
    lru.put("a", {"n": 1})
    lru.put("b", {"n": 2})
    lru.get("a")  # 'a' is now the most recently used
    lru.put("c", {"n": 3})
    if len(lru) != 2:
        raise CheckFailed(
            f"a cache of capacity 2 holds {len(lru)} entries after 3 puts, expected 2: evict only while over capacity"
        )
    if lru.get("a") is None:
        raise CheckFailed(
            "capacity 2: put a, put b, get a, put c — 'a' was evicted, but it had just been used: evict the least "
            "recently *used* entry (a get moves its entry to the end, OrderedDict.move_to_end), not the oldest put"
        )
    _has(lru, "b", None, "put a, put b, get a, put c (capacity 2)", "'b' is the least recently used: it goes")
    _has(lru, "c", {"n": 3}, "put a, put b, get a, put c (capacity 2)", "the newest entry stays")

    def entry(i: int) -> dict:
        return {"text": "é" * 10 + str(i)}  # é: 2 bytes in UTF-8 (6 characters as \\u00e9)

    one = size_of("k0", entry(0))
    sized = ResponseCache(8)
    sized.put("k0", entry(0))
    counted = getattr(sized, "nbytes", None)
    if counted == len("k0") + len(json.dumps(entry(0))):
        raise CheckFailed(
            f"cache.nbytes is {counted} for one entry of {one} bytes: it counts the JSON's characters with non-ASCII "
            "escaped (json.dumps's default) — count the bytes of json.dumps(response, ensure_ascii=False).encode() "
            "plus the key's .encode()"
        )
    if counted != one:
        raise CheckFailed(
            f"cache.nbytes is {counted} after one put of key 'k0' and a response of {one - 2} bytes as UTF-8 JSON: "
            "an entry costs len(key.encode()) + len(json.dumps(response, ensure_ascii=False).encode())"
        )
    again = ResponseCache(2)
    again.put("a", {"v": "short"})
    again.put("a", {"v": "a longer answer"})
    if len(again) != 1:
        raise CheckFailed(f"putting key 'a' twice left {len(again)} entries: the second put replaces the first")
    _has(again, "a", {"v": "a longer answer"}, "putting 'a' twice", "the second put replaces the first")
    if getattr(again, "nbytes", None) != size_of("a", {"v": "a longer answer"}):
        raise CheckFailed(
            f"after putting 'a' twice, cache.nbytes is {getattr(again, 'nbytes', None)}, expected "
            f"{size_of('a', {'v': 'a longer answer'})}: a replaced entry's bytes leave the count"
        )

    budget = ResponseCache(100, max_bytes=4 * one)  # room for exactly 4 entries; one entry is a quarter
    for i in range(5):
        budget.put(f"k{i}", entry(i))
    if len(budget) == 0:
        raise CheckFailed(
            f"5 entries of {one} bytes each into a budget of {4 * one} bytes: none was kept — an entry of exactly "
            f"max_bytes // 4 = {one} bytes is allowed; only one *over* a quarter is refused"
        )
    if len(budget) != 4 or getattr(budget, "nbytes", None) != 4 * one:
        raise CheckFailed(
            f"5 entries of {one} bytes each (key and response as UTF-8 JSON) in a budget of {4 * one} bytes: "
            f"the cache holds {len(budget)} entries and counts {getattr(budget, 'nbytes', None)} bytes, expected 4 "
            f"and {4 * one} — evict the least recently used while nbytes > max_bytes (a full budget is not over it)"
        )
    _has(budget, "k0", None, "5 puts into a byte budget for 4", "the first put is the least recently used: it goes")
    huge = {"text": "x" * (one + 1 - size_of("huge", {"text": ""}))}  # one byte over a quarter of the budget
    budget.put("huge", huge)
    if budget.get("huge") is not None or len(budget) != 4:
        raise CheckFailed(
            f"an entry of {size_of('huge', huge)} bytes, over a quarter of max_bytes={4 * one}, was kept or evicted "
            "others: one answer must not flush the cache — do not keep an entry over max_bytes // 4"
        )


def _serve_through(cache, url: str, model: str) -> None:
    """A repeated greedy request is a hit with a fresh id; two other answers evict it from a cache
    of two; asked again it is answered, kept, then a hit again."""
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    args = GREEDY | {"model": model}
    first = client.completions.create(**args)
    second = client.completions.create(**args)
    if cache.hits != 1 or second.choices[0].text != first.choices[0].text:
        raise CheckFailed(f"in the live server the repeated greedy request was not answered from your cache "
                          f"(hits: {cache.hits}, misses: {cache.misses})")  # fmt: skip
    if second.id == first.id:
        raise CheckFailed("in the live server a cached answer came back with the first answer's id")
    for prompt in ("ROMEO.\n", "HAMLET.\n"):  # two more answers: capacity 2 evicts the first
        client.completions.create(**(args | {"prompt": prompt}))
    client.completions.create(**args)
    if cache.hits != 1 or len(cache) != 2:
        raise CheckFailed(
            f"in the live server, after two other answers in a cache of capacity 2, the first request hit "
            f"(hits: {cache.hits}, entries: {len(cache)}): it should have been evicted"
        )
    third = client.completions.create(**args)
    if cache.hits != 2 or third.choices[0].text != first.choices[0].text:
        raise CheckFailed("in the live server the request answered again was not then served from the cache")


@check
def check_response_cache(ResponseCache, model: str = MODEL) -> str:
    """``ResponseCache(capacity, key=None, max_bytes=...)`` with ``get``, ``put``, ``len``, ``hits``,
    ``misses`` and ``nbytes``: the server's bounded LRU of greedy responses."""
    import openai

    from minillm.server import ServerThread, build_app, build_engines
    from minillm.server.response_cache import cache_key

    _diagnose(ResponseCache)
    cache = GradedCache(ResponseCache(2, key=cache_key))
    engines = build_engines([model], dtype="fp32", kv_cache_memory=8_000_000)
    with ServerThread(build_app(engines, cache)) as server:
        try:
            _serve_through(cache, server.url, model)
        except openai.APIStatusError as err:
            raise CheckFailed(
                f"in the live server a request failed with HTTP {err.status_code} while your cache served it: "
                f"{str(err.message)[:200]}"
            ) from None
    return (
        f"your cache served a live server: a repeated greedy request answered from it with a fresh id, evicted "
        f"after two other answers in a cache of 2, then cached again ({cache.hits} hits, {cache.misses} misses, "
        f"{cache.nbytes / 1000:.1f} kB held)"  # (to 0.1 kB: the bytes differed by one between two runs)
    )
