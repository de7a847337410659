"""Soak: the server under minutes of mixed load with faults, on loopback. Does it leak, lose
requests, or slow down?

    python benchmarks/bench_soak.py                       # 10 minutes, tiny-shakespeare-8m
    python benchmarks/bench_soak.py --minutes 2 --model tiny-shakespeare-1m

``minillm serve`` runs in its own process (``--response-cache 64``); an asyncio client keeps
``--concurrency`` requests in flight, each drawn (seeded) from a mix an operator meets:
completions and chats, greedy and sampled, streamed or not, ``n > 1``, logprobs, repeats that
hit the response cache — and faults: clients that leave mid-stream, malformed JSON, a wrong
content type, hostile values (``top_k`` = 2^63, ``n`` = 10^9), bodies over the size limit, and
bodies trickled slower than ``--body-timeout`` (cut with a 408). Reported:

- **lost requests**: any request without a complete answer — a valid one that did not end in
  200 with its tokens (or ``[DONE]``), a fault not answered with the 4xx it deserves, any 5xx.
  Clients that left on purpose are not counted; the server's ``/metrics`` must show them aborted;
- **RSS** of the server process every 5 s: the drift from the end of the warm-up (the first
  20% of the run) to the last sample and to the largest one (flat means within 5%). The KV
  pool is an on-demand mapping (``minillm/kvcache/zeroed.py``) that the prefix cache fills as
  traffic touches new blocks, so a 1 GiB default pool alone grows RSS for minutes, up to its
  size and no further. The soak therefore gives the server a pool its warm-up fills
  (``--kv-cache-memory``, 64 MB by default) so that the drift measures everything else;
- **left clients**: a client that leaves mid-stream aborts its request, unless the engine had
  already finished it when the server saw the disconnect. After the run the server must hold no
  running or waiting request and no KV block (``/metrics``): nothing a leaver started is kept;
- **p99 TTFT** of the streamed valid requests, in the first and the last fifth of the run.

Writes JSON (with every RSS sample) to ``benchmarks/results/soak-DATE-CPU.json``. A benchmark,
not a test: ``tests/test_front_door.py`` and ``tests/test_server.py`` test each fault alone.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import statistics
import time
from datetime import date
from pathlib import Path

import httpx
import psutil

from minillm.server.launch import ServerProcess

RESULTS = Path(__file__).parent / "results"
PROMPTS = ["KING.\nNow is the winter", "ROMEO.\nBut soft", "JULIET.\nO Romeo", "HAMLET.\nTo be", "FIRST CITIZEN.\n"]


def kinds(rng: random.Random) -> str:
    return rng.choices(
        ["complete", "stream", "chat", "n3", "logprobs", "repeat", "leave", "bad_json", "text_plain", "hostile",
         "too_big", "trickle"],
        weights=[20, 25, 10, 5, 5, 10, 8, 4, 3, 5, 2, 3],
    )[0]  # fmt: skip


async def one(kind: str, rng: random.Random, url: str, model: str, body_timeout: float, out: list) -> None:
    """One request of ``kind``; appends ``(kind, outcome, ttft or None, t)`` to ``out``."""
    prompt = rng.choice(PROMPTS)
    base = {"model": model, "prompt": prompt, "max_tokens": rng.randint(4, 32)}
    start = time.perf_counter()
    ttft = None
    try:
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            if kind in ("complete", "repeat", "n3", "logprobs"):
                body = base | {"temperature": 0 if kind == "repeat" else rng.choice([0, 0.8])}
                body |= {"n": 3, "temperature": 0.8} if kind == "n3" else {}
                body |= {"logprobs": 2} if kind == "logprobs" else {}
                r = await http.post("/v1/completions", json=body)
                ok = r.status_code == 200 and len(r.json()["choices"]) == body.get("n", 1)
            elif kind == "chat":
                body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 16}
                r = await http.post("/v1/chat/completions", json=body)
                ok = r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant"
            elif kind in ("stream", "leave"):
                body = base | {"stream": True, "temperature": 0.7, "max_tokens": 48}
                lines = []
                async with http.stream("POST", "/v1/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            ttft = ttft or time.perf_counter() - start
                            lines.append(line)
                            if kind == "leave" and len(lines) >= 3:
                                break  # the client leaves mid-stream
                ok = kind == "leave" or (r.status_code == 200 and lines[-1] == "data: [DONE]")
            elif kind == "bad_json":
                r = await http.post("/v1/completions", content=b'{"model": ', headers={"content-type": "application/json"})
                ok = r.status_code == 400
            elif kind == "text_plain":
                r = await http.post("/v1/completions", content=json.dumps(base), headers={"content-type": "text/plain"})
                ok = r.status_code == 415
            elif kind == "hostile":
                body = base | rng.choice([{"top_k": 2**63}, {"n": 10**9}, {"temperature": -1}, {"seed": 2**70},
                                          {"logprobs": 99}, {"max_tokens": 0}])  # fmt: skip
                r = await http.post("/v1/completions", json=body)
                ok = 400 <= r.status_code < 500 and bool(r.json()["error"]["param"])
            elif kind == "too_big":
                r = await http.post("/v1/completions", json=base | {"prompt": "x" * (3 << 20)})
                ok = r.status_code == 413
            else:  # trickle: a body slower than the server's body timeout
                ok = await asyncio.to_thread(trickle, url, body_timeout)
    except httpx.HTTPError as err:
        ok = f"{type(err).__name__}"
    out.append((kind, "ok" if ok is True else f"lost: {ok!r}", ttft, time.perf_counter()))


def trickle(url: str, body_timeout: float) -> bool:
    host, port = url.removeprefix("http://").split(":")
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n{")  # fmt: skip
    with socket.create_connection((host, int(port)), timeout=body_timeout * 4) as conn:
        conn.sendall(head)
        answer = conn.recv(4096)
    return b" 408 " in answer.split(b"\r\n")[0]


async def load(url: str, model: str, seconds: float, concurrency: int, body_timeout: float, seed: int) -> list:
    rng, out = random.Random(seed), []
    deadline = time.perf_counter() + seconds

    async def worker(index: int):
        local = random.Random(seed * 1000 + index)
        while time.perf_counter() < deadline:
            await one(kinds(rng), local, url, model, body_timeout, out)

    await asyncio.gather(*(worker(i) for i in range(concurrency)))
    return out


HELD = ("minillm_num_requests_running", "minillm_num_requests_waiting", "minillm_kv_blocks_used")


def metric(text: str, name: str) -> float:
    """The sum of a metric's samples (over its labels) in Prometheus text."""
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + "{") or line.startswith(name + " "))


