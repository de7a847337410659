"""Chapter 10's response cache (``check_response_cache``): two right answers written independently,
and the wrong ones a learner writes, one slip each (``cache_with``)."""

from __future__ import annotations

import copy
import json
import threading
from collections import OrderedDict

from check_catalogue import right, wrong

from minillm.server.response_cache import cache_key

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
