"""Chapter 08 (speculative decoding): verifying a tree — the longest accepted branch."""

from __future__ import annotations

import torch

import minillm.hooks as hooks
from minillm.course.results import CheckFailed, check

# Trees as (parents, drafts, target_tokens): parents before children, -1 for a child of the
# sequence's last token; target_tokens[0] is the target's token after the sequence, 1 + i after node i.
TREE_VERIFY_CASES = [
    ([-1, 0], [5, 6], [4, 5, 6]),  # the first guess is wrong: nothing accepted, whatever follows
    ([-1, 0, 1], [7, 8, 9], [7, 8, 9, 4]),  # a chain, every guess right: 3 accepted and the target's 4th token
    ([-1, 0, 1], [7, 5, 9], [7, 8, 9, 4]),  # a chain cut at its second node
    ([-1, 0, 1], [3, 8, 9], [7, 8, 9, 4]),  # nothing accepted: the target's own token only
    ([-1, -1], [5, 6], [5, 6, 9]),  # two guesses for one position: node 1 is not node 0's continuation
    ([-1, 0, -1, 2], [5, 6, 7, 8], [7, 1, 2, 8, 3]),  # the second branch wins: nodes 2 and 3
    ([-1, -1, -1], [4, 5, 6], [6, 1, 2, 3]),  # three alternatives for the first token: the last one
    ([-1, 0, 0, 1, 2], [7, 3, 8, 9, 4], [7, 8, 2, 2, 5, 6]),  # a fork below the root: its second child
    ([-1, 0, 1, 0, 3], [7, 8, 1, 2, 3], [7, 2, 9, 4, 3, 6]),  # the deeper branch is not the first one
    ([], [], [5]),  # an empty tree: a plain decode step
    ([-1, 0, 1, 2, 3, 4], [1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6, 9]),  # a chain of 6, every guess right
    ([-1, -1, -1, -1, -1, -1], [1, 2, 3, 4, 5, 6], [6, 0, 0, 0, 0, 0, 0]),  # six alternatives: the last one
    # a short first branch, then a deep one accepted to depth 5 (its tokens repeat the first branch's)
    ([-1, 0, -1, 2, 3, 4, 5], [3, 4, 1, 3, 4, 5, 6], [1, 8, 8, 3, 4, 5, 6, 2]),
]


def reference_accept_tree(parents, drafts, target_tokens) -> tuple[list[int], list[int]]:
    from minillm.speculative.tree import accept_tree

    return accept_tree(list(parents), list(drafts), list(target_tokens))


def _random_case(gen: torch.Generator) -> tuple[list[int], list[int], list[int]]:
    """A random tree over a five-token vocabulary, siblings distinct as a draft head's top
    choices are; the target's tokens follow a random branch (so acceptance often runs deep)
    or are random."""
    n = int(torch.randint(0, 16, (), generator=gen))
    parents, drafts = [], []
    for _ in range(n):
        made = len(parents)  # a node skipped below leaves no gap: parents stay earlier nodes
        parent = int(torch.randint(-1, made, (), generator=gen)) if made else -1
        taken = {d for p, d in zip(parents, drafts) if p == parent}
        free = [t for t in range(5) if t not in taken]
        if not free:
            continue
        parents.append(parent)
        drafts.append(free[int(torch.randint(0, len(free), (), generator=gen))])
    target = torch.randint(0, 5, (len(parents) + 1,), generator=gen).tolist()
    if parents and torch.rand((), generator=gen) < 0.7:  # agree along the branch to a random node
        node = int(torch.randint(0, len(parents), (), generator=gen))
        while node >= 0:
            target[parents[node] + 1] = drafts[node]
            node = parents[node]
    return parents, drafts, target