def settled_metrics(url: str, seconds: float = 10.0) -> str:
    """``/metrics`` once nothing is running, or after ``seconds`` (the last aborts land a step
    after their clients left)."""
    deadline = time.perf_counter() + seconds
    while True:
        text = httpx.get(url + "/metrics").text
        if not any(metric(text, name) for name in HELD) or time.perf_counter() > deadline:
            return text
        time.sleep(0.2)


def resident_parts(pid: int) -> dict[str, int]:
    """RSS split as Linux counts it (``/proc/PID/status``): anonymous memory (the heap, tensors,
    the KV pool), file pages (shared libraries' code and data touched so far, mapped weights) and
    shared memory. Growth in file pages is code paths run for the first time, not a leak."""
    parts = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("RssAnon", "RssFile", "RssShmem"):
                parts[key] = int(value.split()[0]) * 1024
    except OSError:  # not Linux
        pass
    return parts


def sample_rss(pid: int, every: float, samples: list, parts: list, stop) -> None:
    process = psutil.Process(pid)
    start = time.perf_counter()
    while not stop.is_set():
        t = round(time.perf_counter() - start, 1)
        samples.append((t, process.memory_info().rss))
        parts.append((t, resident_parts(pid)))
        stop.wait(every)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-shakespeare-8m")
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=12)
    parser.add_argument("--body-timeout", type=float, default=2.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kv-cache-memory", type=int, default=64 << 20, help="the server's KV pool, bytes")
    parser.add_argument("--tag", default="", help="suffix for the result file (paired runs of one day)")
    args = parser.parse_args()

    import threading

    import torch

    from minillm.machine import machine_description, machine_tag

    serve_args = ["--dtype", "fp32", "--response-cache", "64", "--body-timeout", str(args.body_timeout),
                  "--max-body-bytes", str(2 << 20), "--kv-cache-memory", str(args.kv_cache_memory)]  # fmt: skip
    seconds = args.minutes * 60
    with ServerProcess([args.model], serve_args) as server:
        samples, parts, stop = [], [], threading.Event()
        sampler = threading.Thread(target=sample_rss, args=(server.proc.pid, 5.0, samples, parts, stop), daemon=True)
        sampler.start()
        began = time.perf_counter()
        out = asyncio.run(load(server.url, args.model, seconds, args.concurrency, args.body_timeout, args.seed))
        stop.set()
        sampler.join()
        metrics = settled_metrics(server.url)
        healthy = httpx.get(server.url + "/health").status_code == 200
    lost = [o for o in out if o[1] != "ok"]
    warm = [rss for t, rss in samples if t >= 0.2 * seconds] or [samples[-1][1]]
    rss_warm, rss_last, rss_max = warm[0], samples[-1][1], max(warm)
    warm_parts = [p for t, p in parts if t >= 0.2 * seconds and p] or [parts[-1][1]]
    drift_by_part = {key: {"after_warmup_mb": warm_parts[0][key] / 1e6, "last_mb": warm_parts[-1][key] / 1e6,
                           "growth_mb": (warm_parts[-1][key] - warm_parts[0][key]) / 1e6}
                     for key in warm_parts[0]}  # fmt: skip
    first = sorted(o[2] for o in out if o[2] is not None and o[3] - began < 0.2 * seconds)
    last = sorted(o[2] for o in out if o[2] is not None and o[3] - began > 0.8 * seconds)

    def p99(xs):
        return xs[min(len(xs) - 1, int(0.99 * len(xs)))] * 1000 if xs else None

    aborted = metric(metrics, "minillm_requests_aborted_total")
    held = {name: metric(metrics, name) for name in HELD}
    counts = {}
    for kind, outcome, _, _ in out:
        counts.setdefault(kind, [0, 0])[outcome == "ok"] += 1
    result = {
        "date": str(date.today()), "machine": machine_description(torch.device("cpu")), "args": vars(args),
        "requests": len(out), "lost": len(lost), "lost_examples": lost[:10],
        "by_kind": {k: {"answered_right": v[1], "lost": v[0]} for k, v in sorted(counts.items())},
        "left_mid_stream": counts.get("leave", [0, 0])[1], "aborted_in_metrics": aborted,
        "held_after": held, "kv_cache_memory": args.kv_cache_memory,
        "rss_mb": {"after_warmup": rss_warm / 1e6, "last": rss_last / 1e6, "max": rss_max / 1e6,
                   "drift_last_pct": 100 * (rss_last / rss_warm - 1), "drift_max_pct": 100 * (rss_max / rss_warm - 1)},
        "rss_by_part": drift_by_part,
        "ttft_p99_ms": {"first_fifth": p99(first), "last_fifth": p99(last)},
        "ttft_p50_ms": {"first_fifth": statistics.median(first) * 1000 if first else None,
                        "last_fifth": statistics.median(last) * 1000 if last else None},
        "healthy_after": healthy, "rss_samples": samples, "rss_part_samples": parts,
    }  # fmt: skip
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"soak-{result['date']}-{machine_tag(result['machine'])}{'-' + args.tag if args.tag else ''}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    r = result["rss_mb"]
    held_text = ", ".join(f"{name.removeprefix('minillm_')} {value:.0f}" for name, value in held.items())
    print(f"{len(out)} requests in {args.minutes:g} min, {len(lost)} lost; {result['left_mid_stream']} clients left "
          f"mid-stream, {aborted:.0f} aborted in /metrics; RSS {r['after_warmup']:.0f} MB after warm-up, "
          f"{r['last']:.0f} last ({r['drift_last_pct']:+.1f}%), {r['max']:.0f} max ({r['drift_max_pct']:+.1f}%); "
          f"p99 TTFT {result['ttft_p99_ms']['first_fifth']:.0f} ms first fifth, "
          f"{result['ttft_p99_ms']['last_fifth']:.0f} ms last fifth; healthy after: {healthy}; "
          f"held after: {held_text}")
    if drift_by_part:
        print("RSS growth after warm-up by part: " + ", ".join(
            f"{key} {v['growth_mb']:+.1f} MB (of {v['after_warmup_mb']:.0f})" for key, v in drift_by_part.items()))
    print(f"wrote {path}")
    clean = not any(held.values()) and aborted <= result["left_mid_stream"]
    return 0 if not lost and healthy and clean else 1


if __name__ == "__main__":
    raise SystemExit(main())
