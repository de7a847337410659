"""How long ``/health`` takes to answer while 2 MB request bodies arrive — as shipped, and with
request parsing moved onto the event loop — to size ``tests/test_front_door.py``'s bounds.

The load is the test's: four clients each post three ~2 MB bodies (a prompt of text, a prompt
of token ids; too long to fit, so each is refused with a 400) while a prober asks ``/health``
every 20 ms. The server runs in a thread of this process, as in the test, so every thread shares
one GIL. Printed per run: the probes' count, median, 90th percentile and maximum.

- ``shipped``: parsing and validating run on the server's parsing threads (``app.py``'s
  ``off_loop``);
- ``on-loop``: the same app with an executor that runs each call inline, on the event loop —
  the fault the test must catch.

    python benchmarks/bench_health_under_load.py [--runs 4] [--variants shipped on-loop]

A benchmark, not a test; nothing else should run (add your own load to see a busy machine).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import sys
import threading
import time

import httpx
import torch

from minillm.machine import machine_description

MODEL = "tiny-shakespeare-1m"
ENGINE = dict(dtype="fp32", kv_cache_memory=8_000_000, max_num_seqs=8)
TEXT = json.dumps({"model": MODEL, "prompt": "To be or not to be. " * 95_000, "max_tokens": 2}).encode()
IDS = json.dumps({"model": MODEL, "prompt": [5] * 450_000, "max_tokens": 2}).encode()


class InlineExecutor(concurrent.futures.ThreadPoolExecutor):
    """Runs what it is given at once, in the caller's thread: ``run_in_executor`` then blocks
    the event loop for the whole call."""

    def submit(self, fn, /, *args, **kwargs):
        future = concurrent.futures.Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 (handed to the awaiting coroutine)
            future.set_exception(exc)
        return future


def one_run(url: str) -> tuple[list[int], list[float]]:
    codes, latencies, stop = [], [], threading.Event()

    def send(content: bytes) -> None:
        headers = {"content-type": "application/json"}
        for _ in range(3):
            codes.append(httpx.post(url + "/v1/completions", content=content, headers=headers, timeout=60).status_code)

    def probe() -> None:
        with httpx.Client(base_url=url, timeout=10) as http:
            while not stop.is_set():
                start = time.perf_counter()
                http.get("/health")
                latencies.append(time.perf_counter() - start)
                time.sleep(0.02)

    prober = threading.Thread(target=probe)
    prober.start()
    senders = [threading.Thread(target=send, args=(c,)) for c in (TEXT, IDS, TEXT, IDS)]
    for t in senders:
        t.start()
    for t in senders:
        t.join()
    stop.set()
    prober.join()
    return codes, sorted(latencies)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--variants", nargs="+", default=["shipped", "on-loop"], choices=["shipped", "on-loop"])
    args = parser.parse_args()

    import minillm.server.app as app
    from minillm.server import ServerThread, build_app, build_engines

    print(f"# {machine_description(torch.device('cpu'))}")
    for variant in args.variants:
        pool = app.ThreadPoolExecutor
        if variant == "on-loop":
            app.ThreadPoolExecutor = InlineExecutor
        try:
            with ServerThread(build_app(build_engines([MODEL], **ENGINE))) as srv:
                for _ in range(args.runs):
                    codes, lat = one_run(srv.url)
                    n = len(lat)
                    print(
                        f"{variant:8s} all 400: {codes == [400] * 12}  probes {n:3d}  median {lat[n // 2] * 1e3:6.1f} ms"
                        f"  p90 {lat[int(n * 0.9)] * 1e3:6.1f} ms  max {lat[-1] * 1e3:6.1f} ms",
                        flush=True,
                    )
        finally:
            app.ThreadPoolExecutor = pool


if __name__ == "__main__":
    sys.exit(main())
