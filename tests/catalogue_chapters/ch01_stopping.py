"""Chapter 01's stopping exercise (``check_stopping``): two right answers written independently, and
the wrong ones a learner writes, one slip each (``append_with``, ``stream_with``)."""

from __future__ import annotations

import re

from check_catalogue import right, wrong

ST = "check_stopping"


def append_with(**slip):
    """The engine's append_token, with one learner's slip switched on."""

    def append_token(seq, token_id):
        p = seq.params
        if not slip.get("appends_late"):
            seq.output_token_ids.append(token_id)
        stops = set(p.stop_token_ids)
        if not slip.get("never_eos") and (slip.get("always_eos") or not p.ignore_eos):
            stops |= set(seq.eos_token_ids)
        if slip.get("length_first") and len(seq.output_token_ids) >= seq.max_output:
            seq.text += seq.detokenizer.add(token_id) + seq.detokenizer.flush()
            return "length"
        if token_id in stops:
            if slip.get("adds_stop_text"):
                seq.text += seq.detokenizer.add(token_id)
            if not slip.get("no_flush"):
                seq.text += seq.detokenizer.flush()
            return "stop"
        before = len(seq.text)
        new = seq.detokenizer.add(token_id)
        seq.text += new
        if slip.get("appends_late"):
            seq.output_token_ids.append(token_id)
        if p.stop:
            longest = max(len(s) for s in p.stop)
            start = max(0, before - longest + (2 if slip.get("search_late") else 1))
            if slip.get("new_text_only"):
                hits = [before + i for s in p.stop if (i := new.find(s)) != -1]
            else:
                hits = [i for s in p.stop if (i := seq.text.find(s, start)) != -1]
            if hits:
                cut = hits[0] if slip.get("first_listed") else min(hits)
                if slip.get("keeps_stop"):
                    pass
                elif slip.get("cuts_after"):
                    stop = next(s for s in p.stop if seq.text.find(s, start) == cut)
                    seq.text = seq.text[: cut + len(stop)]
                else:
                    seq.text = seq.text[:cut]
                return "stop"
        limit = p.max_tokens if slip.get("max_tokens") else seq.max_output
        done = len(seq.output_token_ids) > limit if slip.get("one_late") else len(seq.output_token_ids) >= limit
        if done and not slip.get("length_first"):
            if not slip.get("no_flush_at_length"):
                seq.text += seq.detokenizer.flush()
            return True if slip.get("returns_bool") else "length"
        return None

    return append_token


def take_stream_text(seq):
    hold = max(len(s) for s in seq.params.stop) - 1 if seq.params.stop and not seq.is_finished else 0
    end = max(seq.num_emitted_chars, len(seq.text) - hold)
    delta = seq.text[seq.num_emitted_chars : end]
    seq.num_emitted_chars = end
    return delta


def stream_with(**slip):
    """take_stream_text with one slip switched on."""

    def take(seq):
        stop = seq.params.stop
        hold = 0
        if stop and (slip.get("holds_when_finished") or not seq.is_finished) and not slip.get("no_hold"):
            hold = max(len(s) for s in stop) - (0 if slip.get("holds_whole") else 1)
        end = len(seq.text) - hold if slip.get("moves_back") else max(seq.num_emitted_chars, len(seq.text) - hold)
        delta = seq.text[seq.num_emitted_chars : end]
        if slip.get("from_start"):
            delta = seq.text[:end]
        if not slip.get("no_advance"):
            seq.num_emitted_chars = end
        return delta

    return take


def append_by_regex(seq, token_id):
    """Right, written differently: the stop strings as one regex over a window of the text."""
    p = seq.params
    seq.output_token_ids += [token_id]
    ends = set(p.stop_token_ids) | (set() if p.ignore_eos else set(seq.eos_token_ids))
    if token_id in ends:
        seq.text = seq.text + seq.detokenizer.flush()
        return "stop"
    old = seq.text
    seq.text = old + seq.detokenizer.add(token_id)
    if p.stop:
        window = max(0, len(old) - max(map(len, p.stop)) + 1)
        m = re.compile("|".join(map(re.escape, p.stop))).search(seq.text, window)
        if m is not None:  # search finds the leftmost start of any alternative: the earliest match
            seq.text = seq.text[: m.start()]
            return "stop"
    if len(seq.output_token_ids) < seq.max_output:
        return None
    seq.text += seq.detokenizer.flush()
    return "length"


def stream_by_slices(seq):
    """Right, written differently: what is safe to show, then the part of it not shown yet."""
    if seq.is_finished or not seq.params.stop:
        safe = seq.text
    else:
        safe = seq.text[: max(0, len(seq.text) - (max(len(s) for s in seq.params.stop) - 1))]
    if len(safe) <= seq.num_emitted_chars:
        return ""
    delta = safe[seq.num_emitted_chars :]
    seq.num_emitted_chars = len(safe)
    return delta


right(ST, append_with(), take_stream_text)
right(ST, append_by_regex, stream_by_slices)
right(ST, append_by_regex, take_stream_text)
wrong(ST, "with params.ignore_eos the EOS token is an ordinary token", append_with(always_eos=True), take_stream_text)
wrong(ST, "an EOS id (seq.eos_token_ids) ends the request", append_with(never_eos=True), take_stream_text)
wrong(ST, "its text is not part of the answer", append_with(adds_stop_text=True), take_stream_text)
wrong(ST, "add seq.detokenizer.flush() to the text before ending", append_with(no_flush=True), take_stream_text)
wrong(ST, "the one that ends the request too", append_with(appends_late=True), take_stream_text)
wrong(ST, "a stop token at the length limit ends with 'stop'", append_with(length_first=True), take_stream_text)
wrong(ST, "a stop string may span tokens", append_with(new_text_only=True), take_stream_text)
wrong(ST, "cut it *before* the match", append_with(keeps_stop=True), take_stream_text)
wrong(ST, "cut it *before* the match", append_with(cuts_after=True), take_stream_text)
wrong(ST, "search from max(0, text_before", append_with(search_late=True), take_stream_text)
wrong(ST, "cut at the *earliest* position", append_with(first_listed=True), take_stream_text)
wrong(ST, "at the 3rd, not after it", append_with(one_late=True), take_stream_text)
wrong(ST, "not params.max_tokens", append_with(max_tokens=True), take_stream_text)
wrong(ST, "the detokenizer may still hold half a character", append_with(no_flush_at_length=True), take_stream_text)
wrong(ST, "return 'stop', 'length' or None", append_with(returns_bool=True), take_stream_text)
wrong(ST, "hold back len(longest stop string) - 1", append_with(), stream_with(no_hold=True))
wrong(ST, "hold back len(longest stop string) - 1", append_with(), stream_with(holds_whole=True))
wrong(ST, "once it is finished show everything left", append_with(), stream_with(holds_when_finished=True))
wrong(ST, "never moves back", append_with(), stream_with(moves_back=True))
wrong(ST, "set seq.num_emitted_chars to where what you return ends", append_with(), stream_with(no_advance=True))
wrong(ST, "set seq.num_emitted_chars to where what you return ends", append_with(), stream_with(from_start=True))
