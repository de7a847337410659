"""Chapter 10, serving: the answers its exercises' checks are tested against (see
``catalogue/__init__.py``)."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import hashlib
import json
import threading
from collections import OrderedDict

from catalogue.answers import Answers
from minillm.server.response_cache import cache_key
from minillm.server.responses import DONE, sse, usage
from minillm.server.streaming import error_event

ANSWERS = Answers()
right, wrong = ANSWERS.right, ANSWERS.wrong


# ---- 10: the response cache's key -------------------------------------------------------------------


def cache_key_canonical(endpoint, body):
    """The reference: canonical JSON of the fields that change the answer."""
    if body.get("temperature", 1.0) != 0 or body.get("stream"):
        return None
    kept = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "user", "metadata")}
    return endpoint + " " + json.dumps(kept, sort_keys=True)


def cache_key_sorted_items(endpoint, body):
    """Independent: a sorted tuple of (field, value) pairs, written with repr."""
    temperature = body["temperature"] if "temperature" in body else 1
    if temperature != 0 or body.get("stream", False):
        return None
    return repr((endpoint, sorted((k, repr(v)) for k, v in body.items() if k not in {"user", "stream_options"})))


def _key_variant(endpoint, body, default_t=1.0, stream=True, sort=True, drop=("stream", "stream_options", "user"),
                 with_endpoint=True, only=None):  # fmt: skip
    if body.get("temperature", default_t) != 0 or (stream and body.get("stream")):
        return None
    kept = {k: v for k, v in body.items() if k not in drop and (only is None or k in only)}
    return (endpoint if with_endpoint else "") + json.dumps(kept, sort_keys=sort)


CK = "check_cache_key"
right(CK, cache_key_canonical)
right(CK, cache_key_sorted_items)
wrong(CK, "a sampled request", lambda e, b: json.dumps(b, sort_keys=True))
wrong(CK, "default temperature is 1", lambda e, b: _key_variant(e, b, default_t=0))
wrong(CK, "a streamed request", lambda e, b: _key_variant(e, b, stream=False))
wrong(CK, "fields in another order", lambda e, b: _key_variant(e, b, sort=False))
wrong(CK, "leave it out of the key", lambda e, b: _key_variant(e, b, drop=("stream",)))
wrong(CK, "differ only in max_tokens", lambda e, b: _key_variant(e, b, only=("model", "prompt", "temperature")))
wrong(CK, "differ only in endpoint", lambda e, b: _key_variant(e, b, with_endpoint=False))
wrong(CK, "differ only in model", lambda e, b: _key_variant(e, b, drop=("stream", "stream_options", "user", "model")))
wrong(CK, "return a string", lambda e, b: None if _key_variant(e, b) is None else hash(_key_variant(e, b)))
wrong(
    CK,
    ".digest() returns bytes, and cache_key must return a str",
    lambda e, b: None if _key_variant(e, b) is None else hashlib.blake2b(_key_variant(e, b).encode()).digest(),
)
wrong(CK, "KeyError", lambda e, b: None if b["temperature"] else e + json.dumps(b, sort_keys=True))
wrong(
    CK,
    "differ only in n (how many completions)",
    lambda e, b: _key_variant(e, b, only=("model", "prompt", "max_tokens", "stop", "temperature")),
)
wrong(
    CK,
    "differ only in messages (another chat)",
    lambda e, b: _key_variant(e, b, drop=("stream", "stream_options", "user", "messages")),
)
wrong(
    CK,
    "differ only in logprobs",
    lambda e, b: _key_variant(e, b, drop=("stream", "stream_options", "user", "logprobs")),
)
wrong(
    CK,
    "one turn longer",
    lambda e, b: _key_variant(e, b | ({"messages": b["messages"][:1]} if "messages" in b else {})),  # first turn only
)
FIELDS_A_LEARNER_LISTS = ("model", "prompt", "messages", "max_tokens", "max_completion_tokens", "stop", "n",
                          "logprobs", "top_logprobs", "temperature", "top_p", "seed")  # fmt: skip
wrong(CK, "differ only in ignore_eos", lambda e, b: _key_variant(e, b, only=FIELDS_A_LEARNER_LISTS))
wrong(
    CK,
    "differ only in repetition_penalty",
    lambda e, b: _key_variant(e, b, only=FIELDS_A_LEARNER_LISTS + ("ignore_eos",)),
)
wrong(
    CK,
    "differ only in max_completion_tokens in a chat request",
    lambda e, b: _key_variant(e, b, drop=("stream", "stream_options", "user", "max_completion_tokens")),
)
wrong(
    CK,
    "differ only in stop (one more stop string)",
    lambda e, b: _key_variant(e, b | {"stop": str(b.get("stop", [""])[0])}),
)


# ---- ch10: more wrong answers a learner writes


# ---- the streaming detokenizer ----------------------------------------------------------------------------

DS = "check_detokenize_step"
REPLACEMENT = chr(0xFFFD)


def detok_step(decode, ids, prefix_offset, read_offset):
    before = decode(ids[prefix_offset:read_offset])
    after = decode(ids[prefix_offset:])
    if len(after) > len(before) and not after.endswith("\ufffd"):
        return after[len(before) :], read_offset, len(ids)
    return "", prefix_offset, read_offset


def detok_early_returns(decode, ids, p, r):
    text = decode(ids[p:])
    if text.endswith(REPLACEMENT):
        return "", p, r  # a character is still incomplete
    old = decode(ids[p:r])
    if len(text) <= len(old):
        return "", p, r
    return text[len(old) :], r, len(ids)


def detok_new_first(decode, ids, prefix_offset, read_offset):
    shown = decode(ids[prefix_offset:read_offset])
    window = decode(ids[prefix_offset:])
    new = window[len(shown) :]
    if not new or window[-1:] == "\N{REPLACEMENT CHARACTER}":
        return "", prefix_offset, read_offset
    return new, read_offset, len(ids)


def detok_vllm_names(decode, all_ids, prefix_offset, read_offset):
    prefix_text = decode(list(all_ids[prefix_offset:read_offset]))
    new_text = decode(list(all_ids[prefix_offset : len(all_ids)]))
    if len(new_text) <= len(prefix_text) or new_text.endswith("�"):
        return "", prefix_offset, read_offset
    return new_text[len(prefix_text) :], read_offset, len(all_ids)


right(DS, detok_early_returns)
right(DS, detok_new_first)
right(DS, detok_vllm_names)


def detok_one_token(decode, ids, prefix_offset, read_offset):
    return decode(ids[-1:]), read_offset, len(ids)  # each token decoded alone


def detok_no_fffd_check(decode, ids, prefix_offset, read_offset):
    before, after = decode(ids[prefix_offset:read_offset]), decode(ids[prefix_offset:])
    if len(after) > len(before):
        return after[len(before) :], read_offset, len(ids)
    return "", prefix_offset, read_offset


def detok_fffd_anywhere(decode, ids, prefix_offset, read_offset):
    before, after = decode(ids[prefix_offset:read_offset]), decode(ids[prefix_offset:])
    if len(after) > len(before) and "\ufffd" not in after:  # any U+FFFD, not only a trailing one
        return after[len(before) :], read_offset, len(ids)
    return "", prefix_offset, read_offset


def detok_offsets_kept(decode, ids, prefix_offset, read_offset):
    before, after = decode(ids[prefix_offset:read_offset]), decode(ids[prefix_offset:])
    if len(after) > len(before) and not after.endswith("\ufffd"):
        return after[len(before) :], prefix_offset, read_offset  # forgot to move the offsets
    return "", prefix_offset, read_offset


def detok_prefix_kept(decode, ids, prefix_offset, read_offset):
    before, after = decode(ids[prefix_offset:read_offset]), decode(ids[prefix_offset:])
    if len(after) > len(before) and not after.endswith("\ufffd"):
        return after[len(before) :], prefix_offset, len(ids)  # the window only grows
    return "", prefix_offset, read_offset


def detok_offsets_swapped(decode, ids, prefix_offset, read_offset):
    before, after = decode(ids[prefix_offset:read_offset]), decode(ids[prefix_offset:])
    if len(after) > len(before) and not after.endswith("\ufffd"):
        return after[len(before) :], len(ids), read_offset
    return "", prefix_offset, read_offset


def detok_offsets_always_move(decode, ids, prefix_offset, read_offset):
    before, after = decode(ids[prefix_offset:read_offset]), decode(ids[prefix_offset:])
    delta = after[len(before) :] if not after.endswith("\ufffd") else ""
    return delta, read_offset, len(ids)  # moved on even when holding back


def detok_slice_plus_one(decode, ids, prefix_offset, read_offset):
    before, after = decode(ids[prefix_offset:read_offset]), decode(ids[prefix_offset:])
    if len(after) > len(before) and not after.endswith("\ufffd"):
        return after[len(before) + 1 :], read_offset, len(ids)
    return "", prefix_offset, read_offset


def detok_slice_minus_one(decode, ids, prefix_offset, read_offset):
    before, after = decode(ids[prefix_offset:read_offset]), decode(ids[prefix_offset:])
    if len(after) > len(before) and not after.endswith("\ufffd"):
        return after[max(len(before) - 1, 0) :], read_offset, len(ids)
    return "", prefix_offset, read_offset


def detok_whole_window(decode, ids, prefix_offset, read_offset):
    before, after = decode(ids[prefix_offset:read_offset]), decode(ids[prefix_offset:])
    if len(after) > len(before) and not after.endswith("\ufffd"):
        return after, read_offset, len(ids)  # the window, not what is new in it
    return "", prefix_offset, read_offset


def detok_at_least_as_long(decode, ids, prefix_offset, read_offset):
    before, after = decode(ids[prefix_offset:read_offset]), decode(ids[prefix_offset:])
    if len(after) >= len(before) and not after.endswith("\ufffd"):
        return after[len(before) :], read_offset, len(ids)
    return "", prefix_offset, read_offset


def detok_tuple_order(decode, ids, prefix_offset, read_offset):
    before, after = decode(ids[prefix_offset:read_offset]), decode(ids[prefix_offset:])
    if len(after) > len(before) and not after.endswith("\ufffd"):
        return read_offset, len(ids), after[len(before) :]
    return prefix_offset, read_offset, ""


def detok_trims_ids(decode, ids, prefix_offset, read_offset):
    del ids[:prefix_offset]  # "the shown tokens are not needed any more"
    before, after = decode(ids[: read_offset - prefix_offset]), decode(ids)
    if len(after) > len(before) and not after.endswith("\ufffd"):
        return after[len(before) :], read_offset, prefix_offset + len(ids)
    return "", prefix_offset, read_offset


def detok_strips_fffd(decode, ids, prefix_offset, read_offset):
    before, after = decode(ids[prefix_offset:read_offset]), decode(ids[prefix_offset:])
    delta = after[len(before) :].rstrip("\ufffd")  # show the complete characters at once
    if delta:
        return delta, read_offset, len(ids)
    return "", prefix_offset, read_offset


def detok_one_token_window(decode, ids, prefix_offset, read_offset):
    before = decode(ids[prefix_offset:read_offset])
    after = decode(ids[prefix_offset : read_offset + 1])  # "one new token since read_offset"
    if len(after) > len(before) and not after.endswith("\ufffd"):
        return after[len(before) :], read_offset, len(ids)
    return "", prefix_offset, read_offset


def detok_checks_before(decode, ids, prefix_offset, read_offset):
    before, after = decode(ids[prefix_offset:read_offset]), decode(ids[prefix_offset:])
    if len(after) > len(before) and not before.endswith("\ufffd"):
        return after[len(before) :], read_offset, len(ids)
    return "", prefix_offset, read_offset


def detok_read_minus_one(decode, ids, prefix_offset, read_offset):
    before, after = decode(ids[prefix_offset:read_offset]), decode(ids[prefix_offset:])
    if len(after) > len(before) and not after.endswith("\ufffd"):
        return after[len(before) :], read_offset, len(ids) - 1  # "the index of the last token"
    return "", prefix_offset, read_offset


def detok_holds_with_none(decode, ids, prefix_offset, read_offset):
    before, after = decode(ids[prefix_offset:read_offset]), decode(ids[prefix_offset:])
    if len(after) > len(before) and not after.endswith("\ufffd"):
        return after[len(before) :], read_offset, len(ids)
    return None  # nothing to say yet


def detok_only_new_tokens(decode, ids, prefix_offset, read_offset):
    text = decode(ids[read_offset:])  # what the tokens since the last emit spell
    if text and not text.endswith("\ufffd"):
        return text, read_offset, len(ids)
    return "", prefix_offset, read_offset


wrong(DS, "is the new token decoded alone", detok_one_token)
wrong(DS, "you emitted U+FFFD", detok_no_fffd_check)
wrong(DS, "holds a U+FFFD in the middle", detok_fffd_anywhere)
wrong(DS, "the offsets must move on", detok_offsets_kept)
wrong(DS, "prefix_offset stayed at", detok_prefix_kept)
wrong(DS, "the offsets must be (0, 1)", detok_offsets_swapped)
wrong(DS, "you moved the offsets to (1, 2) while emitting nothing", detok_offsets_always_move)
wrong(DS, "check the slice's start", detok_slice_plus_one)
wrong(DS, "repeats text already shown", detok_slice_minus_one)
wrong(DS, "repeats text already shown", detok_whole_window)
wrong(DS, "you moved the offsets to (1, 2) while emitting nothing", detok_at_least_as_long)
wrong(DS, "return (delta, prefix_offset, read_offset) in that order", detok_tuple_order)
wrong(DS, "detokenize_step changed ids", detok_trims_ids)
wrong(DS, "not even the whole characters before it", detok_strips_fffd)
wrong(DS, "tokens came since read_offset", detok_one_token_window)
wrong(DS, "you emitted U+FFFD", detok_checks_before)
wrong(DS, "the offsets must move on", detok_read_minus_one)
wrong(DS, "return the tuple (delta, prefix_offset, read_offset)", detok_holds_with_none)
wrong(DS, "is the new token decoded alone", detok_only_new_tokens)


# ---- Chapter 10's response cache (``check_response_cache``): two right answers written independently,
# and the wrong ones a learner writes, one slip each (``cache_with``).


RC = "check_response_cache"


def cache_with(**slip):
    """The package's bounded LRU, with one learner's slip switched on."""

    class ResponseCache:
        def __init__(self, capacity, key=None, max_bytes=64 << 20):
            if (capacity < 1 and not slip.get("any_capacity")) or (max_bytes < 1 and not slip.get("any_budget")):
                raise ValueError("capacity and max_bytes must be >= 1")
            self.capacity, self.max_bytes = capacity, max_bytes
            self.key = cache_key if slip.get("own_key") else key or cache_key
            self.entries = OrderedDict()
            self.lock = threading.Lock()
            self.hits = self.misses = self.nbytes = 0

        def get(self, key):
            with self.lock:
                entry = self.entries.get(key)
                if entry is None:
                    if not slip.get("no_misses"):
                        self.misses += 1
                    return None
                if not slip.get("fifo"):
                    self.entries.move_to_end(key)
                self.hits += 1
                if slip.get("no_copy_out"):
                    return entry[0]
                return dict(entry[0]) if slip.get("shallow_out") else copy.deepcopy(entry[0])

        def put(self, key, response):
            if slip.get("ascii"):
                size = len(key) + len(json.dumps(response))
            elif slip.get("response_only"):
                size = len(json.dumps(response, ensure_ascii=False).encode())
            else:
                size = len(key.encode()) + len(json.dumps(response, ensure_ascii=False).encode())
            quarter = self.max_bytes // 4
            if not slip.get("keeps_huge") and (size >= quarter if slip.get("quarter_inclusive") else size > quarter):
                return
            with self.lock:
                old = self.entries.pop(key, None)
                if old is not None and not slip.get("double_counts"):
                    self.nbytes -= old[1]
                self.entries[key] = (response if slip.get("no_copy_in") else copy.deepcopy(response), size)
                self.nbytes += size
                if slip.get("counts_put_as_hit"):
                    self.hits += 1
                limit = self.capacity - 1 if slip.get("one_short") else self.capacity
                while len(self.entries) > limit or (self.nbytes > self.max_bytes and not slip.get("no_byte_bound")):
                    _, (_, dropped) = self.entries.popitem(last=bool(slip.get("drops_newest")))
                    self.nbytes -= dropped

        def __len__(self):
            return self.capacity if slip.get("len_is_capacity") else len(self.entries)

    return ResponseCache


class RecencyCache:
    """Right, written differently: a plain dict and a use counter; eviction takes the smallest stamp."""

    def __init__(self, capacity, key=None, max_bytes=64 << 20):
        if capacity <= 0:
            raise ValueError(f"capacity={capacity}: at least 1")
        if max_bytes <= 0:
            raise ValueError(f"max_bytes={max_bytes}: at least 1")
        self.capacity, self.max_bytes, self.key = capacity, max_bytes, key if key is not None else cache_key
        self.store, self.stamp, self.clock = {}, {}, 0
        self.hits = self.misses = self.nbytes = 0
        self.lock = threading.RLock()

    def _touch(self, key):
        self.clock += 1
        self.stamp[key] = self.clock

    def get(self, key):
        with self.lock:
            if key not in self.store:
                self.misses += 1
                return None
            self.hits += 1
            self._touch(key)
            return json.loads(json.dumps(self.store[key][0]))  # a deep copy of JSON

    def put(self, key, response):
        cost = len(key.encode("utf-8")) + len(json.dumps(response, ensure_ascii=False).encode("utf-8"))
        if 4 * cost > self.max_bytes - self.max_bytes % 4:  # over a quarter: cost > max_bytes // 4
            return
        with self.lock:
            if key in self.store:
                self.nbytes -= self.store.pop(key)[1]
            self.store[key] = (json.loads(json.dumps(response)), cost)
            self.nbytes += cost
            self._touch(key)
            while len(self.store) > self.capacity or self.nbytes > self.max_bytes:
                oldest = min(self.store, key=self.stamp.__getitem__)
                self.nbytes -= self.store.pop(oldest)[1]
                del self.stamp[oldest]

    def __len__(self):
        return len(self.store)


right(RC, cache_with())
right(RC, RecencyCache)
wrong(RC, "ResponseCache(capacity=0) was accepted", cache_with(any_capacity=True))
wrong(RC, "ResponseCache(capacity=4, max_bytes=0) was accepted", cache_with(any_budget=True))
wrong(RC, "keep the key function you are given", cache_with(own_key=True))
wrong(RC, "every get counts as a hit", cache_with(no_misses=True))
wrong(RC, "every get counts as a hit", cache_with(counts_put_as_hit=True))
wrong(RC, "return a copy (copy.deepcopy", cache_with(no_copy_out=True))
wrong(RC, "return a copy (copy.deepcopy", cache_with(shallow_out=True))
wrong(RC, "keep a copy of what put is given", cache_with(no_copy_in=True))
wrong(RC, "evict the least recently *used* entry", cache_with(fifo=True))
wrong(RC, "'b' is the least recently used", cache_with(drops_newest=True))
wrong(RC, "holds 1 entries after 3 puts, expected 2", cache_with(one_short=True))
wrong(RC, "a replaced entry's bytes leave the count", cache_with(double_counts=True))
wrong(RC, "escaped (json.dumps's default)", cache_with(ascii=True))
wrong(RC, "an entry costs len(key.encode())", cache_with(response_only=True))
wrong(RC, "evict the least recently used while nbytes > max_bytes", cache_with(no_byte_bound=True))
wrong(RC, "do not keep an entry over max_bytes // 4", cache_with(keeps_huge=True))
wrong(RC, "only one *over* a quarter is refused", cache_with(quarter_inclusive=True))
wrong(RC, "len() of a cache with nothing put in it is 4", cache_with(len_is_capacity=True))


# ---- Chapter 10's streaming endpoint (``check_stream_events``): right answers written independently,
# and the wrong ones a learner writes, one slip each (``events_with(...)``).


SE = "check_stream_events"


def events_with(**slip):
    """The merge-by-queue answer, with one of a learner's slips switched on."""

    async def stream_events(streams, fmt, n, include_usage, prompt_tokens, abort):
        queue = asyncio.Queue()

        async def read(p, deltas):
            if slip.get("uncaught"):
                async for d in deltas:
                    await queue.put((p, d))
                return
            try:
                async for d in deltas:
                    await queue.put((p, d))
            except Exception as exc:
                await queue.put((p, exc))

        if slip.get("sequential"):
            tasks = []
        else:
            tasks = [asyncio.create_task(read(p, s)) for p, s in enumerate(streams)]
        total = len(streams) * n
        sent, fresh = [0] * total, [True] * total
        left, tokens, buffered = len(streams), 0, []
        try:
            if fmt.chat and not slip.get("no_role"):
                yield sse(fmt.chunk([fmt.delta_choice(k, "", None, None, True) for k in range(total)]))
                if not slip.get("role_always"):
                    fresh = [False] * total
            if slip.get("sequential"):
                for p, s in enumerate(streams):  # one prompt's stream to its end, then the next
                    async for d in s:
                        yield sse(fmt.chunk([fmt.delta_choice(p * n + d.index, d.text, d.finish_reason, d.logprobs,
                                                              False, 0)]))  # fmt: skip
                yield DONE
                return
            while left:
                p, d = await queue.get()
                if isinstance(d, Exception):
                    if slip.get("raw_error"):
                        raise d
                    yield error_event(d)
                    if slip.get("done_after_error"):
                        yield DONE
                    return
                k = d.index if slip.get("index_only") else p + d.index if slip.get("p_plus_index") else p * n + d.index
                if d.text or not slip.get("skip_empty"):
                    text = d.text
                    offset = 0 if slip.get("no_offsets") else sent[k]
                    event = sse(fmt.chunk([fmt.delta_choice(k, text, None if slip.get("no_finish") else d.finish_reason,
                                                            d.logprobs, fresh[k], offset)]))  # fmt: skip
                    if slip.get("as_text"):
                        event = event.decode()
                    if slip.get("buffered"):
                        buffered.append(event)
                    else:
                        yield event
                sent[k] += len(d.token_ids) if slip.get("token_offsets") else len(d.text)
                if d.output is not None:
                    tokens += 1 if slip.get("count_samples") else len(d.output.token_ids)
                if d.request_finished:
                    left -= 1
                    if slip.get("first_finish_ends"):
                        break
            for event in buffered:
                yield event
            if slip.get("done_before_usage"):
                yield DONE
            if include_usage or slip.get("usage_always"):
                yield sse(fmt.chunk([], usage(prompt_tokens, tokens)))
            if not slip.get("no_done") and not slip.get("done_before_usage"):
                yield DONE
        finally:
            if not slip.get("no_cleanup"):
                for p, t in enumerate(tasks):
                    if slip.get("abort_all") or not t.done():
                        if not slip.get("no_cancel"):
                            t.cancel()
                        abort(p)

    return stream_events


