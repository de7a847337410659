"""How the server's connections open and close: a deadline for every request's headers, and a
gentle ("lingering") close.

**The header deadline.**
uvicorn closes a keep-alive connection that idles *after* a response (``timeout_keep_alive``),
and ``body_limit.py`` bounds the body. Nothing bounds the time before a request's headers are
complete: a client that connects and sends nothing, or sends its headers a byte at a time
("slowloris"), holds a connection for ever, and enough of them exhaust ``--max-connections``.
This is uvicorn's own h11 protocol plus one timer: from the moment a connection opens, or a
new request starts arriving on a kept-alive one, its headers must be complete within
``header_timeout`` seconds, or the connection is closed (a client that sent nothing gets no
answer; one that sent part of a request gets the connection closed, as nginx's
``client_header_timeout`` does).

**The lingering close.** The server may answer before it has read a request's body — a 413
for a body over the limit is sent at its headers. If it then closed its socket with the rest of
the body still arriving, the kernel would answer those bytes with a reset, and a reset destroys
the 413 in the client's receive buffer before the client reads it: a soak on loopback lost 258
of 362 such answers (``benchmarks/bench_soak.py``). So, as Apache's ``lingering_close`` and
nginx's ``lingering_close`` do, a close the server starts ends its own side first (FIN, after
the answer), then reads and drops whatever the client still sends — at most
``LINGER_BYTES``, for at most ``LINGER_S`` seconds — and closes when the client does. A client
that keeps sending past those bounds gets the reset it asked for.

A keep-alive connection closed while **idle** — the server's answer complete and the client
between requests, when the server shuts down or the connection's keep-alive time runs out —
closes at once, as nginx closes its idle keep-alive connections: no body is on its way to draw
a reset, and a client's connection pool (httpx, the openai client) never closes an idle
connection itself, so lingering would hold every shutdown for ``LINGER_S`` seconds. A refusal
sent at a request's headers (401, 415) while the body still arrives keeps its linger.
"""

from __future__ import annotations

import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("minillm.server")

LINGER_S = 5.0  # nginx's lingering_timeout
LINGER_BYTES = 64 << 20


class LingeringTransport:
    """A transport whose ``close`` lingers (module docstring); everything else is the transport's."""

    def __init__(self, transport, loop):
        self._transport, self._loop = transport, loop
        self.lingering, self.dropped, self._timer = False, 0, None
        self.idle = False  # set by the protocol for a close between requests: nothing to linger for

    def __getattr__(self, name):
        return getattr(self._transport, name)

    def is_closing(self) -> bool:
        return self.lingering or self._transport.is_closing()

    def close(self) -> None:
        if self.is_closing():
            return
        if self.idle or not self._transport.can_write_eof():
            return self._transport.close()
        self.lingering = True
        try:
            self._transport.write_eof()  # sends what is buffered (the answer), then FIN
        except OSError:  # the client is already gone: nothing to linger for
            return self.abort()
        self._transport.resume_reading()  # uvicorn may have paused reading while the body waited
        self._timer = self._loop.call_later(LINGER_S, self._transport.close)

    def drop(self, data: bytes) -> None:
        """Bytes that arrived after the close began: dropped, up to ``LINGER_BYTES``."""
        self.dropped += len(data)
        if self.dropped > LINGER_BYTES:
            self.abort()

    def abort(self) -> None:
        self.lingering = True
        self._cancel()
        self._transport.abort()

    def _cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


class HeaderDeadlineProtocol(H11Protocol):
    """``H11Protocol`` with a header deadline (``header_timeout`` seconds; see ``with_header_timeout``)."""

    header_timeout = 10.0

    def connection_made(self, transport) -> None:
        self._header_timer = None
        super().connection_made(LingeringTransport(transport, self.loop))
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self.transport.lingering:  # the server has answered and is closing: drop the rest
            return self.transport.drop(data)
        before = self.cycle
        super().data_received(data)
        if self.cycle is not before:  # a request's headers are complete: the body has its own limit
            self._disarm()
        elif self.cycle is None or self.cycle.response_complete:  # between requests: bytes of the next one's headers
            self._arm()

    def eof_received(self) -> bool | None:
        """The client finished sending. While lingering that is the moment to close; otherwise
        uvicorn's (half-open connections stay open for the answer)."""
        if self.transport.lingering:
            return False  # asyncio closes the transport
        return super().eof_received()

    def shutdown(self) -> None:
        """The server is stopping: uvicorn's, except that an idle connection closes at once (a
        request still running is answered, then lingers as any close after an answer does)."""
        self._mark_idle()
        super().shutdown()

    def timeout_keep_alive_handler(self) -> None:
        """A kept-alive connection idled past ``timeout_keep_alive``: it closes at once."""
        self._mark_idle()
        super().timeout_keep_alive_handler()

    def _mark_idle(self) -> None:
        """Idle: our answer is complete *and* the client is between requests. A refusal sent at
        a request's headers (a 401 or 415 from the front door) completes our side while the
        client may still be sending the body: that close keeps its linger."""
        answered = self.cycle is None or self.cycle.response_complete
        if answered and self.conn.their_state is h11.IDLE:
            self.transport.idle = True

    def connection_lost(self, exc) -> None:
        self._disarm()
        self.transport._cancel()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout, self._headers_too_slow)

    def _disarm(self) -> None:
        if getattr(self, "_header_timer", None) is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if self.cycle is None or self.cycle.response_complete:
            log.info("closed a connection from %s: no complete request headers within %g s",
                     (self.client or ("?",))[0], self.header_timeout)  # fmt: skip
            self.transport.close()


def with_header_timeout(seconds: float) -> type[HeaderDeadlineProtocol]:
    """The protocol class to give uvicorn (``http=``) for a header deadline of ``seconds``."""
    if not seconds > 0:
        raise ValueError(f"header timeout {seconds} must be positive")
    return type("HeaderDeadlineProtocol", (HeaderDeadlineProtocol,), {"header_timeout": float(seconds)})
