"""Chapter 01's stopping exercise: ``append_token(seq, token_id)`` and ``take_stream_text(seq)`` —
when a request ends, with what text, and how much of that text a stream may show yet.

The diagnosis runs hand-made scenes on a stand-in sequence whose detokenizer is scripted (each
token's text is fixed; one token is half a character, held back until the next), so that each
rule is seen on its own: a stop token's text is never added but the held bytes are flushed; EOS
ends a request unless ``ignore_eos``; a stop string may span tokens, is cut *before* its earliest
match, and is searched only as far back as it could end in the new text; the length limit is
``seq.max_output``; a stop wins over the length at the last token. Then both functions run as
every sequence's in the engine, on requests whose stop strings and stop tokens come from the
package's own output, and the texts, tokens, reasons and streamed deltas must be the package's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import minillm.hooks as hooks
from minillm.course.checks.common import DEFAULT_MODEL
from minillm.course.results import CheckFailed, check

TEXTS = {1: "Hel", 2: "lo", 3: " wor", 4: "ld", 5: "!", 6: "abc", 7: "XY", 8: "Z", 9: "</s>", 10: "<|end|>"}
EOS, STOP_TOKEN, HALF = 9, 10, 11  # HALF: the first byte of a two-byte character
REPLACEMENT = "\ufffd"


class ScriptedDetokenizer:
    """Each token's text is fixed; ``HALF`` is held back (a character's first byte) until the next
    token completes it, and ``flush()`` shows whatever is held as a replacement character."""

    def __init__(self):
        self.held = ""
        self.calls: list[str] = []

    def add(self, token_id: int) -> str:
        self.calls.append(f"add({token_id})")
        if token_id == HALF:
            self.held = REPLACEMENT
            return ""
        text = ("é" if self.held else "") + TEXTS.get(token_id, "?")
        self.held = ""
        return text

    def flush(self) -> str:
        self.calls.append("flush()")
        text, self.held = self.held, ""
        return text


@dataclass
class StandInSequence:
    """What ``append_token`` and ``take_stream_text`` may read of the engine's ``Sequence``."""

    params: object
    max_output: int
    eos_token_ids: frozenset = frozenset({EOS})
    output_token_ids: list[int] = field(default_factory=list)
    text: str = ""
    num_emitted_chars: int = 0
    is_finished: bool = False
    detokenizer: ScriptedDetokenizer = field(default_factory=ScriptedDetokenizer)


@dataclass
class Scene:
    what: str
    tokens: list[int]
    reasons: list  # the expected return after each token
    text: str  # the text at the end
    why: str  # what the rule is, for the message
    params: dict = field(default_factory=dict)
    max_output: int = 10


SCENES = [
    Scene("three plain tokens", [1, 2, 3], [None, None, None], "Hello wor", "no rule ends it: return None"),
    Scene(
        "EOS (token 9, text '</s>')", [1, EOS], [None, "stop"], "Hel",
        "an EOS id (seq.eos_token_ids) ends the request with 'stop', and its text is not part of the answer",
    ),
    Scene(
        "EOS with ignore_eos=True", [1, EOS, 2], [None, None, None], "Hel</s>lo",
        "with params.ignore_eos the EOS token is an ordinary token: its text is added and the request goes on",
        {"ignore_eos": True},
    ),
    Scene(
        "stop_token_ids=[10] (text '<|end|>')", [1, STOP_TOKEN], [None, "stop"], "Hel",
        "a token of params.stop_token_ids ends the request with 'stop', without its text",
        {"stop_token_ids": [STOP_TOKEN]},
    ),
    Scene(
        "half a character, then a stop token", [1, HALF, STOP_TOKEN], [None, None, "stop"], "Hel" + REPLACEMENT,
        "the detokenizer still held half a character when the stop token came: add seq.detokenizer.flush() to the "
        "text before ending (the stop token's own text is never added)",
        {"stop_token_ids": [STOP_TOKEN]},
    ),
    Scene(
        "stop=['lo w'], which spans tokens 2 and 3", [1, 2, 3], [None, None, "stop"], "Hel",
        "a stop string may span tokens: search the text, not only the new token's text, and cut it *before* the "
        "match — the stop string is not returned",
        {"stop": ["lo w"]},
    ),
    Scene(
        "stop=['XYZ'] after 'abcXY' + 'Z'", [6, 7, 8], [None, None, "stop"], "abc",
        "a stop string can start len(stop) - 1 characters before the new text: search from max(0, text_before - "
        "len(longest) + 1)",
        {"stop": ["XYZ"]},
    ),
    Scene(
        "stop=['?!', 'XYZ'] after 'abcXY' + 'Z'", [6, 7, 8], [None, None, "stop"], "abc",
        "the search must reach back far enough for the *longest* stop string to end in the new text: "
        "max(0, text_before - max(len(s) for s in stop) + 1)",
        {"stop": ["?!", "XYZ"]},
    ),
    Scene(
        "stop=['Hel'], the first token's whole text", [1], ["stop"], "",
        "a stop string can start at the very beginning of the text (position 0): search from max(0, ...), and "
        "an empty text is the answer then",
        {"stop": ["Hel"]},
    ),
    Scene(
        "stop=['wor', 'o w']: both match at token 3", [1, 2, 3], [None, None, "stop"], "Hell",
        "when several stop strings match, cut at the *earliest* position in the text (min over the matches), "
        "whatever their order in the list",
        {"stop": ["wor", "o w"]},
    ),
    Scene(
        "max_output=3", [1, 2, 3], [None, None, "length"], "Hello wor",
        "the request ends with 'length' when it has seq.max_output output tokens — at the 3rd, not after it",
        {"max_tokens": 3}, 3,
    ),
    Scene(
        "max_output=3, the last token half a character", [1, 2, HALF], [None, None, "length"], "Hello" + REPLACEMENT,
        "at the length limit the detokenizer may still hold half a character: add seq.detokenizer.flush()",
        {"max_tokens": 3}, 3,
    ),
    Scene(
        "max_tokens=10 but max_output=2 (the context is nearly full)", [1, 2], [None, "length"], "Hello",
        "the limit is seq.max_output — max_tokens or the room left in the model's context, whichever is smaller — "
        "not params.max_tokens",
        {"max_tokens": 10}, 2,
    ),
    Scene(
        "EOS as the last allowed token (max_output=2)", [1, EOS], [None, "stop"], "Hel",
        "a stop token at the length limit ends with 'stop' (the model chose to end), and without its text",
        {"max_tokens": 2}, 2,
    ),
    Scene(
        "stop=['lo w'] completed by the last allowed token (max_output=3)", [1, 2, 3], [None, None, "stop"], "Hel",
        "a stop string completed at the length limit ends with 'stop', its text cut before it",
        {"stop": ["lo w"], "max_tokens": 3}, 3,
    ),
]  # fmt: skip


