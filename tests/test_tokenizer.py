"""Incremental detokenization must reproduce a full decode exactly, multi-byte characters included."""

from __future__ import annotations

import random

from conftest import CORPUS

from minillm.tokenizer import IncrementalDetokenizer, Tokenizer


def test_incremental_equals_full_decode(tiny_model):
    tok = Tokenizer(tiny_model)
    ids = tok.encode(CORPUS)
    detok = IncrementalDetokenizer(tok)
    text = "".join(detok.add(i) for i in ids)
    assert text == tok.decode(ids)
    assert "東京" in text and "🙂" in text


def test_random_token_streams_never_emit_partial_characters(tiny_model):
    tok = Tokenizer(tiny_model)
    rng = random.Random(0)
    for _ in range(20):
        ids = [rng.randrange(3, tok.vocab_size) for _ in range(30)]
        detok = IncrementalDetokenizer(tok)
        pieces = [detok.add(i) for i in ids]
        full = tok.decode(ids)
        joined = "".join(pieces)
        assert full.startswith(joined)  # only a trailing incomplete character is withheld...
        assert joined + detok.flush() == full  # ...until the stream ends


def test_chat_template_renders_generation_prompt(tiny_model):
    tok = Tokenizer(tiny_model)
    text = tok.render_chat([{"role": "user", "content": "hi"}])
    assert text.endswith("<|im_start|>assistant\n")
    assert 2 in tok.eos_token_ids  # <|im_end|>