right(SE, events_with())


async def stream_events_by_wait(streams, fmt, n, include_usage, prompt_tokens, abort):
    """One pending ``__anext__`` per stream, raced with ``asyncio.wait``: no queue, no reader tasks."""
    iters = [s.__aiter__() for s in streams]
    pending = {asyncio.ensure_future(it.__anext__()): p for p, it in enumerate(iters)}
    choices = n * len(streams)
    offset = [0] * choices
    done_tokens = 0
    ended = set()
    try:
        if fmt.chat:
            yield sse(fmt.chunk([fmt.delta_choice(i, "", None, None, first=True) for i in range(choices)]))
        while pending:
            finished, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for fut in sorted(finished, key=lambda f: pending[f]):
                p = pending.pop(fut)
                try:
                    d = fut.result()
                except StopAsyncIteration:
                    ended.add(p)
                    continue
                except Exception as exc:
                    ended.add(p)
                    yield error_event(exc)
                    return
                i = p * n + d.index
                yield sse(fmt.chunk([fmt.delta_choice(i, d.text, d.finish_reason, d.logprobs, False, offset[i])]))
                offset[i] += len(d.text)
                if d.output is not None:
                    done_tokens += len(d.output.token_ids)
                if d.request_finished:
                    ended.add(p)
                else:
                    pending[asyncio.ensure_future(iters[p].__anext__())] = p
        if include_usage:
            yield sse(fmt.chunk([], usage(prompt_tokens, done_tokens)))
        yield DONE
    finally:
        for fut in pending:
            fut.cancel()
        for p in range(len(streams)):
            if p not in ended:
                abort(p)