def _diagnose(got, parents, drafts, target_tokens) -> None:
    """Raise ``CheckFailed`` naming what is wrong with ``got`` for this tree (nothing if right)."""
    case = f"parents={parents}, drafts={drafts}, target_tokens={target_tokens}"
    if not isinstance(got, tuple | list) or len(got) != 2:
        raise CheckFailed(f"accept_tree({case}) returned {got!r:.120}: return two lists, (path, emitted)")
    path, emitted = got
    if not isinstance(path, list) or not isinstance(emitted, list):
        raise CheckFailed(f"accept_tree({case}) returned ({type(path).__name__}, {type(emitted).__name__}): "
                          "return two lists, (path, emitted)")  # fmt: skip
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in path + emitted):
        raise CheckFailed(f"accept_tree({case}) returned {got!r:.160}: every node index and token must be a Python int "
                          "(.tolist() or int(...) on a tensor)")  # fmt: skip
    want_path, want_emitted = reference_accept_tree(parents, drafts, target_tokens)
    if path == want_path and emitted == want_emitted:
        return
    chain = _as_chain(drafts, target_tokens)
    if (path, emitted) == chain and any(parents[i] != i - 1 for i in chain[0]):
        raise CheckFailed(
            f"for {case} you returned {chain}, what accept_greedy gives for the drafts in list order: that is a "
            "chain's rule — in a tree node i continues node parents[i], not node i - 1, so a path steps from a node "
            "to one of its children, and siblings are alternatives for the same position"
        )
    own = _own_row(parents, drafts, target_tokens)
    if own[0] and (path, emitted) == own:
        raise CheckFailed(
            f"for {case} you returned {(path, emitted)}: you compared node i's token with target_tokens[i + 1], the "
            "target's token after node i itself — a node is accepted when its token is the target's token after "
            "its parent, target_tokens[parents[i] + 1]"
        )
    if path != want_path and path == [drafts[i] for i in want_path] and want_path:
        raise CheckFailed(f"for {case} your path is {path}, the accepted nodes' tokens: the path holds node indices "
                          f"({want_path}), the tokens go into emitted")  # fmt: skip
    if path != want_path and list(reversed(path)) == want_path:
        raise CheckFailed(f"for {case} your path {path} runs leaf to root: give it root to leaf, {want_path} — the "
                          "order the tokens are emitted in")  # fmt: skip
    node = -1
    for i in path:
        if not 0 <= i < len(parents):
            raise CheckFailed(f"for {case} your path {path} names node {i}, and the tree has nodes 0..{len(parents) - 1}")
        if parents[i] != node:
            where = "the root (-1)" if node == -1 else f"node {node}"
            raise CheckFailed(
                f"for {case} your path {path} goes from {where} to node {i}, whose parent is {parents[i]}: a path "
                "steps from a node to one of its children — a node with the right token on another branch "
                "continues other text"
            )
        if drafts[i] != target_tokens[node + 1]:
            after = "the sequence" if node == -1 else f"node {node}"
            raise CheckFailed(
                f"for {case} your path accepts node {i} (token {drafts[i]}), but the target's token after {after} is "
                f"target_tokens[{node + 1}] = {target_tokens[node + 1]}"
                + (f" — target_tokens[{i + 1}] is the token after node {i} itself, not the one it must match"
                   if drafts[i] == target_tokens[i + 1] else "")  # fmt: skip
            )
        node = i
    if len(path) < len(want_path):
        child = want_path[len(path)]
        after = "the sequence's last token" if node == -1 else f"node {node}"
        raise CheckFailed(
            f"for {case} your path {path} stops too early: node {child} (token {drafts[child]}), a child of {after}, "
            f"holds the target's token there (target_tokens[{node + 1}] = {target_tokens[node + 1]}) — accept the "
            f"longest branch whose every token is the target's, here {want_path}"
        )
    if emitted[: len(path)] != [drafts[i] for i in path]:
        raise CheckFailed(f"for {case} your path is {path} but you emitted {emitted}: emit the accepted nodes' tokens "
                          f"{[drafts[i] for i in path]} first")  # fmt: skip
    bonus = target_tokens[node + 1]
    if len(emitted) == len(path):
        raise CheckFailed(
            f"for {case} you emitted only the accepted tokens {emitted}: add the target's own token after the last "
            f"accepted node, target_tokens[{node + 1}] = {bonus} — the pass computed it, so every verify step emits "
            "at least one token"
        )
    if emitted != want_emitted:
        raise CheckFailed(
            f"for {case} you emitted {emitted}: after the path's tokens comes exactly one token, the target's after "
            f"the last accepted node ({'the sequence' if node == -1 else f'node {node}'}): target_tokens[{node + 1}] = "
            f"{bonus}, so {want_emitted}"
        )
    raise CheckFailed(f"for {case} you returned {got}, expected {(want_path, want_emitted)}")  # not reached


