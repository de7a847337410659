"""Chapter 10's streaming endpoint (``check_stream_events``): right answers written independently,
and the wrong ones a learner writes, one slip each (``events_with(...)``)."""

from __future__ import annotations

import asyncio
import contextlib

from check_catalogue import right, wrong

from minillm.server.responses import DONE, sse, usage
from minillm.server.streaming import error_event

SE = "check_stream_events"


def events_with(**slip):
    """The merge-by-queue answer, with one of a learner's slips switched on."""

    async def stream_events(streams, fmt, n, include_usage, prompt_tokens, abort):
        queue = asyncio.Queue()

        async def read(p, deltas):
            if slip.get("uncaught"):
                async for d in deltas:
                    await queue.put((p, d))
                return
            try:
                async for d in deltas:
                    await queue.put((p, d))
            except Exception as exc:
                await queue.put((p, exc))

        if slip.get("sequential"):
            tasks = []
        else:
            tasks = [asyncio.create_task(read(p, s)) for p, s in enumerate(streams)]
        total = len(streams) * n
        sent, fresh = [0] * total, [True] * total
        left, tokens, buffered = len(streams), 0, []
        try:
            if fmt.chat and not slip.get("no_role"):
                yield sse(fmt.chunk([fmt.delta_choice(k, "", None, None, True) for k in range(total)]))
                if not slip.get("role_always"):
                    fresh = [False] * total
            if slip.get("sequential"):
                for p, s in enumerate(streams):  # one prompt's stream to its end, then the next
                    async for d in s:
                        yield sse(fmt.chunk([fmt.delta_choice(p * n + d.index, d.text, d.finish_reason, d.logprobs,
                                                              False, 0)]))  # fmt: skip
                yield DONE
                return
            while left:
                p, d = await queue.get()
                if isinstance(d, Exception):
                    if slip.get("raw_error"):
                        raise d
                    yield error_event(d)
                    if slip.get("done_after_error"):
                        yield DONE
                    return
                k = d.index if slip.get("index_only") else p + d.index if slip.get("p_plus_index") else p * n + d.index
                if d.text or not slip.get("skip_empty"):
                    text = d.text
                    offset = 0 if slip.get("no_offsets") else sent[k]
                    event = sse(fmt.chunk([fmt.delta_choice(k, text, None if slip.get("no_finish") else d.finish_reason,
                                                            d.logprobs, fresh[k], offset)]))  # fmt: skip
                    if slip.get("as_text"):
                        event = event.decode()
                    if slip.get("buffered"):
                        buffered.append(event)
                    else:
                        yield event
                sent[k] += len(d.token_ids) if slip.get("token_offsets") else len(d.text)
                if d.output is not None:
                    tokens += 1 if slip.get("count_samples") else len(d.output.token_ids)
                if d.request_finished:
                    left -= 1
                    if slip.get("first_finish_ends"):
                        break
            for event in buffered:
                yield event
            if slip.get("done_before_usage"):
                yield DONE
            if include_usage or slip.get("usage_always"):
                yield sse(fmt.chunk([], usage(prompt_tokens, tokens)))
            if not slip.get("no_done") and not slip.get("done_before_usage"):
                yield DONE
        finally:
            if not slip.get("no_cleanup"):
                for p, t in enumerate(tasks):
                    if slip.get("abort_all") or not t.done():
                        if not slip.get("no_cancel"):
                            t.cancel()
                        abort(p)

    return stream_events


right(SE, events_with())


