"""Tree drafting (``minillm/speculative/tree.py``): one pass over a tree of proposals gives every
node the logits and features of its own branch run alone; acceptance walks the branch the target
agrees with; EAGLE trees reproduce the target's greedy output; bad trees are named."""

from __future__ import annotations

import pytest
import torch
from test_eagle import random_head

import minillm.hooks as hooks
from minillm import LLM, SamplingParams
from minillm.assets import resolve_model
from minillm.models import load_model
from minillm.speculative.eagle import load_eagle_head
from minillm.speculative.tree import (
    accept_tree,
    check_parents,
    graft_chain,
    tree_attention_mask,
    tree_generate,
    tree_pass,
)
from minillm.tokenizer import Tokenizer

TARGET = "tiny-shakespeare-8m"


@pytest.fixture(scope="module")
def model():
    return load_model(resolve_model(TARGET), torch.float32)


@pytest.fixture(scope="module")
def prompt():
    return Tokenizer(resolve_model(TARGET)).encode("ROMEO.\nBut soft, what light through yonder window")


def branch_of(parents, drafts, i):
    path = []
    while i >= 0:
        path.append(i)
        i = parents[i]
    return [drafts[j] for j in reversed(path)]


@pytest.mark.parametrize("parents", [[-1, 0, 1], [-1, 0, -1, 2, 0], [-1, -1, -1], [-1, 0, 0, 1, 2, -1, 5]])
def test_every_node_gets_its_branch_run_alone(model, prompt, parents):
    drafts = torch.randint(
        0, model.config.vocab_size, (len(parents),), generator=torch.Generator().manual_seed(1)
    ).tolist()
    logits, hidden = tree_pass(model, prompt, drafts, parents)
    n = len(prompt)
    assert logits.shape == (1 + len(parents), model.config.vocab_size)
    alone, alone_hidden = tree_pass(model, prompt, [], [])
    torch.testing.assert_close(logits[0], alone[0], atol=1e-4, rtol=0)
    torch.testing.assert_close(hidden[:n], alone_hidden, atol=1e-4, rtol=0)
    for i in range(len(parents)):
        branch = branch_of(parents, drafts, i)
        alone, alone_hidden = tree_pass(model, prompt + branch, [], [])
        torch.testing.assert_close(logits[1 + i], alone[0], atol=1e-4, rtol=0)
        torch.testing.assert_close(hidden[n + i], alone_hidden[-1], atol=1e-4, rtol=0)


@pytest.mark.parametrize("cached", [0, 1, 9])
def test_a_pass_over_the_cache_gives_the_cache_free_pass(model, prompt, cached):
    """The sequence's first ``cached`` tokens read from a KV cache, the rest and the tree
    computed: the same logits and features as the pass that computes everything; the tree's
    slots do not leak into the next pass, which overwrites them."""
    from minillm.kvcache.contiguous import ContiguousKVCache

    parents, drafts = [-1, 0, -1, 2, 0], [5, 6, 7, 8, 9]
    cache = ContiguousKVCache(model.config, 1, 64, model.dtype, model.device)
    if cached:
        tree_pass(model, prompt[:cached], [11, 12], [-1, -1], cache=cache)  # fills slots 0 .. cached+1
    logits, hidden = tree_pass(model, prompt, drafts, parents, cache=cache, cached=cached)
    free_logits, free_hidden = tree_pass(model, prompt, drafts, parents)
    torch.testing.assert_close(logits, free_logits, atol=1e-4, rtol=0)
    torch.testing.assert_close(hidden, free_hidden[cached:], atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="cached = 3"):
        tree_pass(model, prompt, drafts, parents, cached=3)  # no cache to read them from
    with pytest.raises(ValueError, match=f"cached = {len(prompt)}"):
        tree_pass(model, prompt, drafts, parents, cache=cache, cached=len(prompt))  # nothing to compute


def test_the_branch_the_target_agrees_with_is_accepted(model, prompt):
    """A tree holding the target's own continuation on one branch and wrong tokens elsewhere:
    the whole right branch is accepted, plus the target's next token."""
    truth = LLM(TARGET, dtype="fp32").generate([prompt], SamplingParams(max_tokens=5, ignore_eos=True))[0].token_ids
    wrong = [(t + 1) % model.config.vocab_size for t in truth]
    drafts = [wrong[0], truth[0], wrong[1], truth[1], truth[2], wrong[3], truth[3]]
    parents = [-1, -1, 1, 1, 3, 4, 4]  # the right chain: nodes 1, 3, 4, 6
    logits, _ = tree_pass(model, prompt, drafts, parents)
    path, emitted = accept_tree(parents, drafts, logits.argmax(-1).tolist())
    assert path == [1, 3, 4, 6]
    assert emitted == truth[:5]


