"""Chapter 10's whole piece: the streaming endpoint's body — a request's delta streams turned into
server-sent events, as ``stream_events(streams, fmt, n, include_usage, prompt_tokens, abort)``.

Two stages:

1. **diagnosis on hand-made streams** — scripted delta streams whose deltas arrive in a fixed
   order across prompts, each one only once the previous one's event has reached the client (a
   stream that collects before it sends, or reads the prompts one after another, stalls and is
   named). Five scenes, each beside the package's events: one completion (an empty-text delta
   among them), a chat of two prompts × two samples interleaved with usage, logprobs' text
   offsets, a prompt whose stream fails while another runs, and a client that leaves mid-answer
   (which prompts are aborted, and whether a reader is left running);
2. **the plug-in run** — the learner's function as ``hooks.stream_events`` of a live server (the
   tiny model, fp32) driven with the official ``openai`` client: streamed chats and batched
   completions equal to the whole answers, usage included, and a client that hangs up frees
   its request in the engine.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import threading
from types import SimpleNamespace

import minillm.hooks as hooks
from minillm.course.results import CheckError, CheckFailed, LearnerRaised, check
from minillm.errors import RequestFailed
from minillm.outputs import StreamDelta, TokenLogprob
from minillm.server.responses import Formatter

STALL_S = 2.0  # a correct stream answers in milliseconds; this long with nothing to show is a stall
MODEL = "tiny-shakespeare-8m"


class ToyTokenizer:
    """Enough of a tokenizer for logprobs: token ``i`` is the word ``WORDS[i]``."""

    WORDS = ["To", " be", " or", " not", "!"]

    def decode(self, ids, skip_special_tokens=False) -> str:
        return "".join(self.WORDS[i] for i in ids)

    def token_bytes(self, token_id: int) -> bytes:
        return self.WORDS[token_id].encode()


def delta(text: str, index: int = 0, finish: str | None = None, tokens: int = 1, done: bool = False,
          logprobs: bool = False) -> StreamDelta:  # fmt: skip
    """One hand-made delta; a finishing one carries an ``output`` of ``tokens`` token ids."""
    ids = [ToyTokenizer.WORDS.index(text)] if logprobs else [7]
    output = SimpleNamespace(token_ids=[7] * tokens) if finish else None
    records = [TokenLogprob(ids[0], -0.5, [])] if logprobs else None
    return StreamDelta("toy", ids[0], text, finish, output, ids, index, records, done)


class Script:
    """Delta streams for several prompts whose items come out in ``order`` (a list of
    ``(prompt, delta or exception)``): item ``i`` is produced once ``i`` events have reached
    the client (when ``gated``), so a stream that holds events back, or waits on one prompt
    while another has a delta ready, stalls."""

    def __init__(self, order: list, prompts: int, gated: bool = True):
        self.order, self.prompts, self.gated = order, prompts, gated
        self.produced = self.received = 0
        self.closed: set[int] = set()  # prompts whose stream was closed or cancelled before its end
        self.aborted: list[int] = []
        self.raised = ""  # the planted error, once a stream has raised it
        self.changed: asyncio.Condition | None = None

    async def stream(self, p: int):
        self.changed = self.changed or asyncio.Condition()
        mine = [i for i, (q, _) in enumerate(self.order) if q == p]
        finished = False
        try:
            for i in mine:
                async with self.changed:
                    await self.changed.wait_for(
                        lambda i=i: self.produced == i and (not self.gated or self.received >= i)
                    )
                    self.produced += 1
                    self.changed.notify_all()
                item = self.order[i][1]
                finished = i == mine[-1]  # a reader need not ask past a prompt's last delta
                if isinstance(item, BaseException):
                    self.raised = f"{type(item).__name__}({item})"
                    raise item
                yield item
        finally:
            if not finished:
                self.closed.add(p)

    def streams(self) -> list:
        return [self.stream(p) for p in range(self.prompts)]

    async def got_event(self) -> None:
        if self.changed is not None:
            async with self.changed:
                self.received += 1
                self.changed.notify_all()


def _parse(event, scene: str):
    if isinstance(event, str):
        raise CheckFailed(f"{scene}: your stream yielded a str; yield bytes, sse(...) (the response body is bytes)")
    if not isinstance(event, (bytes, bytearray)):
        raise CheckFailed(f"{scene}: your stream yielded {type(event).__name__} {event!r:.60}; yield sse(...) events")
    text = bytes(event).decode()
    if not text.startswith("data: ") or not text.endswith("\n\n"):
        raise CheckFailed(f"{scene}: the event {text!r:.60} is not 'data: ...' ended by a blank line: use sse(...)")
    body = text[6:-2]
    return "[DONE]" if body == "[DONE]" else json.loads(body)


async def _play(stream_events, script: Script, n: int, fmt: Formatter, usage: bool, leave_after: int | None):
    """Run one scene: the events (parsed) until the stream ends, or until ``leave_after`` deltas' events
    came and the client closes it. Returns (events, stalled, leftover reader tasks)."""
    gen = stream_events(script.streams(), fmt, n, usage, 11, script.aborted.append)
    if inspect.iscoroutine(gen):
        await gen  # the skeleton's NotImplementedError, or an async def that never yields
        raise CheckFailed("stream_events returned without yielding: it must be an async generator (yield each event)")
    if not hasattr(gen, "__anext__"):
        raise CheckFailed(f"stream_events returned {type(gen).__name__}; write it as an async def that yields events")
    events, stalled, deltas = [], False, 0
    try:
        while leave_after is None or deltas < leave_after:
            try:
                event = await asyncio.wait_for(gen.__anext__(), STALL_S)
            except StopAsyncIteration:
                break
            except asyncio.TimeoutError:
                stalled = True
                break
            except RequestFailed as err:
                raise CheckFailed(f"the stream's RequestFailed ({err}) escaped your generator: send "
                                  "error_event(exc) and stop, so the client gets a JSON error, not a cut connection") from None  # fmt: skip
            except (CheckFailed, asyncio.CancelledError):
                raise
            except Exception as err:
                raise LearnerRaised(f"{type(err).__name__}: {err}") from err
            events.append(_parse(event, ""))
            if isinstance(events[-1], dict) and events[-1].get("choices") and not _is_role_chunk(events[-1]):
                deltas += 1
                await script.got_event()
    finally:
        await gen.aclose()
    for _ in range(5):  # let cancelled readers run their cleanup
        await asyncio.sleep(0)
    leftover = [t for t in asyncio.all_tasks() if t is not asyncio.current_task() and not t.done()]
    for t in leftover:
        t.cancel()
    return events, stalled, len(leftover)


def _is_role_chunk(chunk: dict) -> bool:
    """A chat's first chunk: every choice's role, no text."""
    choices = chunk.get("choices") or [{}]
    return all("role" in c.get("delta", {}) and not c["delta"].get("content") for c in choices)


def _run(coro_factory):
    """Run a scene on a fresh event loop in a thread (a notebook's kernel already runs a loop)."""
    box: dict = {}

    def main():
        try:
            box["value"] = asyncio.run(coro_factory())
        except BaseException as err:  # noqa: BLE001 (re-raised in the caller's thread)
            box["error"] = err

    worker = threading.Thread(target=main, name="stream-events-scene", daemon=True)
    worker.start()
    worker.join(60)
    if worker.is_alive():
        raise CheckFailed("your stream_events never returned control (a blocking call inside an async function?)")
    if "error" in box:
        raise box["error"]
    return box["value"]


def _strip(events: list) -> list:
    """Events without what differs between runs (ids, timestamps)."""
    out = []
    for e in events:
        if isinstance(e, dict):
            e = {k: v for k, v in e.items() if k not in ("id", "created")}
        out.append(e)
    return out


def _scene(stream_events, name: str, build, n: int, chat: bool, usage: bool = False, leave_after=None,
           tokenizer=None) -> tuple[list, Script, int]:  # fmt: skip
    """Play scene ``name`` with the learner's function and the package's; compare what the client saw."""

    def play(fn):
        script = build()
        fmt = Formatter(chat, "toy-1", "toy", tokenizer)
        events, stalled, leftover = _run(lambda: _play(fn, script, n, fmt, usage, leave_after))
        return _strip(events), stalled, leftover, script

    want, stalled, _, ref = play(hooks.default("stream_events"))
    if stalled:
        raise CheckError(f"the package's stream stalled in scene {name!r}")
    got, stalled, leftover, script = play(stream_events)
    if stalled:
        if script.raised:
            raise CheckFailed(
                f"{name}: a prompt's stream raised {script.raised} and your stream never sent it on: the client "
                "waits forever. Catch what a reader's stream raises, hand it to the merge loop, and send "
                "error_event(exc) as the last event"
            )
        if script.produced > script.received:
            raise CheckFailed(
                f"{name}: a delta arrived and its event never reached the client while the next delta waited for "
                "it: yield each event as its delta arrives (collecting them first holds the whole answer back)"
            )
        raise CheckFailed(
            f"{name}: your stream stopped after {script.received} delta events while another prompt had a delta "
            "ready: it waits for one prompt's stream to end before reading the next. Read every prompt's stream "
            "at once (a task per prompt feeding one asyncio.Queue) and send deltas in the order they arrive"
        )
    _compare(name, got, want, chat)
    _compare_exit(name, script, ref, leftover)
    return got, script, leftover


def _compare(name: str, got: list, want: list, chat: bool) -> None:
    if got == want:
        return
    if want and want[-1] == "[DONE]" and (not got or got[-1] != "[DONE]"):
        raise CheckFailed(f"{name}: the stream did not end with data: [DONE] (yield DONE last)")
    if want and want[-1] != "[DONE]" and got and got[-1] == "[DONE]":
        raise CheckFailed(f"{name}: a stream that ends in an error sends no [DONE]: the error event is its last")
    if chat and want and (not got or not isinstance(got[0], dict) or not _is_role_chunk(got[0])):
        raise CheckFailed(f"{name}: a chat stream starts with one chunk giving every choice "
                          "{'role': 'assistant', 'content': ''} (first=True), before any text")  # fmt: skip
    wanted_error = [e for e in want if isinstance(e, dict) and "error" in e]
    got_error = [e for e in got if isinstance(e, dict) and "error" in e]
    if wanted_error and got_error != wanted_error:
        raise CheckFailed(f"{name}: the client should get the error event {wanted_error[0]} "
                          f"(error_event(exc)), got {got_error[:1] or 'none'}")  # fmt: skip
    w_chunks = [e for e in want if isinstance(e, dict) and e.get("choices")]
    g_chunks = [e for e in got if isinstance(e, dict) and e.get("choices")]
    if len(g_chunks) < len(w_chunks) and g_chunks == w_chunks[: len(g_chunks)] and "[DONE]" in got:
        raise CheckFailed(f"{name}: your stream ended after {len(g_chunks)} of the {len(w_chunks)} chunks: the "
                          "stream is over when every prompt's request_finished delta has come, not the first")  # fmt: skip
    w_usage = [e["usage"] for e in want if isinstance(e, dict) and "usage" in e]
    g_usage = [e.get("usage") for e in got if isinstance(e, dict) and "usage" in e]
    if w_usage != g_usage:
        if not w_usage:
            raise CheckFailed(f"{name}: a usage chunk was sent though include_usage is False")
        raise CheckFailed(f"{name}: the usage should be {w_usage[0]} in one chunk with no choices just before [DONE] "
                          f"(completion tokens: every finished sample's output.token_ids), got {g_usage or 'none'}")  # fmt: skip
    if len(g_chunks) != len(w_chunks):
        raise CheckFailed(f"{name}: {len(g_chunks)} chunks with choices where {len(w_chunks)} were due: one per delta, "
                          "also when its text is empty (the client sees every step)")  # fmt: skip
    for i, (g, w) in enumerate(zip(g_chunks, w_chunks)):
        if g == w:
            continue
        if len(g["choices"]) != len(w["choices"]):
            raise CheckFailed(f"{name}: chunk {i} has {len(g['choices'])} choices where {len(w['choices'])} were due")
        for gc, wc in zip(g["choices"], w["choices"]):
            if gc.get("index") != wc["index"]:
                raise CheckFailed(
                    f"{name}: chunk {i} is for choice {gc.get('index')} where choice {wc['index']} was due: prompt p's "
                    "sample delta.index is choice p * n + delta.index, and deltas go out in the order they arrive"
                )
            for field in ("text", "delta", "finish_reason", "logprobs"):
                if gc.get(field) != wc.get(field):
                    raise CheckFailed(f"{name}: chunk {i} (choice {wc['index']}) has {field} {gc.get(field)!r:.90} "
                                      f"where {wc.get(field)!r:.90} was due{_why(field, gc, wc)}")  # fmt: skip
        raise CheckFailed(f"{name}: chunk {i} is {g} where {w} was due")
    raise CheckFailed(f"{name}: the events differ from the package's: {got} where {want} were due")


def _why(field: str, got: dict, want: dict) -> str:
    if field == "delta" and "role" in (got.get("delta") or {}):
        return ": only the first chunk gives a choice its role (first=True once, then False)"
    if field == "logprobs":
        return (": a completion's text_offset counts the characters already sent to that choice "
                "(offsets[k] += len(delta.text) after each chunk)")  # fmt: skip
    return ""


def _compare_exit(name: str, script: Script, ref: Script, leftover: int) -> None:
    if sorted(script.aborted) != sorted(ref.aborted):
        if not ref.aborted:
            raise CheckFailed(f"{name}: abort was called for prompts {sorted(script.aborted)} though every prompt "
                              "finished")  # fmt: skip
        if not script.aborted:
            raise CheckFailed(f"{name}: prompt(s) {ref.aborted} had not finished when the stream ended, and nothing "
                              "aborted them: the engine would go on generating for nobody. In a finally, call "
                              "abort(p) for every prompt whose reader had not finished")  # fmt: skip
        raise CheckFailed(f"{name}: abort was called for prompts {sorted(script.aborted)} where {sorted(ref.aborted)} "
                          "had not finished: abort only those (a finished request is gone from the engine)")  # fmt: skip
    if leftover or script.closed != ref.closed:
        raise CheckFailed(f"{name}: after the stream ended a reader was still waiting on an unfinished prompt's "
                          "stream: cancel the reader tasks in a finally")  # fmt: skip


def _diagnose(stream_events) -> None:
    def one_prompt():
        texts = ["To", " be", "", " or"]
        order = [(0, delta(t)) for t in texts] + [(0, delta(" not", finish="length", tokens=5, done=True))]
        return Script(order, 1, gated=False)

    _scene(stream_events, "one completion prompt, five deltas (one with empty text)", one_prompt, 1, chat=False)

    def chat_two_by_two():
        order = [(1, delta("To", 0)), (0, delta("To", 1)), (1, delta(" be", 1)), (0, delta(" be", 0)),
                 (1, delta(" or", 0, "stop", 2)), (0, delta(" not", 1, "length", 2)),
                 (0, delta("!", 0, "stop", 2, done=True)), (1, delta("!", 1, "stop", 2, done=True))]  # fmt: skip
        return Script(order, 2)

    _scene(stream_events, "a chat, 2 prompts × n=2, interleaved, with usage", chat_two_by_two, 2, chat=True, usage=True)

    def offsets():
        words = [("To", 0), ("To", 1), (" be", 1), (" be", 0), (" or", 0), (" not", 1)]
        order = [(0, delta(w, i, logprobs=True)) for w, i in words]
        order += [(0, delta("!", 1, "stop", 4, logprobs=True)), (0, delta("!", 0, "stop", 4, True, logprobs=True))]
        return Script(order, 1)

    _scene(stream_events, "a completion with logprobs, n=2 (text offsets)", offsets, 2, chat=False,
           tokenizer=ToyTokenizer())  # fmt: skip

    def failing():
        bad = RequestFailed("repetition_penalty made a row's logits all -inf", "repetition_penalty")
        order = [(0, delta("To")), (1, delta("To")), (1, bad), (0, delta(" be", finish="stop", tokens=2, done=True))]
        return Script(order, 2)

    _scene(stream_events, "prompt 1 fails while prompt 0 runs", failing, 1, chat=False)

    def leaving():
        order = [(0, delta("To", finish="stop", done=True))] + [(1, delta(w)) for w in ("To", " be", " or", " not")]
        order.append((1, delta("!", finish="stop", done=True)))
        return Script(order, 2)

    _scene(stream_events, "the client leaves after 3 deltas", leaving, 1, chat=False, leave_after=3)


def _live(stream_events, model: str) -> str:
    """Plug the function into a live server and stream through the openai client."""
    import time

    import httpx
    import openai

    from minillm.server import ServerThread, build_app, build_engines

    engines = build_engines([model], dtype="fp32", kv_cache_memory=8_000_000)
    engine = engines[model].engine
    with hooks.override(stream_events=stream_events), ServerThread(build_app(engines)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        chat = {"model": model, "messages": [{"role": "user", "content": "Who is the king?"}], "max_tokens": 12,
                "temperature": 0, "n": 2}  # fmt: skip
        whole = client.chat.completions.create(**chat)
        texts, usage = ["", ""], None
        for chunk in client.chat.completions.create(**chat, stream=True, stream_options={"include_usage": True}):
            usage = chunk.usage or usage
            for c in chunk.choices:
                texts[c.index] += c.delta.content or ""
        if texts != [c.message.content for c in whole.choices]:
            raise CheckFailed(f"in the live server the streamed chat (n=2) read {texts} where the whole answer "
                              f"was {[c.message.content for c in whole.choices]}")  # fmt: skip
        if usage is None or usage.completion_tokens != whole.usage.completion_tokens:
            raise CheckFailed(
                f"in the live server the streamed usage was {usage} where the whole answer's is {whole.usage}"
            )
        prompts = ["KING.\nNow is", "ROMEO.\nBut soft"]
        args = {"model": model, "prompt": prompts, "max_tokens": 10, "temperature": 0}
        batch = client.completions.create(**args)
        streamed = ["", ""]
        for chunk in client.completions.create(**args, stream=True):
            for c in chunk.choices:
                streamed[c.index] += c.text
        if streamed != [c.text for c in sorted(batch.choices, key=lambda c: c.index)]:
            raise CheckFailed(f"in the live server two streamed prompts read {streamed} where the whole answers are "
                              f"{[c.text for c in batch.choices]}")  # fmt: skip
        body = {"model": model, "prompt": "KING.\n", "max_tokens": 400, "ignore_eos": True, "temperature": 0,
                "stream": True}  # fmt: skip
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            for _ in range(6):
                next(lines)
        deadline = time.monotonic() + 20
        while engine.has_unfinished_requests() and time.monotonic() < deadline:
            time.sleep(0.02)
        if engine.has_unfinished_requests():
            raise CheckFailed("in the live server a client hung up mid-answer and its request kept running in the "
                              "engine: abort the unfinished prompts when the stream is closed")  # fmt: skip
    return "streamed chats (n=2, with usage) and two batched prompts read as the whole answers; a client that hung up "\
           "was aborted"  # fmt: skip


@check
def check_stream_events(stream_events, model: str = MODEL) -> str:
    """``stream_events(streams, fmt, n, include_usage, prompt_tokens, abort)``: async generator of SSE bytes."""
    _diagnose(stream_events)
    live = _live(stream_events, model)
    return (
        "your stream sent every delta as it arrived, in order, across prompts and samples (the chat's roles first, "
        f"usage and [DONE] last, an error event instead when a prompt failed, aborts for who had not finished); {live}"
    )