async def stream_events_by_wait(streams, fmt, n, include_usage, prompt_tokens, abort):
    """One pending ``__anext__`` per stream, raced with ``asyncio.wait``: no queue, no reader tasks."""
    iters = [s.__aiter__() for s in streams]
    pending = {asyncio.ensure_future(it.__anext__()): p for p, it in enumerate(iters)}
    choices = n * len(streams)
    offset = [0] * choices
    done_tokens = 0
    ended = set()
    try:
        if fmt.chat:
            yield sse(fmt.chunk([fmt.delta_choice(i, "", None, None, first=True) for i in range(choices)]))
        while pending:
            finished, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for fut in sorted(finished, key=lambda f: pending[f]):
                p = pending.pop(fut)
                try:
                    d = fut.result()
                except StopAsyncIteration:
                    ended.add(p)
                    continue
                except Exception as exc:
                    ended.add(p)
                    yield error_event(exc)
                    return
                i = p * n + d.index
                yield sse(fmt.chunk([fmt.delta_choice(i, d.text, d.finish_reason, d.logprobs, False, offset[i])]))
                offset[i] += len(d.text)
                if d.output is not None:
                    done_tokens += len(d.output.token_ids)
                if d.request_finished:
                    ended.add(p)
                else:
                    pending[asyncio.ensure_future(iters[p].__anext__())] = p
        if include_usage:
            yield sse(fmt.chunk([], usage(prompt_tokens, done_tokens)))
        yield DONE
    finally:
        for fut in pending:
            fut.cancel()
        for p in range(len(streams)):
            if p not in ended:
                abort(p)


async def stream_events_sentinel(streams, fmt, n, include_usage, prompt_tokens, abort):
    """Readers that post a sentinel when their stream ends; usage summed from every delta's tokens."""
    inbox: asyncio.Queue = asyncio.Queue()
    END = object()

    async def reader(p, stream):
        try:
            async for item in stream:
                inbox.put_nowait((p, item))
            inbox.put_nowait((p, END))
        except Exception as exc:
            inbox.put_nowait((p, exc))

    readers = {p: asyncio.ensure_future(reader(p, s)) for p, s in enumerate(streams)}
    live, count = set(readers), 0
    text_sent: dict[int, int] = {}
    try:
        if fmt.chat:
            roles = [fmt.delta_choice(c, "", None, None, True) for c in range(len(streams) * n)]
            yield sse(fmt.chunk(roles))
        while live:
            p, item = await inbox.get()
            if item is END:
                live.discard(p)
                continue
            if isinstance(item, Exception):
                yield error_event(item)
                return
            c = p * n + item.index
            yield sse(fmt.chunk([fmt.delta_choice(c, item.text, item.finish_reason, item.logprobs, False,
                                                  text_sent.get(c, 0))]))  # fmt: skip
            text_sent[c] = text_sent.get(c, 0) + len(item.text)
            count += len(item.token_ids)
        if include_usage:
            yield sse(fmt.chunk([], usage(prompt_tokens, count)))
        yield DONE
    finally:
        for p, task in readers.items():
            if not task.done():
                task.cancel()
                with contextlib.suppress(Exception):
                    abort(p)


right(SE, stream_events_by_wait)
right(SE, stream_events_sentinel)

wrong(SE, "waits for one prompt's stream to end", events_with(sequential=True))
wrong(SE, "collecting them first holds the whole answer back", events_with(buffered=True))
wrong(SE, "starts with one chunk giving every choice", events_with(no_role=True))
wrong(SE, "only the first chunk gives a choice its role", events_with(role_always=True))
wrong(SE, "also when its text is empty", events_with(skip_empty=True))
wrong(SE, "p * n + delta.index", events_with(index_only=True))
wrong(SE, "p * n + delta.index", events_with(p_plus_index=True))
wrong(SE, "did not end with data: [DONE]", events_with(no_done=True))
wrong(SE, "did not end with data: [DONE]", events_with(done_before_usage=True))
wrong(SE, "sends no [DONE]", events_with(done_after_error=True))
wrong(SE, "escaped your generator", events_with(raw_error=True))
wrong(SE, "never sent it on", events_with(uncaught=True))
wrong(SE, "usage chunk was sent though include_usage is False", events_with(usage_always=True))
wrong(SE, "the usage should be", events_with(count_samples=True))
wrong(SE, "nothing aborted them", events_with(no_cleanup=True))
wrong(SE, "abort was called for prompts", events_with(abort_all=True))
wrong(SE, "cancel the reader tasks", events_with(no_cancel=True))
wrong(SE, "text_offset counts the characters", events_with(no_offsets=True))
wrong(SE, "text_offset counts the characters", events_with(token_offsets=True))
wrong(SE, "yielded a str", events_with(as_text=True))
wrong(SE, "finish_reason", events_with(no_finish=True))
wrong(SE, "not the first", events_with(first_finish_ends=True))