def test_accept_tree_by_hand():
    parents, drafts = [-1, -1, 0, 1, 1], [7, 8, 9, 5, 6]
    assert accept_tree(parents, drafts, [8, 0, 0, 0, 2, 2]) == ([1], [8, 0])  # after node 1 the target wants 0
    assert accept_tree(parents, drafts, [8, 0, 6, 0, 0, 4]) == ([1, 4], [8, 6, 4])  # row 1 + i: after node i
    assert accept_tree(parents, drafts, [3, 0, 0, 0, 0, 0]) == ([], [3])  # no child agrees: one token
    assert accept_tree([], [], [5]) == ([], [5])


def test_eagle_trees_reproduce_the_target_alone(tmp_path, model, prompt):
    head = load_eagle_head(random_head(tmp_path / "head"), model)
    plain = LLM(TARGET, dtype="fp32").generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))[0].token_ids
    for branches in (1, 3):
        out = tree_generate(model, head, prompt, 12, depth=3, branches=branches)
        assert out["token_ids"] == plain
        assert sum(out["tokens_per_pass"]) == 12


@pytest.mark.parametrize(
    "parents,drafts,message",
    [
        ([0], [1], "parents[0] = 0"),
        ([-1, 1], [1, 2], "parents[1] = 1"),
        ([-1, -2], [1, 2], "parents[1] = -2"),
        ([-1, True], [1, 2], "parents[1] = True"),
        ([-1], [1, 2], "2 draft tokens but 1 parents"),
    ],
)
def test_bad_trees_are_named(model, prompt, parents, drafts, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        tree_pass(model, prompt, drafts, parents)


def test_a_mask_of_the_wrong_kind_is_refused(model, prompt):
    with hooks.override(tree_attention_mask=lambda p: tree_attention_mask(p).float()):
        with pytest.raises(ValueError, match="bool tensor of shape"):
            tree_pass(model, prompt, [1, 2], [-1, 0])


@pytest.mark.slow
def test_smollm2_eagle_tree_reproduces_the_target_alone():
    """The committed head drafting trees over SmolLM2 in fp32: its own greedy tokens, with more
    tokens per pass than one."""
    target = load_model(resolve_model("smollm2-135m"), torch.float32, max_positions=1024)
    head = load_eagle_head(resolve_model("smollm2-eagle"), target)
    chat = [{"role": "user", "content": "Explain how a rainbow forms."}]
    tok = Tokenizer(resolve_model("smollm2-135m"))
    ids = tok.encode(tok.render_chat(chat), add_special_tokens=False)
    plain = LLM("smollm2-135m", dtype="fp32", compile=False).generate([chat], SamplingParams(max_tokens=24))[0]
    out = tree_generate(target, head, ids, len(plain.token_ids), depth=3, branches=2)
    assert out["token_ids"] == plain.token_ids
    assert out["passes"] < len(plain.token_ids)


def test_a_model_with_a_sliding_window_is_refused_past_it(model, prompt, monkeypatch):
    """tree_pass's mask has no window term: a sequence and tree longer than the model's window
    are refused by name rather than attended past the window."""
    monkeypatch.setattr(model, "sliding_window", len(prompt) + 1)
    tree_pass(model, prompt, [5], [-1])  # within the window: fine
    with pytest.raises(ValueError, match="no sliding window"):
        tree_pass(model, prompt, [5, 6], [-1, 0])


@pytest.mark.parametrize(
    "chain, drafts, parents",
    [
        ([], [5, 6, 7], [-1, -1, 0]),  # no guess: the tree as it was
        ([5, 7], [5, 6, 7], [-1, -1, 0]),  # every token already a node of one branch: nothing new
        ([5, 7, 8, 9], [5, 6, 7, 8, 9], [-1, -1, 0, 2, 3]),  # follows 5 -> 7, then grows under node 2
        ([6, 1], [5, 6, 7, 1], [-1, -1, 0, 1]),  # follows the second root child
        ([9, 7], [5, 6, 7, 9, 7], [-1, -1, 0, -1, 3]),  # differs at once: a new root child, then its own 7
        ([5, 6, 5], [5, 6, 7, 6, 5], [-1, -1, 0, 0, 3]),  # 6 under 5 is not the root's 6
    ],
)
def test_graft_chain_follows_the_tree_then_grows_its_own_branch(chain, drafts, parents):
    tree_drafts, tree_parents = [5, 6, 7], [-1, -1, 0]
    got = graft_chain(tree_drafts, tree_parents, chain)
    assert got == (drafts, parents)
    assert (tree_drafts, tree_parents) == ([5, 6, 7], [-1, -1, 0])  # the inputs untouched
    check_parents(got[1], len(got[0]))  # parents before children
    siblings = [(p, t) for p, t in zip(got[1], got[0])]
    assert len(set(siblings)) == len(siblings)  # no two children of a node with one token
    node = -1  # the chain is a branch of the grafted tree, from the root
    for token in chain:
        node = next(i for i, (p, t) in enumerate(siblings) if p == node and t == token)