def _as_chain(drafts, target_tokens) -> tuple[list[int], list[int]]:
    """The verdict of chain acceptance (exercise 1) applied to the nodes in list order (a common slip)."""
    from minillm.speculative.acceptance import accept_greedy

    emitted = accept_greedy(list(target_tokens[: len(drafts) + 1]), list(drafts))
    return list(range(len(emitted) - 1)), emitted


def _own_row(parents, drafts, target_tokens) -> tuple[list[int], list[int]]:
    """The verdict when each node is matched against the target's token after itself (a slip)."""
    path, node = [], -1
    while True:
        child = next((i for i, p in enumerate(parents) if p == node and drafts[i] == target_tokens[i + 1]), None)
        if child is None:
            return path, [drafts[i] for i in path] + [target_tokens[node + 1]]
        path.append(child)
        node = child


def _greedy(model, ids: list[int], max_tokens: int) -> list[int]:
    """The target alone: one token per pass over a contiguous KV cache."""
    from minillm.kvcache.contiguous import ContiguousKVCache
    from minillm.speculative.tree import tree_pass

    tokens = list(ids)
    cache = ContiguousKVCache(model.config, 1, len(ids) + max_tokens + 1, model.dtype, model.device)
    for _ in range(max_tokens):
        cached = 0 if len(tokens) == len(ids) else len(tokens) - 1
        logits, _ = tree_pass(model, tokens, [], [], cache=cache, cached=cached)
        tokens.append(int(logits[0].argmax()))
    return tokens[len(ids) :]


@check
def check_accept_tree(accept_tree, model: str = "smollm2-135m", head: str = "smollm2-eagle") -> str:
    """``accept_tree(parents, drafts, target_tokens) -> (path, emitted)``: the longest branch of
    the draft tree the target agrees with, and the tokens the verify pass emits."""
    from minillm.assets import resolve_model
    from minillm.models import load_model
    from minillm.speculative.eagle import load_eagle_head
    from minillm.speculative.tree import check_parents, tree_generate
    from minillm.tokenizer import Tokenizer

    cases = list(TREE_VERIFY_CASES)
    gen = torch.Generator().manual_seed(8)
    cases += [_random_case(gen) for _ in range(200)]
    for parents, _, _ in cases:
        check_parents(parents)
    for parents, drafts, target_tokens in cases:
        args = (list(parents), list(drafts), list(target_tokens))
        got = accept_tree(*args)
        if args != (parents, drafts, target_tokens):
            raise CheckFailed(f"accept_tree changed its arguments: {(parents, drafts, target_tokens)} became {args}")
        _diagnose(got, parents, drafts, target_tokens)

    # In the engine: SmolLM2 (fp32) decodes with its EAGLE head's trees, every verdict yours.
    target = load_model(resolve_model(model), torch.float32)
    draft = load_eagle_head(resolve_model(head), target)
    tokenizer = Tokenizer(resolve_model(model))
    verdicts = []

    def learner(parents, drafts, target_tokens):
        got = accept_tree(list(parents), list(drafts), list(target_tokens))
        _diagnose(got, parents, drafts, target_tokens)
        verdicts.append(len(got[0]))
        return got

    prompts = ["Explain how a rainbow forms.", "Give me a simple recipe for pancakes."]
    for question in prompts:
        ids = tokenizer.encode(tokenizer.render_chat([{"role": "user", "content": question}]), add_special_tokens=False)
        plain = _greedy(target, ids, 16)
        with hooks.override(accept_tree=learner):
            out = tree_generate(target, draft, ids, 16, depth=3, branches=3)
        if out["token_ids"] != plain:
            raise CheckFailed(f"with your accept_tree, tree decoding of {question!r} gave {out['token_ids']}, and "
                              f"SmolLM2 alone gives {plain}")  # fmt: skip
    if not verdicts:
        raise RuntimeError("tree_generate no longer calls hook accept_tree")
    return (
        f"your verdict is right on {len(cases)} trees; SmolLM2 (fp32) with its EAGLE head's trees (3 branches of 3) "
        f"decoded {len(prompts)} chat prompts token for token as it does alone, every verify pass's verdict yours"
    )
