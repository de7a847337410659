"""Engine outputs → OpenAI response objects, whole or as server-sent-event chunks.

Server-sent events (the WHATWG HTML standard, "Server-sent events") are plain text over a
kept-open HTTP response: each event is one or more ``data: ...`` lines ended by a blank line.
The OpenAI API sends one JSON chunk per event and ends the stream with ``data: [DONE]``.
"""

from __future__ import annotations

import json
import time

from minillm.tokenizer import Tokenizer


def sse(payload: dict | str) -> bytes:
    """One server-sent event: ``data: <json>`` and the blank line that ends the event.

    JSON never contains a raw newline (``json.dumps`` escapes them), so one ``data:`` line is
    always enough.
    """
    text = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"data: {text}\n\n".encode()


DONE = sse("[DONE]")


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class Formatter:
    """Builds one request's response objects; knows its id, model name and endpoint kind."""

    def __init__(self, chat: bool, request_id: str, model: str, tokenizer: Tokenizer):
        self.chat, self.id, self.model, self.tokenizer = chat, request_id, model, tokenizer
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

    def _piece(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    # -- logprobs ---------------------------------------------------------------------------

    def logprobs(self, records, text_offset: int = 0) -> dict | None:
        """``records``: the engine's per-token logprob records (None when not requested)."""
        if records is None:
            return None
        if self.chat:
            content = []
            for r in records:
                piece = self._piece(r.token_id)
                content.append(
                    {
                        "token": piece,
                        "logprob": r.logprob,
                        "bytes": list(self.tokenizer.token_bytes(r.token_id)),  # raw: parts of a character too
                        "top_logprobs": [
                            {"token": self._piece(t), "logprob": lp, "bytes": list(self.tokenizer.token_bytes(t))}
                            for t, lp in r.top
                        ],
                    }
                )
            return {"content": content}
        tokens, offsets, offset = [], [], text_offset
        for r in records:
            tokens.append(self._piece(r.token_id))
            offsets.append(offset)
            offset += len(tokens[-1])
        return {
            "tokens": tokens,
            "token_logprobs": [r.logprob for r in records],
            "top_logprobs": [{self._piece(t): lp for t, lp in r.top} for r in records],
            "text_offset": offsets,
        }

    # -- whole responses ---------------------------------------------------------------------

    def choice(self, index: int, text: str, finish_reason: str | None, records=None) -> dict:
        if self.chat:
            return {
                "index": index,
                "message": {"role": "assistant", "content": text},
                "logprobs": self.logprobs(records),
                "finish_reason": finish_reason,
            }
        return {"index": index, "text": text, "logprobs": self.logprobs(records), "finish_reason": finish_reason}

    def response(self, choices: list[dict], prompt_tokens: int, completion_tokens: int) -> dict:
        return {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage(prompt_tokens, completion_tokens),
        }

    # -- streamed chunks ---------------------------------------------------------------------

    def chunk(self, choices: list[dict], usage_: dict | None = None) -> dict:
        out = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if usage_ is not None:
            out["usage"] = usage_
        return out

    def delta_choice(self, index: int, text: str, finish_reason: str | None, records=None, first=False, offset=0):
        if self.chat:
            delta = {"role": "assistant", "content": text} if first else {"content": text}
            return {"index": index, "delta": delta, "logprobs": self.logprobs(records), "finish_reason": finish_reason}
        return {
            "index": index,
            "text": text,
            "logprobs": self.logprobs(records, offset),
            "finish_reason": finish_reason,
        }