def _params(**kw):
    from minillm import SamplingParams

    return SamplingParams(**{"max_tokens": 10, **kw})


def _diagnose_append(append_token) -> None:
    for scene in SCENES:
        seq = StandInSequence(_params(**scene.params), scene.max_output)
        for n, (token, want) in enumerate(zip(scene.tokens, scene.reasons)):
            got = append_token(seq, token)
            where = f"{scene.what}: after token {token} (#{n + 1})"
            if got not in (None, "stop", "length") or isinstance(got, bool):
                raise CheckFailed(f"{where}, append_token returned {got!r}: return 'stop', 'length' or None")
            if seq.output_token_ids != scene.tokens[: n + 1]:
                raise CheckFailed(
                    f"{where}, seq.output_token_ids is {seq.output_token_ids}, expected {scene.tokens[: n + 1]}: "
                    "append every token to seq.output_token_ids, the one that ends the request too (it is the "
                    "model's output, and what the usage counts)"
                )
            if got != want:
                raise CheckFailed(f"{where}, append_token returned {got!r}, expected {want!r}: {scene.why}")
            if want is not None:
                break
        if seq.text != scene.text:
            raise CheckFailed(f"{scene.what}: seq.text is {seq.text!r}, expected {scene.text!r}: {scene.why}")


@dataclass
class StreamScene:
    what: str
    stop: list[str]
    steps: list  # (text, finished, expected delta)
    why: str


STREAM_SCENES = [
    StreamScene("no stop strings", [], [("Hello", False, "Hello"), ("Hello wor", False, " wor")],
                "without stop strings every new character can be shown at once"),
    StreamScene(
        "stop=['world!'] (6 characters)", ["world!"],
        [("Hello wor", False, "Hell"), ("Hello world", False, "o "), ("Hello world", True, "world")],
        "while the request runs, hold back len(longest stop string) - 1 characters (here 5: 'o wor' could "
        "still become 'world!'), no more; once it is finished show everything left",
    ),
    StreamScene(
        "stop=['abcdef'], only 'xy' so far", ["abcdef"], [("xy", False, ""), ("xyz", False, ""), ("xyz", True, "xyz")],
        "when the text is shorter than what is held back, show nothing — the end of what is shown never moves "
        "back: end = max(seq.num_emitted_chars, len(seq.text) - hold)",
    ),
    StreamScene(
        "stop=['lo w'], finished with the text cut", ["lo w"], [("Hel", False, ""), ("Hel", True, "Hel")],
        "a finished request's text is already cut before its stop string: show all of it",
    ),
]  # fmt: skip


