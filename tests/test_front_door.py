"""The server as an operator runs it: who may call it, what a probe sees, what the CLI refuses.

Each case is an attack or an operator's mistake from the field report: a web page posting to
a loopback server (Host / Content-Type), a missing API key, public docs, a lone surrogate, a
token holding part of a character, a dead tensor-parallel worker behind a healthy-looking
``/health``, and the CLI's ports, FIFOs, Ctrl-C and vLLM's ``serve MODEL`` form.
"""

from __future__ import annotations

import os
import shutil
import time
from types import SimpleNamespace

import httpx
import pytest
from conftest import child_pids

from minillm.cli import _replica_argv, build_parser, main
from minillm.errors import ModelLoadError
from minillm.models.loader import safetensors_files
from minillm.server import ServerThread, build_app, build_engines
from minillm.server.front_door import default_allowed_hosts
from minillm.tokenizer import Tokenizer

MODEL = "tiny-shakespeare-1m"
ENGINE = dict(dtype="fp32", kv_cache_memory=8_000_000, max_num_seqs=8)
BODY = {"model": MODEL, "prompt": "KING.\n", "max_tokens": 3, "temperature": 0}


@pytest.fixture(scope="module")
def guarded():
    engines = build_engines([MODEL], **ENGINE)
    app = build_app(engines, allowed_hosts=default_allowed_hosts("127.0.0.1"), api_key="s3cret")
    with ServerThread(app) as srv:
        yield srv


def post(srv, path="/v1/completions", **kwargs):
    headers = {"authorization": "Bearer s3cret", **kwargs.pop("headers", {})}
    return httpx.post(srv.url + path, headers=headers, timeout=60, **kwargs)


def test_a_web_page_cannot_post_text_plain(guarded):
    """A page may POST text/plain cross-site without a preflight: refused before any route."""
    import json

    r = post(guarded, content=json.dumps(BODY), headers={"content-type": "text/plain"})
    assert r.status_code == 415 and r.json()["error"]["param"] == "content-type"
    assert post(guarded, json=BODY).status_code == 200


@pytest.mark.parametrize("host", ["evil.example.com", "evil.example.com:8000", "127.0.0.1.nip.io", ""])
def test_a_rebound_host_name_is_refused(guarded, host):
    r = post(guarded, json=BODY, headers={"host": host})
    assert r.status_code == 421 and r.json()["error"]["param"] == "host"


@pytest.mark.parametrize("host", ["localhost:8000", "127.0.0.1", "LOCALHOST"])
def test_loopback_names_are_served(guarded, host):
    assert post(guarded, json=BODY, headers={"host": host}).status_code == 200


