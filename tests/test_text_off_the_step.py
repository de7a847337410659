"""Detokenization off the step: a request without stop strings gets ``DeferredDelta``s whose
text is made when read (``sequence.py``). Whatever the reader does — read each delta at once,
read them all at the end, read the last one first, read from another thread while the engine
steps, abort half-way, plug a learner's hook in mid-request — every delta's text and every
output must be exactly what the step itself made before (the hooks' reference on the step)."""

from __future__ import annotations

import random
import threading

import pytest

import minillm.hooks as hooks
from minillm import LLMEngine, SamplingParams
from minillm.outputs import DeferredDelta

TINY = "data/tiny-shakespeare-1m"
PROMPTS = ["To be, or not to be", "Friends, Romans", "Now is the winter of", "O Romeo", "What light"]


@pytest.fixture(scope="module", params=["shakespeare", "multibyte"])
def engine(request):
    """The 1M Shakespeare model (its text mostly ASCII), and the suite's random tiny model, whose
    byte-level vocabulary makes half characters (held back, then flushed) common."""
    model = TINY if request.param == "shakespeare" else request.getfixturevalue("tiny_model")
    engine = LLMEngine(model, compile=False, max_num_seqs=8)
    yield engine
    engine.close()


def on_the_step(seq, token_id):
    """The reference ``append_token`` as a learner's override: the text is made on the step."""
    return hooks.default("append_token")(seq, token_id)


def params(seed: int) -> list[SamplingParams]:
    eos = [] if seed % 2 else [3]  # a stop token id now and then: it ends a request without its text
    return [
        SamplingParams(max_tokens=5 + 7 * i, temperature=1.0, seed=seed * 10 + i, stop_token_ids=eos,
                       n=2 if i == 1 else 1, logprobs=1 if i == 2 else None)  # fmt: skip
        for i in range(len(PROMPTS))
    ]


def run(engine, seed, read="now", abort_at=None):
    """Every request's deltas (by request and sample) and outputs, read the way ``read`` says."""
    ids = [engine.add_request(p, sp) for p, sp in zip(PROMPTS, params(seed))]
    deltas, step = [], 0
    while engine.has_unfinished_requests():
        got = engine.step()
        if read == "now":
            [d.text for d in got]
        deltas += got
        step += 1
        if step == abort_at and ids[3] in engine.requests:
            deltas.append(engine.abort(ids[3]))
    if read == "reversed":
        [d.text for d in reversed(deltas)]
    return described(deltas, ids)


def described(deltas, ids) -> list[tuple]:
    """What a caller sees of each delta (or an abort's output), by the request's place in ``ids``."""
    return [
        (ids.index(d.request_id), d.text, d.finish_reason, d.output.text if d.output else None)
        if not hasattr(d, "prompt") else ("abort", d.text, d.finish_reason)
        for d in deltas
    ]


@pytest.mark.parametrize("read", ["now", "late", "reversed"])
@pytest.mark.parametrize("seed", [0, 1])
def test_deferred_text_is_the_text_the_step_made(engine, seed, read):
    with hooks.override(append_token=on_the_step):
        expected = run(engine, seed)
    got = run(engine, seed, read)
    assert got == expected
    assert any(text for _, text, *_ in got)


def test_an_abort_keeps_the_deltas_text_and_the_output_is_complete(engine):
    with hooks.override(append_token=on_the_step):
        expected = run(engine, 1, abort_at=4)
    assert run(engine, 1, read="late", abort_at=4) == expected


def test_the_step_makes_no_text_and_the_reader_does(engine):
    calls = []
    reference = hooks.default("detokenize_step")

    def counted(*args):
        calls.append(1)
        return reference(*args)

    with hooks.override(detokenize_step=counted):
        engine.add_request("To be, or not to be", SamplingParams(max_tokens=6, ignore_eos=True))
        deltas = []
        while engine.has_unfinished_requests():
            deltas += engine.step()
        assert calls == [] and all(isinstance(d, DeferredDelta) for d in deltas)
    # Read after the override ended: made by the detokenize_step in force when the tokens came
    # (chapter 10's check streams inside its override and may read the answers after it).
    text = "".join(d.text for d in deltas)
    assert len(calls) == 6 and text == deltas[-1].output.text != ""
    # A request with stop strings is detokenized on the step: a stop string must end it there.
    with hooks.override(detokenize_step=counted):
        calls.clear()
        engine.add_request("To be, or not to be", SamplingParams(max_tokens=6, ignore_eos=True, stop=["zzz"]))
        while engine.has_unfinished_requests():
            assert not any(isinstance(d, DeferredDelta) for d in engine.step())
        assert len(calls) == 6


