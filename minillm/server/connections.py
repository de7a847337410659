"""A deadline for every request's headers: idle and slow-header connections are closed.

uvicorn closes a keep-alive connection that idles *after* a response (``timeout_keep_alive``),
and ``body_limit.py`` bounds the body. Nothing bounds the time before a request's headers are
complete: a client that connects and sends nothing, or sends its headers a byte at a time
("slowloris"), holds a connection for ever, and enough of them exhaust ``--max-connections``.
This is uvicorn's own h11 protocol plus one timer: from the moment a connection opens, or a
new request starts arriving on a kept-alive one, its headers must be complete within
``header_timeout`` seconds, or the connection is closed (a client that sent nothing gets no
answer; one that sent part of a request gets the connection closed, as nginx's
``client_header_timeout`` does).
"""

from __future__ import annotations

import logging

from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("minillm.server")


class HeaderDeadlineProtocol(H11Protocol):
    """``H11Protocol`` with a header deadline (``header_timeout`` seconds; see ``with_header_timeout``)."""

    header_timeout = 10.0

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._header_timer = None
        self._arm()

    def data_received(self, data: bytes) -> None:
        before = self.cycle
        super().data_received(data)
        if self.cycle is not before:  # a request's headers are complete: the body has its own limit
            self._disarm()
        elif self.cycle is None or self.cycle.response_complete:  # between requests: bytes of the next one's headers
            self._arm()

    def connection_lost(self, exc) -> None:
        self._disarm()
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
