"""The OpenAI-compatible HTTP API: FastAPI routes over one :class:`AsyncEngine` per model.

    POST /v1/completions        text in, text out (``prompt``: a string, token ids, or a batch)
    POST /v1/chat/completions   messages in, the model's chat template applied
    GET  /v1/models             the models this process serves (``--model`` may be repeated)
    GET  /health                liveness: 200 while every engine can serve, else 503 naming why
    GET  /ready                 readiness: models loaded and serving, with the fast path's state
    GET  /metrics               Prometheus text format

Both POST routes stream with ``"stream": true`` (server-sent events, ending ``data: [DONE]``).
Every error is a JSON body in OpenAI's shape with the HTTP status that fits: 400 for a bad
value (naming the field in ``param``), 404 for an unknown model or route, 413 for a body over
the limit, 429 when too many requests wait (with ``Retry-After``), 503 if an engine has died.
A request's failure never touches the others: validation happens before anything is queued,
a request whose own settings fail inside a step ends alone (400 naming the setting;
``engine/isolation.py``), and a client that leaves aborts only its own request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

import minillm.hooks as hooks
from minillm.errors import RequestFailed
from minillm.server import (
    heap,
    streaming,  # noqa: F401 (registers hooks.stream_events' reference)
)
from minillm.server.async_engine import AsyncEngine, EngineDead, QueueFull
from minillm.server.body_limit import BodyLimit
from minillm.server.front_door import FrontDoor
from minillm.server.metrics import ServerMetrics
from minillm.server.plan import choose_engine, parse, plan, response_of
from minillm.server.protocol import APIError, error_body
from minillm.server.response_cache import ResponseCache
from minillm.server.responses import DONE, Formatter

log = logging.getLogger("minillm.server")
PARSE_THREADS = 2


def build_app(
    engines: dict[str, AsyncEngine],
    response_cache: ResponseCache | None = None,
    max_body_bytes: int = 2 << 20,
    disconnect_poll_s: float = 0.25,
    enable_docs: bool = False,
    allowed_hosts: list[str] | None = None,
    api_key: str | None = None,
    body_timeout_s: float | None = 30.0,
) -> FastAPI:
    """An app serving ``engines`` (model name → engine). Starts and stops their threads.

    ``allowed_hosts`` (None: any), ``api_key``: the front door's checks (``front_door.py``);
    ``enable_docs``: serve the interactive API docs at ``/docs`` (off: they advertise every
    route to anyone who can reach the port); ``body_timeout_s``: how long a request body may
    take to arrive in full (408 after; ``body_limit.py``)."""
    if not engines:
        raise ValueError("serve at least one model")
    metrics = ServerMetrics(engines, response_cache)
    # Before any of the server's threads start: a server that runs for hours keeps its RSS flat
    # only with few malloc arenas and a periodic trim (``heap.py``).
    heap.limit_arenas()
    # Requests are parsed, validated and tokenized here, off the event loop (a few threads: the
    # work is CPU-bound, and the tokenizer releases the GIL). A fixed pool: no thread per request.
    parsing = ThreadPoolExecutor(PARSE_THREADS, thread_name_prefix="minillm-parse")
    docs = {} if enable_docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="minillm", lifespan=_lifespan(engines, parsing), **docs)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes, body_timeout_s=body_timeout_s)
    app.add_middleware(FrontDoor, allowed_hosts=allowed_hosts, api_key=api_key)  # outermost: runs first
    app.state.engines, app.state.metrics, app.state.response_cache = engines, metrics, response_cache
    _add_error_handlers(app, metrics)
    _add_status_routes(app, engines, metrics)
    generation = Generation(engines, metrics, response_cache, parsing, disconnect_poll_s)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generation(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generation(request, "/v1/chat/completions")

    return app


async def _off_loop(pool: ThreadPoolExecutor, fn, *args):
    return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)


def _lifespan(engines: dict[str, AsyncEngine], parsing: ThreadPoolExecutor):
    """The app's start and stop: the engines' threads, the heap trimmer, the parse pool."""

    async def trim_heap_forever():
        while True:
            await asyncio.sleep(heap.TRIM_EVERY_S)
            await _off_loop(parsing, heap.trim)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        for engine in engines.values():
            if not engine._thread.is_alive() and engine.error is None:
                engine.start()
        trimmer = asyncio.create_task(trim_heap_forever())
        yield
        trimmer.cancel()
        for engine in engines.values():
            engine.stop()
            engine.engine.close()  # a parallel engine's worker processes, a compile still running
        parsing.shutdown(wait=False)

    return lifespan


def _add_error_handlers(app: FastAPI, metrics: ServerMetrics) -> None:
    """Every error a JSON body in OpenAI's shape, with the status that fits."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        metrics.requests.labels(_model_of(request), request.url.path, str(exc.status)).inc()
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(exc.detail), kind), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        log.exception("unhandled error on %s", request.url.path)
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}", "server_error"), status_code=500)


