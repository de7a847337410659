"""Chapter 08, speculative decoding: the answers its exercises' checks are tested against (see
``catalogue/__init__.py``)."""

from __future__ import annotations

import torch

from catalogue.answers import Answers
from minillm.course import forward_step, new_cache
from minillm.kvcache.addressing import RELEASED
from minillm.speculative import propose_ngram
from minillm.speculative.acceptance import accept_greedy as _accept  # the loop is the subject here

ANSWERS = Answers()
right, wrong = ANSWERS.right, ANSWERS.wrong


# ---- 08: speculative decoding ---------------------------------------------------------------------


def accept_greedy(target_tokens, draft_tokens):
    out = []
    for i, d in enumerate(draft_tokens):
        if d != target_tokens[i]:
            return out + [target_tokens[i]]
        out.append(d)
    return out + [target_tokens[len(draft_tokens)]]


def accept_greedy_zip(target_tokens, draft_tokens):
    """Independent: count the agreeing prefix first, then slice."""
    n = 0
    while n < len(draft_tokens) and draft_tokens[n] == target_tokens[n]:
        n += 1
    return list(draft_tokens[:n]) + [int(target_tokens[n])]


def _greedy_variant(target, drafts, on_mismatch="target", stop=True, bonus=0, shift=0, only_accepted=False):
    out = []
    for i, d in enumerate(drafts):
        t = target[i + shift]
        if d != t:
            if only_accepted:
                return out
            out.append(t if on_mismatch == "target" else d)
            if stop:
                return out
            continue
        out.append(d)
    if only_accepted:
        return out
    return out + ([] if bonus is None else [target[len(drafts) + bonus]])


CG = "check_accept_greedy"
right(CG, accept_greedy)
right(CG, accept_greedy_zip)
wrong(CG, "the bonus token", lambda t, d: _greedy_variant(t, d, bonus=None))
wrong(CG, "kept the draft's token", lambda t, d: _greedy_variant(t, d, on_mismatch="draft"))
wrong(CG, "went on after the first disagreement", lambda t, d: _greedy_variant(t, d, stop=False))
wrong(CG, "not target_tokens[k - 1]", lambda t, d: _greedy_variant(t, d, bonus=-1))
wrong(CG, "only the accepted proposals", lambda t, d: _greedy_variant(t, d, only_accepted=True))
wrong(CG, "compared proposal i with target_tokens[i + 1]", lambda t, d: _greedy_variant(t, d, shift=1))
wrong(CG, "list of Python ints", lambda t, d: torch.tensor(accept_greedy(t, d)))


def accept_sampled(target_probs, draft_probs, draft_tokens, generator=None):
    out = []
    for i, d in enumerate(draft_tokens):
        p = target_probs[i]
        if draft_probs is None:
            q = torch.zeros_like(p)
            q[d] = 1.0
        else:
            q = draft_probs[i]
        u = torch.rand((), generator=generator)
        if u * q[d] < p[d]:
            out.append(d)
            continue
        r = (p - q).clamp(min=0)
        return out + [int(torch.multinomial(r / r.sum(), 1, generator=generator))]
    return out + [int(torch.multinomial(target_probs[len(draft_tokens)], 1, generator=generator))]


def accept_sampled_cdf(target_probs, draft_probs, draft_tokens, generator=None):
    """Independent: all uniforms drawn up front, float64, inverse-CDF sampling, min(1, p/q)."""
    k = len(draft_tokens)
    p_all = target_probs.double()
    us = torch.rand(k + 1, generator=generator, dtype=torch.float64)

    def draw(weights, u):
        cdf = torch.cumsum(weights / weights.sum(), 0)
        return min(int(torch.searchsorted(cdf, u.reshape(1), right=True)), len(weights) - 1)

    for i, d in enumerate(draft_tokens):
        p = p_all[i]
        q_d = 1.0 if draft_probs is None else float(draft_probs[i][d])
        if q_d > 0 and float(us[i]) < min(1.0, float(p[d]) / q_d):
            continue
        if draft_probs is None:
            residual = p.clone()
            residual[d] = 0
        else:
            residual = torch.clamp(p - draft_probs[i].double(), min=0)
        extra = torch.rand((), generator=generator, dtype=torch.float64)
        return list(draft_tokens[:i]) + [draw(residual, extra)]
    return list(draft_tokens) + [draw(p_all[k], us[k])]


