"""Chapter 04's whole piece: the learner's input building for one mixed step of the paged runner.

``prepare_inputs(chunks, block_size, null_block)`` turns the scheduler's chunks — decodes, whole
prompts, a prompt's middle chunk, a speculative verify chunk — into the flat lists the paged
attention reads. Two stages:

1. **diagnosis on a hand-made step** — five chunks of every kind, field by field against the
   textbook layout (the decodes first, as they come), each classic slip named (positions from 0,
   a slot from the block's index instead of its id, the context without the cached tokens,
   tables padded with 0 or to a wrong width, logit rows in the runner's order, ``num_logits``
   ignored);
2. **the plug-in run** — the learner's function as the input building of the real paged engine
   (hook ``step_layout``), with a token budget small enough that prompts are chunked and steps mix
   decodes and prefills: greedy tokens equal to the same engine's own, and mixed steps counted.
"""

from __future__ import annotations

import torch

import minillm.hooks as hooks
from minillm.course.compare import compare_requests
from minillm.course.results import CheckFailed, check
from minillm.runtime.runner import ChunkInput

FIELDS = ("input_ids", "positions", "slot_mapping", "query_lens", "context_lens", "block_tables", "num_decodes",
          "logit_rows")  # fmt: skip


def reference_inputs(chunks: list[ChunkInput], block_size: int, null_block: int, decodes=None) -> dict:
    """The textbook layout: decodes first (in the order they come, or as ``decodes`` lists them:
    any order of the decodes is right — the engine sorts them by start), then the other chunks."""
    decodes = decodes if decodes is not None else [c for c in chunks if len(c.token_ids) == 1]
    order = list(decodes) + [c for c in chunks if len(c.token_ids) > 1]
    out: dict = {k: [] for k in FIELDS[:5]}
    for c in order:
        n = len(c.token_ids)
        out["input_ids"] += list(c.token_ids)
        out["positions"] += list(range(c.start, c.start + n))
        out["slot_mapping"] += [c.block_table[p // block_size] * block_size + p % block_size
                                for p in range(c.start, c.start + n)]  # fmt: skip
        out["query_lens"].append(n)
        out["context_lens"].append(c.start + n)
    width = max(-(-n // block_size) for n in out["context_lens"])
    out["block_tables"] = [(list(c.block_table) + [null_block] * width)[:width] for c in order]
    out["num_decodes"] = sum(len(c.token_ids) == 1 for c in chunks)
    ends, end = {}, 0
    for c, n in zip(order, out["query_lens"]):
        end += n
        ends[id(c)] = end
    out["logit_rows"] = [ends[id(c)] - k for c in chunks for k in range(c.num_logits, 0, -1)]
    return out


def example_step() -> tuple[list[ChunkInput], int, int]:
    """A mixed step of block size 4 (null block 99): a prompt's first chunk, a decode, a prompt's
    middle chunk (no logits), another decode (with blocks reserved ahead), a speculative verify
    chunk (logits at every token)."""
    chunks = [
        ChunkInput("a", [11, 12, 13, 14, 15, 16], 0, 1, [3, 7]),
        ChunkInput("b", [21], 9, 1, [1, 4, 8]),
        ChunkInput("c", [31, 32], 4, 0, [2, 5]),
        ChunkInput("d", [41], 2, 1, [6, 9, 14, 15]),  # blocks reserved ahead
        ChunkInput("e", [51, 52, 53, 54], 5, 4, [10, 12, 13]),
    ]
    return chunks, 4, 99


def _field_mistakes(name: str, got, chunks, block_size, null_block, expected):
    """(what a slip in ``name`` gives, the message naming it)."""
    everything = [c for c in chunks]
    if name == "input_ids":
        yield (
            [t for c in everything for t in c.token_ids],
            (
                "input_ids keep the chunks' order: put the decodes (one-token chunks) first — the attention reads rows "
                "0..num_decodes-1 as one-token sequences"
            ),
        )
    order = [c for c in chunks if len(c.token_ids) == 1] + [c for c in chunks if len(c.token_ids) > 1]
    if name == "positions":
        yield (
            [p for c in order for p in range(len(c.token_ids))],
            (
                "positions start at 0 for every chunk: a chunk's tokens sit at start, start+1, ... of their sequence (a "
                "decode at its sequence's length)"
            ),
        )
    if name == "slot_mapping":
        yield (
            [p for c in order for p in range(c.start, c.start + len(c.token_ids))],
            (
                "slot_mapping is the position itself: a token's slot is block_table[p // block_size] * block_size + "
                "p % block_size — the id of the block that holds position p, not its index in the sequence"
            ),
        )
        yield [c.block_table[p // block_size] + p % block_size for c in order for p in range(c.start, c.start + len(c.token_ids))], (
            "slot_mapping adds the offset to the block id: multiply the block id by block_size first"
        )  # fmt: skip
    if name == "context_lens":
        yield (
            [len(c.token_ids) for c in order],
            ("context_lens counts only the new tokens: a sequence attends to its cached tokens too, start + n"),
        )
        yield (
            [c.start for c in order],
            "context_lens leaves out the new tokens: it is start + n (they attend to themselves)",
        )
    if name == "block_tables":
        width = len(expected["block_tables"][0])
        yield (
            [(list(c.block_table) + [0] * width)[:width] for c in order],
            ("block_tables are padded with 0, a real block: pad with null_block, which no sequence owns"),
        )
        yield (
            [list(c.block_table) for c in order],
            (
                "block_tables have one length per sequence: pad every row with null_block to the width of the longest "
                "context, ceil(max(context_lens) / block_size) blocks"
            ),
        )
        longest = max(len(c.block_table) for c in order)
        yield (
            [(list(c.block_table) + [null_block] * longest)[:longest] for c in order],
            (
                "block_tables are as wide as the longest block table: the width is the blocks the longest *context* "
                "needs, ceil(max(context_lens) / block_size) (a table can hold blocks reserved ahead)"
            ),
        )
    if name == "logit_rows":
        end, rows = 0, []
        for c in order:
            end += len(c.token_ids)
            rows += [end - k for k in range(c.num_logits, 0, -1)]
        yield rows, "logit_rows follow the flat (decodes-first) order: list them in the order of `chunks`, the caller's"
        ends, end = {}, 0
        for c in order:
            end += len(c.token_ids)
            ends[id(c)] = end
        yield (
            [ends[id(c)] - 1 for c in chunks],
            (
                "logit_rows take one row per chunk: a chunk wants its last num_logits rows — none for a prompt's middle "
                "chunk, all of a verify chunk's"
            ),
        )
    if name == "num_decodes":
        yield len(chunks), "num_decodes counts every chunk: count only the one-token chunks (the decodes)"


def _check_example(prepare_inputs) -> None:
    chunks, block_size, null_block = example_step()
    before = [(c.token_ids[:], c.block_table[:]) for c in chunks]
    got = prepare_inputs(chunks, block_size, null_block)
    if [(c.token_ids, c.block_table) for c in chunks] != before:
        raise CheckFailed("prepare_inputs changed a chunk's token_ids or block_table: copy before you extend or pad")
    if not isinstance(got, dict):
        raise CheckFailed(
            f"prepare_inputs should return a dict with the keys {', '.join(FIELDS)}; got {type(got).__name__}"
        )
    missing = [k for k in FIELDS if k not in got]
    if missing:
        raise CheckFailed(f"prepare_inputs' dict has no {', '.join(missing)}")
    got = {name: _plain(name, got[name]) for name in FIELDS}
    expected = reference_inputs(chunks, block_size, null_block)
    decodes = [c for c in chunks if len(c.token_ids) == 1]
    first = got["input_ids"][: len(decodes)] if isinstance(got["input_ids"], list) else None
    by_token = {c.token_ids[0]: c for c in decodes}  # the example's decode tokens are distinct
    ints = first is not None and all(isinstance(t, int) for t in first)
    if ints and sorted(first) == sorted(by_token) and first != [c.token_ids[0] for c in decodes]:
        expected = reference_inputs(chunks, block_size, null_block, [by_token[t] for t in first])
    for name in FIELDS:
        value = got[name]
        if value == expected[name]:
            continue
        for mistake, why in _field_mistakes(name, value, chunks, block_size, null_block, expected):
            if value == mistake:
                raise CheckFailed(why)
        raise CheckFailed(
            f"prepare_inputs' {name} for the example step (block size 4, null block 99; chunks a: 6 prompt tokens "
            f"from 0, b: a decode at 9, c: 2 tokens from 4 without logits, d: a decode at 2, e: 4 verify tokens "
            f"from 5) is {value!r}, expected {expected[name]!r}"
        )


def _plain(name: str, value):
    """A field as plain Python: a tensor or tuple as a list (of lists, for the block tables)."""
    value = value.tolist() if isinstance(value, torch.Tensor) else value
    if name == "block_tables" and isinstance(value, (list, tuple)):
        return [list(row) if isinstance(row, (list, tuple, range)) else row for row in value]
    return list(value) if isinstance(value, (tuple, range)) else value


def layout_adapter(prepare_inputs, counts: dict):
    """Fit a learner's ``prepare_inputs`` into hook ``step_layout``: their lists become the
    runner's tensors; ``counts`` records how many steps mixed decodes with longer chunks."""
    from minillm.attention.layout import StepLayout

    def run(runner, chunks):
        got = prepare_inputs(chunks, runner.cache.block_size, runner.cache.null_block)
        counts["steps"] = counts.get("steps", 0) + 1
        decodes = sum(len(c.token_ids) == 1 for c in chunks)
        if 0 < decodes < len(chunks):
            counts["mixed"] = counts.get("mixed", 0) + 1

        def tensor(values):
            return torch.as_tensor(values, dtype=torch.long, device=runner.device)

        return StepLayout(
            input_ids=tensor(got["input_ids"])[None],
            positions=tensor(got["positions"])[None],
            slot_mapping=tensor(got["slot_mapping"]),
            query_lens=[int(n) for n in got["query_lens"]],
            context_lens=[int(n) for n in got["context_lens"]],
            block_tables=tensor(got["block_tables"]),
            num_decodes=int(got["num_decodes"]),
            logit_index=tensor(got["logit_rows"]),
            pool=runner.pool,
            window=runner.window,
        )

    return run


PROMPTS = (
    "ROMEO.\nBut soft, what light through yonder window breaks? It is the east, and Juliet is the sun.",
    "KING.\nNow is the winter",
    "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer",
)


def _engine(model: str):
    from minillm import LLM

    # a 16-token budget chunks every prompt, and decodes share steps with prompt chunks
    return LLM(model, dtype="fp32", attention_backend="torch", compile=False, max_num_batched_tokens=16,
               enable_prefix_caching=False, seed=0)  # fmt: skip


@check
def check_prepare_inputs(prepare_inputs, model: str = "tiny-shakespeare-1m") -> str:
    """``prepare_inputs(chunks, block_size, null_block) -> dict`` of ``input_ids``, ``positions``,
    ``slot_mapping``, ``query_lens``, ``context_lens``, ``block_tables``, ``num_decodes`` and
    ``logit_rows``: the paged runner's inputs for one mixed step."""
    from minillm import SamplingParams

    _check_example(prepare_inputs)
    llm = _engine(model)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    expected = [o.token_ids for o in llm.generate(list(PROMPTS), params)]
    counts: dict = {}
    with hooks.override(step_layout=layout_adapter(prepare_inputs, counts)):
        got = [o.token_ids for o in llm.generate(list(PROMPTS), params)]
    compare_requests(
        got,
        expected,
        "request {i} of the paged engine running your prepare_inputs",
        "your function matched the example step: what differs on the engine's own steps?",
    )
    if counts.get("mixed", 0) == 0:
        raise CheckFailed("internal: the check's run had no step mixing decodes with prompt chunks")
    return (
        f"your input building ran all {counts['steps']} steps of the paged engine — {counts['mixed']} of them "
        f"mixing decodes with prompt chunks — and the {len(PROMPTS)} requests got the engine's greedy tokens"
    )
