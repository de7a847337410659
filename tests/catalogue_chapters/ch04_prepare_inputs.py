"""Chapter 04's runner inputs (``check_prepare_inputs``): right answers written independently, and the
wrong ones a learner writes, one slip each (``build(...)`` switches it on)."""

from __future__ import annotations

import itertools

from check_catalogue import right, wrong

PI = "check_prepare_inputs"


def build(**slip):
    def prepare_inputs(chunks, block_size, null_block):
        decodes = [c for c in chunks if len(c.token_ids) == 1]
        order = list(chunks) if slip.get("keep_order") else decodes + [c for c in chunks if len(c.token_ids) > 1]
        out = dict(input_ids=[], positions=[], slot_mapping=[], query_lens=[], context_lens=[])
        for c in order:
            n = len(c.token_ids)
            out["input_ids"] += c.token_ids
            for i, p in enumerate(range(c.start, c.start + n)):
                out["positions"].append(i if slip.get("positions_from_zero") else p)
                if slip.get("slot_is_position"):
                    out["slot_mapping"].append(p)
                elif slip.get("slot_no_multiply"):
                    out["slot_mapping"].append(c.block_table[p // block_size] + p % block_size)
                else:
                    out["slot_mapping"].append(c.block_table[p // block_size] * block_size + p % block_size)
            out["query_lens"].append(n)
            out["context_lens"].append(n if slip.get("context_is_n") else c.start + n)
        width = max(-(-n // block_size) for n in out["context_lens"])
        if slip.get("widest_table"):
            width = max(len(c.block_table) for c in order)
        pad = 0 if slip.get("pad_zero") else null_block
        if slip.get("ragged"):
            out["block_tables"] = [list(c.block_table) for c in order]
        else:
            out["block_tables"] = [(c.block_table + [pad] * width)[:width] for c in order]
        out["num_decodes"] = len(chunks) if slip.get("all_decodes") else len(decodes)
        ends = dict(zip(map(id, order), itertools.accumulate(out["query_lens"])))
        listed = order if slip.get("rows_in_flat_order") else chunks
        if slip.get("one_row_each"):
            out["logit_rows"] = [ends[id(c)] - 1 for c in listed]
        else:
            out["logit_rows"] = [ends[id(c)] - k for c in listed for k in range(c.num_logits, 0, -1)]
        return out

    return prepare_inputs


def prepare_b(chunks, block_size, null_block):
    """Index arithmetic with two passes and decodes sorted by start, as the engine does."""
    decodes = sorted((c for c in chunks if len(c.token_ids) == 1), key=lambda c: c.start)
    order = decodes + [c for c in chunks if len(c.token_ids) != 1]
    starts = [0]
    for c in order:
        starts.append(starts[-1] + len(c.token_ids))
    positions = [c.start + i for c in order for i in range(len(c.token_ids))]
    tables = [c.block_table for c in order for _ in c.token_ids]
    slots = [t[p // block_size] * block_size + p % block_size for t, p in zip(tables, positions)]
    contexts = [c.start + len(c.token_ids) for c in order]
    width = (max(contexts) + block_size - 1) // block_size
    index = {id(c): k for k, c in enumerate(order)}
    rows = []
    for c in chunks:
        end = starts[index[id(c)] + 1]
        rows.extend(range(end - c.num_logits, end))
    return {
        "input_ids": [t for c in order for t in c.token_ids],
        "positions": positions,
        "slot_mapping": slots,
        "query_lens": [len(c.token_ids) for c in order],
        "context_lens": contexts,
        "block_tables": [c.block_table[:width] + [null_block] * (width - len(c.block_table[:width])) for c in order],
        "num_decodes": len(decodes),
        "logit_rows": rows,
    }


def prepare_in_place(chunks, block_size, null_block):
    """Pads the chunks' own block tables (``c.block_table += ...``): the sequences' tables grow."""
    out = build()(chunks, block_size, null_block)
    width = len(out["block_tables"][0])
    for c in chunks:
        c.block_table += [null_block] * (width - len(c.block_table))
    return out


def prepare_tuple(chunks, block_size, null_block):
    return tuple(build()(chunks, block_size, null_block).values())


def prepare_missing_rows(chunks, block_size, null_block):
    out = build()(chunks, block_size, null_block)
    del out["logit_rows"]
    return out


right(PI, build())
right(PI, prepare_b)

for slip, message in (
    ({"keep_order": True}, "put the decodes (one-token chunks) first"),
    ({"positions_from_zero": True}, "positions start at 0 for every chunk"),
    ({"slot_is_position": True}, "slot_mapping is the position itself"),
    ({"slot_no_multiply": True}, "multiply the block id by block_size first"),
    ({"context_is_n": True}, "context_lens counts only the new tokens"),
    ({"pad_zero": True}, "pad with null_block, which no sequence owns"),
    ({"ragged": True}, "block_tables have one length per sequence"),
    ({"widest_table": True}, "as wide as the longest block table"),
    ({"all_decodes": True}, "num_decodes counts every chunk"),
    ({"rows_in_flat_order": True}, "list them in the order of `chunks`"),
    ({"one_row_each": True}, "a chunk wants its last num_logits rows"),
):
    wrong(PI, message, build(**slip))
wrong(PI, "changed a chunk's token_ids or block_table", prepare_in_place)
wrong(PI, "should return a dict", prepare_tuple)
wrong(PI, "dict has no logit_rows", prepare_missing_rows)
