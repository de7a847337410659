"""The OpenAI request shapes the server accepts, and the errors it answers with.

Requests are pydantic models, so a wrong type is caught before it reaches the engine and the
error can name the field (``param``) the way the OpenAI API does. Values the engine itself
checks (``temperature`` < 0, a prompt too long for the context) are turned into the same error
shape by :func:`error_body`. Fields the engine cannot honour (``echo``, nonzero presence /
frequency penalties) are refused by name rather than silently ignored: a client that relies on
them should learn it at once.

References: the OpenAI API reference for ``/v1/completions`` and ``/v1/chat/completions``
(https://platform.openai.com/docs/api-reference), and vLLM's ``entrypoints/openai/protocol.py``,
which accepts the same extensions (``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from minillm.sampling import MAX_LOGPROBS as MAX_TOP_LOGPROBS
from minillm.sampling import MAX_N, SamplingParams

#: OpenAI's limit for ``logprobs`` on /v1/completions (chat's ``top_logprobs`` goes to 20).
MAX_COMPLETION_LOGPROBS = 5
#: Prompts in one /v1/completions request: each is tokenized on the event loop before queueing.
MAX_PROMPTS = 256

Number = StrictInt | StrictFloat


class APIError(Exception):
    """An error the client caused (4xx) or the server could not serve (503), in OpenAI's shape."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        type: str = "invalid_request_error",
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None, code=None) -> dict:
    """``{"error": {"message", "type", "param", "code"}}``: what the OpenAI clients parse."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = False


class _Common(BaseModel):
    """Fields shared by both endpoints. Unknown fields are ignored, as OpenAI-compatible servers
    commonly do (clients send ``user``, ``metadata``...)."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr
    temperature: Number | None = None
    top_p: Number | None = None
    n: StrictInt = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: StrictStr | list[StrictStr] | None = None
    seed: StrictInt | None = None
    presence_penalty: Number = 0
    frequency_penalty: Number = 0
    # Accepted so that they can be refused by name: this server cannot honour them.
    response_format: Any = None
    logit_bias: Any = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    best_of: Any = None
    # Extensions (vLLM's names).
    top_k: StrictInt | None = None
    min_p: Number | None = None
    repetition_penalty: Number | None = None
    ignore_eos: StrictBool = False

    def check_supported(self) -> None:
        for name in ("response_format", "logit_bias", "tools", "tool_choice", "functions"):
            value = getattr(self, name)
            if value not in (None, {}, [], {"type": "text"}, "none"):
                raise APIError(400, f"{name} is not supported by this server", name)
        if self.best_of not in (None, 1, self.n):
            raise APIError(400, "best_of is not supported by this server (use n)", "best_of")
        if self.presence_penalty or self.frequency_penalty:
            name = "presence_penalty" if self.presence_penalty else "frequency_penalty"
            raise APIError(400, f"{name} is not supported by this server (use repetition_penalty)", name)
        if not 1 <= self.n <= MAX_N:
            raise APIError(400, f"n={self.n} must be between 1 and {MAX_N}", "n")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed with stream=true", "stream_options")

    def sampling_params(self, max_tokens: int | None, default_max_tokens: int, logprobs: int | None) -> SamplingParams:
        """The engine's parameters; a value the engine refuses becomes a 400 naming its field."""
        values = dict(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k if self.top_k and self.top_k > 0 else 0,  # -1 (vLLM) or 0: off
            min_p=0.0 if self.min_p is None else self.min_p,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            max_tokens=default_max_tokens if max_tokens is None else max_tokens,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            seed=self.seed,
            ignore_eos=self.ignore_eos,
            n=self.n,
            logprobs=logprobs,
        )
        if self.top_k is not None and self.top_k < -1:
            raise APIError(400, f"top_k={self.top_k} must be -1 or 0 (off) or a positive integer", "top_k")
        if len(values["stop"]) > 4:
            raise APIError(400, "stop may hold at most 4 sequences", "stop")
        try:
            params = SamplingParams(**values)
        except ValueError as exc:
            raise APIError(400, str(exc), _field_of(str(exc), values)) from None
        return params


def _field_of(message: str, values: dict) -> str | None:
    """The field an engine error names (its messages start ``name=value``)."""
    for name in values:
        if message.startswith(f"{name}=") or message.startswith(f"{name} "):
            return name
    return "stop" if message.startswith("stop") else None


class CompletionRequest(_Common):
    prompt: StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]]
    max_tokens: StrictInt | None = None
    logprobs: StrictInt | None = None
    echo: StrictBool = False
    suffix: StrictStr | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise APIError(400, "echo is not supported by this server", "echo")
        if self.suffix:
            raise APIError(400, "suffix is not supported by this server", "suffix")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_COMPLETION_LOGPROBS:
            raise APIError(400, f"logprobs={self.logprobs} must be between 0 and {MAX_COMPLETION_LOGPROBS}", "logprobs")
        if isinstance(self.prompt, list) and not self.prompt:
            raise APIError(400, "prompt must not be empty", "prompt")
        if len(self.prompts()) > MAX_PROMPTS:
            raise APIError(
                400, f"a request may hold at most {MAX_PROMPTS} prompts, got {len(self.prompts())}", "prompt"
            )

    def prompts(self) -> list[str | list[int]]:
        """One prompt or a batch of them (a list of strings, or a list of token-id lists)."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_Common):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise APIError(400, "top_logprobs needs logprobs=true", "top_logprobs")
            if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
                raise APIError(400, f"top_logprobs={self.top_logprobs} must be between 0 and {MAX_TOP_LOGPROBS}",
                               "top_logprobs")  # fmt: skip

    def conversation(self) -> list[dict[str, str]]:
        # "developer" is OpenAI's newer name for the system role; chat templates know "system".
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]

    def logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