def test_a_learners_hook_plugged_in_mid_request_takes_over_exactly(engine):
    with hooks.override(append_token=on_the_step):
        expected = run(engine, 0)
    ids = [engine.add_request(p, sp) for p, sp in zip(PROMPTS, params(0))]
    deltas = []
    for _ in range(3):
        deltas += engine.step()  # deferred, unread
    with hooks.override(append_token=on_the_step):
        while engine.has_unfinished_requests():
            deltas += engine.step()
    assert described(deltas, ids) == expected


def test_a_reader_thread_settles_while_the_engine_steps(engine):
    """The server's shape: the engine's thread steps; another thread reads the texts."""
    with hooks.override(append_token=on_the_step):
        expected = run(engine, 1)
    ids = [engine.add_request(p, sp) for p, sp in zip(PROMPTS, params(1))]
    produced, done = [], threading.Event()

    def reader():
        rng = random.Random(0)
        while not done.is_set() or produced:
            if produced:
                rng.choice(produced[-3:]).text  # noqa: B018 (reading settles it and those before it)
                produced.pop(0).text  # noqa: B018

    thread = threading.Thread(target=reader)
    thread.start()
    deltas = []
    while engine.has_unfinished_requests():
        got = engine.step()
        deltas += got
        produced.extend(got)
    done.set()
    thread.join(timeout=30)
    assert described(deltas, ids) == expected


def test_deltas_dropped_unread_cost_nothing_and_their_text_goes_to_the_next_read(engine):
    """``generate`` keeps only each request's last delta: the ones it dropped are not kept for
    their text (a long answer would hold one object per token), and the text they would have
    shown goes to the next delta read, so the answer is whole."""
    with hooks.override(append_token=on_the_step):
        expected = run(engine, 0)
    ids = [engine.add_request(p, sp) for p, sp in zip(PROMPTS, params(0))]
    kept, longest = [], 0
    while engine.has_unfinished_requests():
        for delta in engine.step():
            if delta.finish_reason is not None or delta.token_id % 3 == 0:
                delta.text  # noqa: B018 (read now, as a stream's reader does)
                kept.append(delta)  # the others are dropped here, unread
        longest = max([longest] + [len(s.pending_deltas) for r in engine.requests.values() for s in r.samples])
    assert longest <= 3, longest
    finals = [d.output.text for d in kept if d.finish_reason is not None]
    assert sorted(finals) == sorted(out for *_, out in expected if out is not None)
    assert ids
    shown = {}
    for d in kept:
        shown[(d.request_id, d.index)] = shown.get((d.request_id, d.index), "") + d.text
    for d in kept:
        if d.finish_reason is not None:
            assert shown[(d.request_id, d.index)] == d.output.text


def test_a_settled_delta_lets_its_sequence_go_and_copies_like_a_plain_one(engine):
    import copy
    import dataclasses
    import pickle

    engine.add_request("To be", SamplingParams(max_tokens=3, ignore_eos=True))
    deltas = []
    while engine.has_unfinished_requests():
        deltas += engine.step()
    last = deltas[-1]
    assert isinstance(last, DeferredDelta) and last.output.text == "".join(d.text for d in deltas)
    assert last._seq is None  # settled: it no longer holds the sequence (its tokenizer, its lists)
    again = pickle.loads(pickle.dumps(last))
    assert type(again).__name__ == "StreamDelta" and again.text == last.text and again.output == last.output
    assert dataclasses.replace(last, index=0).text == last.text
    assert copy.deepcopy(last).text == last.text
