"""An exact-match cache of whole responses, for requests whose answer cannot change.

A greedy request (``temperature`` 0) to the same model with the same prompt and parameters
produces the same tokens every time, so its finished response can be served again without
running the model. Only such requests are cached — a sampled one would wrongly repeat itself —
and only whole (non-streamed) responses. The cache is bounded and evicts the least recently
used entry; it is off unless the server is started with ``--response-cache N``.
"""

from __future__ import annotations

import copy
import json
import threading
from collections import OrderedDict

import minillm.hooks as hooks

#: Request fields that do not change the answer, left out of the key.
_NOT_IN_KEY = {"stream", "stream_options", "user", "metadata"}


def cache_key(endpoint: str, body: dict) -> str | None:
    """The cache key of a request body, or None when its answer may differ between runs.

    Greedy means ``temperature`` 0 given explicitly: OpenAI's default is 1 (sampling). The key
    is canonical JSON (sorted keys), so the same request written in another field order hits.
    Streamed requests are not cached (the cache holds whole responses).
    """
    if body.get("temperature", 1.0) != 0 or body.get("stream"):
        return None
    fields = {k: v for k, v in body.items() if k not in _NOT_IN_KEY}
    return endpoint + "\n" + json.dumps(fields, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


DEFAULT_MAX_BYTES = 64 << 20


class ResponseCache:
    """``key`` may replace :meth:`cache_key` (chapter 10 plugs the learner's version in here).

    Bounded twice: at most ``capacity`` entries and ``max_bytes`` of keys and responses (as
    JSON), least recently used out first; one entry over a quarter of the budget is not kept.
    The server keys the *validated* request — the fields its schema knows — so a client cannot
    grow the cache, or miss it, with fields the server ignores."""

    def __init__(self, capacity: int, key=None, max_bytes: int = DEFAULT_MAX_BYTES):
        if capacity < 1:
            raise ValueError(f"response cache capacity={capacity} must be >= 1")
        if max_bytes < 1:
            raise ValueError(f"response cache max_bytes={max_bytes} must be >= 1")
        self.capacity, self.max_bytes = capacity, max_bytes
        self.key = key or cache_key
        self._entries: OrderedDict[str, tuple[dict, int]] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0
        self.nbytes = 0

    def get(self, key: str) -> dict | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return copy.deepcopy(entry[0])

    def put(self, key: str, response: dict) -> None:
        size = len(key.encode()) + len(json.dumps(response, ensure_ascii=False).encode())
        if size > self.max_bytes // 4:
            return  # one answer must not flush the whole cache
        with self._lock:
            old = self._entries.pop(key, None)
            self.nbytes -= old[1] if old else 0
            self._entries[key] = (copy.deepcopy(response), size)
            self.nbytes += size
            while len(self._entries) > self.capacity or self.nbytes > self.max_bytes:
                _, (_, dropped) = self._entries.popitem(last=False)
                self.nbytes -= dropped

    def __len__(self) -> int:
        return len(self._entries)


@hooks.reference("response_cache")
def response_cache(capacity: int) -> ResponseCache:
    """The server's response cache of ``capacity`` entries (hook ``response_cache``: chapter 10's
    learner writes the class)."""
    return ResponseCache(capacity)
