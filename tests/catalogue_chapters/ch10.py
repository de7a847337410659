"""Chapter 10: more wrong answers a learner writes (see ``check_catalogue``)."""

from __future__ import annotations

from check_catalogue import right, wrong  # noqa: F401

# ---- the streaming detokenizer ----------------------------------------------------------------------------

DS = "check_detokenize_step"
REPLACEMENT = chr(0xFFFD)


def detok_step(decode, ids, prefix_offset, read_offset):
    before = decode(ids[prefix_offset:read_offset])
    after = decode(ids[prefix_offset:])
    if len(after) > len(before) and not after.endswith("\ufffd"):
        return after[len(before) :], read_offset, len(ids)
    return "", prefix_offset, read_offset


def detok_early_returns(decode, ids, p, r):
    text = decode(ids[p:])
    if text.endswith(REPLACEMENT):
        return "", p, r  # a character is still incomplete
    old = decode(ids[p:r])
    if len(text) <= len(old):
        return "", p, r
    return text[len(old) :], r, len(ids)


def detok_new_first(decode, ids, prefix_offset, read_offset):
    shown = decode(ids[prefix_offset:read_offset])
    window = decode(ids[prefix_offset:])
    new = window[len(shown) :]
    if not new or window[-1:] == "\N{REPLACEMENT CHARACTER}":
        return "", prefix_offset, read_offset
    return new, read_offset, len(ids)


def detok_vllm_names(decode, all_ids, prefix_offset, read_offset):
    prefix_text = decode(list(all_ids[prefix_offset:read_offset]))
    new_text = decode(list(all_ids[prefix_offset : len(all_ids)]))
    if len(new_text) <= len(prefix_text) or new_text.endswith("�"):
        return "", prefix_offset, read_offset
    return new_text[len(prefix_text) :], read_offset, len(all_ids)


right(DS, detok_early_returns)
right(DS, detok_new_first)
right(DS, detok_vllm_names)


def detok_one_token(decode, ids, prefix_offset, read_offset):
    return decode(ids[-1:]), read_offset, len(ids)  # each token decoded alone


def detok_no_fffd_check(decode, ids, prefix_offset, read_offset):
    before, after = decode(ids[prefix_offset:read_offset]), decode(ids[prefix_offset:])
    if len(after) > len(before):
        return after[len(before) :], read_offset, len(ids)
    return "", prefix_offset, read_offset


def detok_fffd_anywhere(decode, ids, prefix_offset, read_offset):
    before, after = decode(ids[prefix_offset:read_offset]), decode(ids[prefix_offset:])
    if len(after) > len(before) and "\ufffd" not in after:  # any U+FFFD, not only a trailing one
        return after[len(before) :], read_offset, len(ids)
    return "", prefix_offset, read_offset


def detok_offsets_kept(decode, ids, prefix_offset, read_offset):
    before, after = decode(ids[prefix_offset:read_offset]), decode(ids[prefix_offset:])
    if len(after) > len(before) and not after.endswith("\ufffd"):
        return after[len(before) :], prefix_offset, read_offset  # forgot to move the offsets
    return "", prefix_offset, read_offset


def detok_prefix_kept(decode, ids, prefix_offset, read_offset):
    before, after = decode(ids[prefix_offset:read_offset]), decode(ids[prefix_offset:])
    if len(after) > len(before) and not after.endswith("\ufffd"):
        return after[len(before) :], prefix_offset, len(ids)  # the window only grows
    return "", prefix_offset, read_offset


def detok_offsets_swapped(decode, ids, prefix_offset, read_offset):
    before, after = decode(ids[prefix_offset:read_offset]), decode(ids[prefix_offset:])
    if len(after) > len(before) and not after.endswith("\ufffd"):
        return after[len(before) :], len(ids), read_offset
    return "", prefix_offset, read_offset


def detok_offsets_always_move(decode, ids, prefix_offset, read_offset):
    before, after = decode(ids[prefix_offset:read_offset]), decode(ids[prefix_offset:])
    delta = after[len(before) :] if not after.endswith("\ufffd") else ""
    return delta, read_offset, len(ids)  # moved on even when holding back


def detok_slice_plus_one(decode, ids, prefix_offset, read_offset):
    before, after = decode(ids[prefix_offset:read_offset]), decode(ids[prefix_offset:])
    if len(after) > len(before) and not after.endswith("\ufffd"):
        return after[len(before) + 1 :], read_offset, len(ids)
    return "", prefix_offset, read_offset


def detok_slice_minus_one(decode, ids, prefix_offset, read_offset):
    before, after = decode(ids[prefix_offset:read_offset]), decode(ids[prefix_offset:])
    if len(after) > len(before) and not after.endswith("\ufffd"):
        return after[max(len(before) - 1, 0) :], read_offset, len(ids)
    return "", prefix_offset, read_offset


