"""Chapter 03's block table (``check_block_table``): the wrong ``grow_table`` a learner writes, one slip
each (``grow_with``), beside a right slot mapping."""

from __future__ import annotations

from check_catalogue import BT, slot_mapping, wrong


def grow_with(**slip):
    """The copy-then-grow answer, with one learner's slip switched on."""

    def grow_table(table, num_computed, num_new, block_size, ref_count, take, release):
        if slip.get("new_list"):
            table = list(table)
        copies = []
        first = num_computed // block_size
        if slip.get("last_block"):
            first = max(len(table) - 1, 0)
        shared = (lambda b: ref_count(b) >= 1) if slip.get("copies_unshared") else (lambda b: ref_count(b) > 1)
        blocks = range(len(table)) if slip.get("every_shared") else [first]
        for j in blocks:
            if slip.get("no_copy") or not (j < len(table) or slip.get("le_bound")) or not shared(table[j]):
                continue
            private = take()
            copies.append((private, table[j]) if slip.get("reversed") else (table[j], private))
            if not slip.get("no_release"):
                release(table[j])
            if slip.get("append_copy"):
                table.append(private)
            else:
                table[j] = private
        end = num_new if slip.get("only_new") else num_computed + num_new
        if slip.get("floor"):
            while len(table) < end // block_size:
                table.append(take())
        elif slip.get("one_more"):
            while len(table) <= end // block_size:
                table.append(take())
        elif slip.get("forgets_append"):
            while len(table) * block_size < end:
                take()
        else:
            while len(table) * block_size < end:
                table.append(take())
        if slip.get("spare"):
            take()  # one for later, never used
        if slip.get("returns_table"):
            return table
        return copies

    return grow_table


wrong(BT, "writing into it would change the other sequence's K/V", grow_with(no_copy=True), slot_mapping)
wrong(BT, "still counts a reference to shared block", grow_with(no_release=True), slot_mapping)
wrong(BT, "a copy goes (src, dst) = (shared block, private copy)", grow_with(reversed=True), slot_mapping)
wrong(BT, "need ceil(10 / 4) = 3 blocks", grow_with(floor=True), slot_mapping)
wrong(BT, "the table has 3 blocks afterwards, expected 2", grow_with(one_more=True), slot_mapping)
wrong(BT, "grow the table in place", grow_with(new_list=True, returns_table=True), slot_mapping)
wrong(BT, "return the list of (src, dst) block copies", grow_with(returns_table=True), slot_mapping)
wrong(BT, "no new token is written into block 7", grow_with(every_shared=True), slot_mapping)
wrong(BT, "no new token is written into block 8", grow_with(last_block=True), slot_mapping)
wrong(BT, "is not shared (ref_count 1)", grow_with(copies_unshared=True), slot_mapping)
wrong(BT, "every block taken must end up in the table", grow_with(spare=True), slot_mapping)
wrong(BT, "the table has 3 blocks afterwards, expected 2", grow_with(append_copy=True), slot_mapping)
wrong(BT, "your code raised IndexError", grow_with(le_bound=True), slot_mapping)
wrong(BT, "the table has 2 blocks afterwards, expected 3", grow_with(only_new=True), slot_mapping)
wrong(BT, "does every turn of its loop add a block to the table?", grow_with(forgets_append=True), slot_mapping)
