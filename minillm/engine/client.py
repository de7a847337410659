"""The engine client: submit requests, abort them, and get each request's deltas — and only its own.

One ``LLMEngine.step()`` produces deltas for every running request at once, while each caller
waits for its own request. Whoever drives the loop — ``LLM`` (the caller that waits runs the
next step), the server's engine thread (``server/async_engine.py``), a disaggregated worker
(``cluster/disagg.py``) — needs the same bookkeeping: a **sink** per request, the step's
deltas routed to their sinks, a finished request's sink dropped, an aborted request freed,
and on a failed step the request at fault told — or, if the engine itself failed, every
waiting caller. ``EngineClient`` is that bookkeeping, once.

A sink is anything with ``put(item)``: ``item`` is a ``StreamDelta``, or the exception that
ended the request. ``step()`` returns the routed ``(sink, delta)`` pairs instead of calling
``put`` itself, so a caller that delivers across threads can batch one step's deltas per
receiver (the server wakes each event loop once per step, not once per request).

Not thread-safe by itself: callers hold the engine's lock (``LLM``) or keep every call on one
thread (the server's engine thread).
"""

from __future__ import annotations

import logging
from collections.abc import Hashable
from typing import Protocol

from minillm.engine import isolation
from minillm.outputs import StreamDelta
from minillm.sequence import Sequence

log = logging.getLogger("minillm.engine")


class Sink(Protocol):
    """Where one request's deltas go."""

    def put(self, item: StreamDelta | BaseException) -> None: ...


class EngineClient:
    """Requests in, each request's deltas out, for one engine."""

    def __init__(self, engine):
        self.engine = engine
        self._sinks: dict[Hashable, Sink] = {}

    def submit(self, seq: Sequence, sink: Sink) -> None:
        """Queue ``seq`` (made by ``engine.make_sequence``: already validated) and send its
        deltas to ``sink``. An id the engine already runs raises ``ValueError``; nothing changes."""
        self.engine.enqueue(seq)
        self._sinks[seq.request_id] = sink

    def add(self, prompt, params, sink: Sink, **options) -> Sequence:
        """Validate ``prompt`` with ``params`` (``make_sequence``'s options: ``request_id``,
        ``arrival_time``, ``priority``), then ``submit`` it."""
        seq = self.engine.make_sequence(prompt, params, **options)
        self.submit(seq, sink)
        return seq

    def owns(self, request_id: Hashable) -> bool:
        """Whether ``request_id`` was submitted here and has not finished or been aborted."""
        return request_id in self._sinks

    def foreign_requests(self) -> list[Hashable]:
        """Unfinished requests of the engine that were not submitted through this client."""
        return [rid for rid in self.engine.requests if rid not in self._sinks]

    @property
    def num_open(self) -> int:
        return len(self._sinks)

    def abort(self, request_id: Hashable) -> None:
        """Stop sending ``request_id``'s deltas and free its blocks (no-op once it has finished)."""
        self._sinks.pop(request_id, None)
        if request_id in self.engine.requests:
            self.engine.abort(request_id)

    def forget(self, request_id: Hashable) -> None:
        """Stop routing ``request_id``'s deltas without touching the engine (the request already
        ended there — aborted by someone else — and its id may since belong to another request)."""
        self._sinks.pop(request_id, None)

    def step(self) -> list[tuple[Sink, StreamDelta]]:
        """Run one engine step; its deltas paired with their requests' sinks, in step order. A
        request's sink is dropped after its last delta (``request_finished``); deltas of requests
        submitted elsewhere are left out. A step that raises because of some requests' own
        settings ends only those (their sinks get a ``RequestFailed``; ``engine/isolation.py``)
        and returns no deltas: the others run again next step. Any other failure is raised."""
        try:
            deltas = self.engine.step()
        except Exception:
            found = isolation.culprits(self.engine)
            if not found:
                raise  # the engine's own failure: the caller fails every request (``fail``)
            for request_id, error in found.items():  # only they end; the others run the step again
                log.warning("request %r failed in a step and was isolated: %s", request_id, error)
                sink = self._sinks.pop(request_id, None)
                if request_id in self.engine.requests:
                    self.engine.abort(request_id)
                if sink is not None:
                    sink.put(error)
            return []
        routed = []
        for delta in deltas:
            sink = self._sinks.get(delta.request_id)
            if sink is None:
                continue
            routed.append((sink, delta))
            if delta.request_finished:
                del self._sinks[delta.request_id]
        return routed

    def fail(self, error: BaseException) -> None:
        """A step raised: abort every request still in the engine (a request that finished inside
        the failed step is no longer there, but its caller still waits) and tell every sink."""
        for rid in list(self.engine.requests):
            try:
                self.engine.abort(rid)
            except Exception:  # noqa: BLE001 (one that cannot be aborted must not keep the others waiting)
                log.exception("abort of %r after a failed step", rid)
        self.close(error)

    def close(self, error: BaseException) -> None:
        """Tell every open request's sink ``error`` and forget them all."""
        for sink in self._sinks.values():
            sink.put(error)
        self._sinks.clear()
