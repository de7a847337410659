"""Refuse request bodies over a size limit, or too slow to arrive, before they are read.

A pure ASGI middleware: it answers 413 at once when ``Content-Length`` is too large, and
counts the bytes of a chunked body as they arrive, cutting it off past the limit. Without it a
client could make the server buffer any amount of data before the JSON parser even looks at it.
And a body must arrive in full within ``body_timeout_s`` of the request's start: a client that
trickles a body, or stops half-way, gets a 408 and its connection closed, instead of holding a
connection (and a handler) forever — the "slow POST" attack (a limit per piece would not stop
a client sending a byte a second).
"""

from __future__ import annotations

import asyncio
import json


class BodyTooLarge(Exception):
    pass


class BodyTooSlow(Exception):
    pass


class BodyLimit:
    def __init__(self, app, max_bytes: int, body_timeout_s: float | None = 30.0):
        self.app, self.max_bytes, self.body_timeout_s = app, max_bytes, body_timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    too_big = int(value) > self.max_bytes
                except ValueError:
                    return await self._refuse(send, 400, "the Content-Length header is not a number")
                if too_big:
                    return await self._refuse(send, 413, self._message())
        seen = 0
        started = False
        complete = scope.get("method") in ("GET", "HEAD")
        loop = asyncio.get_running_loop()
        deadline = None if self.body_timeout_s is None else loop.time() + self.body_timeout_s

        async def counted_receive():
            nonlocal seen, complete
            if complete or deadline is None:  # after the body: a wait for the disconnect, unbounded
                message = await receive()
            else:
                try:
                    message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
                except asyncio.TimeoutError:
                    raise BodyTooSlow from None
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                complete = not message.get("more_body", False)
                if seen > self.max_bytes:
                    raise BodyTooLarge
            return message

        async def tracking_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, tracking_send)
        except BodyTooLarge:
            if not started:
                await self._refuse(send, 413, self._message())
        except BodyTooSlow:
            if not started:
                await self._refuse(send, 408, f"the request body did not arrive within {self.body_timeout_s:g} s")

    def _message(self) -> str:
        return f"the request body is larger than the server's limit of {self.max_bytes} bytes"

    @staticmethod
    async def _refuse(send, status: int, message: str) -> None:
        kind = "invalid_request_error"
        body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": None}}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]  # fmt: skip
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
