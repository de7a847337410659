"""Chapter 05's whole piece: the learner's attention layer over the paged cache — one mixed step's
new K/V written into the pool at their slots, then its queries, each sequence against its own
keys read through its block table, grouped K/V heads, the causal mask at the right positions,
and the sliding window, whose keys are read from the window's first position on (the blocks
behind it were released).

1. **diagnosis on a hand-made step** — a random pool of block size 4 (stale values where the new
   tokens go), three sequences (a decode, a fresh prompt, a prompt chunk continuing a cached
   prefix), 4 query heads over 2 K/V heads, with and without a window of 3 (with it, the table
   entries of the blocks wholly behind the window point at the null block, which holds NaN, as
   memory nobody owns may): first the pool it leaves (every new token's K and V at its
   position's slot, nothing else touched), then the output against the textbook computation and
   its classic variants (K/V heads tiled, keys past the context read, the chunk masked from
   position 0, the window one key long or short, the window read from the last query's edge or
   left out of the mask, keys behind the window read, the scale ignored, the new K/V written
   after they were read), then a head count that cannot be grouped (a ``ValueError`` before
   anything is written);
2. **the plug-in run** — the learner's function as the attention of every layer of the real
   paged engine (hook ``paged_attention``), chunked prompts mixing with decodes, with a sliding
   window of 12 keys: greedy tokens equal to the naive engine's with the same window.
"""

from __future__ import annotations

import torch

import minillm.hooks as hooks
from minillm.course.compare import compare_requests, compare_tensors, name_the_slip
from minillm.course.results import CheckFailed, LearnerRaised, check, learner_function

WINDOW = 12  # the plug-in run's sliding window (keys), short enough to bite on the check's prompts
NULL_BLOCK = 8  # the example pool's block that nothing owns: released table entries point at it


def first_key(n: int, ctx: int, window: int | None) -> int:
    """The first position a step's ``n`` queries over ``ctx`` keys may see: 0, or with a window the
    first query's (at ``ctx - n``) window edge — the blocks wholly before it were released."""
    return 0 if window is None else max(0, ctx - n - window + 1)


