"""Chapter 08 (speculative decoding): rolling back rejected tokens' blocks, and the tree attention mask."""

from __future__ import annotations

import torch

import minillm.hooks as hooks
from minillm.course.checks.ch08_common import PROMPTS, TARGET, draft_spec, greedy_outputs, is_int_list, spec_engine
from minillm.course.compare import compare_tokens
from minillm.course.results import CheckFailed, check

# Exercise 3: rolling back the KV of rejected tokens
# ---------------------------------------------------------------------------------------------


def _split_reference(table: list[int], num_tokens: int, block_size: int) -> tuple[list[int], list[int]]:
    from minillm.kvcache.addressing import RELEASED, blocks_for

    keep = blocks_for(num_tokens, block_size)
    return table[:keep], [b for b in reversed(table[keep:]) if b != RELEASED]


def _span(j: int, block_size: int, num_tokens: int) -> str:
    first, last = j * block_size, min((j + 1) * block_size, num_tokens) - 1
    return f"token {first}" if first == last else f"tokens {first}-{last}"


def _rollback_diagram(table, num_tokens: int, block_size: int, spec: tuple, yours: tuple) -> str:
    """The block table before the rollback, the spec's after and the learner's after, one row
    each, entry j of every row under the tokens it holds."""
    from minillm.kvcache.addressing import RELEASED

    rows = [("before", list(table), None), ("spec after", *spec), ("yours after", *yours)]
    width = max(len(r) for r, _, _ in rows)
    n = max(len(cells) for _, cells, _ in rows)
    spans = [f"{j * block_size}-{(j + 1) * block_size - 1}" for j in range(n)]
    cell = max(len(x) for x in spans + [str(b) for _, cells, _ in rows for b in cells])
    lines = [f"{'tokens':>{width}}    " + "   ".join(f"{x:>{cell}}" for x in spans)]
    for label, cells, freed in rows:
        body = " | ".join(f"{b:>{cell}}" for b in cells)
        line = f"{label:>{width}}: [ {body}{' ' if cells else ''}]"
        if freed is not None:
            line = f"{line:<{width + 5 + n * (cell + 3)}}  freed {freed}"
        lines.append(line.rstrip())
    keep = -(-num_tokens // block_size)
    legend = (
        f"; {RELEASED} = RELEASED, the placeholder of a block a sliding window gave back" if RELEASED in table else ""
    )
    lines.append(f"num_tokens={num_tokens}: keep the first ceil({num_tokens} / {block_size}) = {keep} entries{legend}")
    return "\n".join(lines)


def _diagnose_rollback(got, table: list[int], num_tokens: int, block_size: int) -> None:
    from minillm.kvcache.addressing import RELEASED

    call = f"blocks_to_roll_back({table}, num_tokens={num_tokens}, block_size={block_size})"
    shape = f"{call} should return a tuple (kept, freed) of two lists of ints, got {got!r:.80}"
    if isinstance(got, (tuple, list)) and len(got) == 2:
        for name, part in zip(("kept", "freed"), got):
            if hasattr(part, "__next__"):
                raise CheckFailed(
                    f"{call} returned {name} as a {type(part).__name__}, an iterator, not a list: what reversed(...), "
                    "filter(...) or a generator expression give is used up after one pass — make it a list: list(...)"
                )
    if not (isinstance(got, (tuple, list)) and len(got) == 2 and all(isinstance(x, (list, tuple)) for x in got)):
        raise CheckFailed(shape)
    kept, freed = list(got[0]), list(got[1])
    if not (is_int_list(kept) and is_int_list(freed)):
        raise CheckFailed(shape)
    exp_kept, exp_freed = _split_reference(table, num_tokens, block_size)
    if kept == exp_kept and freed == exp_freed:
        return
    head = f"{call} returned kept={kept}, freed={freed}; expected kept={exp_kept}, freed={exp_freed}"
    diagram = _rollback_diagram(table, num_tokens, block_size, (exp_kept, exp_freed), (kept, freed))
    real = [b for b in table if b != RELEASED]
    if RELEASED in exp_kept and kept and RELEASED not in kept and all(b in real for b in kept):
        # Dropped the placeholders: whether from kept alone or from the whole table before splitting it,
        # every later block now sits at the wrong entry (and a block of kept tokens may look "not kept").
        raise CheckFailed(
            f"{head}: you dropped the {RELEASED} (RELEASED) entries from kept — placeholders that keep the positions "
            "of blocks a sliding window already gave back. The placeholders must stay in the table, in place: "
            "entry j of a block table holds tokens j × block_size onwards, so removing one shifts every "
            "later block onto the wrong tokens. Keep the first ceil(num_tokens / block_size) entries as they are, "
            "placeholders included, and skip RELEASED only in freed",
            diagram=diagram,
        )
    both = [b for b in freed if b in kept and b != RELEASED]
    if both:
        j = kept.index(both[0])
        raise CheckFailed(
            f"{head}: block {both[0]} is both kept and given back. It holds {_span(j, block_size, num_tokens)}, which "
            "stay: a block partly filled by kept tokens is kept whole (the next tokens are written after them)",
            diagram=diagram,
        )
    if RELEASED in freed:
        raise CheckFailed(
            f"{head}: you gave back the table entry {RELEASED} (RELEASED): that block was already returned behind a "
            "sliding window — there is no block to free. Skip those entries",
            diagram=diagram,
        )
    if len(kept) < len(exp_kept):
        lost = exp_kept[len(kept)]
        j = len(kept)
        partial = num_tokens % block_size and j == len(exp_kept) - 1
        why = (
            f"the last kept block is only partly filled ({_span(j, block_size, num_tokens)} of a block of "
            f"{block_size}), and those tokens stay"
            if partial
            else f"it holds {_span(j, block_size, num_tokens)}, which stay"
        )
        raise CheckFailed(
            f"{head}: block {lost} must be kept — {why}. Keep blocks_for(num_tokens) = ceil(num_tokens / block_size) "
            f"= {len(exp_kept)} blocks",
            diagram=diagram,
        )
    if len(kept) > len(exp_kept):
        extra = kept[len(exp_kept)]
        raise CheckFailed(
            f"{head}: {len(kept)} blocks kept for {num_tokens} tokens of {block_size} per block — block {extra} holds "
            f"only rejected positions: keep ceil(num_tokens / block_size) = {len(exp_kept)} blocks and give the rest back",
            diagram=diagram,
        )
    if kept != exp_kept:
        raise CheckFailed(f"{head}: kept must be the table's first {len(exp_kept)} entries, in order", diagram=diagram)
    zero = " — block 0 is a real block (only RELEASED, -1, marks a missing one): test `b != RELEASED`, not `b > 0`"
    if not freed and exp_freed:
        raise CheckFailed(
            f"{head}: blocks {exp_freed} hold only rejected tokens and are neither kept nor given back — they would "
            "leak from the pool: return them as freed" + (zero if 0 in exp_freed else ""),
            diagram=diagram,
        )
    missing = [b for b in exp_freed if b not in freed]
    if missing and set(freed) <= set(exp_freed):
        raise CheckFailed(
            f"{head}: block{'s' if len(missing) > 1 else ''} {missing} hold{'' if len(missing) > 1 else 's'} only "
            f"rejected tokens but {'are' if len(missing) > 1 else 'is'} not given back: it would leak from the pool"
            + (zero if 0 in missing else ""),
            diagram=diagram,
        )
    if sorted(freed) == sorted(exp_freed) and freed == sorted(freed, reverse=True) != exp_freed[::-1]:
        raise CheckFailed(
            f"{head}: you sorted the blocks by their number. Tail first means by their place in the table — the "
            "last entry first (reversed(table[keep:])), as BlockManager.free gives them back: a block's number "
            "says nothing about where it sits in the sequence",
            diagram=diagram,
        )
    if sorted(freed) == sorted(exp_freed):
        raise CheckFailed(
            f"{head}: give the blocks back tail first (the last block of the table first), as BlockManager.free does: "
            "with prefix caching an unreferenced block stays cached and is evicted in the order it was given back, "
            "and the end of a sequence should go before its beginning, which other requests may share",
            diagram=diagram,
        )
    raise CheckFailed(f"{head}: freed must be the table's entries after the kept ones, last first", diagram=diagram)


ROLLBACK_CASES = [
    # table, num_tokens, block_size: what each case is about
    ([3, 8, 5, 9], 6, 4),  # the last kept block (8) is partly filled: tokens 4-5
    ([3, 8, 5], 8, 4),  # exactly two full blocks stay
    ([3, 8], 7, 4),  # nothing to give back
    ([7, 2, 6], 0, 4),  # back to nothing: everything goes, tail first
    ([10, 20, 30, 40], 17, 16),  # larger blocks: tokens 16-16 keep block 20
    ([-1, -1, 4, 11, 12], 13, 4),  # a sliding window released the first two blocks
    ([-1, -1, 4, 11], 0, 4),  # ... and a rollback past them frees only real blocks
    ([6, 2, 0], 5, 4),  # block 0 is a block like any other: it is given back
    ([0, 9, 1], 3, 4),  # ... or kept
]


def _pool_tables(llm) -> tuple[dict, dict]:
    draft = llm.engine.speculator.draft
    return (
        {rid: list(t) for rid, t in llm.engine.block_manager.tables.items()},
        {rid: list(t) for rid, t in draft.blocks.tables.items()},
    )


@check
def check_rollback(blocks_to_roll_back, model: str = TARGET) -> str:
    """``blocks_to_roll_back(table, num_tokens, block_size) -> (kept, freed)``: the blocks a
    rollback keeps and those it gives back, tail first."""
    from minillm import SamplingParams

    for table, num_tokens, block_size in ROLLBACK_CASES:
        _diagnose_rollback(blocks_to_roll_back(list(table), num_tokens, block_size), table, num_tokens, block_size)

    calls = []

    def learner(table, num_tokens, block_size):  # what BlockManager.truncate calls
        got = blocks_to_roll_back(list(table), num_tokens, block_size)
        _diagnose_rollback(got, list(table), num_tokens, block_size)
        kept, freed = (list(x) for x in got)
        calls.append(len(freed))
        return kept, freed

    options = dict(block_size=4, max_num_batched_tokens=64)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    plain = [o.token_ids for o in greedy_outputs(spec_engine(None, **options), steps=40)]
    mine, ref = spec_engine(draft_spec(), **options), spec_engine(draft_spec(), **options)
    for n, prompt in enumerate(PROMPTS):
        mine.engine.add_request(prompt, params, request_id=n)
        ref.engine.add_request(prompt, params, request_id=n)
    outputs, step = {}, 0
    while mine.engine.has_unfinished_requests():
        with hooks.override(blocks_to_roll_back=learner):
            deltas = mine.engine.step()
        ref.engine.step()
        step += 1
        for delta in deltas:
            if delta.output is not None:
                outputs[delta.request_id] = delta.output
        for name, pool in (
            ("the 8M model's", mine.engine.block_manager),
            ("the draft's", mine.engine.speculator.draft.blocks),
        ):
            try:
                pool.check_invariants()
            except AssertionError as err:
                raise CheckFailed(f"after step {step}, {name} KV pool is inconsistent: {err}") from None
        for name, got, expected in zip(("the 8M model's", "the draft's"), _pool_tables(mine), _pool_tables(ref)):
            if got != expected:
                rid = next(r for r in expected.keys() | got.keys() if got.get(r) != expected.get(r))
                raise CheckFailed(
                    f"after step {step}, request {rid}'s block table in {name} pool is {got.get(rid)}, "
                    f"the package's rollback gives {expected.get(rid)}"
                )
    if not calls:
        raise RuntimeError("BlockManager.truncate no longer calls hook blocks_to_roll_back")
    for n in range(len(PROMPTS)):
        compare_tokens(
            outputs[n].token_ids, plain[n], f"prompt {n} with your rollback", "roll back only rejected tokens"
        )
    stats = mine.engine.stats()
    if stats.kv_blocks_used or stats.draft_kv_blocks_used:
        raise CheckFailed(
            f"every request finished, but {stats.kv_blocks_used} blocks of the 8M model's pool and "
            f"{stats.draft_kv_blocks_used} of the draft's are still in use: blocks leaked"
        )
    freed = sum(calls)
    return (
        f"your rollback ran {len(calls)} times over {step} steps ({freed} blocks of 4 tokens given back, in the 8M "
        f"model's pool and the draft's): both pools consistent after every step and empty at the end, block tables "
        f"identical to the package's, {len(PROMPTS)}×40 tokens identical to the 8M model alone"
    )


# ---------------------------------------------------------------------------------------------
# Exercise 4: the tree attention mask
# ---------------------------------------------------------------------------------------------

# Trees as parent lists (-1: a child of the sequence's last token), parents before children.
TREE_CASES = [
    [-1, 0, 1, 2],  # a chain: the mask is the causal triangle
    [-1, 0, -1, 2],  # two branches of two
    [-1, -1, -1],  # three alternatives for the same position
    [-1, 0, 0, 1, 2, -1, 5, 6],  # branching below the root, and a second chain
    [-1, 0, 1, 0, 3, 1],  # depth 3 with a fork at each level
    [-1],
    [],
]


def _reference_tree_mask(parents: list[int]) -> torch.Tensor:
    from minillm.speculative.tree import tree_attention_mask

    return tree_attention_mask(parents)


def _ancestors(parents: list[int], i: int) -> list[int]:
    out = []
    while parents[i] >= 0:
        i = parents[i]
        out.append(i)
    return out


def _diagnose_tree_mask(got, parents: list[int]) -> torch.Tensor:
    n = len(parents)
    if not isinstance(got, torch.Tensor):
        raise CheckFailed(f"tree_attention_mask({parents}) returned a {type(got).__name__}: return a torch.Tensor")
    if tuple(got.shape) != (n, n):
        raise CheckFailed(
            f"tree_attention_mask({parents}) has shape {tuple(got.shape)}: one row and one column per node, ({n}, {n})"
        )
    if got.dtype != torch.bool:
        raise CheckFailed(
            f"tree_attention_mask({parents}) is {got.dtype}: return a bool mask (True = may attend), which "
            "scaled_dot_product_attention reads as allowed/blocked — not 0/1 numbers or an additive -inf mask"
        )
    expected = _reference_tree_mask(parents)
    if torch.equal(got, expected):
        return got
    for i in range(n):
        if not got[i, i]:
            raise CheckFailed(f"in tree {parents}, node {i} does not see itself: a token attends to its own key too")
    if n > 1 and torch.equal(got, expected.T):
        raise CheckFailed(
            f"in tree {parents}, your mask is transposed: row i is node i's query, so it must mark i's ancestors "
            "(the nodes it continues), not its descendants"
        )
    for i in range(n):
        for j in range(n):
            if got[i, j] and not expected[i, j]:
                if j > i:
                    why = f"node {j} comes after it (a child or another branch)"
                elif torch.equal(got, torch.ones(n, n, dtype=torch.bool).tril()):
                    why = (
                        f"node {j} is on another branch: a causal triangle is right for a chain only — "
                        "in a tree, earlier in the list is not the same as earlier in the branch"
                    )
                else:
                    why = f"node {j} is not on its branch (its ancestors are {_ancestors(parents, i) or 'none'})"
                raise CheckFailed(f"in tree {parents}, node {i} may attend to node {j}, but {why}")
            if expected[i, j] and not got[i, j]:
                hint = (
                    " — every ancestor, not only the parent: the grandparent's token is part of the text before it"
                    if parents[i] != j
                    else ""
                )
                raise CheckFailed(f"in tree {parents}, node {i} cannot see node {j}, its ancestor{hint}")
    raise CheckFailed(f"in tree {parents}, your mask differs from the expected one")  # not reached


@check
def check_tree_attention_mask(tree_attention_mask, model: str = TARGET) -> str:
    """``tree_attention_mask(parents[N]) -> bool [N, N]``: node ``i`` sees itself and its ancestors."""
    from minillm.assets import resolve_model
    from minillm.models import load_model
    from minillm.speculative.tree import tree_pass

    for parents in TREE_CASES:
        given = list(parents)
        _diagnose_tree_mask(tree_attention_mask(given), parents)
        if given != parents:
            raise CheckFailed(f"tree_attention_mask changed its argument: {parents} became {given}")
    gen = torch.Generator().manual_seed(4)
    trees = []
    for _ in range(40):  # random trees: each node's parent drawn among the root and the earlier nodes
        n = int(torch.randint(1, 9, (), generator=gen))
        parents = [int(torch.randint(-1, i, (), generator=gen)) if i else -1 for i in range(n)]
        _diagnose_tree_mask(tree_attention_mask(list(parents)), parents)
        trees.append(parents)

    # Into the verify pass: one pass of the 8M model over a prompt and a tree, each node's logits
    # against its branch run as plain text.
    target = load_model(resolve_model(model), torch.float32)
    calls = []

    def learner(parents):
        got = tree_attention_mask(list(parents))
        _diagnose_tree_mask(got, list(parents))
        calls.append(len(parents))
        return got

    from minillm.tokenizer import Tokenizer

    prompt = Tokenizer(resolve_model(model)).encode(PROMPTS[2])
    vocab = target.config.vocab_size
    nodes = 0
    for parents in trees[:6] + [TREE_CASES[3]]:
        drafts = torch.randint(0, vocab, (len(parents),), generator=gen).tolist()
        with hooks.override(tree_attention_mask=learner):
            logits, _ = tree_pass(target, prompt, drafts, parents)
        for i in range(len(parents)):
            branch = [drafts[j] for j in reversed([i, *_ancestors(parents, i)])]
            alone, _ = tree_pass(target, prompt + branch, [], [])
            diff = float((logits[1 + i] - alone[0]).abs().max())
            nodes += 1
            if diff > 1e-3:
                raise CheckFailed(
                    f"in the verify pass over tree {parents}, node {i}'s logits differ from its branch run alone by "
                    f"{diff:.3g}: it saw tokens that are not its branch's"
                )
    if not calls:
        raise RuntimeError("tree_pass no longer calls hook tree_attention_mask")
    return (
        f"your mask is right on {len(TREE_CASES) + len(trees)} trees; in {len(calls)} verify passes of the 8M model "
        f"every one of {nodes} draft nodes got the logits of its own branch run alone (to within 1e-3: the same "
        "sums in another order)"
    )