async def stream_events_sentinel(streams, fmt, n, include_usage, prompt_tokens, abort):
    """Readers that post a sentinel when their stream ends; usage summed from every delta's tokens."""
    inbox: asyncio.Queue = asyncio.Queue()
    END = object()

    async def reader(p, stream):
        try:
            async for item in stream:
                inbox.put_nowait((p, item))
            inbox.put_nowait((p, END))
        except Exception as exc:
            inbox.put_nowait((p, exc))

    readers = {p: asyncio.ensure_future(reader(p, s)) for p, s in enumerate(streams)}
    live, count = set(readers), 0
    text_sent: dict[int, int] = {}
    try:
        if fmt.chat:
            roles = [fmt.delta_choice(c, "", None, None, True) for c in range(len(streams) * n)]
            yield sse(fmt.chunk(roles))
        while live:
            p, item = await inbox.get()
            if item is END:
                live.discard(p)
                continue
            if isinstance(item, Exception):
                yield error_event(item)
                return
            c = p * n + item.index
            yield sse(fmt.chunk([fmt.delta_choice(c, item.text, item.finish_reason, item.logprobs, False,
                                                  text_sent.get(c, 0))]))  # fmt: skip
            text_sent[c] = text_sent.get(c, 0) + len(item.text)
            count += len(item.token_ids)
        if include_usage:
            yield sse(fmt.chunk([], usage(prompt_tokens, count)))
        yield DONE
    finally:
        for p, task in readers.items():
            if not task.done():
                task.cancel()
                with contextlib.suppress(Exception):
                    abort(p)