def new_slots(query_lens, context_lens, block_tables, block_size: int) -> torch.Tensor:
    """The pool slots of a step's new tokens, in ``q``'s row order: sequence ``i``'s positions
    ``ctx - n .. ctx - 1`` through its block table (the step's slot mapping)."""
    return torch.tensor([int(table[p // block_size]) * block_size + p % block_size
                         for n, ctx, table in zip(query_lens, context_lens, block_tables) for p in range(ctx - n, ctx)])  # fmt: skip


def reference_paged_attention(q, k, v, k_slots, v_slots, query_lens, context_lens, block_tables, block_size: int,
                              scale: float, window: int | None = None, mistake: str | None = None) -> torch.Tensor:  # fmt: skip
    """The textbook computation — the new K/V written into the pool (in place), then attention over
    the keys from ``first_key`` on — or one of its wrong variants (``MISTAKES``; those leave the
    pool as they found it)."""
    heads, kv_heads = q.shape[1], k_slots.shape[1]
    if mistake is not None:
        k_slots, v_slots = k_slots.clone(), v_slots.clone()
    slots_new = new_slots(query_lens, context_lens, block_tables, block_size)
    if mistake != "read_before_write":
        k_slots[slots_new], v_slots[slots_new] = k, v
    out, row = [], 0
    for n, ctx, table in zip(query_lens, context_lens, block_tables):
        seen = len(table) * block_size if mistake == "past_context" else ctx
        first = first_key(n, ctx, window)
        if mistake == "window_from_last_query" and window is not None:
            first = max(0, ctx - window)
        elif mistake == "past_context":
            first = 0
        slots = torch.tensor([int(table[p // block_size]) * block_size + p % block_size for p in range(first, seen)])
        k, v = k_slots[slots], v_slots[slots]  # [seen - first, KV, D]
        if mistake == "tiled":
            k, v = k.repeat(1, heads // kv_heads, 1), v.repeat(1, heads // kv_heads, 1)
        else:
            k, v = k.repeat_interleave(heads // kv_heads, dim=1), v.repeat_interleave(heads // kv_heads, dim=1)
        qs = q[row : row + n]
        used_scale = 1.0 if mistake == "no_scale" else scale
        scores = torch.einsum("thd,shd->hts", qs, k) * used_scale  # [H, n, seen - first]
        pos = torch.arange(ctx - n, ctx)[:, None] - (ctx - n if mistake == "from_zero" else 0)
        keys = torch.arange(first, seen)[None, :]
        allowed = keys <= pos
        if mistake == "past_context" and n == 1:  # "a decode sees everything": no mask for one query
            allowed = torch.ones_like(allowed)
        if window is not None and mistake != "no_window":
            reach = {"window_plus_one": window + 1, "window_minus_one": window - 1}.get(mistake, window)
            allowed = allowed & (keys > pos - reach)
        scores = scores.masked_fill(~allowed, float("-inf"))
        out.append(torch.einsum("hts,shd->thd", torch.softmax(scores, dim=-1), v))
        row += n
    return torch.cat(out)


MISTAKES = {
    "tiled": "K/V heads were repeated as [0, 1, 0, 1]: query head h reads K/V head h // (H // KV) — "
    "repeat_interleave along the heads",
    "past_context": "a decode read every key of its table's blocks, past its context: read positions "
    "0..context_len-1 only (the rest of the last block is empty or another sequence's, and padding entries point "
    "at a block someone else may own)",
    "from_zero": "the causal mask put a chunk's queries at positions 0..n-1: they sit at context_len - n .. "
    "context_len - 1 (a chunk continuing a cached prefix sees all of it)",
    "window_plus_one": "the window lets a query see window + 1 keys: it sees its last `window` keys, positions "
    "pos - window + 1 .. pos",
    "window_minus_one": "the window lets a query see only window - 1 keys: it sees its last `window` keys, "
    "positions pos - window + 1 .. pos, itself included",
    "window_from_last_query": "a chunk read its keys from its last query's window edge (context_len - window): its "
    "first query, at context_len - n, sees from context_len - n - window + 1 on — read from there",
    "no_window": "the sliding window was left out of the mask: the keys were read from the window's first position, "
    "but with window w a query at position pos sees only keys pos - w + 1 .. pos, and a chunk's later queries "
    "see fewer of them than its first",
    "no_scale": "the scores were not multiplied by `scale` (1/sqrt(head_dim), passed in)",
    "read_before_write": "the queries read the pool before this step's K/V were in it (they saw the stale values "
    "at the new tokens' slots): write k and v at their slots first, then read each sequence's keys",
}


def example_step(window: int | None = None, seed: int = 0):
    """A random pool (9 blocks of 4 slots, 2 K/V heads of 8 dims; the new tokens' slots hold stale
    values, block 8 is the null block and holds NaN) and a step of three sequences: a decode at
    context 7, a fresh 5-token prompt, a 3-token chunk continuing to context 10 — their queries and
    new K/V. With a window of 3 the decode's and the chunk's first blocks lie wholly behind it: as
    in the engine, they were released and their table entries point at the null block."""
    gen = torch.Generator().manual_seed(seed)
    k_slots, v_slots = torch.randn(36, 2, 8, generator=gen), torch.randn(36, 2, 8, generator=gen)
    null = slice(NULL_BLOCK * 4, NULL_BLOCK * 4 + 4)
    k_slots[null], v_slots[null] = float("nan"), float("nan")
    query_lens, context_lens = [1, 5, 3], [7, 5, 10]
    block_tables = torch.tensor([[5, 2, 0], [1, 7, 0], [3, 6, 4]])  # 0 pads (an unused block here)
    if window == 3:  # positions 0-3 are behind the decode's window (it sees 4-6) and the chunk's (5-9)
        block_tables[0, 0] = block_tables[2, 0] = NULL_BLOCK
    q = torch.randn(sum(query_lens), 4, 8, generator=gen)
    k, v = torch.randn(sum(query_lens), 2, 8, generator=gen), torch.randn(sum(query_lens), 2, 8, generator=gen)
    return dict(q=q, k=k, v=v, k_slots=k_slots, v_slots=v_slots, query_lens=query_lens, context_lens=context_lens,
                block_tables=block_tables, block_size=4, scale=8**-0.5, window=window)  # fmt: skip


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaN equal to NaN (the null block's)."""
    return a.shape == b.shape and bool(torch.allclose(a, b, rtol=0, atol=0, equal_nan=True))


SEQUENCES = ["the decode at context 7", "the fresh 5-token prompt", "the 3-token chunk continuing to context 10"]


def _check_pool(args: dict, pools: dict, what: str) -> None:
    """The pool the learner left against the one the step should leave: the new K/V at their slots,
    every other slot as it was."""
    slots = new_slots(args["query_lens"], args["context_lens"], args["block_tables"].tolist(), args["block_size"])
    owner = [(i, p) for i, (n, ctx) in enumerate(zip(args["query_lens"], args["context_lens"]))
             for p in range(ctx - n, ctx)]  # fmt: skip
    for name, new in (("k_slots", "k"), ("v_slots", "v")):
        before, after = pools[name], args[name]
        if _same(before, after):
            raise CheckFailed(
                f"{what}: {name} is as it was: write this step's new {new} into the pool first, in place "
                f"({name}[slot] = ..., not into a copy), row j of {new} at the slot of its position (sequence i's new "
                "tokens sit at positions context_len - n .. context_len - 1), then read the keys through the block "
                "table"
            )
        expected = before.clone()
        expected[slots] = args[new]
        for row, slot in enumerate(slots.tolist()):
            if not _same(after[slot], expected[slot]):
                i, pos = owner[row]
                swapped = "v" if new == "k" else "k"
                other = [r for r in range(len(slots)) if torch.equal(after[slot], args[new][r])]
                went = [t for t in range(after.shape[0]) if t != slot and not torch.equal(after[t], before[t])
                        and torch.equal(after[t], args[new][row])]  # fmt: skip
                if other:
                    hint = f": it holds row {other[0]} of {new}"
                elif went:
                    hint = f"; row {row} went to slot {went[0]}" + _where(went[0], i, pos, args)
                elif any(torch.equal(after[slot], row_) for row_ in args[swapped]):
                    hint = f": it holds a row of {swapped} — k goes to k_slots, v to v_slots"
                else:
                    hint = ""
                raise CheckFailed(
                    f"{what}: slot {slot} of {name} should hold row {row} of {new} ({SEQUENCES[i]}'s position {pos}: "
                    f"block table entry {pos // args['block_size']}, offset {pos % args['block_size']}){hint}"
                )
        touched = [s for s in range(after.shape[0]) if not _same(after[s], expected[s])]
        if touched:
            raise CheckFailed(
                f"{what}: slot {touched[0]} of {name} changed, which no new token owns: write only the new tokens' "
                "slots — the others hold other positions' keys (or other sequences')"
            )


def _where(slot: int, seq: int, pos: int, args: dict) -> str:
    """What a wrongly chosen slot is to the sequence: its position used as the slot, or another position's."""
    if slot == pos:
        return f" — position {pos} used as the slot number: the slot is table[pos // block_size] * block_size + pos % block_size"
    table, size = args["block_tables"][seq].tolist(), args["block_size"]
    if slot // size in table[: -(-args["context_lens"][seq] // size)]:
        return f", its position {table.index(slot // size) * size + slot % size}'s: new tokens sit at context_len - n .. context_len - 1"
    return ""


def _check_example(paged_attention) -> None:
    for window in (None, 3):
        args = example_step(window)
        frozen = {k: v.clone() for k, v in args.items() if isinstance(v, torch.Tensor)}
        got = paged_attention(**args)
        what = "paged_attention on the example step" + (f" with a window of {window}" if window else "")
        changed = [k for k, v in frozen.items() if k not in ("k_slots", "v_slots") and not torch.equal(args[k], v)]
        if changed:
            raise CheckFailed(f"paged_attention changed one of its inputs in place ({changed[0]}): only the pool "
                              "(k_slots, v_slots) is written, and only at the new tokens' slots")  # fmt: skip
        _check_pool(args, frozen, what)
        args.update(k_slots=frozen["k_slots"], v_slots=frozen["v_slots"])  # the reference writes them again
        expected = reference_paged_attention(**{k: (v.clone() if k.endswith("_slots") else v) for k, v in args.items()})
        if window is not None and isinstance(got, torch.Tensor) and got.shape == expected.shape:
            _check_released(paged_attention, got, args)
        slips = ((reference_paged_attention(**args, mistake=m), why) for m, why in MISTAKES.items())
        if name_the_slip(got, expected, slips, equal_nan=True):
            bad = _first_bad_sequence(got, expected, args["query_lens"])
            raise CheckFailed(
                f"{what}: sequence {bad} ({SEQUENCES[bad]}) "
                f"differs from the reference by up to {float((got - expected).abs().max()):.3g}"
            )  # fmt: skip
        compare_tensors(got, expected, what)


def _check_released(paged_attention, got: torch.Tensor, args: dict) -> None:
    """A sequence that came out NaN, and comes out finite once the null block holds zeros, read
    keys behind the window: nothing else in the example holds NaN."""
    bad = [i for i, rows in enumerate(got.split(args["query_lens"])) if not bool(torch.isfinite(rows.float()).all())]
    if not bad:
        return
    null = slice(NULL_BLOCK * args["block_size"], (NULL_BLOCK + 1) * args["block_size"])
    again = dict(args, k_slots=args["k_slots"].clone(), v_slots=args["v_slots"].clone())
    again["k_slots"][null], again["v_slots"][null] = 0.0, 0.0
    rows = paged_attention(**again).split(args["query_lens"])
    for i in bad:
        if bool(torch.isfinite(rows[i].float()).all()):
            n, ctx = args["query_lens"][i], args["context_lens"][i]
            raise CheckFailed(
                f"paged_attention with a window of {args['window']}: sequence {i} ({SEQUENCES[i]}) came out NaN — "
                f"it read keys behind the window. Its queries see positions {first_key(n, ctx, args['window'])} .. "
                f"{ctx - 1} at most; the blocks wholly before that were released (exercise 3), and the engine points "
                "their table entries at its null block, whose slots hold whatever was last written there (here "
                "NaN). Masking a key after reading it does not help: its weight is 0, and 0 × NaN is NaN. Read "
                "positions max(0, ctx - n - window + 1) .. ctx - 1 only (and mask each query's own window)"
            )


def _check_refusal(paged_attention) -> None:
    """Query heads that cannot be grouped over the K/V heads: a ValueError, before the pool is touched."""
    args = example_step()
    args["q"] = torch.randn(args["q"].shape[0], 3, 8)
    frozen = args["k_slots"].clone(), args["v_slots"].clone()
    call = "paged_attention with 3 query heads over 2 K/V heads"
    try:
        got = learner_function(paged_attention)(**args)
    except LearnerRaised as err:
        if isinstance(err.__cause__, NotImplementedError):  # the skeleton: not attempted yet
            raise
        if not isinstance(err.__cause__, ValueError):
            raise CheckFailed(f"{call} raised {type(err.__cause__).__name__}: {err.__cause__}. Each K/V head serves "
                              "a whole group of H / KV query heads: check H % KV first and raise ValueError, the "
                              "error a bad argument gets, naming both numbers") from None  # fmt: skip
    else:
        raise CheckFailed(f"{call} returned {type(got).__name__} instead of raising ValueError: 3 heads cannot share "
                          "2 K/V heads in equal groups (repeat_interleave by 3 // 2 = 1 pairs them up wrongly)")  # fmt: skip
    if not (_same(args["k_slots"], frozen[0]) and _same(args["v_slots"], frozen[1])):
        raise CheckFailed(f"{call} wrote into the pool before raising ValueError: check the heads first, so a bad "
                          "call leaves the cache as it found it")  # fmt: skip


def _first_bad_sequence(got, expected, query_lens) -> int:
    row = 0
    for i, n in enumerate(query_lens):
        if not torch.allclose(got[row : row + n], expected[row : row + n], atol=1e-5):
            return i
        row += n
    return 0


def attention_adapter(paged_attention, counts: dict):
    """Fit a learner's function into hook ``paged_attention`` (the step's pool and layout as
    plain tensors and lists); ``counts`` records the steps that mixed decodes with prompt chunks."""

    def run(step, layer, q, k, v, scale):
        layout, pool = step.layout, step.pool
        if layer == 0:
            counts["steps"] = counts.get("steps", 0) + 1
            if 0 < layout.num_decodes < len(layout.query_lens):
                counts["mixed"] = counts.get("mixed", 0) + 1
        if pool.k_scales is not None:  # an 8-bit pool (chapter 07) stores K/V quantized: the package's layer
            return hooks.default("paged_attention")(step, layer, q, k, v, scale)
        return paged_attention(q, k, v, pool.k_slots[layer], pool.v_slots[layer], list(layout.query_lens),
                               list(layout.context_lens), layout.block_tables, pool.block_size, scale,
                               layout.window)  # fmt: skip

    return run


PROMPTS = (
    "ROMEO.\nBut soft, what light through yonder window breaks? It is the east, and Juliet is the sun.",
    "KING.\nNow is the winter of our discontent made glorious summer",
)


@check
def check_paged_attention(paged_attention, model: str = "tiny-shakespeare-1m") -> str:
    """``paged_attention(q[N, H, D], k, v[N, KV, D], k_slots, v_slots[num_slots, KV, D], query_lens,
    context_lens, block_tables[S, W], block_size, scale, window=None) -> [N, H, D]``: the step's new
    K/V into the pool, then attention over the keys each sequence may see (with a window, none of the
    released blocks behind it); a ``ValueError`` for heads that cannot be grouped."""
    from minillm import LLM, SamplingParams

    _check_example(paged_attention)
    _check_refusal(paged_attention)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    naive = LLM(model, dtype="fp32", mode="naive", sliding_window=WINDOW)
    expected = [o.token_ids for o in naive.generate(list(PROMPTS), params)]
    llm = LLM(model, dtype="fp32", attention_backend="torch", compile=False, sliding_window=WINDOW, block_size=4,
              max_num_batched_tokens=16, enable_prefix_caching=False)  # fmt: skip
    counts: dict = {}
    with hooks.override(paged_attention=attention_adapter(paged_attention, counts)):
        got = [o.token_ids for o in llm.generate(list(PROMPTS), params)]
    compare_requests(
        got,
        expected,
        f"request {{i}} of the paged engine running your attention (window {WINDOW})",
        "your function matched the example step: what differs on the engine's own steps?",
    )
    if counts.get("mixed", 0) == 0:
        raise CheckFailed("internal: the check's run had no step mixing decodes with prompt chunks")
    return (
        "your attention read only the keys in each window, refused heads it cannot group, and ran in every layer "
        f"of the paged engine for {counts['steps']} steps ({counts['mixed']} mixing decodes with prompt chunks), "
        f"with a {WINDOW}-key sliding window, and gave the naive engine's greedy tokens"
    )
