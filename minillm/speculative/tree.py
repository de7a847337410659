"""Tree drafting: several guesses for the same positions, verified in one target pass.

A chain of proposals bets everything on its first token: when ``d1`` is wrong, the rows of
``d2 .. dk`` are scored for nothing. A **tree** keeps alternatives — say the draft's two best
first tokens, each continued by its own guesses — and the target scores every node in the same
pass. Two things make that one pass correct:

- **the tree attention mask**: a node sees the whole sequence and its own ancestors (and itself),
  never a sibling branch, although all nodes sit side by side in the pass (hook
  ``tree_attention_mask``, chapter 08's exercise);
- **depth positions**: a node at depth ``d`` (0 for a child of the sequence's last token) is the
  token at position ``n + d`` of its branch, whatever its index in the pass.

Acceptance then walks down from the root: at each level keep the child whose token is the
target's choice there, and stop (with the target's own token) where none is.

SpecInfer (Miao et al., 2024, arXiv:2305.09781) verifies token trees this way; Medusa (Cai et
al., 2024, arXiv:2401.10774) uses a fixed tree over its heads' top-k; EAGLE-2 (Li et al., 2024,
arXiv:2406.16858) grows the tree from the draft head's confidence. Here the tree runs in a
pass over a contiguous KV cache (``tree_pass``), enough to measure what a tree buys in accepted
tokens (``tree_generate``). The serving engine verifies the same trees in its paged steps,
compiled or not: each node a row at its own address with its depth's position, seeing only its
ancestors through the C++ kernel's ancestor bits (``runtime/fast_path.token_rows``); the
accepted branch's keys then move up behind the sequence (``PagedRunner.keep_tree_branch``). The
EAGLE proposer grows those trees by confidence (``EagleProposer._grow_tree``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import minillm.hooks as hooks
from minillm.attention.contiguous import AttentionMask, ContiguousStep, ForwardBatch
from minillm.kvcache.contiguous import ContiguousKVCache


def check_parents(parents: list[int], num_nodes: int | None = None) -> None:
    """A tree in topological order: node ``i``'s parent is ``-1`` (the sequence's last token)
    or an earlier node."""
    if num_nodes is not None and len(parents) != num_nodes:
        raise ValueError(f"the tree has {num_nodes} draft tokens but {len(parents)} parents")
    for i, p in enumerate(parents):
        if not isinstance(p, int) or isinstance(p, bool) or not -1 <= p < i:
            raise ValueError(f"parents[{i}] = {p!r}: a node's parent is -1 (the root) or an earlier node (0..{i - 1})")


@hooks.reference("tree_attention_mask")  # tree_pass calls it through the hook (chapter 08's exercise)
def tree_attention_mask(parents: list[int]) -> torch.Tensor:
    """``mask[i, j]`` (bool, ``[N, N]``): node ``i`` may attend to node ``j`` — ``j`` is ``i``
    itself or one of its ancestors. Parents come before children, so a node's row is its
    parent's row plus itself."""
    mask = torch.eye(len(parents), dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            mask[i] |= mask[p]
    return mask


def tree_depths(mask: torch.Tensor) -> torch.Tensor:
    """Each node's depth: how many ancestors it sees (its row of the mask, less itself)."""
    return mask.sum(-1) - 1


@dataclass
class TreeBatch(ForwardBatch):
    """A sequence's new tokens followed by a tree of proposals, in one pass with an explicit mask."""

    full_mask: torch.Tensor | None = None  # [1, 1, inputs, slots]: n - cached + N rows, n + N columns
    first_logit_row: int = 0

    @property
    def logit_rows(self) -> torch.Tensor:
        """Logits after the sequence's last token and after every node: what verification reads."""
        return torch.arange(self.first_logit_row, self.input_ids.shape[1], device=self.input_ids.device)

    def bind(self, model) -> ContiguousStep:
        return ContiguousStep(self, AttentionMask(mask=self.full_mask), model.attention_backend.padded)


def tree_pass(
    model, tokens: list[int], drafts: list[int], parents: list[int], cache=None, cached: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """One target pass over ``tokens`` (the sequence) and the tree ``drafts``/``parents``.

    Without ``cache`` the pass computes the whole sequence. With a ``ContiguousKVCache`` holding
    the first ``cached`` tokens' keys and values, it computes only ``tokens[cached:]`` and the
    tree, writing their keys and values into the cache's next slots: the sequence's new tokens
    are kept, and the tree's slots are overwritten by the next pass, which starts with the
    tokens the tree gave (``tree_generate``). A node's slot is not its position: RoPE takes the
    position ``n + depth``, the mask takes the slot.

    Returns logits ``[1 + N, V]`` — row 0 after the sequence's last token, row ``1 + i`` after
    node ``i`` — and the last hidden states ``[n - cached + N, hidden]`` of every input row (the
    features a feature-level draft reads; a node's are its branch's own, as it saw only its
    ancestors)."""
    check_parents(parents, len(drafts))
    n, N = len(tokens), len(drafts)
    if n == 0:
        raise ValueError("tree_pass needs at least one token before the tree")
    if not 0 <= cached < n or (cache is None and cached):
        raise ValueError(f"cached = {cached}: a pass computes at least the sequence's last token, and only a "
                         f"cache can hold the ones before it (cache given: {cache is not None}, {n} tokens)")  # fmt: skip
    window = getattr(model, "sliding_window", None)
    if window is not None and n + N > window:
        raise ValueError(f"tree_pass has no sliding window: {n} tokens and {N} nodes pass this model's window "
                         f"of {window} (its mask would let every node see the whole sequence)")  # fmt: skip
    tree = hooks.tree_attention_mask(list(parents))
    if not isinstance(tree, torch.Tensor) or tree.shape != (N, N) or tree.dtype != torch.bool:
        raise ValueError(f"tree_attention_mask must return a bool tensor of shape ({N}, {N}), got "
                         f"{getattr(tree, 'dtype', type(tree).__name__)} {tuple(getattr(tree, 'shape', ()))}")  # fmt: skip
    device = model.embed_tokens.weight.device
    m = n - cached  # the sequence's tokens this pass computes, at slots cached .. n-1
    full = torch.zeros(m + N, n + N, dtype=torch.bool)  # rows: this pass's inputs; columns: slots 0 .. n+N-1
    full[:m, :n] = torch.ones(m, n, dtype=torch.bool).tril(diagonal=cached)  # causal over the sequence
    full[m:, :n] = True  # every node sees the whole sequence
    full[m:, n:] = tree
    positions = torch.cat([torch.arange(cached, n), n + tree_depths(tree)])
    batch = TreeBatch(
        input_ids=torch.tensor([list(tokens[cached:]) + list(drafts)], device=device),
        positions=positions[None].to(device),
        cache=cache,
        kv_len=n + N if cache is not None else None,
        same_start=cached if cache is not None else None,  # the pass's keys and values go to slots cached ..
        full_mask=full[None, None].to(device),
        first_logit_row=m - 1,
    )
    with torch.inference_mode():
        logits, hidden = model.forward_with_hidden(batch)
    return logits, hidden


def graft_chain(drafts: list[int], parents: list[int], chain: list[int]) -> tuple[list[int], list[int]]:
    """Another proposer's chain of guesses (prompt lookup's, say) grafted onto a draft tree:
    the chain follows the tree while its tokens are nodes already there, and from where it
    differs grows a branch of its own. Returns the new ``(drafts, parents)``: the tree's nodes
    first and unchanged (a prefix of the list, as the scheduler may cut it, is still the tree's
    best), then the chain's new nodes in order — parents before children, and no two siblings
    with the same token, so one target pass verifies both proposers' guesses and acceptance
    keeps whichever agrees longer.

    Why: the two are right about different tokens. A draft head guesses the next words of free
    text; prompt lookup copies runs the text has already seen (a name, a phrase of the
    question, a line of code) whole, where the head's confidence fades after a token or two."""
    drafts, parents, node = list(drafts), list(parents), -1
    children = {(p, t): i for i, (p, t) in enumerate(zip(parents, drafts))}
    for token in chain:
        child = children.get((node, token))
        if child is None:
            drafts.append(token)
            parents.append(node)
            child = children[(node, token)] = len(drafts) - 1
        node = child
    return drafts, parents


@hooks.reference("accept_tree")  # tree_generate calls it through the hook (chapter 08's exercise)
def accept_tree(parents: list[int], drafts: list[int], target_tokens: list[int]) -> tuple[list[int], list[int]]:
    """``target_tokens[0]``: the target's token after the sequence; ``target_tokens[1 + i]``:
    after node ``i``. Returns the accepted nodes (root to leaf) and the tokens to emit — the
    accepted nodes' tokens, then the target's own token where no child agrees.

    Greedy verification of a chain (``acceptance.accept_greedy``) is the case where every node's
    parent is the one before it. In a tree a node's token is checked against the target's token
    after its **parent** (``target_tokens[parent + 1]``), not after the node before it in the
    list; siblings hold different tokens (the head's different guesses), so at most one child
    matches at each level and the accepted nodes form one branch."""
    path, emitted, node = [], [], -1
    while True:
        want = target_tokens[node + 1]
        child = next((i for i, p in enumerate(parents) if p == node and drafts[i] == want), None)
        emitted.append(want)
        if child is None:
            return path, emitted
        path.append(child)
        node = child


def verified_tree(parents: list[int], drafts: list[int], target_tokens: list[int]) -> tuple[list[int], list[int]]:
    """``hooks.accept_tree``'s verdict, checked before a pass's features and tokens are cut by
    it: the path must be a branch of the tree from the root, and the emitted tokens its tokens
    followed by the target's own."""
    got = hooks.accept_tree(list(parents), list(drafts), list(target_tokens))
    if not (isinstance(got, tuple | list) and len(got) == 2 and all(isinstance(x, list) for x in got)):
        raise ValueError(f"accept_tree must return (path, emitted), two lists, got {got!r:.200}")
    path, emitted = got
    node = -1
    for i in path:
        if not isinstance(i, int) or not 0 <= i < len(parents) or parents[i] != node:
            raise ValueError(f"accept_tree's path {path} is not a branch from the root of the tree {parents}")
        node = i
    if emitted != [drafts[i] for i in path] + [target_tokens[node + 1]]:
        raise ValueError(f"accept_tree emitted {emitted} for path {path}: the path's draft tokens, then the target's "
                         f"token after its last node ({target_tokens[node + 1]})")  # fmt: skip
    return path, emitted


def accept_tree_sampled(target_probs: torch.Tensor, parents: list[int], drafts: list[int],
                        generator: torch.Generator | None = None) -> tuple[list[int], list[int]]:  # fmt: skip
    """Sampling verification of a tree of deterministic guesses: ``target_probs[1 + N, V]`` —
    row 0 the target's distribution after the sequence, row ``1 + i`` after node ``i`` — →
    the accepted branch and the tokens to emit, distributed exactly as the target's own samples.

    At each node, its children are tried in order, each as a point guess: child ``x`` is kept
    with probability ``r(x)``, where ``r`` starts as the target's distribution and loses each
    rejected child's token (renormalised) — so the first child is emitted with probability
    ``p(x1)``, the second with ``(1 - p(x1)) · p(x2) / (1 - p(x1)) = p(x2)``, and so on; when
    every child is rejected, the token is drawn from what is left of ``r``: every token ends up
    with probability ``p`` (SpecInfer's multi-candidate rule, Miao et al., 2024,
    arXiv:2305.09781, with point-mass drafts). A kept child's own children are then tried
    against the target's distribution after it."""
    children: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        children.setdefault(p, []).append(i)
    path, emitted, node = [], [], -1
    while True:
        r = target_probs[node + 1].clone()
        kept = None
        for child in children.get(node, []):
            token = drafts[child]
            total = r.sum()
            u = torch.rand((), generator=generator, device=r.device)
            if total > 0 and u * total < r[token]:
                kept = child
                break
            r[token] = 0.0
        if kept is None:
            if not r.sum() > 0:  # every token the target allows was a rejected guess: cannot happen but by rounding
                r = target_probs[node + 1]
            emitted.append(int(torch.multinomial(r, 1, generator=generator)))
            return path, emitted
        path.append(kept)
        emitted.append(drafts[kept])
        node = kept


@torch.inference_mode()
def eagle_tree(head, feats: torch.Tensor, tokens: list[int], depth: int, branches: int) -> tuple[list[int], list[int]]:
    """An EAGLE head's tree: its ``branches`` best first tokens, each continued greedily to
    ``depth`` tokens. ``feats[len(tokens) - 1, hidden]``: the target's features at positions
    ``0 .. n-2`` (the last token's is not computed yet). Returns ``(drafts, parents)``."""
    n, device = len(tokens), feats.device
    positions = torch.arange(n - 1, device=device)
    pred, k_all, v_all = head(feats[: n - 1], torch.tensor(tokens[1:], device=device), positions)
    first = head.logits(pred[-1:])[0].topk(branches).indices
    drafts, parents = [], []
    for token in head.vocab_ids[first].tolist():
        feat, keys, values, parent = pred[-1:], k_all, v_all, -1
        for step in range(depth):
            drafts.append(token)
            parents.append(parent)
            parent = len(drafts) - 1
            if step + 1 == depth:
                break
            at = torch.tensor([n - 1 + step], device=device)  # the position whose token is `token`
            feat, k_new, v_new = head(feat, torch.tensor([token], device=device), at, keys, values)
            keys, values = torch.cat([keys, k_new]), torch.cat([values, v_new])
            token = int(head.vocab_ids[head.logits(feat)[0].argmax()])
    return drafts, parents


def tree_generate(model, head, prompt: list[int], max_tokens: int, depth: int, branches: int) -> dict:
    """Greedy decoding where every target pass verifies an EAGLE tree (``branches`` = 1: a chain).

    The sequence's keys and values stay in a contiguous KV cache: each pass computes the tokens
    the last pass emitted and the new tree (``tree_pass``). Returns the output tokens, the
    passes and the tokens each pass emitted."""
    tokens = list(prompt)
    cache = ContiguousKVCache(model.config, 1, len(prompt) + max_tokens + depth * branches, model.dtype, model.device)
    logits, hidden = tree_pass(model, tokens, [], [], cache=cache)
    tokens.append(int(logits[0].argmax()))
    feats, cached = hidden[: len(tokens) - 1], len(prompt)  # features of positions 0 .. n-2; slots 0 .. cached-1 in the cache
    per_pass = [1]
    while len(tokens) - len(prompt) < max_tokens:
        drafts, parents = eagle_tree(head, feats, tokens, depth, branches)
        logits, hidden = tree_pass(model, tokens, drafts, parents, cache=cache, cached=cached)
        path, emitted = verified_tree(parents, drafts, logits.argmax(-1).tolist())
        n = len(tokens)
        m = n - cached  # hidden's first m rows: positions cached .. n-1; then the nodes
        feats = torch.cat([feats[:cached], hidden[:m], hidden[[m + i for i in path]]])  # positions 0 .. n-1+len(path)
        cached = n  # the tree's slots are overwritten by the next pass's first tokens
        emitted = emitted[: max_tokens - (n - len(prompt))]
        tokens += emitted
        per_pass.append(len(emitted))
    return {"token_ids": tokens[len(prompt) :], "passes": len(per_pass), "tokens_per_pass": per_pass}
