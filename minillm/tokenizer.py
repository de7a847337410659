"""Text ↔ token ids, chat templates and incremental detokenization.

We lean on ``transformers``' fast tokenizer (Rust ``tokenizers`` underneath) for encoding and
for rendering chat templates exactly as the model was trained, and add what an engine needs
on top: the set of end-of-sequence ids, and ``IncrementalDetokenizer`` which turns a growing
list of ids into text deltas without re-decoding everything or emitting half a UTF-8 character.
"""

from __future__ import annotations

import json
from pathlib import Path

import minillm.hooks as hooks
from minillm.errors import ModelLoadError

ChatMessages = list[dict[str, str]]


class Tokenizer:
    def __init__(self, folder: str | Path):
        folder = Path(folder)
        if not (folder / "tokenizer.json").is_file() and not (folder / "tokenizer_config.json").is_file():
            raise ModelLoadError(f"{folder}: no tokenizer.json / tokenizer_config.json found")
        # deferred: transformers takes 0.6 s to import; import minillm (the CLI, the course) stays light until a model loads
        from transformers import AutoTokenizer

        try:
            self.hf = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        except (OSError, ValueError, json.JSONDecodeError) as err:
            raise ModelLoadError(f"{folder}: cannot load the tokenizer ({err})") from None
        self.eos_token_ids = self._eos_ids(folder)
        self._backend_decode = _backend_decode(self.hf)

    def _eos_ids(self, folder: Path) -> frozenset[int]:
        ids: set[int] = set()
        if self.hf.eos_token_id is not None:
            ids.add(int(self.hf.eos_token_id))
        gen = folder / "generation_config.json"
        if gen.is_file():
            try:
                raw = json.loads(gen.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError) as err:
                raise ModelLoadError(f"{gen}: not valid JSON ({err})") from None
            if not isinstance(raw, dict):
                raise ModelLoadError(f"{gen}: must hold a JSON object, got {type(raw).__name__}")
            eos = raw.get("eos_token_id")
            eos = eos if isinstance(eos, list) else ([] if eos is None else [eos])
            if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in eos):
                raise ModelLoadError(f"{gen}: field 'eos_token_id' = {raw['eos_token_id']!r} must be token id(s)")
            ids.update(eos)
        return frozenset(ids)

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # verbose=False: the engine checks lengths against max_model_len itself.
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens, verbose=False))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """``hf.decode``'s text. Called twice per generated token (``detokenize_step``), so it goes
        straight to the Rust tokenizer where transformers would add nothing but Python overhead
        (about 3/4 of the call: argument conversion, batching checks)."""
        if self._backend_decode is not None and type(ids) is list:  # a tensor, an array: transformers converts
            return self._backend_decode(ids, skip_special_tokens=skip_special_tokens)
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes token ``token_id`` stands for — OpenAI's logprob ``bytes``. A byte-level
        BPE token may hold part of a UTF-8 character (``日`` is three bytes, often two tokens):
        decoded alone it is U+FFFD, whose bytes ``EF BF BD`` would not let a client rebuild the
        text by joining the tokens' bytes; these do."""
        piece = self.hf.convert_ids_to_tokens(int(token_id))
        if piece is None or int(token_id) in self.hf.all_special_ids:
            return self.decode([token_id], skip_special_tokens=False).encode()
        if type(self.hf.backend_tokenizer.decoder).__name__ == "ByteLevel" and all(c in _BYTE_OF for c in piece):
            return bytes(_BYTE_OF[c] for c in piece)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):  # SentencePiece's byte fallback
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        return piece.replace("\u2581", " ").encode()  # SentencePiece's word boundary is a space

    def render_chat(self, messages: ChatMessages) -> str:
        """The prompt text for a chat, ending where the assistant's reply should begin."""
        if not self.has_chat_template:
            raise ValueError("this model's tokenizer has no chat template; pass a plain string prompt")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"chat message {i} must be a dict with 'role' and 'content', got {m!r}")
        return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


@hooks.reference("detokenize_step")
def detokenize_step(decode, ids: list[int], prefix_offset: int, read_offset: int) -> tuple[str, int, int]:
    """One step of incremental detokenization, after a token was appended to ``ids``.

    ``ids[:read_offset]`` has been shown as text already; ``ids[prefix_offset:read_offset]`` is
    the context kept for the next decode (the last tokens shown). Decoding that context with and
    without the new tokens, the difference is the new text: the context gives a token its
    leading space (a decode may drop the space at the start of a text) and the bytes a
    character shares with its neighbours. A window ending in U+FFFD stops at an incomplete UTF-8
    character: show nothing and keep the offsets, so the next token completes it. Returns
    ``(delta, prefix_offset, read_offset)``: after text is shown the context moves up to it.
    """
    before = decode(ids[prefix_offset:read_offset])
    after = decode(ids[prefix_offset:])
    if len(after) > len(before) and not after.endswith("\ufffd"):
        return after[len(before) :], read_offset, len(ids)
    return "", prefix_offset, read_offset


class IncrementalDetokenizer:
    """Text deltas for a stream of token ids.

    Decoding ids one at a time is wrong: with byte-level BPE a character may span several
    tokens, and some tokenizers (SentencePiece's) drop the leading space of a decode's first
    token, so a token's space depends on its neighbour. Each new token runs one
    ``detokenize_step`` (a hook: chapter 10's exercise plugs in there), which decodes a short
    window ``ids[prefix:]`` and compares it with ``ids[prefix:read]``; whatever is new is the
    delta, unless it ends in the replacement character (an incomplete UTF-8 sequence), in which
    case we wait for the next token. The window stays a few tokens long, so a step costs the
    same at token 10 and at token 10,000.
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def add(self, token_id: int, step=None) -> str:
        """The text ``token_id`` makes visible. ``step``: the ``detokenize_step`` to run (default:
        the hook's current one; a deferred text passes the one in force when the token came)."""
        self.ids.append(token_id)
        args = (self.tokenizer.decode, self.ids, self.prefix_offset, self.read_offset)
        if step is None:
            delta, self.prefix_offset, self.read_offset = hooks.detokenize_step(*args)
        else:
            delta, self.prefix_offset, self.read_offset = step(*args)
        return delta

    def flush(self) -> str:
        """At the end of a stream: whatever is still held back (shown as replacement chars)."""
        decode = self.tokenizer.decode
        before = decode(self.ids[self.prefix_offset : self.read_offset])
        after = decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return after[len(before) :]


def _backend_decode(hf):
    """The Rust tokenizer's ``decode`` when it gives exactly what ``hf.decode`` gives, else None.

    transformers' fast tokenizers decode with the Rust tokenizer and then, only if
    ``clean_up_tokenization_spaces`` is in force, tidy spaces before punctuation (never for a
    BPE model, unless forced). Rather than trust that reading of its internals, the two are
    compared on a spread of ids, special ones included, with and without skipping specials."""
    backend = getattr(hf, "_tokenizer", None)
    decode = getattr(backend, "decode", None)
    if decode is None:
        return None
    size = len(hf)
    sample = list(range(0, size, max(1, size // 97))) + list(hf.all_special_ids)
    windows = [sample[i : i + 5] for i in range(0, len(sample), 5)] + [sample]
    try:
        for skip in (True, False):
            for ids in windows:
                if decode(ids, skip_special_tokens=skip) != hf.decode(ids, skip_special_tokens=skip):
                    return None
    except Exception:  # noqa: BLE001 (an unusual tokenizer: keep transformers' own path)
        return None
    return decode


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's table: each byte as the printable character byte-level BPE writes it as."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


_BYTE_OF = {c: b for b, c in _bytes_to_unicode().items()}