def _sampled_variant(target_probs, draft_probs, draft_tokens, generator=None, keep="ratio", replace="residual",
                     bonus=True, normalize=True, seeded=True, none_ok=True, one_u=False):  # fmt: skip
    gen = generator if seeded else None
    shared = float(torch.rand((), generator=gen)) if one_u else None  # one uniform for the whole pass
    out = []
    for i, d in enumerate(draft_tokens):
        p = target_probs[i]
        if draft_probs is None and none_ok:
            q = torch.zeros_like(p)
            q[d] = 1.0
        else:
            q = draft_probs[i]
        u = shared if one_u else float(torch.rand((), generator=gen))
        kept = {
            "ratio": u * float(q[d]) < float(p[d]),
            "inverse": u * float(p[d]) < float(q[d]),
            "deterministic": float(p[d]) >= float(q[d]),
        }[keep]
        if kept:
            out.append(d)
            continue
        if replace == "p":
            return out + [int(torch.multinomial(p, 1, generator=gen))]
        r = (p - q).clamp(min=0)
        if normalize:
            return out + [int(torch.multinomial(r / r.sum(), 1, generator=gen))]
        v = float(torch.rand((), generator=gen))
        return out + [int((r.cumsum(0) < v).sum())]  # an unnormalized cdf: can run past the vocabulary
    if not bonus:
        return out
    return out + [int(torch.multinomial(target_probs[len(draft_tokens)], 1, generator=gen))]


CS = "check_accept_sampled"
right(CS, accept_sampled)
right(CS, accept_sampled_cdf)
wrong(CS, "replaced by a draw from p", lambda *a: _sampled_variant(*a, replace="p"))
wrong(CS, "upside down", lambda *a: _sampled_variant(*a, keep="inverse"))
wrong(CS, "with no random draw", lambda *a: _sampled_variant(*a, keep="deterministic"))
wrong(CS, "normalize it", lambda *a: _sampled_variant(*a, normalize=False))
wrong(CS, "sample the bonus from target_probs[k]", lambda *a: _sampled_variant(*a, bonus=False))
wrong(CS, "with draft_probs=None your code raised TypeError", lambda *a: _sampled_variant(*a, none_ok=False))
wrong(CS, "draw every random number from the generator", lambda *a: _sampled_variant(*a, seeded=False))
wrong(CS, "one draw per position", lambda *a: _sampled_variant(*a, one_u=True))


