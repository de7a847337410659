"""The front door's first step: a prompt, as a caller gives it, → the token ids the engine runs.

A prompt is a string, a list of token ids, or a chat (a list of ``{"role", "content"}``
messages rendered with the model's chat template). Every entry point — ``LLMEngine.add_request``
(and so ``LLM`` and the server), offline data-parallel replicas, the data-parallel router and
disaggregated prefill/decode — turns prompts into ids here, so they all accept the same prompts
and refuse the same bad ones with the same message.

``InputProcessor`` keeps no state of its own beyond what it is built with (the tokenizer, the
vocabulary size, the context length), so any number of threads may share one.
"""

from __future__ import annotations

from typing import Union

from minillm.errors import PromptTooLongError
from minillm.tokenizer import ChatMessages, Tokenizer

Prompt = Union[str, list[int], ChatMessages]


def is_chat(prompt) -> bool:
    """A non-empty list of message dicts."""
    return isinstance(prompt, list) and bool(prompt) and all(isinstance(m, dict) for m in prompt)


def is_token_ids(prompt) -> bool:
    """A list of ints (bools are not token ids)."""
    return isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)


def routing_ids(tokenizer: Tokenizer, prompt) -> list[int]:
    """A prompt's ids for a routing decision only: lenient, ``[]`` for anything unreadable (the
    engine that gets the request validates it and says what is wrong)."""
    try:
        if isinstance(prompt, str):
            return tokenizer.encode(prompt)
        if is_chat(prompt):
            return tokenizer.encode(tokenizer.render_chat(prompt), add_special_tokens=False)
        return list(prompt) if is_token_ids(prompt) else []
    except Exception:  # noqa: BLE001 (a malformed chat, say: route it anyway)
        return []


class InputProcessor:
    """Validates prompts and turns them into ``(text, token_ids)`` for one model."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, max_model_len: int):
        self.tokenizer, self.vocab_size, self.max_model_len = tokenizer, vocab_size, max_model_len
        self._max_prompt_chars: int | None = None

    @property
    def max_prompt_chars(self) -> int:
        """The most characters a prompt that fits can have: (max_model_len − 1) tokens of the
        vocabulary's longest token. Longer text cannot fit, so it is refused before tokenizing
        (a 2 MB prompt would otherwise hold a server's CPU for seconds, only to be refused)."""
        if self._max_prompt_chars is None:
            longest = max((len(token) for token in self.tokenizer.hf.get_vocab()), default=1)
            self._max_prompt_chars = (self.max_model_len - 1) * max(longest, 1)
        return self._max_prompt_chars

    def _check_chars(self, text: str, where: str) -> None:
        if len(text) > self.max_prompt_chars:
            raise PromptTooLongError(
                f"{where} has {len(text):,} characters: more than {self.max_prompt_chars:,}, so at least "
                f"max_model_len={self.max_model_len} tokens, leaving no room to generate"
            )

    def prompt_ids(self, prompt: Prompt, where: str = "prompt") -> tuple[str, list[int]]:
        """The prompt's text and ids; a ``ValueError``/``TypeError`` naming ``where`` for an
        empty prompt, ids outside the vocabulary, or something that is not a prompt; a
        ``PromptTooLongError`` before any tokenizing for one that cannot fit."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError(f"{where} is an empty string")
            self._check_chars(prompt, where)
            return prompt, self.tokenizer.encode(prompt)
        if is_chat(prompt):
            text = self.tokenizer.render_chat(prompt)
            self._check_chars(text, where)
            return text, self.tokenizer.encode(text, add_special_tokens=False)
        if is_token_ids(prompt):
            if not prompt:
                raise ValueError(f"{where} is an empty list of token ids")
            if len(prompt) >= self.max_model_len:  # before decoding a million ids
                raise PromptTooLongError(
                    f"{where} has {len(prompt)} tokens; max_model_len={self.max_model_len} leaves no room "
                    f"to generate (at most {self.max_model_len - 1} prompt tokens)"
                )
            bad = [t for t in prompt if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"{where} has token id(s) {bad[:5]} outside the vocabulary [0, {self.vocab_size})")
            return self.tokenizer.decode(prompt, skip_special_tokens=False), list(prompt)
        raise TypeError(f"{where} must be a string, a list of token ids or a list of chat messages, got {prompt!r:.80}")

    def process(self, prompt: Prompt, where: str = "prompt") -> tuple[str, list[int]]:
        """``prompt_ids``, and a prompt that leaves room to generate within ``max_model_len``
        (``PromptTooLongError`` otherwise)."""
        text, ids = self.prompt_ids(prompt, where)
        if not ids:
            raise ValueError(f"{where} ({text!r:.40}) encodes to zero tokens")
        if len(ids) >= self.max_model_len:
            raise PromptTooLongError(
                f"{where} has {len(ids)} tokens; max_model_len={self.max_model_len} leaves no room "
                f"to generate (at most {self.max_model_len - 1} prompt tokens)"
            )
        return text, ids
