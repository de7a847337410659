"""Refuse request bodies over a size limit before they are read into memory.

A pure ASGI middleware: it answers 413 at once when ``Content-Length`` is too large, and
counts the bytes of a chunked body as they arrive, cutting it off past the limit. Without it a
client could make the server buffer any amount of data before the JSON parser even looks at it.
"""

from __future__ import annotations

import json


class BodyTooLarge(Exception):
    pass


class BodyLimit:
    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

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

        async def counted_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
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

    def _message(self) -> str:
        return f"the request body is larger than the server's limit of {self.max_bytes} bytes"

    @staticmethod
    async def _refuse(send, status: int, message: str) -> None:
        kind = "invalid_request_error"
        body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": None}}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