def blocks_to_roll_back(table, num_tokens, block_size):
    from minillm.kvcache.addressing import RELEASED

    keep = -(-num_tokens // block_size)
    return table[:keep], [b for b in reversed(table[keep:]) if b != RELEASED]


def blocks_to_roll_back_loop(table, num_tokens, block_size):
    """Independent: walk the table from the end, by the first position each block holds."""
    kept, freed = list(table), []
    while kept and (len(kept) - 1) * block_size >= num_tokens:
        block = kept.pop()
        if block >= 0:
            freed.append(block)
    return kept, freed


def _rollback_variant(table, num_tokens, block_size, keep=None, order=-1, skip_released=True, free=True, overlap=False,
                      real=lambda b: b >= 0, released="keep"):  # fmt: skip
    if released == "filter":  # the placeholders dropped from the whole table before splitting it
        table = [b for b in table if b >= 0]
    n = -(-num_tokens // block_size) if keep is None else keep(num_tokens, block_size)
    tail = table[n - 1 :] if overlap and n else table[n:]
    freed = [b for b in tail[::order] if real(b) or not skip_released]
    kept = [b for b in table[:n] if b >= 0] if released == "drop" else table[:n]
    return kept, (freed if free else [])


CR = "check_rollback"
right(CR, blocks_to_roll_back)
right(CR, blocks_to_roll_back_loop)
wrong(CR, "tail first", lambda *a: _rollback_variant(*a, order=1))
wrong(CR, "not `b > 0`", lambda *a: _rollback_variant(*a, real=lambda b: b > 0))
wrong(CR, "not given back", lambda *a: _rollback_variant(*a, real=lambda b: b >= 0 and b != a[0][-1]))
wrong(CR, "last kept block is only partly filled", lambda *a: _rollback_variant(*a, keep=lambda n, b: n // b))
wrong(CR, "holds only rejected positions", lambda *a: _rollback_variant(*a, keep=lambda n, b: n // b + 1))
wrong(CR, "must be kept", lambda *a: _rollback_variant(*a, keep=lambda n, b: max(0, (n - 1) // b)))
wrong(CR, "(RELEASED)", lambda *a: _rollback_variant(*a, skip_released=False))
wrong(CR, "they would leak", lambda *a: _rollback_variant(*a, free=False))
wrong(CR, "both kept and given back", lambda *a: _rollback_variant(*a, overlap=True))
wrong(CR, "placeholders must stay in the table, in place", lambda *a: _rollback_variant(*a, released="drop"))
wrong(CR, "placeholders must stay in the table, in place", lambda *a: _rollback_variant(*a, released="filter"))
wrong(CR, "tuple (kept, freed)", lambda t, n, b: blocks_to_roll_back(t, n, b)[0])


# ---- 08: the tree attention mask ---------------------------------------------------------


def tree_mask_rows(parents):
    mask = torch.eye(len(parents), dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            mask[i] |= mask[p]
    return mask


def tree_mask_walk(parents):
    """Independent: walk up from every node, marking what it passes."""
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    return mask


def tree_mask_closure(parents):
    """Independent: the reflexive-transitive closure of the parent relation, by squaring."""
    n = len(parents)
    reach = torch.eye(n)
    for i, p in enumerate(parents):
        if p >= 0:
            reach[i, p] = 1
    for _ in range(max(1, n).bit_length()):
        reach = ((reach @ reach) > 0).float()
    return reach > 0


def _parent_only(parents):
    n = len(parents)
    mask = torch.eye(n, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            mask[i, p] = True
    return mask


def _same_depth_siblings(parents):
    """Sees its ancestors and also every earlier node at its own depth (another branch)."""
    mask = tree_mask_rows(parents)
    depth = mask.sum(-1)
    for i in range(len(parents)):
        for j in range(i):
            if depth[i] == depth[j]:
                mask[i, j] = True
    return mask


CT = "check_tree_attention_mask"
right(CT, tree_mask_rows)
right(CT, tree_mask_walk)
right(CT, tree_mask_closure)
wrong(CT, "transposed", lambda p: tree_mask_rows(p).T.contiguous())
wrong(CT, "does not see itself", lambda p: tree_mask_rows(p) & ~torch.eye(len(p), dtype=torch.bool))
wrong(CT, "not only the parent", _parent_only)
wrong(CT, "a causal triangle is right for a chain only", lambda p: torch.ones(len(p), len(p), dtype=torch.bool).tril())
wrong(CT, "is not on its branch", _same_depth_siblings)
wrong(CT, "comes after it", lambda p: torch.ones(len(p), len(p), dtype=torch.bool))
wrong(CT, "return a bool mask", lambda p: tree_mask_rows(p).float())
wrong(CT, "return a torch.Tensor", lambda p: tree_mask_rows(p).tolist())
wrong(CT, "one row and one column per node", lambda p: tree_mask_rows(p)[None])
wrong(CT, "changed its argument", lambda p: (tree_mask_rows(p), p.append(-1))[0])


def _tree_mask_parent_off_by_one(parents):
    mask = torch.eye(len(parents), dtype=torch.bool)
    for i, p in enumerate(parents):
        if 0 <= p and p + 1 < i:
            mask[i] |= mask[p + 1]
    return mask


def _tree_mask_child_into_parent(parents):
    """Swapped the update: the parent's row takes the child's."""
    mask = torch.eye(len(parents), dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            mask[p] |= mask[i]
    return mask


def _tree_mask_roots_share(parents):
    """The root-level alternatives see each other (they all follow the same token...)."""
    mask = tree_mask_rows(parents)
    roots = [i for i, p in enumerate(parents) if p < 0]
    for a in roots:
        for b in roots:
            if b < a:
                mask[a, b] = True
    return mask


def _tree_mask_children_first(parents):
    """Walks the nodes last to first: a parent's row is not complete when its child copies it."""
    mask = torch.eye(len(parents), dtype=torch.bool)
    for i in reversed(range(len(parents))):
        if parents[i] >= 0:
            mask[i] |= mask[parents[i]]
    return mask


wrong(CT, "node 1 cannot see node 0, its ancestor", _tree_mask_parent_off_by_one)
wrong(CT, "comes after it", _tree_mask_child_into_parent)
wrong(CT, "is not on its branch", _tree_mask_roots_share)
wrong(CT, "not only the parent", _tree_mask_children_first)


# ---- 08: verifying a tree (the longest accepted branch) ------------------------------------------


def tree_accept_walk(parents, drafts, target_tokens):
    path, emitted, node = [], [], -1
    while True:
        want = target_tokens[node + 1]
        emitted.append(want)
        child = next((i for i, p in enumerate(parents) if p == node and drafts[i] == want), None)
        if child is None:
            return path, emitted
        path.append(child)
        node = child


def tree_accept_children_map(parents, drafts, target_tokens):
    children = {}
    for i, p in enumerate(parents):
        children.setdefault(p, {})[drafts[i]] = i
    path, node = [], -1
    while target_tokens[node + 1] in children.get(node, {}):
        node = children[node][target_tokens[node + 1]]
        path.append(node)
    return path, [drafts[i] for i in path] + [target_tokens[node + 1]]


def tree_accept_deepest(parents, drafts, target_tokens):
    """Every node accepted iff its token is the target's after its parent and its parent is
    accepted; the deepest accepted node ends the path."""
    ok, depth = [], []
    for i, p in enumerate(parents):
        ok.append(drafts[i] == target_tokens[p + 1] and (p < 0 or ok[p]))
        depth.append(0 if p < 0 else depth[p] + 1)
    best = max((i for i in range(len(parents)) if ok[i]), key=lambda i: depth[i], default=-1)
    path, node = [], best
    while node >= 0:
        path.insert(0, node)
        node = parents[node]
    return path, [drafts[i] for i in path] + [target_tokens[best + 1]]


CA = "check_accept_tree"
right(CA, tree_accept_walk)
right(CA, tree_accept_children_map)
right(CA, tree_accept_deepest)


def _accept_as_chain(parents, drafts, target_tokens):
    """accept_greedy over the nodes in list order: right for a chain only."""
    path = []
    for i, d in enumerate(drafts):
        if d != target_tokens[i]:
            break
        path.append(i)
    return path, [drafts[i] for i in path] + [target_tokens[len(path)]]


def _accept_own_row(parents, drafts, target_tokens):
    """Matches a node against the target's token after the node itself."""
    path, node = [], -1
    while True:
        child = next((i for i, p in enumerate(parents) if p == node and drafts[i] == target_tokens[i + 1]), None)
        if child is None:
            return path, [drafts[i] for i in path] + [target_tokens[node + 1]]
        path.append(child)
        node = child


def _accept_any_branch(parents, drafts, target_tokens):
    """Level by level, any node at the right depth with the right token, whoever its parent."""
    depth = []
    for p in parents:
        depth.append(0 if p < 0 else depth[p] + 1)
    path, node = [], -1
    while True:
        d = len(path)
        child = next((i for i in range(len(parents)) if depth[i] == d and drafts[i] == target_tokens[node + 1]), None)
        if child is None:
            return path, [drafts[i] for i in path] + [target_tokens[node + 1]]
        path.append(child)
        node = child


def _accept_one_level(parents, drafts, target_tokens):
    child = next((i for i, p in enumerate(parents) if p == -1 and drafts[i] == target_tokens[0]), None)
    if child is None:
        return [], [target_tokens[0]]
    return [child], [drafts[child], target_tokens[child + 1]]


def _accept_no_bonus(parents, drafts, target_tokens):
    path, emitted = tree_accept_walk(parents, drafts, target_tokens)
    return path, emitted[:-1]


def _accept_bonus_off_by_one(parents, drafts, target_tokens):
    path, emitted = tree_accept_walk(parents, drafts, target_tokens)
    last = path[-1] if path else -1
    return path, emitted[:-1] + [target_tokens[last + 2 if last + 2 < len(target_tokens) else 0]]


def _accept_reversed(parents, drafts, target_tokens):
    path, emitted = tree_accept_walk(parents, drafts, target_tokens)
    return path[::-1], emitted


def _accept_tokens_as_path(parents, drafts, target_tokens):
    path, emitted = tree_accept_walk(parents, drafts, target_tokens)
    return [drafts[i] for i in path], emitted


def _accept_emitted_only(parents, drafts, target_tokens):
    return tree_accept_walk(parents, drafts, target_tokens)[1]


def _accept_pops_drafts(parents, drafts, target_tokens):
    out = tree_accept_walk(list(parents), list(drafts), target_tokens)
    while len(drafts) > len(out[0]):
        drafts.pop()
    return out


def _accept_tensor_tokens(parents, drafts, target_tokens):
    path, emitted = tree_accept_walk(parents, drafts, target_tokens)
    return path, [torch.tensor(t) for t in emitted]


def _accept_first_child_always(parents, drafts, target_tokens):
    """Follows the first child whether or not it matches, as long as some child does."""
    path, node = [], -1
    while True:
        kids = [i for i, p in enumerate(parents) if p == node]
        if not any(drafts[i] == target_tokens[node + 1] for i in kids):
            return path, [drafts[i] for i in path] + [target_tokens[node + 1]]
        path.append(kids[0])
        node = kids[0]


def _accept_bonus_only_when_rejected(parents, drafts, target_tokens):
    """Adds the target's token only when no node was accepted."""
    path, emitted = tree_accept_walk(parents, drafts, target_tokens)
    return path, emitted if not path else emitted[:-1]


def _accept_emits_draft_not_target(parents, drafts, target_tokens):
    """On a rejection, emits the rejected child's draft instead of the target's token."""
    path, node = [], -1
    while True:
        kids = [i for i, p in enumerate(parents) if p == node]
        child = next((i for i in kids if drafts[i] == target_tokens[node + 1]), None)
        if child is None:
            tail = [drafts[kids[0]]] if kids else [target_tokens[node + 1]]
            return path, [drafts[i] for i in path] + tail
        path.append(child)
        node = child


def _accept_three_levels(parents, drafts, target_tokens):
    """A walk capped at depth 3, the depth the engine's trees happen to have."""
    path, emitted = tree_accept_walk(parents, drafts, target_tokens)
    path = path[:3]
    last = path[-1] if path else -1
    return path, [drafts[i] for i in path] + [target_tokens[last + 1]]


def _accept_first_four_children(parents, drafts, target_tokens):
    path, node = [], -1
    while True:
        kids = [i for i, p in enumerate(parents) if p == node][:4]
        child = next((i for i in kids if drafts[i] == target_tokens[node + 1]), None)
        if child is None:
            return path, [drafts[i] for i in path] + [target_tokens[node + 1]]
        path.append(child)
        node = child


wrong(CA, "stops too early", _accept_three_levels)
wrong(CA, "stops too early", _accept_first_four_children)
wrong(CA, "a path steps from a node to one of its children", _accept_as_chain)
wrong(CA, "token after its parent", _accept_own_row)
wrong(CA, "continues other text", _accept_any_branch)
wrong(CA, "stops too early", _accept_one_level)
wrong(CA, "add the target's own token", _accept_no_bonus)
wrong(CA, "exactly one token, the target's", _accept_bonus_off_by_one)
wrong(CA, "runs leaf to root", _accept_reversed)
wrong(CA, "the path holds node indices", _accept_tokens_as_path)
wrong(CA, "return two lists", _accept_emitted_only)
wrong(CA, "changed its arguments", _accept_pops_drafts)
wrong(CA, "must be a Python int", _accept_tensor_tokens)
wrong(CA, "but the target's token after", _accept_first_child_always)
wrong(CA, "add the target's own token", _accept_bonus_only_when_rejected)
wrong(CA, "exactly one token, the target's", _accept_emits_draft_not_target)


# ---- ch08: more wrong answers a learner writes


# ---- accept_greedy -------------------------------------------------------------------------------

CG = "check_accept_greedy"


def greedy_extends_drafts(target_tokens, draft_tokens):
    """Right tokens, but built in the caller's list: the engine's proposals grow or shrink."""
    for i, d in enumerate(draft_tokens):
        if d != target_tokens[i]:
            del draft_tokens[i:]
            break
    draft_tokens.append(target_tokens[len(draft_tokens)])
    return draft_tokens


def greedy_loop_variable(target_tokens, draft_tokens):
    out = []
    for i, d in enumerate(draft_tokens):
        if d != target_tokens[i]:
            return out + [target_tokens[i]]
        out.append(d)
    return out + [target_tokens[i + 1]]  # i does not exist when nothing was proposed


def greedy_nothing_proposed_is_empty(target_tokens, draft_tokens):
    if not draft_tokens:
        return []
    out = []
    for i, d in enumerate(draft_tokens):
        if d != target_tokens[i]:
            return out + [target_tokens[i]]
        out.append(d)
    return out + [target_tokens[-1]]


def greedy_counts_all_agreements(target_tokens, draft_tokens):
    n = sum(d == t for d, t in zip(draft_tokens, target_tokens))
    return list(draft_tokens[:n]) + [target_tokens[n]]


def greedy_replacement_one_later(target_tokens, draft_tokens):
    out = []
    for i, d in enumerate(draft_tokens):
        if d != target_tokens[i]:
            return out + [target_tokens[i + 1]]
        out.append(d)
    return out + [target_tokens[len(draft_tokens)]]


def greedy_break_then_bonus(target_tokens, draft_tokens):
    out = []
    for i, d in enumerate(draft_tokens):
        if d != target_tokens[i]:
            out.append(target_tokens[i])
            break
        out.append(d)
    return out + [target_tokens[len(draft_tokens)]]


wrong(CG, "changed its argument draft_tokens", greedy_extends_drafts)
wrong(CG, "accept_greedy([3], []) raised UnboundLocalError", greedy_loop_variable)
wrong(CG, "with no proposals (the draft proposed nothing this step)", greedy_nothing_proposed_is_empty)
wrong(CG, "not the agreeing *prefix*", greedy_counts_all_agreements)
wrong(
    CG,
    "you emitted target_tokens[2] = 7; the replacement is the target's token at the same position",
    greedy_replacement_one_later,
)
wrong(CG, "after a rejected proposal you appended the bonus token", greedy_break_then_bonus)

# ---- accept_sampled -------------------------------------------------------------------------------

CS = "check_accept_sampled"


def _q_of(target_probs, draft_probs, i, d):
    if draft_probs is None:
        q = torch.zeros_like(target_probs[i])
        q[d] = 1.0
        return q
    return draft_probs[i]


def sampled(target_probs, draft_probs, draft_tokens, generator=None, keep=None, residual=None, draw=None, tail=None):
    """The rule with one piece swapped: keep(u, p_d, q_d), residual(p, q, d), draw(weights, generator)."""
    keep = keep or (lambda u, p_d, q_d: u * q_d < p_d)
    residual = residual or (lambda p, q, d: (p - q).clamp(min=0))
    draw = draw or (lambda w, g: int(torch.multinomial(w / w.sum(), 1, generator=g)))
    out = []
    for i, d in enumerate(draft_tokens):
        p, q = target_probs[i], _q_of(target_probs, draft_probs, i, d)
        if keep(float(torch.rand((), generator=generator)), float(p[d]), float(q[d])):
            out.append(d)
            continue
        out.append(draw(residual(p, q, d), generator))
        if tail is None:
            return out
        break
    bonus = torch.multinomial(target_probs[len(draft_tokens)], 1, generator=generator)
    return out + [int(bonus) if tail is None else tail(bonus)]


def _p_without_d(p, q, d):
    r = p.clone()
    r[d] = 0
    return r


def sampled_none_means_no_draft(target_probs, draft_probs, draft_tokens, generator=None):
    """draft_probs=None read as "the draft agrees with the target": q = p, every proposal kept."""
    out = []
    for i, d in enumerate(draft_tokens):
        p = target_probs[i]
        q = p if draft_probs is None else draft_probs[i]
        if torch.rand((), generator=generator) * q[d] < p[d]:
            out.append(d)
            continue
        r = (p - q).clamp(min=0)
        return out + [int(torch.multinomial(r / r.sum(), 1, generator=generator))]
    return out + [int(torch.multinomial(target_probs[len(draft_tokens)], 1, generator=generator))]


wrong(CS, "torch.multinomial refused the weights", lambda *a: sampled(*a, residual=lambda p, q, d: p - q))
wrong(CS, "residual's most likely token (an argmax)", lambda *a: sampled(*a, draw=lambda w, g: int(w.argmax())))
wrong(CS, "with the rejected token removed", lambda *a: sampled(*a, residual=_p_without_d))
wrong(CS, "the comparison is inverted", lambda *a: sampled(*a, keep=lambda u, p_d, q_d: u * q_d >= p_d))
wrong(CS, "kept with probability p(x), forgetting the draft", lambda *a: sampled(*a, keep=lambda u, p_d, q_d: u < p_d))
wrong(CS, "should return a list of Python ints", lambda *a: sampled(*a, tail=lambda bonus: bonus))
wrong(CS, "after the first rejected proposal comes one replacement, and then nothing", lambda *a: sampled(*a, tail=int))
wrong(
    CS,
    "with draft_probs=None (deterministic proposals, as prompt lookup makes) the proposal was kept 100.0%",
    sampled_none_means_no_draft,
)

# ---- blocks_to_roll_back ------------------------------------------------------------------------

CR = "check_rollback"


def rollback_reversed_iterator(table, num_tokens, block_size):
    keep = -(-num_tokens // block_size)
    return table[:keep], reversed([b for b in table[keep:] if b != RELEASED])


def rollback_drops_released_from_kept(table, num_tokens, block_size):
    keep = -(-num_tokens // block_size)
    return [b for b in table[:keep] if b != RELEASED], [b for b in reversed(table[keep:]) if b != RELEASED]


def rollback_tokens_as_entries(table, num_tokens, block_size):
    return table[:num_tokens], [b for b in reversed(table[num_tokens:]) if b != RELEASED]


def rollback_rounded(table, num_tokens, block_size):
    keep = round(num_tokens / block_size)  # to the nearest: 17 tokens of 16 keep 1 block
    return table[:keep], [b for b in reversed(table[keep:]) if b != RELEASED]


def rollback_sorted_by_number(table, num_tokens, block_size):
    keep = -(-num_tokens // block_size)
    return table[:keep], sorted((b for b in table[keep:] if b != RELEASED), reverse=True)


wrong(CR, "returned freed as a list_reverseiterator, an iterator, not a list", rollback_reversed_iterator)
wrong(CR, "you dropped the -1 (RELEASED) entries from kept", rollback_drops_released_from_kept)
wrong(CR, "4 blocks kept for 6 tokens of 4 per block", rollback_tokens_as_entries)
wrong(CR, "you sorted the blocks by their number", rollback_sorted_by_number)
wrong(CR, "the last kept block is only partly filled (token 16 of a block of 16)", rollback_rounded)


# ---- Chapter 08's speculative decoding loop (``check_speculative_decode``): right answers written
# independently, and the wrong ones a learner writes, one slip each (``decode_with(...)``).


SD = "check_speculative_decode"


def decode_with(**slip):
    """The reference loop with one of a learner's slips switched on."""

    def speculative_decode(model, prompt_ids, max_new_tokens, k, eos_token_id=None):
        eos = None if slip.get("ignores_eos") else eos_token_id
        ids = prompt_ids if slip.get("mutates_prompt") else list(prompt_ids)
        cache = new_cache(model, len(ids) + max_new_tokens + 64)
        logits = forward_step(model, list(ids), 0, cache)
        if not slip.get("drops_prefill_token"):
            ids.append(int(logits[0 if slip.get("first_row") else -1].argmax()))
        passes, start = 1, len(ids) - 1
        while len(ids) - len(prompt_ids) < max_new_tokens + (1 if slip.get("one_more") else 0):
            if ids[-1] == eos and not slip.get("eos_not_at_prefill"):
                break
            drafts = [] if slip.get("never_proposes") else propose_ngram(ids, 100 if slip.get("uncapped") else k)
            if slip.get("new_cache"):
                cache = new_cache(model, len(ids) + max_new_tokens + 64)
            if slip.get("recompute"):
                logits = forward_step(model, ids + drafts, 0, cache)[len(ids) - 1 :]
            elif slip.get("drafts_only") and drafts:
                logits = forward_step(model, drafts, len(ids), cache)  # the last token's K/V never written
            else:
                begin = start if slip.get("no_rollback") else len(ids) - 1
                logits = forward_step(model, [ids[-1]] + drafts, begin, cache)
                start = begin + 1 + len(drafts)
            passes += 1
            target = logits.argmax(-1).tolist()
            if slip.get("accept_all"):
                ids += drafts + [target[len(drafts)]] if len(target) > len(drafts) else drafts
            elif slip.get("shifted"):
                ids += _accept(target[1:] + target[-1:], drafts)
            elif slip.get("drafts_only") and drafts:
                ids += _accept([ids[-1]] + target, drafts)
            else:
                kept = _accept(target, drafts)
                if eos in kept and not slip.get("eos_last_only"):
                    kept = kept[: kept.index(eos) + (0 if slip.get("drops_eos") else 1)]
                ids += kept
                if eos in kept[-1:] or (slip.get("drops_eos") and eos in _accept(target, drafts)):
                    break
        new = ids[len(prompt_ids) :]
        if slip.get("echo"):
            return ids[: len(prompt_ids) + max_new_tokens], passes
        if slip.get("no_trim"):
            return new, passes
        return new[:max_new_tokens], passes - 1 if slip.get("no_prefill_count") else passes

    return speculative_decode


def propose_lookup(tokens, k, max_n=4):
    """Right, written independently: the n-grams as tuples, the latest occurrence by rindex-like search."""
    for n in range(min(max_n, len(tokens) - 1), 0, -1):
        tail = tuple(tokens[-n:])
        for start in reversed(range(len(tokens) - n)):
            if tuple(tokens[start : start + n]) == tail:
                return list(tokens[start + n : start + n + k])
    return []


def propose_with(**slip):
    """The prompt lookup with one of a learner's slips switched on."""

    def propose(tokens, k, max_n=4):
        if slip.get("sorts"):
            tokens.sort()  # "tidy up" the caller's list
        top = min(max_n, len(tokens) - 1)
        if slip.get("ignores_max_n"):
            top = len(tokens) - 1
        sizes = list(range(top, 0, -1))
        if slip.get("shortest_first"):
            sizes.reverse()
        for n in sizes:
            suffix = tokens[len(tokens) - n :]
            last = len(tokens) - n - (0 if slip.get("self_match") else 1)
            starts = range(0, last + 1) if slip.get("oldest_first") else range(last, -1, -1)
            for start in starts:
                if tokens[start : start + n] == suffix:
                    begin = start + n + (1 if slip.get("skips_one") else 0)  # "the token after the match"
                    found = tokens[begin : begin + k + (1 if slip.get("one_more") else 0)]
                    if slip.get("tuple"):
                        return tuple(found)
                    return found[:-1] if slip.get("one_less") and len(found) == k else found
            if slip.get("gives_up"):
                return []
        return None if slip.get("none") else []

    return propose


right(SD, propose_lookup, decode_with())


def speculative_decode_positions(model, prompt_ids, max_new_tokens, k, eos_token_id=None):
    """Tracks the cache's valid length in a variable instead of reading len(tokens)."""
    tokens = list(prompt_ids)
    cache = new_cache(model, len(tokens) + max_new_tokens + k + 1)
    valid = 0  # positions whose K/V the cache holds for the kept tokens
    passes = 0
    pending = tokens
    while len(tokens) < len(prompt_ids) + max_new_tokens:
        if passes and tokens[-1] == eos_token_id:
            break
        guesses = propose_ngram(tokens, k) if valid else []
        feed = pending + guesses
        logits = forward_step(model, feed, valid, cache)
        passes += 1
        best = logits.argmax(-1).tolist()[len(pending) - 1 :]
        kept = 0
        while kept < len(guesses) and guesses[kept] == best[kept]:
            kept += 1
        new = guesses[:kept] + [best[kept]]
        if eos_token_id in new:  # the answer's end: nothing after it
            new = new[: new.index(eos_token_id) + 1]
        valid += len(pending) + kept  # the fed tokens that stay: the pending ones and the accepted guesses
        tokens += new
        pending = [new[-1]]
    return tokens[len(prompt_ids) : len(prompt_ids) + max_new_tokens], passes


right(SD, propose_lookup, speculative_decode_positions)

wrong(SD, "return only the new tokens", propose_lookup, decode_with(echo=True))
wrong(SD, "keep exactly 48", propose_lookup, decode_with(no_trim=True))
wrong(SD, "changed the prompt_ids list", propose_lookup, decode_with(mutates_prompt=True))
wrong(SD, "no proposal was ever accepted", propose_lookup, decode_with(never_proposes=True))
wrong(SD, "at most k proposals", propose_lookup, decode_with(uncapped=True))
wrong(SD, "ran against a new cache", propose_lookup, decode_with(new_cache=True))
wrong(SD, "recomputing the whole sequence", propose_lookup, decode_with(recompute=True))
wrong(SD, "that is the rollback", propose_lookup, decode_with(no_rollback=True))
wrong(SD, "a pass starts with the last kept token", propose_lookup, decode_with(drafts_only=True))
wrong(SD, "keep a proposal only while it equals the target's argmax", propose_lookup, decode_with(accept_all=True))
wrong(SD, "keep a proposal only while it equals the target's argmax", propose_lookup, decode_with(shifted=True))
wrong(SD, "the prefill counts as one", propose_lookup, decode_with(no_prefill_count=True))
wrong(SD, "plain greedy decoding gives", propose_lookup, decode_with(first_row=True))
wrong(SD, "the prefill's last row already gives the first new token", propose_lookup, decode_with(drops_prefill_token=True))
wrong(SD, "the last pass ran after all", propose_lookup, decode_with(one_more=True))
wrong(SD, "the shortest n-gram was tried first", propose_with(shortest_first=True), decode_with())
wrong(SD, "the oldest occurrence was used", propose_with(oldest_first=True), decode_with())
wrong(SD, "the last n tokens matched themselves", propose_with(self_match=True), decode_with())
wrong(SD, "propose at most k", propose_with(one_more=True), decode_with())
wrong(SD, "an n-gram longer than max_n was matched", propose_with(ignores_max_n=True), decode_with())
wrong(SD, "changed the tokens it was given", propose_with(sorts=True), decode_with())
wrong(SD, "return a list of token ids", propose_with(tuple=True), decode_with())
wrong(SD, "return a list of token ids", propose_with(none=True), decode_with())
wrong(SD, "expected [9, 9, 3, 4]", propose_with(one_less=True), decode_with())
wrong(SD, "go on with n - 1, down to 1", propose_with(gives_up=True), decode_with())
wrong(SD, "expected [9, 9, 3, 4]", propose_with(skips_one=True), decode_with())
wrong(SD, "expected [", lambda tokens, k, max_n=4: tokens[-k:], decode_with())
wrong(SD, "your loop went on after the EOS", propose_lookup, decode_with(ignores_eos=True))
wrong(SD, "not only the last: keep it, cut what follows", propose_lookup, decode_with(eos_last_only=True))
wrong(SD, "check the prefill's token before the first verify pass", propose_lookup, decode_with(eos_not_at_prefill=True))
wrong(SD, "you dropped the EOS itself", propose_lookup, decode_with(drops_eos=True))


def decode_without_eos(model, prompt_ids, max_new_tokens, k):
    """The loop as it was before the EOS: no eos_token_id parameter."""
    return decode_with()(model, prompt_ids, max_new_tokens, k)


wrong(SD, "add the parameter eos_token_id=None", propose_lookup, decode_without_eos)
