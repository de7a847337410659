"""Data parallelism for serving: ``minillm serve --data-parallel-size N``.

N **replicas** — whole engines, each ``minillm serve`` in its own process with its own KV pool
and prefix cache — sit behind one **router** process that speaks the same OpenAI API. For each
request the router reads the prompt, asks ``Router`` (round robin, least loaded or prefix
aware) which replica should take it, forwards the request there and streams the answer back
unchanged, with the choice in an ``x-minillm-replica`` header. ``GET /router`` lists the
recent decisions and each replica's outstanding requests; a request counts as outstanding
from routing until its last byte has been sent back.

The router tokenizes only to choose: validation and the real work stay in the replicas, so a
bad request gets the replica's own 4xx. A replica that cannot be reached answers 503 naming
it; the others keep serving.
"""

from __future__ import annotations

import asyncio
import json
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from minillm.cluster.router import Router
from minillm.inputs import routing_ids
from minillm.server.body_limit import BodyLimit
from minillm.server.protocol import error_body

FORWARDED_HEADERS = ("content-type", "retry-after")


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
    max_body_bytes: int = 2 << 20,
):  # fmt: skip
    """A FastAPI app forwarding the OpenAI routes to ``replica_urls`` by ``policy``;
    ``on_shutdown()`` runs when the app stops (the replicas are stopped there: uvicorn ends
    the process by re-raising SIGTERM, so a ``finally`` after ``uvicorn.run`` never runs)."""
    router = Router(len(replica_urls), policy, block_size, max_decisions=1000)
    clients: dict[str, httpx.AsyncClient] = {}

    @asynccontextmanager
    async def lifespan(app):
        clients["http"] = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0))
        yield
        await clients["http"].aclose()
        if on_shutdown is not None:
            on_shutdown()

    app = FastAPI(title="minillm router", lifespan=lifespan)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)  # as the replicas do, before anything is read
    app.state.router = router

    async def forward(request: Request, path: str):
        body = await request.body()  # at most max_body_bytes (BodyLimit answers 413 above)
        ids = await asyncio.to_thread(prompt_ids_for_routing, body, tokenizers)  # off the event loop
        replica = router.route(router.num_routed, ids)
        http = clients["http"]
        upstream = http.build_request(
            request.method, replica_urls[replica] + path, content=body,
            headers={"content-type": request.headers.get("content-type", "application/json")},
        )  # fmt: skip
        try:
            response = await http.send(upstream, stream=True)
        except httpx.TransportError as err:
            router.finished(replica)
            message = f"replica {replica} ({replica_urls[replica]}) is unreachable: {type(err).__name__}"
            return JSONResponse(error_body(message, "server_error"), status_code=503)
        headers = {k: v for k, v in response.headers.items() if k.lower() in FORWARDED_HEADERS}
        headers["x-minillm-replica"] = str(replica)

        async def relay():
            try:
                async for chunk in response.aiter_raw():
                    yield chunk
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
        response = await clients["http"].get(replica_urls[0] + "/v1/models")
        return Response(response.content, response.status_code, media_type="application/json")

    @app.get("/health")
    async def health():
        states = []
        for url in replica_urls:
            try:
                states.append((await clients["http"].get(url + "/health", timeout=5)).status_code == 200)
            except httpx.TransportError:
                states.append(False)
        return JSONResponse({"replicas": states}, status_code=200 if all(states) else 503)

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


def serve_data_parallel(
    models: list[str], replicas: int, replica_args: list[str], policy: str = "prefix_aware",
    host: str = "127.0.0.1", port: int = 8000, log_level: str = "info", block_size: int = 16,
    max_body_bytes: int = 2 << 20,
) -> None:  # fmt: skip
    """Start ``replicas`` servers of ``models`` (each ``minillm serve`` + ``replica_args`` on a
    free loopback port), then the router on ``host:port`` until interrupted; the replicas
    stop with it."""
    import uvicorn

    from minillm.assets import resolve_model
    from minillm.server.launch import ServerProcess, served_name
    from minillm.tokenizer import Tokenizer

    tokenizers = {served_name(m): Tokenizer(resolve_model(m)) for m in models}
    servers = [ServerProcess(models, replica_args, log_level="warning") for _ in range(replicas)]

    def stop_replicas():
        for server in servers:
            server.stop()

    try:
        for server in servers:
            server.start()
        urls = [s.url for s in servers]
        app = build_router_app(urls, tokenizers, policy, block_size, stop_replicas, max_body_bytes)
        uvicorn.run(app, host=host, port=port, log_level=log_level)
    finally:  # a replica that failed to start, or Ctrl-C before the app ran
        stop_replicas()
