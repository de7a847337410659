"""Where a served process's memory grows under soak load: Python objects, malloc, or free pages held.

    python benchmarks/census_server_heap.py                      # 2 + 4 minutes, tiny-shakespeare-8m
    python benchmarks/census_server_heap.py --warmup 60 --minutes 6

``bench_soak.py`` sees the server's anonymous RSS grow by tens of MB over minutes while every
tensor's bytes stay flat. This splits that growth. The server (the app ``minillm serve`` builds,
with the soak's settings) runs in a thread of this process, under ``bench_soak``'s own mixed load
with faults; after ``--warmup`` seconds of load it takes a first census, after ``--minutes``
more a second one, each once the load has stopped and the server has settled, after
``malloc_trim(0)``:

- **RssAnon** (``/proc/self/status``): what the soak reports;
- **malloc** (glibc's ``mallinfo2``): bytes in use, bytes free but still held in arenas
  (fragmentation), bytes in mmapped chunks;
- **Python's allocations** (``tracemalloc``, started at the first census, 25 frames): the growth
  by allocation site — everything the interpreter allocated after the first census and still
  holds at the second;
- **objects by type** (``gc.get_objects()``): counts and ``sys.getsizeof`` bytes.

malloc's in-use growth minus tracemalloc's is memory allocated outside Python's allocator
(PyTorch's C++ side, the tokenizer's Rust side). A benchmark, not a test: the numbers say where to
look. tracemalloc slows the server (every allocation is recorded), so requests per minute are
lower than in the soak.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import sys
import time
import tracemalloc
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from bench_soak import load, resident_parts  # noqa: E402  (the soak's own load generator)

from minillm.server.heap import malloc_stats  # noqa: E402


def objects_by_type() -> tuple[Counter, Counter]:
    counts, sizes = Counter(), Counter()
    for obj in gc.get_objects():
        name = type(obj).__qualname__
        counts[name] += 1
        try:
            sizes[name] += sys.getsizeof(obj)
        except TypeError:
            pass
    return counts, sizes


def settle(seconds: float = 8.0) -> None:
    time.sleep(seconds)  # abort/finish whatever the last clients left, and let the trim thread run
    gc.collect()


def census() -> dict:
    settle()
    counts, sizes = objects_by_type()
    return {"rss": resident_parts(_pid()), "malloc": malloc_stats(), "counts": counts, "sizes": sizes,
            "traced": tracemalloc.get_traced_memory()[0] if tracemalloc.is_tracing() else 0}  # fmt: skip


def _pid() -> int:
    import os

    return os.getpid()


def mb(x: float) -> str:
    return f"{x / 1e6:+.2f} MB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny-shakespeare-8m")
    parser.add_argument("--warmup", type=float, default=120.0, help="seconds of load before the first census")
    parser.add_argument("--minutes", type=float, default=4.0, help="minutes of load between the two")
    parser.add_argument("--concurrency", type=int, default=12)
    parser.add_argument("--top", type=int, default=20)
    args = parser.parse_args()

    from minillm.server.app import build_app
    from minillm.server.launch import ServerThread, build_engines
    from minillm.server.response_cache import ResponseCache

    engines = build_engines([args.model], dtype="fp32", kv_cache_memory=64 << 20)
    app = build_app(engines, ResponseCache(64), body_timeout_s=2.0)
    with ServerThread(app) as server:
        warm = asyncio.run(load(server.url, args.model, args.warmup, args.concurrency, 2.0, 0))
        first = census()
        tracemalloc.start(25)
        base = tracemalloc.take_snapshot()
        began = time.perf_counter()
        out = asyncio.run(load(server.url, args.model, args.minutes * 60, args.concurrency, 2.0, 1))
        elapsed = time.perf_counter() - began
        second = census()
        snapshot = tracemalloc.take_snapshot()
    lost = sum(o[1] != "ok" for o in out)
    print(f"warm-up: {len(warm)} requests; census window: {len(out)} requests in {elapsed:.0f} s, {lost} lost")
    for key in second["rss"]:
        print(f"  {key}: {first['rss'][key] / 1e6:.1f} -> {second['rss'][key] / 1e6:.1f} MB "
              f"({mb(second['rss'][key] - first['rss'][key])})")  # fmt: skip
    if first["malloc"] and second["malloc"]:
        for key in first["malloc"]:
            print(f"  malloc {key}: {first['malloc'][key] / 1e6:.1f} -> {second['malloc'][key] / 1e6:.1f} MB "
                  f"({mb(second['malloc'][key] - first['malloc'][key])})")  # fmt: skip
    print(f"  Python allocations made in the window and still held (tracemalloc): {mb(second['traced'])}")
    print(f"\ngrowth by allocation site (top {args.top}, innermost frames first):")
    for stat in snapshot.compare_to(base, "traceback")[: args.top]:
        if stat.size_diff <= 0:
            continue
        frames = [f for f in stat.traceback if "tracemalloc" not in f.filename]
        ours = [f for f in frames if "/minillm/" in f.filename]
        where = " <- ".join(f"{Path(f.filename).name}:{f.lineno}" for f in frames[-1:-4:-1])
        mine = f" [minillm: {Path(ours[-1].filename).name}:{ours[-1].lineno}]" if ours else ""
        print(f"  {mb(stat.size_diff)} in {stat.count_diff:+d} blocks: {where}{mine}")
    print("\nobjects by type (count and getsizeof growth, top by bytes):")
    grown = {name: second["sizes"][name] - first["sizes"].get(name, 0) for name in second["sizes"]}
    for name, size in sorted(grown.items(), key=lambda kv: -kv[1])[: args.top]:
        if size <= 0:
            break
        print(f"  {name}: {second['counts'][name] - first['counts'].get(name, 0):+d} objects, {mb(size)}")


if __name__ == "__main__":
    main()