def _add_status_routes(app: FastAPI, engines: dict[str, AsyncEngine], metrics: ServerMetrics) -> None:
    """The small GET routes: liveness, readiness, the model list, Prometheus metrics."""

    @app.get("/health")
    async def health():
        """Liveness: 503 as soon as an engine can no longer serve (its thread stopped, a
        parallel worker died), naming why — an orchestrator restarts the server then."""
        dead = {name: reason for name, e in engines.items() if (reason := e.failure()) is not None}
        if dead:
            return JSONResponse({"status": "engine stopped", "engines": dead}, status_code=503)
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():
        """Readiness: 200 once every model is loaded and its engine serving (this app exists
        only after the models loaded), with each decode fast path's state — ``building``
        engines already answer, eagerly; 503 like ``/health`` otherwise."""
        state = {}
        for name, e in engines.items():
            status = e.engine.fast_path_status()
            state[name] = {"serving": e.failure() is None, "failure": e.failure(), "fast_path": status.state,
                           "fast_path_detail": status.detail}  # fmt: skip
        serving = all(s["serving"] for s in state.values())
        return JSONResponse({"status": "ready" if serving else "not ready", "engines": state},
                            status_code=200 if serving else 503)  # fmt: skip

    @app.get("/v1/models")
    async def models():
        now = int(time.time())
        return {
            "object": "list",
            "data": [
                {"id": name, "object": "model", "created": now, "owned_by": "minillm",
                 "max_model_len": e.engine.max_model_len}
                for name, e in engines.items()
            ],
        }  # fmt: skip

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


