"""From a request body to the engine sequences that answer it — shared by the HTTP routes and
the offline batch runner, so both accept and refuse exactly the same requests.

Every check happens here, before anything is queued: the body's shape (pydantic), the values
the engine refuses (``SamplingParams.validate``), the model's name, and each prompt's length and
fit in the KV pool (``LLMEngine.make_sequence``, which also tokenizes). A request that passes
cannot fail later for a reason the client could have fixed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from jinja2.exceptions import TemplateError
from pydantic import ValidationError

from minillm.errors import PromptTooLongError
from minillm.sequence import Sequence
from minillm.server.protocol import APIError, ChatCompletionRequest, CompletionRequest
from minillm.server.responses import Formatter

#: OpenAI's default ``max_tokens`` for /v1/completions. Chat defaults to the rest of the context.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
ENDPOINTS = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest}


@dataclass
class Plan:
    request: CompletionRequest | ChatCompletionRequest
    engine: object  # the AsyncEngine (server) or LLMEngine (batch) that will run it
    seqs: list[Sequence]  # one per prompt; each holds the request's n samples (choice i * n + sample index)
    formatter: Formatter
    prompt_tokens: int  # each prompt counted once, whatever n

    @property
    def chat(self) -> bool:
        return self.formatter.chat


def parse(endpoint: str, body: dict) -> CompletionRequest | ChatCompletionRequest:
    """Validate a body against the endpoint's schema; errors name the offending field."""
    schema = ENDPOINTS.get(endpoint)
    if schema is None:
        raise APIError(404, f"unknown endpoint {endpoint!r}; use one of {sorted(ENDPOINTS)}", "url")
    try:
        req = schema.model_validate(body)
    except ValidationError as exc:
        raise _validation_error(exc) from None
    req.check_supported()
    return req


_TYPE_TAG = re.compile(r"^(int|float|str|bool|none|list|dict|.*\[.*\]|function-.*|constrained-.*|[A-Z]\w*)$")


def _validation_error(exc: ValidationError) -> APIError:
    """One 400 naming the field: pydantic reports a union's failure once per member type, with
    the member's tag in the location (``temperature.int``, ``temperature.float``)."""
    errors = exc.errors()
    first = errors[0]
    path = [p for p in first["loc"] if isinstance(p, int) or not _TYPE_TAG.match(str(p))]
    param = ".".join(str(p) for p in path) or None
    same = [e for e in errors if [p for p in e["loc"] if isinstance(p, int) or not _TYPE_TAG.match(str(p))] == path]
    if first["type"] == "missing":
        return APIError(400, f"{param} is required", param)
    value = repr(first.get("input"))[:80]
    reasons = "; ".join(dict.fromkeys(e["msg"] for e in same))
    return APIError(400, f"{param}: invalid value {value} ({reasons})", param)


def choose_engine(req, engines: dict):
    engine = engines.get(req.model)
    if engine is None:
        raise APIError(404, f"model {req.model!r} is not served here; try {sorted(engines)}", "model",
                       "invalid_request_error", "model_not_found")  # fmt: skip
    return engine


def plan(req, engine, llm_engine, request_id: str) -> Plan:
    """Build (not queue) the sequences for ``req`` on ``llm_engine`` (an ``LLMEngine``)."""
    chat = isinstance(req, ChatCompletionRequest)
    if chat:
        params = req.sampling_params(req.requested_max_tokens(), llm_engine.max_model_len, req.logprobs_count())
        prompts = [req.conversation()]
    else:
        params = req.sampling_params(req.max_tokens, COMPLETIONS_DEFAULT_MAX_TOKENS, req.logprobs)
        prompts = req.prompts()
    asked = req.requested_max_tokens() if chat else req.max_tokens
    seqs = []
    for i, prompt in enumerate(prompts):
        where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
        try:  # n samples live inside one request: the prompt is prefilled once, then forked
            seqs.append(llm_engine.make_sequence(prompt, params, where, request_id=f"{request_id}-{i}"))
        except (ValueError, TypeError, PromptTooLongError, TemplateError) as exc:
            # A chat template may refuse a conversation itself ("roles must alternate").
            param = "n" if str(exc).startswith("n=") else "messages" if chat else "prompt"
            raise APIError(400, str(exc), param) from None
        if asked is not None:
            _check_fits(len(seqs[-1].prompt_token_ids), asked, llm_engine.max_model_len, where, req)
    prompt_tokens = sum(len(s.prompt_token_ids) for s in seqs)
    return Plan(req, engine, seqs, Formatter(chat, request_id, req.model, llm_engine.tokenizer), prompt_tokens)


def _check_fits(prompt_tokens: int, max_tokens: int, max_model_len: int, where: str, req) -> None:
    """A ``max_tokens`` the client set must fit in the context beside the prompt: 400 otherwise,
    naming the limit, as OpenAI and vLLM answer. (Capping it quietly, as this server once did,
    answered a request for 10^9 tokens with 1,023 and a client could not tell why it stopped.)
    Left unset, ``max_tokens`` is this server's default — 16 for a completion, the rest of the
    context for a chat — cut to what the context leaves, the output's ``finish_reason`` then
    "length"."""
    if prompt_tokens + max_tokens > max_model_len:
        param = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) is not None else "max_tokens"
        raise APIError(
            400, f"this model's context is {max_model_len} tokens; {where} has {prompt_tokens}, so {param} may be at "
            f"most {max_model_len - prompt_tokens}, not {max_tokens}", param)  # fmt: skip


def response_of(plan_: Plan, outputs) -> dict:
    """The whole (non-streamed) response for finished ``outputs``: every sample of every
    prompt, prompt-major (choice ``i * n + j``)."""
    fmt = plan_.formatter
    choices = [fmt.choice(k, o.text, o.finish_reason, o.logprobs) for k, o in enumerate(outputs)]
    return fmt.response(choices, plan_.prompt_tokens, sum(len(o.token_ids) for o in outputs))