def _diagnose_stream(take_stream_text) -> None:
    for scene in STREAM_SCENES:
        seq = StandInSequence(_params(stop=scene.stop), 10)
        shown = ""
        for text, finished, want in scene.steps:
            seq.text, seq.is_finished = text, finished
            got = take_stream_text(seq)
            where = f"{scene.what}: with seq.text {text!r}" + (" (finished)" if finished else "")
            if not isinstance(got, str):
                raise CheckFailed(f"{where}, take_stream_text returned {got!r}: return the new text, a str")
            if got != want:
                if shown and got.startswith(shown):
                    raise CheckFailed(
                        f"{where}, take_stream_text returned {got!r} after {shown!r} was shown: set "
                        "seq.num_emitted_chars to where what you return ends, so the next call starts there"
                    )
                raise CheckFailed(f"{where}, take_stream_text returned {got!r}, expected {want!r}: {scene.why}")
            if seq.num_emitted_chars < len(shown):
                raise CheckFailed(
                    f"{where}, seq.num_emitted_chars went back to {seq.num_emitted_chars} after {len(shown)} "
                    f"characters were shown: {scene.why}"
                )
            shown += got
            if seq.num_emitted_chars != len(shown):
                raise CheckFailed(
                    f"{where}, seq.num_emitted_chars is {seq.num_emitted_chars} after {len(shown)} characters were "
                    "shown: set seq.num_emitted_chars to where what you return ends (it counts the characters of "
                    "seq.text handed to the stream so far)"
                )


def _requests(llm, prompts):
    """Requests whose stop strings and stop tokens come from the package's own greedy output, so
    that each rule fires in the engine: a stop string spanning tokens, a stop token, EOS and its
    ignore_eos twin, a short max_tokens."""
    from minillm import SamplingParams

    free = llm.generate(prompts[:2], SamplingParams(max_tokens=24, ignore_eos=True))
    text, ids = free[0].text, free[0].token_ids
    spanning = text[len(text) // 3 : len(text) // 3 + 3]  # three characters in the middle
    later = free[1].text[10:12]
    eos = sorted(llm.tokenizer.eos_token_ids)
    return [
        (prompts[0], SamplingParams(max_tokens=24, stop=[spanning, later])),
        (prompts[1], SamplingParams(max_tokens=24, stop=[later], ignore_eos=True)),
        (prompts[0], SamplingParams(max_tokens=24, stop_token_ids=[ids[7]], ignore_eos=True)),
        (prompts[0], SamplingParams(max_tokens=24, stop_token_ids=eos)),
        (prompts[2], SamplingParams(max_tokens=5, ignore_eos=True)),
    ]


@check
def check_stopping(append_token, take_stream_text, model: str = DEFAULT_MODEL) -> str:
    """``append_token(seq, token_id) -> 'stop' | 'length' | None`` and ``take_stream_text(seq) -> str``."""
    from minillm import LLM

    _diagnose_append(append_token)
    _diagnose_stream(take_stream_text)
    llm = LLM(model, dtype="fp32", compile=False)
    prompts = ["ROMEO.\nBut soft, what light", "KING.\nNow is the winter", "HAMLET.\nTo be, or not"]
    requests = _requests(llm, prompts)

    def run():
        outs = [llm.generate([p], params)[0] for p, params in requests]
        deltas = [[d.text for d in llm.stream(p, params)] for p, params in requests[:2]]
        return [(o.text, o.token_ids, o.finish_reason) for o in outs], deltas

    expected, expected_deltas = run()
    calls = {"append_token": 0, "take_stream_text": 0}

    def counted(name, fn):
        def call(*args):
            calls[name] += 1
            return fn(*args)

        return call

    with hooks.override(
        append_token=counted("append_token", append_token),
        take_stream_text=counted("take_stream_text", take_stream_text),
    ):
        got, got_deltas = run()
    if not calls["append_token"] or not calls["take_stream_text"]:
        raise RuntimeError(f"the engine did not call both hooks: {calls}")
    for i, ((text, ids, reason), (want_text, want_ids, want_reason)) in enumerate(zip(got, expected)):
        if (ids, reason, text) != (want_ids, want_reason, want_text):
            raise CheckFailed(
                f"request {i} ({requests[i][1]!r:.120}) in the engine: tokens {ids[-3:]}…, reason {reason!r}, text "
                f"{text[-20:]!r}; the package's: {want_ids[-3:]}…, {want_reason!r}, {want_text[-20:]!r} — the "
                "hand-made scenes matched, so look at what the real sequence has that they had not"
            )
    for i, (mine, ref) in enumerate(zip(got_deltas, expected_deltas)):
        if mine != ref:
            raise CheckFailed(
                f"request {i} streamed {mine[:6]}…, the package streams {ref[:6]}…: the same text, cut into other "
                "deltas — hold back exactly len(longest stop string) - 1 characters while it runs"
            )
    reasons = sorted({r for _, _, r in got})
    return (
        f"your append_token took all {calls['append_token']} tokens of {len(requests)} requests in the engine "
        f"({' and '.join(reasons)}: stop strings, a stop token, EOS, max_tokens) and your take_stream_text cut "
        f"{sum(map(len, got_deltas))} deltas — texts, tokens, reasons and streams identical to the package's"
    )