class Generation:
    """The two generation routes' handler: read and validate the body off the event loop,
    answer from the response cache, admit, queue, then collect or stream the results."""

    def __init__(self, engines, metrics: ServerMetrics, response_cache: ResponseCache | None,
                 parsing: ThreadPoolExecutor, disconnect_poll_s: float):  # fmt: skip
        self.engines, self.metrics, self.response_cache = engines, metrics, response_cache
        self.parsing, self.disconnect_poll_s = parsing, disconnect_poll_s

    async def __call__(self, request: Request, endpoint: str):
        # Decoding, parsing and (below) tokenizing run on a worker thread, not the event loop: a
        # 2 MB body must not stall every other connection, /health included, while it is read.
        try:
            raw = await request.body()
        except ClientDisconnect:  # it left while sending: nobody to answer, nothing went wrong here
            log.info("client %s left while sending its request body to %s", _peer(request), endpoint)
            return Response(status_code=499)
        body, req = await _off_loop(self.parsing, _parse_body, raw, endpoint)
        engine = choose_engine(req, self.engines)
        request.state.model = req.model  # a metrics label only once it names a served model
        prefix = "chatcmpl" if endpoint == "/v1/chat/completions" else "cmpl"
        cache_key = self._cache_key(endpoint, body, req)
        if cache_key is not None and (hit := self.response_cache.get(cache_key)) is not None:
            self.metrics.requests.labels(req.model, endpoint, "200").inc()
            hit["id"], hit["created"] = engine.new_request_id(prefix), int(time.time())
            return JSONResponse(hit)
        count = req.n * (1 if prefix == "chatcmpl" else len(req.prompts()))  # sequences this request will queue
        if count > engine.max_waiting:
            raise APIError(400, f"this request asks for {count} sequences (prompts × n); the server queues at most "
                                f"{engine.max_waiting}", "n" if req.n > 1 else "prompt")  # fmt: skip
        p = await _off_loop(self.parsing, plan, req, engine, engine.engine, engine.new_request_id(prefix))
        self._admit(engine, count)
        streams = [engine.open(seq) for seq in p.seqs]  # queued now: no await since admit()
        self.metrics.prompt_tokens.labels(req.model).inc(p.prompt_tokens)
        if req.stream:
            self.metrics.requests.labels(req.model, endpoint, "200").inc()
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(
                self.stream(engine, p.seqs, streams, p.formatter, include_usage, req.model, p.prompt_tokens),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        response = response_of(p, await self.collect(request, engine, p.seqs, streams, req.model))
        if cache_key is not None:
            self.response_cache.put(cache_key, response)
        self.metrics.requests.labels(req.model, endpoint, "200").inc()
        return JSONResponse(response)

    def _cache_key(self, endpoint: str, body: dict, req) -> str | None:
        """The response cache's key for this request, None when it cannot be cached. Built from
        the validated request: fields the schema ignores neither grow nor miss the cache."""
        if self.response_cache is None:
            return None
        return self.response_cache.key(endpoint, {k: v for k, v in body.items() if k in type(req).model_fields})

    def _admit(self, engine: AsyncEngine, count: int) -> None:
        """Reserve ``count`` places in the engine's queue, or answer 429 (full) / 503 (dead)."""
        try:
            engine.admit(count)
        except QueueFull as exc:
            self.metrics.rejected.labels("queue_full").inc()
            raise APIError(429, f"server busy: {exc}; retry later", None, "rate_limit_error", "queue_full",
                           {"Retry-After": str(exc.retry_after)}) from None  # fmt: skip
        except EngineDead as exc:
            raise APIError(503, str(exc), None, "server_error") from None

    async def collect(self, request: Request, engine: AsyncEngine, seqs, streams, model: str):
        """Run every sequence to the end; abort them all if the client hangs up first."""
        metrics = self.metrics

        async def last(deltas):
            done = []
            async for delta in deltas:
                if delta.output is not None:  # a sample finished
                    metrics.observe_finished(model, delta.output)
                    done.append(delta.output)
                if delta.request_finished:
                    return sorted(done, key=lambda o: o.index)
            raise EngineDead("stream ended without a result")

        tasks = [asyncio.ensure_future(last(d)) for d in streams]
        try:
            while True:
                done, _ = await asyncio.wait(tasks, timeout=self.disconnect_poll_s)
                if len(done) == len(tasks):
                    break
                if await request.is_disconnected():
                    metrics.aborted.labels(model).inc(sum(not t.done() for t in tasks))
                    raise APIError(499, "client disconnected", None)
            return [sample for t in tasks for sample in t.result()]
        except EngineDead as exc:
            raise APIError(503, str(exc), None, "server_error") from None
        except RequestFailed as exc:  # its own settings failed in a step; the others went on
            raise APIError(400, str(exc), exc.param) from None
        finally:
            for t, seq in zip(tasks, seqs):
                if not t.done():
                    t.cancel()
                    engine.abort(seq.request_id)

    def stream(
        self, engine: AsyncEngine, seqs, streams, fmt: Formatter, include_usage: bool, model: str, prompt_tokens: int
    ) -> AsyncIterator[bytes]:
        """The request's event stream: ``hooks.stream_events`` (``server/streaming.py``, chapter
        10's exercise) over its deltas, with the metrics of finished samples and aborts kept here."""
        metrics = self.metrics

        async def observed(deltas):
            async for delta in deltas:
                if delta.output is not None:  # a sample finished
                    metrics.observe_finished(model, delta.output)
                yield delta

        def abort(p: int) -> None:  # the client left (or an error ended the stream) before prompt p finished
            metrics.aborted.labels(model).inc()
            engine.abort(seqs[p].request_id)

        n = len(seqs) and seqs[0].params.n
        events = hooks.stream_events([observed(d) for d in streams], fmt, n, include_usage, prompt_tokens, abort)
        return _done_after_a_cut(events, engine)


async def _done_after_a_cut(events: AsyncIterator[bytes], engine: AsyncEngine) -> AsyncIterator[bytes]:
    """``events``, then ``[DONE]`` where the server's drain deadline cut the stream.

    ``stream_events`` ends a stream whose request failed with the error event alone. One the
    server ended on purpose (``AsyncEngine.cut``: the error event names the shutdown) is
    closed properly too, so a client reading to ``[DONE]``, as OpenAI's do, stops cleanly
    rather than on a broken connection."""
    last = None
    try:
        async for last in events:
            yield last
        if last != DONE and engine.shutting_down is not None:
            yield DONE
    finally:
        aclose = getattr(events, "aclose", None)  # a learner's hook may return any async iterator
        if aclose is not None:
            await aclose()  # a client that left: stream_events aborts its prompts now, not at collection


def _peer(request: Request) -> str:
    return f"{request.client.host}:{request.client.port}" if request.client else "?"


def _model_of(request: Request) -> str:
    return getattr(request.state, "model", "") or ""


def _parse_body(raw: bytes, endpoint: str) -> tuple[dict, object]:
    """The body as JSON and as the endpoint's validated request (on a worker thread)."""
    body = _json_body(raw)
    return body, parse(endpoint, body)


def _json_body(raw: bytes) -> dict:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise APIError(400, f"the request body is not valid UTF-8 (byte {exc.start})", None) from None
    try:
        body = json.loads(text)
    except json.JSONDecodeError as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}",
                       None) from None  # fmt: skip
    except (ValueError, RecursionError) as exc:  # a 5000-digit number, brackets nested 50,000 deep
        raise APIError(400, f"the request body cannot be parsed: {type(exc).__name__}", None) from None
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}", None)
    where = _lone_surrogate(body)
    if where is not None:
        raise APIError(400, f"{where} holds a lone UTF-16 surrogate (an escape such as \\ud800 without its pair), "
                            "which is not text", where.split("[", 1)[0].split(".", 1)[0])  # fmt: skip
    return body


def _lone_surrogate(value, path: str = "") -> str | None:
    """Where in a parsed body a string holds a lone surrogate (JSON allows the escape; no
    tokenizer can encode it), as ``messages[0].content``; None if nowhere."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        where = _lone_surrogate(item, f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}" if path else key)
        if where is not None:
            return where
    return None
