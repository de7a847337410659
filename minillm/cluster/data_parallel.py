"""Data parallelism for serving: ``minillm serve --data-parallel-size N``.

N **replicas** — whole engines, each ``minillm serve`` in its own process with its own KV pool
and prefix cache — sit behind one **router** process that speaks the same OpenAI API. For each
request the router reads the prompt, asks ``Router`` (round robin, least loaded or prefix
aware) which replica should take it, forwards the request there and streams the answer back
unchanged, with the choice in an ``x-minillm-replica`` header. ``GET /router`` lists the
recent decisions and each replica's outstanding requests; a request counts as outstanding
from routing until its last byte has been sent back.

The router tokenizes only to choose: validation and the real work stay in the replicas, so a
bad request gets the replica's own 4xx.

**Failover.** The router checks every replica's ``/health`` each ``health_interval_s`` and
routes only to live ones (``Router.mark_down``). A request whose replica cannot be reached —
the connection refused, so the request never started there — is marked down at once and the
request retried on another live replica. A stream cut because its replica died ends with an
error event (the client learns it, instead of a silent end). ``/v1/models`` asks the live
replicas; ``/health`` is 200 while any replica serves (listing each), 503 when none does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
from contextlib import asynccontextmanager

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from minillm.assets import resolve_model
from minillm.cluster.router import NoLiveReplica, Router
from minillm.inputs import routing_ids
from minillm.server.body_limit import BodyLimit
from minillm.server.connections import with_header_timeout
from minillm.server.front_door import FrontDoor, default_allowed_hosts
from minillm.server.launch import ServerProcess, served_name
from minillm.server.protocol import error_body
from minillm.tokenizer import Tokenizer

FORWARDED_HEADERS = ("content-type", "retry-after")
log = logging.getLogger("minillm.router")


def prompt_ids_for_routing(body: bytes, tokenizers: dict) -> list[int]:
    """The token ids of a request's (first) prompt, for the routing decision only — [] when the
    body cannot be read (the replica will say what is wrong with it)."""
    try:
        request = json.loads(body)
        tokenizer = tokenizers.get(request.get("model")) or next(iter(tokenizers.values()))
        if "messages" in request:
            return routing_ids(tokenizer, request["messages"])
        prompt = request["prompt"]
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            prompt = prompt[0]  # a batch: route by its first prompt
        return routing_ids(tokenizer, prompt)
    except Exception:  # noqa: BLE001 (any unreadable body: route it anyway)
        return []


def build_router_app(
    replica_urls: list[str], tokenizers: dict, policy: str = "prefix_aware", block_size: int = 16, on_shutdown=None,
    max_body_bytes: int = 2 << 20, allowed_hosts: list[str] | None = None, api_key: str | None = None,
    health_interval_s: float = 1.0,
):  # fmt: skip
    """A FastAPI app forwarding the OpenAI routes to ``replica_urls`` by ``policy``;
    ``on_shutdown()`` runs when the app stops (the replicas are stopped there: uvicorn ends
    the process by re-raising SIGTERM, so a ``finally`` after ``uvicorn.run`` never runs)."""
    router = Router(len(replica_urls), policy, block_size, max_decisions=1000)
    clients: dict[str, httpx.AsyncClient] = {}

    async def replica_serves(replica: int) -> bool:
        try:
            return (await clients["http"].get(replica_urls[replica] + "/health", timeout=2)).status_code == 200
        except httpx.HTTPError:
            return False

    async def watch_replicas():
        while True:
            states = await asyncio.gather(*(replica_serves(r) for r in range(len(replica_urls))))
            for replica, serves in enumerate(states):
                if serves and replica in router.down:
                    log.warning("replica %d (%s) serves again", replica, replica_urls[replica])
                    router.mark_up(replica)
                elif not serves and replica not in router.down:
                    log.warning("replica %d (%s) failed its health check: routing around it", replica,
                                replica_urls[replica])  # fmt: skip
                    router.mark_down(replica)
            await asyncio.sleep(health_interval_s)

    @asynccontextmanager
    async def lifespan(app):
        clients["http"] = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0))
        watcher = asyncio.ensure_future(watch_replicas())
        yield
        watcher.cancel()
        await clients["http"].aclose()
        if on_shutdown is not None:
            on_shutdown()

    app = FastAPI(title="minillm router", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)  # as the replicas do, before anything is read
    app.add_middleware(FrontDoor, allowed_hosts=allowed_hosts, api_key=api_key)  # the public face checks callers
    app.state.router = router

    async def forward(request: Request, path: str):
        body = await request.body()  # at most max_body_bytes (BodyLimit answers 413 above)
        ids = await asyncio.to_thread(prompt_ids_for_routing, body, tokenizers)  # off the event loop
        http = clients["http"]
        while True:  # until a replica takes the request, or none is left
            try:
                replica = router.route(router.num_routed, ids)
            except NoLiveReplica as err:
                return JSONResponse(error_body(f"no replica can serve: {err}", "server_error"), status_code=503)
            upstream = http.build_request(
                request.method, replica_urls[replica] + path, content=body,
                headers={"content-type": request.headers.get("content-type", "application/json")},
            )  # fmt: skip
            try:
                response = await http.send(upstream, stream=True)
                break
            except (httpx.ConnectError, httpx.ConnectTimeout) as err:  # never reached it: safe to retry elsewhere
                router.finished(replica)
                log.warning("replica %d (%s) refused a connection (%s): routing around it", replica,
                            replica_urls[replica], type(err).__name__)  # fmt: skip
                router.mark_down(replica)
            except httpx.TransportError as err:  # it may have started the request: not retried
                router.finished(replica)
                router.mark_down(replica)
                message = f"replica {replica} ({replica_urls[replica]}) failed: {type(err).__name__}"
                return JSONResponse(error_body(message, "server_error"), status_code=503)
        headers = {k: v for k, v in response.headers.items() if k.lower() in FORWARDED_HEADERS}
        headers["x-minillm-replica"] = str(replica)
        streaming = response.headers.get("content-type", "").startswith("text/event-stream")

        async def relay():
            try:
                async for chunk in response.aiter_raw():
                    yield chunk
            except httpx.TransportError as err:  # the replica died mid-answer
                router.mark_down(replica)
                log.warning("replica %d (%s) cut a response (%s)", replica, replica_urls[replica], type(err).__name__)
                if streaming:  # end the stream with an error event, not silently
                    message = f"replica {replica} failed mid-stream ({type(err).__name__}); the answer is incomplete"
                    yield f"\n\ndata: {json.dumps(error_body(message, 'server_error'))}\n\n".encode()
            finally:  # the last byte sent, or the client left (which closes the upstream too)
                await response.aclose()
                router.finished(replica)

        return StreamingResponse(relay(), status_code=response.status_code, headers=headers)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await forward(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await forward(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models():
        for replica in router.live:  # every replica serves the same models: the first live one answers
            try:
                response = await clients["http"].get(replica_urls[replica] + "/v1/models", timeout=5)
            except httpx.HTTPError:
                router.mark_down(replica)
                continue
            return Response(response.content, response.status_code, media_type="application/json")
        return JSONResponse(error_body("no replica can serve", "server_error"), status_code=503)

    @app.get("/health")
    async def health():
        """200 while any replica serves (each listed), 503 when none does."""
        states = list(await asyncio.gather(*(replica_serves(r) for r in range(len(replica_urls)))))
        return JSONResponse({"replicas": states, "live": sum(states)}, status_code=200 if any(states) else 503)

    @app.get("/router")
    async def decisions():
        return {
            "policy": router.policy,
            "replicas": replica_urls,
            "outstanding": router.load,
            "decisions": [
                {"request": d.request_id, "replica": d.replica, "matched_blocks": d.matched_blocks, "load": d.load}
                for d in router.decisions
            ],
        }

    return app


class RouterServer(uvicorn.Server):
    """The router's uvicorn server: on SIGTERM it passes the signal to every replica at once, so
    each drains for its own ``--shutdown-timeout`` and ends what is left with an error event
    naming the shutdown and ``[DONE]`` (or a 503) — which reach the clients through the router,
    whose own drain waits ``REPLICA_MARGIN_S`` longer than theirs."""

    REPLICA_MARGIN_S = 2.0

    def __init__(self, config: uvicorn.Config, replicas: list[ServerProcess]):
        super().__init__(config)
        self.replicas = replicas

    async def shutdown(self, sockets=None) -> None:
        for replica in self.replicas:
            if replica.proc is not None and replica.proc.poll() is None:
                replica.proc.send_signal(signal.SIGTERM)
        await super().shutdown(sockets)


def serve_data_parallel(
    models: list[str], replicas: int, replica_args: list[str], policy: str = "prefix_aware",
    host: str = "127.0.0.1", port: int = 8000, log_level: str = "info", block_size: int = 16,
    max_body_bytes: int = 2 << 20, allowed_hosts: list[str] | None = None, api_key: str | None = None,
    shutdown_timeout: float = 10.0,
) -> None:  # fmt: skip
    """Start ``replicas`` servers of ``models`` (each ``minillm serve`` + ``replica_args`` on a
    free loopback port), then the router on ``host:port`` until interrupted; the replicas
    stop with it. ``shutdown_timeout``: the replicas' drain (``replica_args`` carries the same
    flag to them), the router's a little longer (``RouterServer``)."""
    tokenizers = {served_name(m): Tokenizer(resolve_model(m)) for m in models}
    servers = [ServerProcess(models, replica_args, log_level="warning") for _ in range(replicas)]

    def stop_replicas():
        for server in servers:
            server.stop()

    try:
        for server in servers:
            server.start()
        urls = [s.url for s in servers]
        app = build_router_app(urls, tokenizers, policy, block_size, stop_replicas, max_body_bytes,
                               allowed_hosts or default_allowed_hosts(host), api_key)  # fmt: skip
        config = uvicorn.Config(app, host=host, port=port, log_level=log_level, http=with_header_timeout(10.0),
                                timeout_graceful_shutdown=shutdown_timeout + RouterServer.REPLICA_MARGIN_S)  # fmt: skip
        with contextlib.suppress(KeyboardInterrupt):  # as uvicorn.run: Ctrl-C is a way to stop, not an error
            RouterServer(config, servers).run()
    finally:  # a replica that failed to start, or Ctrl-C before the app ran
        stop_replicas()