right(SE, stream_events_by_wait)
right(SE, stream_events_sentinel)

wrong(SE, "waits for one prompt's stream to end", events_with(sequential=True))
wrong(SE, "collecting them first holds the whole answer back", events_with(buffered=True))
wrong(SE, "starts with one chunk giving every choice", events_with(no_role=True))
wrong(SE, "only the first chunk gives a choice its role", events_with(role_always=True))
wrong(SE, "also when its text is empty", events_with(skip_empty=True))
wrong(SE, "p * n + delta.index", events_with(index_only=True))
wrong(SE, "p * n + delta.index", events_with(p_plus_index=True))
wrong(SE, "did not end with data: [DONE]", events_with(no_done=True))
wrong(SE, "did not end with data: [DONE]", events_with(done_before_usage=True))
wrong(SE, "sends no [DONE]", events_with(done_after_error=True))
wrong(SE, "escaped your generator", events_with(raw_error=True))
wrong(SE, "never sent it on", events_with(uncaught=True))
wrong(SE, "usage chunk was sent though include_usage is False", events_with(usage_always=True))
wrong(SE, "the usage should be", events_with(count_samples=True))
wrong(SE, "nothing aborted them", events_with(no_cleanup=True))
wrong(SE, "abort was called for prompts", events_with(abort_all=True))
wrong(SE, "cancel the reader tasks", events_with(no_cancel=True))
wrong(SE, "text_offset counts the characters", events_with(no_offsets=True))
wrong(SE, "text_offset counts the characters", events_with(token_offsets=True))
wrong(SE, "yielded a str", events_with(as_text=True))
wrong(SE, "finish_reason", events_with(no_finish=True))
wrong(SE, "not the first", events_with(first_finish_ends=True))
