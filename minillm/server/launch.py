"""Starting the server: engines for each model, then uvicorn — blocking, or in a thread.

``ServerThread`` runs a real uvicorn server on a loopback port in a background thread of this
process; tests and notebooks use it to talk HTTP to the engine without a second process.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import uvicorn

import minillm.hooks as hooks
from minillm.config import environment
from minillm.engine import LLMEngine
from minillm.server import heap
from minillm.server.app import build_app
from minillm.server.async_engine import AsyncEngine, ServerShuttingDown
from minillm.server.connections import with_header_timeout
from minillm.server.front_door import default_allowed_hosts

# A served engine keeps no per-step records unless asked: nothing in the server reads them, yet
# each step would build one (its chunks, pool counters) and the engine keeps the last 10,000 (its
# default, for notebooks that draw them) for as long as the server runs.
SERVED_STEP_RECORDS = 0


def build_engines(models: list[str], max_waiting: int = 256, **engine_args) -> dict[str, AsyncEngine]:
    """One engine per model name (the name clients put in ``model``), all with ``engine_args``
    (``max_step_records`` defaults to ``SERVED_STEP_RECORDS``)."""
    engine_args.setdefault("max_step_records", SERVED_STEP_RECORDS)
    if len(set(models)) != len(models):
        raise ValueError(f"a model is named twice in {models}")
    return {
        served_name(name): AsyncEngine(LLMEngine(name, **engine_args), served_name(name), max_waiting)
        for name in models
    }


def served_name(name: str) -> str:
    """The name clients put in ``model``: a short name as given, a folder by its last component."""
    return os.path.basename(os.path.normpath(name)) if os.sep in name else name


def serve(
    models: list[str],
    host: str = "127.0.0.1",
    port: int = 8000,
    response_cache: int = 0,
    max_waiting: int = 256,
    max_body_bytes: int = 2 << 20,
    log_level: str = "info",
    enable_docs: bool = False,
    allowed_hosts: list[str] | None = None,
    api_key: str | None = None,
    body_timeout: float = 30.0,
    keep_alive_timeout: float = 5.0,
    max_connections: int | None = 1024,
    shutdown_timeout: float = 10.0,
    header_timeout: float = 10.0,
    **engine_args,
) -> None:
    """Build the engines and serve until interrupted (what ``minillm serve`` runs).

    ``allowed_hosts`` None: the names of ``host`` (loopback: localhost, 127.0.0.1, [::1]).
    Connections are bounded: an idle keep-alive connection closes after ``keep_alive_timeout``
    s, one whose request headers are not complete within ``header_timeout`` s is closed
    (``connections.py``); past ``max_connections`` open connections new ones get a 503; a
    request body must arrive in full within ``body_timeout`` s (408); on SIGTERM the server stops
    accepting, lets running requests finish for up to ``shutdown_timeout`` s, then exits."""
    heap.bound_kernel_caches()  # before any engine builds a kernel: they are read once
    engines = build_engines(models, max_waiting, **engine_args)
    cache = hooks.response_cache(response_cache) if response_cache else None
    hosts = allowed_hosts if allowed_hosts else default_allowed_hosts(host)
    app = build_app(engines, cache, max_body_bytes=max_body_bytes, enable_docs=enable_docs, allowed_hosts=hosts,
                    api_key=api_key, body_timeout_s=body_timeout)  # fmt: skip
    heap.freeze_startup_heap()  # the start-up's objects live until exit: no collection walks them again
    run_server(app, engines, host=host, port=port, log_level=log_level, timeout_keep_alive=keep_alive_timeout,
               limit_concurrency=max_connections, timeout_graceful_shutdown=shutdown_timeout,
               http=with_header_timeout(header_timeout))  # fmt: skip


def run_server(app, engines: dict[str, AsyncEngine], **options) -> None:
    """What ``uvicorn.run(app, **options)`` does — Ctrl-C a way to stop, a server that never
    started a failed start (exit 3) — with a ``DrainingServer``, whose drain ends what it cuts
    with a word to the client."""
    server = DrainingServer(uvicorn.Config(app, **options), engines)
    with contextlib.suppress(KeyboardInterrupt):
        server.run()
    if not server.started:
        sys.exit(3)


class DrainingServer(uvicorn.Server):
    """uvicorn's server, whose drain ends requests itself before uvicorn's deadline cuts them.

    On SIGTERM uvicorn stops accepting, waits up to ``timeout_graceful_shutdown`` seconds for
    running requests, then cancels them: a stream cut so ends with neither an error nor
    ``[DONE]`` (the client sees "peer closed connection without sending complete message
    body"), and a client cannot tell a shutdown from a crash. So ``DRAIN_MARGIN_S`` before that
    deadline (half the drain when it is shorter than twice that) every engine is ``cut``: each
    open request is aborted with ``ServerShuttingDown`` — a stream's last events are an error
    naming the shutdown and ``[DONE]``, a waiting non-streamed request gets a 503 with a JSON
    body — and new requests are refused with a 503. With no timeout, uvicorn waits for ever and
    nothing is cut."""

    DRAIN_MARGIN_S = 0.5

    def __init__(self, config: uvicorn.Config, engines: dict[str, AsyncEngine]):
        super().__init__(config)
        self.engines = engines

    async def shutdown(self, sockets=None) -> None:
        timeout = self.config.timeout_graceful_shutdown
        if timeout is not None:
            cut_after = timeout - min(self.DRAIN_MARGIN_S, timeout / 2)
            reason = ServerShuttingDown(
                f"the server is shutting down: this request had not finished when its drain time "
                f"(--shutdown-timeout {timeout:g} s) ran out; retry it on another server"
            )  # fmt: skip
            asyncio.get_running_loop().call_later(cut_after, self.cut_all, reason)
        await super().shutdown(sockets)

    def cut_all(self, reason: ServerShuttingDown) -> None:
        for engine in self.engines.values():
            engine.cut(reason)


class ServerThread:
    """A real uvicorn server on ``host`` and a free port, in a daemon thread of this process.

    with ServerThread(build_app(engines)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                 header_timeout: float = 10.0):  # fmt: skip
        self.app = app
        config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                                http=with_header_timeout(header_timeout))  # fmt: skip
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="minillm-uvicorn", daemon=True)
        self.host, self.port = host, port

    def start(self, timeout: float = 60.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _terminate_with_parent() -> None:
    """In the child, before it runs: on Linux, ask the kernel for SIGTERM when the parent dies,
    so a server never outlives a killed notebook kernel or router."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: the parent's stop() is the only way


class ServerProcess:
    """``minillm serve`` in a child process: a separate interpreter, as in deployment (chapter 10
    and ``benchmarks/bench_server.py``). ``args`` are extra CLI arguments (``--dtype fp32``...).

        with ServerProcess(["tiny-shakespeare-8m"], ["--dtype", "fp32"]) as server:
            httpx.get(server.url + "/health")
    """

    def __init__(self, models: list[str], args: list[str] = (), port: int | None = None, log_level: str = "warning"):
        if port is None:
            with socket.socket() as s:  # a free port now; the child binds it a moment later
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
        self.port = port
        self.cmd = [sys.executable, "-m", "minillm", "serve", "--port", str(port), "--log-level", log_level]
        for m in models:
            self.cmd += ["--model", m]
        self.cmd += list(args)
        self.proc = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 300.0) -> ServerProcess:
        import httpx  # deferred: httpx: a client for the readiness probe, not a dependency of the package

        self.proc = subprocess.Popen(
            self.cmd, env=environment.for_children(PYTHONUNBUFFERED="1"), preexec_fn=_terminate_with_parent
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with code {self.proc.returncode}: {' '.join(self.cmd)}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"the server did not become healthy within {timeout:.0f} s")

    def stop(self, timeout: float = 30.0) -> int | None:
        """Ask it to shut down (SIGTERM: uvicorn finishes open responses), then insist."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.terminate()
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
