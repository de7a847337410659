"""One engine, one thread: how an asyncio web server drives a synchronous step loop.

``LLMEngine.step()`` runs the model and may take from milliseconds to seconds; running it in
the event loop would freeze every other connection for that long. So one background thread
owns the engine and calls ``step()`` while there is work, and the HTTP handlers talk to it
through two thread-safe hand-offs:

- an **inbox** (``queue.SimpleQueue``) of "add this sequence" / "abort that request" orders,
  which the engine thread applies between steps — the handlers never touch the scheduler;
- one ``asyncio.Queue`` per request, which the engine thread fills with that request's
  ``StreamDelta`` objects through ``loop.call_soon_threadsafe`` (asyncio queues are not
  thread-safe; that call hands the ``put`` to the loop's own thread).

A handler validates and tokenizes its request itself (``LLMEngine.make_sequence`` is a pure
check plus tokenization), so a bad request is answered at once and never reaches the engine.
When a client goes away, the handler's generator is closed and its ``finally`` posts an abort:
the engine frees the request's blocks before its next step.

Backpressure: at most ``max_waiting`` requests may wait for a seat (not yet running); past
that, :class:`QueueFull` — the server's 429 — instead of an unbounded queue whose last entry
would time out anyway.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Hashable
from dataclasses import dataclass

from minillm.engine import LLMEngine
from minillm.engine.client import EngineClient
from minillm.errors import RequestFailed
from minillm.outputs import StreamDelta
from minillm.sequence import Sequence

log = logging.getLogger("minillm.server")


def _put_all(items) -> None:
    for queue_, item in items:
        queue_.put_nowait(item)


class QueueFull(Exception):
    """More requests are waiting than the server admits; retry after ``retry_after`` seconds."""

    def __init__(self, waiting: int, retry_after: int):
        super().__init__(f"{waiting} requests are already waiting for this model")
        self.retry_after = retry_after


class EngineDead(Exception):
    """The engine thread failed; the message says why."""


class ServerShuttingDown(EngineDead):
    """The server's drain deadline ended this request before it finished (SIGTERM, then
    ``--shutdown-timeout`` seconds: ``launch.DrainingServer``), or it arrived after that: a
    stream gets it as an error event and then ``[DONE]``, any other request a 503."""


@dataclass
class _Sink:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    def put(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass


class AsyncEngine:
    """Runs one :class:`LLMEngine` in a background thread and streams its deltas to asyncio."""

    def __init__(self, engine: LLMEngine, name: str, max_waiting: int = 256):
        if max_waiting < 1:
            raise ValueError(f"max_waiting={max_waiting} must be >= 1")
        self.engine, self.name, self.max_waiting = engine, name, max_waiting
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._pending = 0  # orders posted but not yet applied by the engine thread
        self._pending_adds = 0  # of which new requests (what counts as waiting)
        self._pending_lock = threading.Lock()
        self.client = EngineClient(engine)  # touched by the engine thread only
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self._run, name=f"minillm-engine-{name}", daemon=True)
        self.error: BaseException | None = None
        self.num_steps_failed = 0
        self.shutting_down: ServerShuttingDown | None = None  # set by ``cut``: new requests are refused

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self.failure() is None

    def failure(self) -> str | None:
        """Why this engine cannot serve — its thread stopped, or the engine itself failed (a dead
        tensor-parallel worker) — or None while it can."""
        if self.error is not None:
            return f"engine thread stopped: {self.error!r}"
        if not self._thread.is_alive():
            return "engine thread not running"
        return self.engine.failure()

    # -- what handlers call --------------------------------------------------------------------

    def new_request_id(self, prefix: str) -> str:
        return f"{prefix}-{next(self._ids)}-{time.monotonic_ns() % 10**9}"

    @property
    def num_waiting(self) -> int:
        """Requests not yet running: posted to the inbox or queued in the scheduler."""
        return self._pending_adds + len(self.engine.scheduler.waiting)

    @property
    def num_running(self) -> int:
        return len(self.engine.scheduler.running)

    def admit(self, count: int = 1) -> None:
        """Raise :class:`QueueFull` if ``count`` more sequences may not wait (checked before
        tokenizing; the caller posts them with no ``await`` in between)."""
        if self.shutting_down is not None:
            raise ServerShuttingDown(str(self.shutting_down))
        failure = self.failure()
        if failure is not None:
            raise EngineDead(f"the engine for {self.name!r} cannot serve: {failure}")
        waiting = self.num_waiting
        if waiting + count > self.max_waiting:
            # A rough hint: a waiting request starts within about one batch's decode time.
            raise QueueFull(waiting, retry_after=1 + waiting // max(1, self.engine.engine_config.max_num_seqs))

    def open(self, seq: Sequence) -> AsyncIterator[StreamDelta]:
        """Queue ``seq`` (already validated) now, and return the stream of its deltas.

        Posting happens here, synchronously, so that :meth:`admit` and the post happen without
        an ``await`` between them: no other handler can be admitted in between and overshoot
        ``max_waiting``. Closing the stream early (the client left) aborts the request; a
        handler that never iterates it must call :meth:`abort` itself.
        """
        sink = _Sink(asyncio.get_running_loop(), asyncio.Queue())
        self._post(("add", seq, sink))
        return self._deltas(seq.request_id, sink)

    def abort(self, request_id: Hashable) -> None:
        """Abort a request (no-op if it has finished): the engine frees its blocks before its next step."""
        self._post(("abort", request_id, None))

    def cut(self, reason: ServerShuttingDown) -> None:
        """End every open request with ``reason`` (each is aborted, its caller told) and refuse
        new ones: the server's drain deadline has come. Called on the event loop's thread, as
        ``admit`` is, so no request is admitted after it and missed by it."""
        self.shutting_down = reason
        self._post(("cut", reason, None))

    async def _deltas(self, request_id: Hashable, sink: _Sink) -> AsyncIterator[StreamDelta]:
        finished = False
        try:
            while True:
                item = await sink.queue.get()
                if isinstance(item, (RequestFailed, ServerShuttingDown)):  # this request alone failed; the drain's end
                    raise item
                if isinstance(item, BaseException):
                    raise EngineDead(f"the engine for {self.name!r} failed: {item!r}") from item
                yield item
                if item.request_finished:  # with n > 1, every sample has finished
                    finished = True
                    return
        finally:
            if not finished:
                self.abort(request_id)

    # -- the engine thread ---------------------------------------------------------------------

    def _post(self, order) -> None:
        with self._pending_lock:
            self._pending += 1
            self._pending_adds += order[0] == "add"
        self._inbox.put(order)
        self._wake.set()

    def _apply_orders(self) -> None:
        while True:
            try:
                kind, item, sink = self._inbox.get_nowait()
            except queue.Empty:
                return
            with self._pending_lock:
                self._pending -= 1
                self._pending_adds -= kind == "add"
            if kind == "add":
                try:
                    self.client.submit(item, sink)
                except Exception as exc:  # noqa: BLE001 (an id clash: answer this request, keep serving)
                    sink.put(exc)
            elif kind == "cut":  # the drain deadline: every open request aborted, its caller told why
                self.client.fail(item)
            else:  # abort: the request may have finished meanwhile (then nothing happens)
                if self.client.owns(item):
                    self.client.abort(item)

    def _run(self) -> None:
        engine = self.engine
        try:
            while not self._stop.is_set():
                if not engine.has_unfinished_requests() and self._inbox.empty():
                    self._wake.wait(timeout=0.5)
                self._wake.clear()
                self._apply_orders()
                if not engine.has_unfinished_requests():
                    continue
                try:
                    routed = self.client.step()
                except Exception as exc:  # noqa: BLE001
                    self._fail_all(exc)
                    continue
                if not routed:  # a dynamic batch still filling: don't spin at full speed
                    time.sleep(0.001)
                self._dispatch(routed)
        except BaseException as exc:  # noqa: BLE001 (the thread must not die silently)
            self.error = exc
            log.exception("engine thread for %s stopped", self.name)
            self.client.close(exc)
            return
        self._apply_orders()  # stopped: answer whoever is still waiting rather than leave them hanging
        self.client.close(EngineDead(f"the engine for {self.name!r} was stopped"))

    def _dispatch(self, routed: list[tuple[_Sink, StreamDelta]]) -> None:
        """Hand one step's deltas to their requests' queues: one wake-up of each event loop per
        step (``call_soon_threadsafe`` writes to the loop's wake-up pipe), not one per request."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, StreamDelta]]] = {}
        for sink, delta in routed:
            batches.setdefault(sink.loop, []).append((sink.queue, delta))
        for loop, items in batches.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # that loop is closed: nobody is listening any more
                pass

    def _fail_all(self, exc: Exception) -> None:
        """A step raised: fail every open request, abort what is left in the engine, and keep
        serving new requests."""
        self.num_steps_failed += 1
        log.error("engine step failed for %s: %r; failing its %d open requests", self.name, exc, self.client.num_open)
        self.client.fail(exc)
