"""Who may talk to the server, checked before any route runs: Host, Content-Type, API key.

A server on loopback is still reachable from every web page its user opens: a page can
``POST`` a ``text/plain`` body to ``http://127.0.0.1:8000`` without a CORS preflight (a
cross-site request forgery), or rebind its own domain name to 127.0.0.1 (DNS rebinding) and
then read the answers. Two checks close both doors, as vLLM's and Jupyter's servers do:

- **Host**: the ``Host`` header must name this server — by default, when it listens on
  loopback, ``localhost``, ``127.0.0.1`` or ``[::1]`` (any port); when it listens on all
  interfaces, any host unless ``allowed_hosts`` lists them. A rebound domain name fails;
- **Content-Type**: a POST body must be ``application/json`` — a type a page can only send
  after the browser's preflight, which this server never grants.

An optional **API key** (``--api-key``, as ``vllm serve --api-key``) guards ``/v1/*`` with
``Authorization: Bearer KEY``, compared in constant time; ``/health`` and ``/metrics`` stay open
for probes and scrapers. A refusal is OpenAI's JSON error shape, like every other error here.
"""

from __future__ import annotations

import hmac
import json

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]", "::1")


def default_allowed_hosts(host: str) -> list[str] | None:
    """The Host names a server listening on ``host`` accepts by default (None: any)."""
    if host in ("127.0.0.1", "localhost", "::1"):
        return list(LOOPBACK_NAMES)
    if host in ("0.0.0.0", "::", ""):
        return None  # listening everywhere: the operator names hosts with --allowed-hosts
    return [host, *LOOPBACK_NAMES]


def _host_name(value: str) -> str:
    """``Host`` without its port: ``example.com:8000`` → ``example.com``; ``[::1]:80`` → ``[::1]``."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[: value.find("]") + 1] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


class FrontDoor:
    """A pure ASGI middleware applying the module's three checks."""

    def __init__(self, app, allowed_hosts: list[str] | None = None, api_key: str | None = None):
        self.app = app
        self.allowed = None if allowed_hosts is None else {h.lower() for h in allowed_hosts}
        self.api_key = api_key.encode() if api_key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {name.decode("latin-1"): value.decode("latin-1") for name, value in scope.get("headers", [])}
        if self.allowed is not None and "*" not in self.allowed:
            host = _host_name(headers.get("host", ""))
            if host not in self.allowed:
                return await _refuse(send, 421, f"Host {headers.get('host', '')!r} is not served here "
                                                "(allowed: " + ", ".join(sorted(self.allowed)) + "; see --allowed-hosts)",
                                     "host")  # fmt: skip
        path = scope.get("path", "")
        if self.api_key is not None and path.startswith("/v1/"):
            given = headers.get("authorization", "")
            token = given[7:].strip().encode() if given.lower().startswith("bearer ") else b""
            if not hmac.compare_digest(token, self.api_key):
                return await _refuse(send, 401, "missing or wrong API key: send Authorization: Bearer KEY",
                                     None, "authentication_error", {"www-authenticate": "Bearer"})  # fmt: skip
        if scope.get("method") == "POST":
            kind = headers.get("content-type", "").split(";", 1)[0].strip().lower()
            if kind != "application/json":
                return await _refuse(send, 415, f"the request body must be JSON, sent with Content-Type: application/json "
                                                f"(got {kind or 'none'!r})", "content-type")  # fmt: skip
        return await self.app(scope, receive, send)


async def _refuse(send, status: int, message: str, param, kind: str = "invalid_request_error", extra=None) -> None:
    body = json.dumps({"error": {"message": message, "type": kind, "param": param, "code": None}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.encode(), v.encode()) for k, v in (extra or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
