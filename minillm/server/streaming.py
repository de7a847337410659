"""One request's engine deltas → one server-sent-event stream (chapter 10's streaming exercise).

Why a module of its own: a streamed request holds one async stream of deltas per prompt (a
batch of prompts, each with ``n`` samples), and the client must see every token as soon as the
engine makes it, from whichever prompt made it. So the streams are read concurrently — one
task per prompt feeding one queue — and the queue is turned into events in the order the
deltas arrive. The same function decides what a client that leaves costs: when the response
generator is closed early (the connection dropped, an error), its ``finally`` cancels the
readers and aborts every prompt that had not finished, so the engine frees their KV blocks
before its next step instead of generating tokens for nobody.

The server calls it through ``hooks.stream_events`` (``server/app.py``), so a learner's version
can be plugged into a live server.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import minillm.hooks as hooks
from minillm.errors import RequestFailed
from minillm.server.async_engine import EngineDead
from minillm.server.protocol import error_body
from minillm.server.responses import DONE, Formatter, sse, usage


def error_event(exc: BaseException) -> bytes:
    """The event that ends a stream a request cannot finish, in OpenAI's error shape.

    A request whose own settings failed inside a step (``RequestFailed``) gets an
    ``invalid_request_error`` naming the setting; anything else is the server's fault."""
    if isinstance(exc, RequestFailed):
        return sse(error_body(str(exc), "invalid_request_error", exc.param))
    message = str(exc) if isinstance(exc, EngineDead) else f"{type(exc).__name__}: {exc}"
    return sse(error_body(message, "server_error"))


@hooks.reference("stream_events")
async def stream_events(
    streams: list, fmt: Formatter, n: int, include_usage: bool, prompt_tokens: int, abort: Callable[[int], None]
) -> AsyncIterator[bytes]:
    """Merge the prompts' delta streams into one event stream, in the order deltas arrive.

    ``streams[p]``: prompt ``p``'s async iterator of ``StreamDelta`` (its ``n`` samples
    interleaved; the last delta has ``request_finished``). Choice ``p * n + delta.index`` is
    that sample's place in the response. Yields ``bytes`` events: for a chat, first one chunk
    giving every choice its role; then one chunk per delta (an empty text too, so a client sees
    every step); with ``include_usage`` a chunk with the token counts and no choices; then
    ``DONE``. A stream that raises ends everything with ``error_event`` and no ``DONE``.
    ``abort(p)`` is called, on the way out, for every prompt whose stream had not finished."""
    merged: asyncio.Queue = asyncio.Queue()

    async def pump(p: int, deltas) -> None:
        try:
            async for delta in deltas:
                await merged.put((p, delta))
        except Exception as exc:  # noqa: BLE001 (reported in-band; cancellation ends the task quietly)
            await merged.put((p, exc))

    readers = [asyncio.ensure_future(pump(p, deltas)) for p, deltas in enumerate(streams)]
    choices = len(streams) * n
    offsets = [0] * choices  # characters sent to each choice so far (a completion's logprobs' text_offset)
    remaining, completion_tokens = len(streams), 0
    try:
        if fmt.chat:  # the role comes first, in a chunk of its own, as OpenAI sends it
            yield sse(fmt.chunk([fmt.delta_choice(k, "", None, None, True) for k in range(choices)]))
        while remaining:
            p, item = await merged.get()
            if isinstance(item, BaseException):
                yield error_event(item)
                return
            k = p * n + item.index
            # One chunk per engine step, even when the detokenizer holds the text back (half a
            # UTF-8 character, a possible stop string): clients see every token's timing.
            yield sse(fmt.chunk([fmt.delta_choice(k, item.text, item.finish_reason, item.logprobs, False, offsets[k])]))
            offsets[k] += len(item.text)
            if item.output is not None:  # a sample finished: its tokens count once
                completion_tokens += len(item.output.token_ids)
            if item.request_finished:
                remaining -= 1
        if include_usage:
            yield sse(fmt.chunk([], usage(prompt_tokens, completion_tokens)))
        yield DONE
    finally:
        for p, reader in enumerate(readers):
            if not reader.done():  # the client left, or another prompt failed: stop this one too
                reader.cancel()
                abort(p)