def detok_whole_window(decode, ids, prefix_offset, read_offset):
    before, after = decode(ids[prefix_offset:read_offset]), decode(ids[prefix_offset:])
    if len(after) > len(before) and not after.endswith("\ufffd"):
        return after, read_offset, len(ids)  # the window, not what is new in it
    return "", prefix_offset, read_offset


def detok_at_least_as_long(decode, ids, prefix_offset, read_offset):
    before, after = decode(ids[prefix_offset:read_offset]), decode(ids[prefix_offset:])
    if len(after) >= len(before) and not after.endswith("\ufffd"):
        return after[len(before) :], read_offset, len(ids)
    return "", prefix_offset, read_offset


def detok_tuple_order(decode, ids, prefix_offset, read_offset):
    before, after = decode(ids[prefix_offset:read_offset]), decode(ids[prefix_offset:])
    if len(after) > len(before) and not after.endswith("\ufffd"):
        return read_offset, len(ids), after[len(before) :]
    return prefix_offset, read_offset, ""


def detok_trims_ids(decode, ids, prefix_offset, read_offset):
    del ids[:prefix_offset]  # "the shown tokens are not needed any more"
    before, after = decode(ids[: read_offset - prefix_offset]), decode(ids)
    if len(after) > len(before) and not after.endswith("\ufffd"):
        return after[len(before) :], read_offset, prefix_offset + len(ids)
    return "", prefix_offset, read_offset


def detok_strips_fffd(decode, ids, prefix_offset, read_offset):
    before, after = decode(ids[prefix_offset:read_offset]), decode(ids[prefix_offset:])
    delta = after[len(before) :].rstrip("\ufffd")  # show the complete characters at once
    if delta:
        return delta, read_offset, len(ids)
    return "", prefix_offset, read_offset


def detok_one_token_window(decode, ids, prefix_offset, read_offset):
    before = decode(ids[prefix_offset:read_offset])
    after = decode(ids[prefix_offset : read_offset + 1])  # "one new token since read_offset"
    if len(after) > len(before) and not after.endswith("\ufffd"):
        return after[len(before) :], read_offset, len(ids)
    return "", prefix_offset, read_offset


def detok_checks_before(decode, ids, prefix_offset, read_offset):
    before, after = decode(ids[prefix_offset:read_offset]), decode(ids[prefix_offset:])
    if len(after) > len(before) and not before.endswith("\ufffd"):
        return after[len(before) :], read_offset, len(ids)
    return "", prefix_offset, read_offset


def detok_read_minus_one(decode, ids, prefix_offset, read_offset):
    before, after = decode(ids[prefix_offset:read_offset]), decode(ids[prefix_offset:])
    if len(after) > len(before) and not after.endswith("\ufffd"):
        return after[len(before) :], read_offset, len(ids) - 1  # "the index of the last token"
    return "", prefix_offset, read_offset


def detok_holds_with_none(decode, ids, prefix_offset, read_offset):
    before, after = decode(ids[prefix_offset:read_offset]), decode(ids[prefix_offset:])
    if len(after) > len(before) and not after.endswith("\ufffd"):
        return after[len(before) :], read_offset, len(ids)
    return None  # nothing to say yet


def detok_only_new_tokens(decode, ids, prefix_offset, read_offset):
    text = decode(ids[read_offset:])  # what the tokens since the last emit spell
    if text and not text.endswith("\ufffd"):
        return text, read_offset, len(ids)
    return "", prefix_offset, read_offset


wrong(DS, "is the new token decoded alone", detok_one_token)
wrong(DS, "you emitted U+FFFD", detok_no_fffd_check)
wrong(DS, "holds a U+FFFD in the middle", detok_fffd_anywhere)
wrong(DS, "the offsets must move on", detok_offsets_kept)
wrong(DS, "prefix_offset stayed at", detok_prefix_kept)
wrong(DS, "the offsets must be (0, 1)", detok_offsets_swapped)
wrong(DS, "you moved the offsets to (1, 2) while emitting nothing", detok_offsets_always_move)
wrong(DS, "check the slice's start", detok_slice_plus_one)
wrong(DS, "repeats text already shown", detok_slice_minus_one)
wrong(DS, "repeats text already shown", detok_whole_window)
wrong(DS, "you moved the offsets to (1, 2) while emitting nothing", detok_at_least_as_long)
wrong(DS, "return (delta, prefix_offset, read_offset) in that order", detok_tuple_order)
wrong(DS, "detokenize_step changed ids", detok_trims_ids)
wrong(DS, "not even the whole characters before it", detok_strips_fffd)
wrong(DS, "tokens came since read_offset", detok_one_token_window)
wrong(DS, "you emitted U+FFFD", detok_checks_before)
wrong(DS, "the offsets must move on", detok_read_minus_one)
wrong(DS, "return the tuple (delta, prefix_offset, read_offset)", detok_holds_with_none)
wrong(DS, "is the new token decoded alone", detok_only_new_tokens)