def test_the_api_key_guards_v1_only(guarded):
    for headers in ({"authorization": ""}, {"authorization": "Bearer wrong"}, {"authorization": "s3cret"}):
        r = post(guarded, json=BODY, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(guarded.url + "/v1/models").status_code == 401
    assert httpx.get(guarded.url + "/health").status_code == 200  # probes need no key
    assert httpx.get(guarded.url + "/metrics").status_code == 200


def test_the_docs_are_off_unless_enabled(guarded):
    assert httpx.get(guarded.url + "/docs").status_code == 404
    assert httpx.get(guarded.url + "/openapi.json").status_code == 404
    with ServerThread(build_app(build_engines([MODEL], **ENGINE), enable_docs=True)) as srv:
        assert httpx.get(srv.url + "/docs").status_code == 200


def test_a_lone_surrogate_is_a_400_naming_the_field(guarded):
    content = b'{"model": "%s", "prompt": "a\\ud800b", "max_tokens": 2}' % MODEL.encode()
    r = post(guarded, content=content, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    chat = b'{"model": "%s", "messages": [{"role": "user", "content": "\\udfff"}]}' % MODEL.encode()
    r = post(guarded, "/v1/chat/completions", content=chat, headers={"content-type": "application/json"})
    assert r.status_code == 400 and "messages[0].content" in r.json()["error"]["message"]


def test_ready_reports_the_fast_path_and_health_is_ok(guarded):
    r = httpx.get(guarded.url + "/ready")
    assert r.status_code == 200 and r.json()["engines"][MODEL]["fast_path"] in ("off", "building", "ready")
    assert httpx.get(guarded.url + "/health").json() == {"status": "ok"}


def test_token_bytes_rebuild_multibyte_text(tiny_model):
    tokenizer = Tokenizer(tiny_model)
    text = "café — 日本語, naïve 🙂"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert b"".join(tokenizer.token_bytes(i) for i in ids).decode("utf-8") == text
    partial = [i for i in ids if "\ufffd" in tokenizer.decode([i])]
    assert partial and all(b"\xef\xbf\xbd" not in tokenizer.token_bytes(i) for i in partial)


def test_a_dead_tensor_parallel_worker_fails_health_and_ready():
    before = child_pids()
    engines = build_engines([MODEL], tensor_parallel_size=2, **ENGINE)
    with ServerThread(build_app(engines)) as srv:
        assert httpx.get(srv.url + "/health").status_code == 200
        runner = engines[MODEL].engine.runner
        runner.procs[1].kill()
        runner.procs[1].join(10)
        health = httpx.get(srv.url + "/health")
        assert health.status_code == 503 and "rank 1 exited" in health.json()["engines"][MODEL]
        assert httpx.get(srv.url + "/ready").status_code == 503
        r = httpx.post(srv.url + "/v1/completions", json=BODY, timeout=60)
        assert r.status_code == 503 and "rank 1" in r.json()["error"]["message"]
    assert child_pids() <= before  # the server's shutdown stopped the surviving rank too


# ---- the command line ------------------------------------------------------------------------------


def test_serve_takes_the_model_positionally_as_vllm_does():
    args = build_parser().parse_args(["serve", MODEL, "--port", "8001", "--block-size", "4"])
    assert args.models == [MODEL]
    argv = ["serve", MODEL, "--allowed-hosts", "a.com,b.com", "--api-key", "k", "--enable-docs", "--block-size", "4",
            "--data-parallel-size", "2"]  # fmt: skip
    # replicas get neither the model (the router names it), nor the router's own checks
    assert _replica_argv(argv, [MODEL]) == ["--enable-docs", "--block-size", "4", "--data-parallel-size", "1"]


@pytest.mark.parametrize("port", ["99999", "-1", "65536"])
def test_a_port_out_of_range_is_named_before_loading(port, capsys):
    start = time.perf_counter()
    assert main(["serve", "no-such-model-is-loaded", "--port", port]) == 2
    assert f"--port {port} is not a TCP port" in capsys.readouterr().err
    assert time.perf_counter() - start < 5


def test_weights_that_are_not_regular_files_are_refused(tiny_model, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(tiny_model, folder)
    (weights,) = folder.glob("*.safetensors")
    weights.unlink()
    os.mkfifo(weights)  # reading it would block forever
    with pytest.raises(ModelLoadError, match="not a regular file"):
        safetensors_files(folder)


def test_ctrl_c_in_the_cli_is_one_line(tiny_model, capsys, monkeypatch):
    import minillm.cli as cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "cmd_generate", interrupted)
    assert main(["generate", "--model", str(tiny_model), "--prompt", "x"]) == 130
    err = capsys.readouterr().err
    assert err.strip() == "minillm: interrupted" and "Traceback" not in err


@pytest.mark.quiet  # a latency percentile: another worker's tests would be in it
def test_health_stays_fast_while_two_megabyte_requests_arrive(guarded):
    """Parsing and tokenizing run off the event loop, and a prompt that cannot fit is refused
    before tokenizing: /health keeps answering while 2 MB bodies (text, and token ids) arrive."""
    import json
    import threading

    text = json.dumps({"model": MODEL, "prompt": "To be or not to be. " * 95_000, "max_tokens": 2}).encode()
    ids = json.dumps({"model": MODEL, "prompt": [5] * 450_000, "max_tokens": 2}).encode()
    assert 1.8e6 < len(text) < 2 << 20 and 1.3e6 < len(ids) < 2 << 20
    codes, latencies, stop = [], [], threading.Event()

    def send(content):
        for _ in range(3):
            codes.append(post(guarded, content=content, headers={"content-type": "application/json"}).status_code)

    def probe():
        with httpx.Client(base_url=guarded.url, timeout=10) as http:
            while not stop.is_set():
                start = time.perf_counter()
                assert http.get("/health").status_code == 200
                latencies.append(time.perf_counter() - start)
                time.sleep(0.02)

    prober = threading.Thread(target=probe)
    prober.start()
    senders = [threading.Thread(target=send, args=(c,)) for c in (text, ids, text, ids)]
    for t in senders:
        t.start()
    for t in senders:
        t.join(120)
    stop.set()
    prober.join(10)
    assert codes == [400] * 12
    # The 90th percentile, not the median or the maximum (`benchmarks/bench_health_under_load.py`,
    # 4 runs a variant, Intel Xeon, 2 cores, a slow day; `benchmarks/results/health-under-load-*`):
    # as shipped p90 75-117 ms, max 119-279 ms (653 ms once, in a full suite); with parsing moved
    # onto the event loop p90 488-1021 ms, while its median (67-474 ms) overlapped the shipped
    # one's (30-63 ms) and its max (488-1021 ms) a busy run's. The last bound catches a stall of
    # seconds.
    latencies.sort()
    assert len(latencies) >= 5 and latencies[int(len(latencies) * 0.9)] < 0.3, latencies
    assert latencies[-1] < 2.0, latencies


# ---- slow clients, disconnects, shutdown ------------------------------------------------------------


@pytest.fixture(scope="module")
def impatient():
    engines = build_engines([MODEL], **ENGINE)
    with ServerThread(build_app(engines, body_timeout_s=1.0)) as srv:
        yield srv


def _raw(srv, head: bytes, body_parts, pause: float) -> tuple[bytes, float]:
    """Send ``head`` then each body part ``pause`` s apart; the answer and when it came."""
    import socket

    start = time.perf_counter()
    with socket.create_connection((srv.host, srv.port), timeout=30) as conn:
        conn.sendall(head)
        try:
            for part in body_parts:
                time.sleep(pause)
                conn.sendall(part)
        except OSError:  # the server already answered and closed
            pass
        answer = b""
        while chunk := conn.recv(65536):
            answer += chunk
    return answer, time.perf_counter() - start


HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 200\r\n\r\n"


def test_a_trickled_body_gets_408_and_its_connection_closed(impatient):
    answer, took = _raw(impatient, HEAD, [b"{" + b" " * 9] * 20, pause=0.5)  # 10 bytes every 0.5 s: ~10 s in all
    assert answer.startswith(b"HTTP/1.1 200") is False and b" 408 " in answer.split(b"\r\n")[0]
    assert took < 8


def test_a_half_sent_body_gets_408(impatient):
    answer, took = _raw(impatient, HEAD + b'{"model": "x", ', [], pause=0)
    assert b" 408 " in answer.split(b"\r\n")[0] and b"did not arrive within 1 s" in answer
    assert took < 5


def test_a_client_leaving_mid_body_is_one_info_line(impatient, caplog):
    import logging
    import socket

    with caplog.at_level(logging.INFO, logger="minillm.server"):
        for _ in range(5):
            with socket.create_connection((impatient.host, impatient.port)) as conn:
                conn.sendall(HEAD + b'{"model": ')
            time.sleep(0.2)
        time.sleep(0.5)
    lines = [r for r in caplog.records if r.name == "minillm.server"]
    assert len(lines) == 5 and all(r.levelno == logging.INFO and "left while sending" in r.getMessage() for r in lines)
    assert not any(r.exc_info for r in caplog.records)
    assert httpx.post(impatient.url + "/v1/completions", json=BODY, timeout=60).status_code == 200


def _serve_subprocess(tiny_model, *flags):
    """`minillm serve` of the tiny model on a free port, in its own process, once healthy."""
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "minillm", "serve", str(tiny_model), "--port", str(port), "--dtype", "fp32",
         "--block-size", "4", "--log-level", "warning", *flags],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={k: v for k, v in os.environ.items() if k != "MINILLM_COMPILE"},
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(proc.stdout.read().decode()[-2000:])
        time.sleep(0.3)


def test_sigterm_drains_running_requests_then_exits(tiny_model, tmp_path):
    """`minillm serve` with a request in flight: SIGTERM stops accepting, lets it finish (within
    --shutdown-timeout) and exits."""
    import signal
    import threading

    proc, url = _serve_subprocess(tiny_model, "--shutdown-timeout", "20")
    try:
        name = os.path.basename(str(tiny_model))
        started, lines = threading.Event(), []

        def long_stream():
            body = {"model": name, "prompt": "hello", "max_tokens": 240, "ignore_eos": True, "temperature": 0,
                    "stream": True}  # fmt: skip
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        lines.append(line)
                        started.set()

        t = threading.Thread(target=long_stream)
        t.start()
        assert started.wait(60)
        proc.send_signal(signal.SIGTERM)  # mid-stream
        t.join(60)
        assert proc.wait(30) in (0, -signal.SIGTERM)  # uvicorn re-raises SIGTERM once it has shut down cleanly
        assert lines[-1] == "data: [DONE]" and len(lines) == 240 + 1  # every token, then the end
    finally:
        if proc.poll() is None:
            proc.kill()


def _requests_inside(url: str) -> int:
    """Requests running or waiting in the served engine, read from ``/metrics``."""
    import httpx

    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(int(float(line.rsplit(" ", 1)[1])) for line in text.splitlines()
               if line.startswith(("minillm_num_requests_running{", "minillm_num_requests_waiting{")))  # fmt: skip


def test_the_drain_deadline_ends_every_request_with_a_word(tiny_model):
    """SIGTERM with --shutdown-timeout 1 while 16 requests need longer than that (one runs at a
    time): each stream the deadline cuts ends with an error event naming the shutdown and then
    [DONE] (not a broken connection), each non-streamed one gets a 503 with a JSON body, and
    the server exits. A request that finished before the deadline is whole."""
    import json
    import signal
    import threading

    proc, url = _serve_subprocess(tiny_model, "--shutdown-timeout", "1", "--max-num-seqs", "1")
    try:
        name = os.path.basename(str(tiny_model))
        body = {"model": name, "prompt": "hello", "max_tokens": 240, "ignore_eos": True, "temperature": 0}
        streams: list[list[str]] = [[] for _ in range(8)]
        answers: list = [None] * 8
        started = threading.Event()

        def stream(i):
            with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        streams[i].append(line)
                        started.set()

        def collect(i):
            answers[i] = httpx.post(url + "/v1/completions", json=body, timeout=60)

        threads = [threading.Thread(target=f, args=(i,)) for i in range(8) for f in (stream, collect)]
        for t in threads:
            t.start()
        assert started.wait(60)
        # Every request inside the engine (or already answered) before the signal: one still on its
        # way in when the server stops accepting gets a closed connection (uvicorn's, before any
        # minillm code sees it) — on a slow machine the sleep alone left one on its way (CI run103,
        # 2026-12-07). Answered ones count: on a fast one the first finished before the last came
        # in, 16 were never inside at once, and the 30 s wait let every request finish (run112).
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and _requests_inside(url) + sum(not t.is_alive() for t in threads) < 16:
            time.sleep(0.05)
        time.sleep(0.2)  # the others queued behind it
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(60)
        assert proc.wait(30) in (0, -signal.SIGTERM)
    finally:
        if proc.poll() is None:
            proc.kill()
    cut = 0
    for lines in streams:
        assert lines and lines[-1] == "data: [DONE]", lines[-3:]  # every stream ends properly
        if len(lines) < 240 + 1:
            error = json.loads(lines[-2].removeprefix("data: "))["error"]
            assert "shutting down" in error["message"] and "--shutdown-timeout 1 s" in error["message"]
            cut += 1
    for answer in answers:
        if answer.status_code != 200:
            assert answer.status_code == 503 and "shutting down" in answer.json()["error"]["message"]
            cut += 1
        else:
            assert answer.json()["usage"]["completion_tokens"] == 240
    # 16 x 240 tokens one at a time outlast the drain (~2.4 s here, where ~6 requests finish a second):
    # whatever the machine's speed, the last of each kind to queue is cut
    assert cut >= 2 and any(a.status_code == 503 for a in answers) and any(len(lines) < 241 for lines in streams)


@pytest.fixture(scope="module")
def strict_headers():
    with ServerThread(build_app(build_engines([MODEL], **ENGINE)), header_timeout=1.0) as srv:
        yield srv


@pytest.mark.parametrize("sends", [[], [b"POST /v1/comp", b"letions HTTP/1.1\r\n", b"Host: 127.0.0.1\r\n"]])
def test_idle_and_slow_header_connections_are_closed(strict_headers, sends):
    """A connection that sends nothing, or trickles its request line and headers, is closed at the
    header deadline (1 s here) instead of being held for ever (slowloris)."""
    import socket

    start = time.perf_counter()
    with socket.create_connection((strict_headers.host, strict_headers.port), timeout=10) as conn:
        try:
            for part in sends:
                conn.sendall(part)
                time.sleep(0.4)
            closed = conn.recv(4096) == b""
        except ConnectionResetError:
            closed = True
    assert closed and time.perf_counter() - start < 4
    r = httpx.post(strict_headers.url + "/v1/completions", json=BODY, timeout=60)
    assert r.status_code == 200  # a client that sends its request at once is unaffected


@pytest.mark.parametrize("error", [PermissionError(13, "Permission denied", "/models/private"),
                                   IsADirectoryError(21, "Is a directory", "/models/x/config.json")])  # fmt: skip
def test_an_unreadable_model_is_one_line_not_a_traceback(error, capsys, monkeypatch):
    """As root a folder cannot be made unreadable, so the loader's PermissionError is raised by hand."""
    import minillm.cli as cli

    def unreadable(args):
        raise error

    monkeypatch.setattr(cli, "cmd_generate", unreadable)
    assert main(["generate", "--model", "/models/private", "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("minillm: error:") and error.filename in err and "Traceback" not in err


def test_an_oversized_body_still_being_sent_reads_its_413(impatient):
    """A body over the limit is refused at its headers, while the client is still sending. Had
    the server closed its socket with body bytes unread, the kernel would reset the connection
    and destroy the 413 before the client read it (the soak lost 258 of 362 so). The server now
    ends its side, drops what still arrives for a moment, then closes: the client, sending on
    after the answer came, still reads a whole 413."""
    import socket

    size = 3 << 20
    head = HEAD.replace(b"Content-Length: 200", b"Content-Length: %d" % size)
    with socket.create_connection((impatient.host, impatient.port), timeout=30) as conn:
        conn.sendall(head + b"{" + b" " * (1 << 20))
        time.sleep(0.5)  # the 413 is sent and the server's close has begun
        conn.sendall(b" " * (1 << 20))  # still sending: dropped, not answered with a reset
        answer = b""
        while chunk := conn.recv(65536):
            answer += chunk
    status, _, body = answer.partition(b"\r\n\r\n")
    assert b" 413 " in status.split(b"\r\n")[0] and b"larger than the server's limit" in body
    assert httpx.post(impatient.url + "/v1/completions", json=BODY, timeout=60).status_code == 200


class _Transport:
    """A transport that records what the lingering close asks of it."""

    def __init__(self, eof_fails: bool = False, can_eof: bool = True):
        self.calls, self.eof_fails, self.can_eof, self.closing = [], eof_fails, can_eof, False

    def can_write_eof(self):
        return self.can_eof

    def is_closing(self):
        return self.closing

    def write_eof(self):
        self.calls.append("write_eof")
        if self.eof_fails:
            raise OSError(107, "Transport endpoint is not connected")

    def resume_reading(self):
        self.calls.append("resume_reading")

    def close(self):
        self.calls.append("close")
        self.closing = True

    def abort(self):
        self.calls.append("abort")
        self.closing = True


class _Loop:
    def __init__(self):
        self.timers = []

    def call_later(self, delay, callback):
        self.timers.append((delay, callback))
        return self

    def cancel(self):
        self.timers.append("cancelled")


def test_the_lingering_close_is_bounded_in_time_and_bytes():
    from minillm.server.connections import LINGER_BYTES, LINGER_S, LingeringTransport

    raw, loop = _Transport(), _Loop()
    lingering = LingeringTransport(raw, loop)
    lingering.close()
    assert raw.calls == ["write_eof", "resume_reading"] and lingering.is_closing()
    assert [delay for delay, _ in loop.timers] == [LINGER_S] and loop.timers[0][1] == raw.close
    lingering.close()  # uvicorn may close twice: nothing more happens
    assert raw.calls == ["write_eof", "resume_reading"]
    lingering.drop(b"x" * (LINGER_BYTES // 2))
    assert "abort" not in raw.calls
    lingering.drop(b"x" * (LINGER_BYTES // 2 + 1))  # past the byte bound: reset
    assert raw.calls[-1] == "abort" and loop.timers[-1] == "cancelled"

    raw = _Transport(eof_fails=True)  # the client already left: no linger, no error
    LingeringTransport(raw, _Loop()).close()
    assert raw.calls == ["write_eof", "abort"]
    raw = _Transport(can_eof=False)  # TLS cannot half-close: a plain close
    LingeringTransport(raw, _Loop()).close()
    assert raw.calls == ["close"]


def test_an_idle_kept_alive_connection_does_not_hold_the_shutdown(monkeypatch):
    """A client's pool (httpx, openai) keeps its idle connection open and never closes it. On
    shutdown that connection closes at once: with the lingering close it held every stop for
    ``LINGER_S`` (5 s for each of chapter 10's live checks). Here the linger is made 10 minutes:
    a stop that lingered would outlive the join below."""
    from minillm.server import connections

    monkeypatch.setattr(connections, "LINGER_S", 600.0)
    server = ServerThread(build_app(build_engines([MODEL], **ENGINE))).start()
    with httpx.Client(base_url=server.url, timeout=60) as client:
        assert client.post("/v1/completions", json=BODY).status_code == 200  # the connection stays in the pool
        server.stop(timeout=60)
        assert not server.thread.is_alive(), "the server waited on an idle keep-alive connection"
        with pytest.raises(httpx.TransportError):  # the pool's connection was closed, the port is shut
            client.post("/v1/completions", json=BODY)


def test_only_a_close_between_requests_skips_the_linger():
    """The transport closes at once only when the protocol marked it idle; the protocol marks
    it only when its answer is complete and the client is between requests — not after a
    refusal sent at the headers while the client still sends its body (that answer keeps the
    linger's protection), nor while a request is being answered."""
    import h11

    from minillm.server.connections import HeaderDeadlineProtocol, LingeringTransport

    raw = _Transport()
    idle = LingeringTransport(raw, _Loop())
    idle.idle = True
    idle.close()
    assert raw.calls == ["close"]

    def protocol(cycle, conn):
        p = HeaderDeadlineProtocol.__new__(HeaderDeadlineProtocol)
        p.cycle, p.conn, p.transport = cycle, conn, LingeringTransport(_Transport(), _Loop())
        p._mark_idle()
        return p.transport.idle

    post = h11.Request(method="POST", target="/v1/completions",
                       headers=[("host", "x"), ("content-length", "100")])  # fmt: skip
    done, busy = SimpleNamespace(response_complete=True), SimpleNamespace(response_complete=False)
    assert protocol(None, h11.Connection(h11.SERVER))  # a connection that sent nothing yet
    refused = h11.Connection(h11.SERVER)
    refused.receive_data(h11.Connection(h11.CLIENT).send(post))
    assert isinstance(refused.next_event(), h11.Request)
    refused.send(h11.Response(status_code=401, headers=[("content-length", "0")]))
    refused.send(h11.EndOfMessage())  # answered at the headers; the client's body still to come
    assert refused.their_state is h11.SEND_BODY and not protocol(done, refused)
    assert not protocol(busy, h11.Connection(h11.SERVER))  # an answer still being written
