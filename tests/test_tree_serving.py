"""EAGLE-2 trees in the serving engine: each step proposes a tree, the paged step verifies every
node in one pass (each node a row at its own address, its depth's position, seeing only its
ancestors through the kernel's ancestor bits), the accepted branch's keys move up behind the
sequence, and the output is exactly the target's — greedy tokens identical, sampled tokens
distributed as the target's own — eagerly and on the compiled step, through rollbacks,
preemption and prefix hits."""

from __future__ import annotations

import re

import pytest
import torch
from test_eagle import PROMPTS, TARGET, random_head

import minillm.speculative.speculator as speculator_module
from minillm import LLM, SamplingParams
from minillm.assets import resolve_model
from minillm.attention import cpu_paged
from minillm.config import ModelConfig
from minillm.kvcache.addressing import kv_bytes_per_token
from minillm.runtime.fast_path import ancestor_bits, token_rows
from minillm.runtime.runner import ChunkInput
from minillm.speculative.eagle import EagleProposer
from minillm.speculative.ngram import COPYING, match_length, reach
from minillm.speculative.tree import accept_tree_sampled, tree_attention_mask

pytestmark = pytest.mark.skipif(
    cpu_paged.kernel_unavailable_reason() is not None, reason="trees are verified through the C++ kernel"
)


def tree_config(head_dir, k: int = 7, topk: int = 3, depth: int = 3) -> dict:
    """Always k nodes (the governor is not these tests' subject)."""
    return {"method": "eagle", "model": str(head_dir), "num_speculative_tokens": k, "topk": topk, "depth": depth,
            "adaptive": False}  # fmt: skip


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory):
    return random_head(tmp_path_factory.mktemp("eagle-tree"))


@pytest.fixture(scope="module")
def reference():
    llm = LLM(TARGET, dtype="fp32")
    return [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=24, ignore_eos=True))]


def lure_tree(future: list[int], k: int) -> tuple[list[int], list[int]]:
    """A tree whose right branch is never the first child: a wrong guess first at the root, the
    true next token as its sibling, the true continuation under the true token only — and the
    same true token under the wrong branch too, which only a node that could see its sibling
    branch (a leaking mask) or the wrong position would score differently."""
    f0, f1, f2 = future[0], future[1], future[2]
    w = lambda t: (t + 7) % 40  # noqa: E731  (a token that is not the target's)
    tokens = [w(f0), f0, f1, w(f1), f2, f1, w(f2)]
    parents = [-1, -1, 1, 1, 2, 0, 2]  # the branch f0 f1 f2 is nodes 1, 2, 4; f1 again under the wrong guess: node 5
    return tokens[:k], parents[:k]


def lured(monkeypatch, llm: LLM) -> None:
    truth = {}
    ref = LLM(TARGET, dtype="fp32")
    for p in PROMPTS:
        ids = ref.tokenizer.encode(p)
        truth[tuple(ids)] = ref.generate(p, SamplingParams(max_tokens=40, ignore_eos=True))[0].token_ids
    grow = EagleProposer._grow_tree

    def grow_lure(self, seq, state, k, topk, depth):
        tokens, parents = grow(self, seq, state, k, topk, depth)  # the head's machinery runs as usual
        future = truth.get(tuple(seq.prompt_token_ids), [])[len(seq.output_token_ids) :]  # other prompts: the head's own
        return lure_tree(future, k) if len(future) >= 3 else (tokens, parents)

    monkeypatch.setattr(EagleProposer, "_grow_tree", grow_lure)


def test_ancestor_bits_are_the_tree_mask_row_by_row():
    parents = [-1, -1, 0, 1, 1, 4, 2, -1]
    mask = tree_attention_mask(parents)
    for i in range(len(parents)):
        bits = ancestor_bits(parents, i)
        for j in range(i + 1):  # node j lies i - j addresses before node i
            assert bool((bits >> (i - j)) & 1) == bool(mask[i, j]), (i, j)
        assert all((bits >> b) & 1 for b in range(i + 1, 64))  # the root and the sequence: always seen
    rows = token_rows([ChunkInput("r", [9, 1, 2, 3, 4, 5, 6, 7, 8], 20, 9, [0], tree_parents=parents)])
    assert [r.start for r in rows] == list(range(20, 29))  # addresses: one after the other
    assert [r.positions[0] for r in rows] == [20, 21, 21, 22, 22, 22, 23, 23, 21]  # positions: by depth
    with pytest.raises(ValueError, match="at most 62 nodes"):
        ancestor_bits(list(range(-1, 62)), 62)


def test_greedy_trees_reproduce_the_target_alone(head_dir, reference):
    llm = LLM(TARGET, dtype="fp32", speculative_config=tree_config(head_dir))
    assert llm.engine.runner.supports_trees()
    assert "trees of up to k nodes (top-3, depth 3)" in llm.engine.resolved.speculation
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=24, ignore_eos=True))
    assert [o.token_ids for o in outs] == reference
    assert sum(o.metrics.spec_proposed for o in outs) > 0
    assert llm.engine.block_manager.num_used_blocks == 0 and not llm.engine.speculator.draft.states


def test_the_right_branch_is_found_behind_a_wrong_first_guess(head_dir, reference, monkeypatch):
    """Each step's tree hides the true continuation behind a wrong first child (``lure_tree``):
    three of its tokens are accepted per step, their keys moved up behind the sequence, and the
    tokens never change — alone, in a pool small enough to preempt, and on a round that hits
    the prefix cache."""
    llm = LLM(TARGET, dtype="fp32", speculative_config=tree_config(head_dir))
    lured(monkeypatch, llm)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    out = llm.generate(PROMPTS[1], params)[0]
    assert out.token_ids == reference[1]
    assert out.metrics.spec_accepted >= 3 * (out.metrics.num_verify_steps - 2)  # 3 per step, but near the end
    per_block = 4 * kv_bytes_per_token(ModelConfig.from_folder(resolve_model(TARGET)), torch.float32)
    small = LLM(TARGET, dtype="fp32", speculative_config=tree_config(head_dir), max_num_batched_tokens=9,
                block_size=4, kv_cache_memory=16 * per_block, max_model_len=64)  # fmt: skip
    outs = small.generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == reference
    assert sum(o.num_preemptions for o in outs) > 0 and sum(o.metrics.spec_accepted for o in outs) > 0
    small.engine.block_manager.check_invariants()
    cached = LLM(TARGET, dtype="fp32", speculative_config=tree_config(head_dir), block_size=4)
    for _ in range(2):
        outs = cached.generate(PROMPTS, params)
        assert [o.token_ids for o in outs] == reference
    assert sum(o.num_cached_tokens for o in outs) > 0


def test_logprobs_of_a_tree_step_come_from_the_accepted_branchs_rows(head_dir, monkeypatch):
    plain = LLM(TARGET, dtype="fp32")
    params = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=2)
    want = plain.generate(PROMPTS[0], params)[0]
    llm = LLM(TARGET, dtype="fp32", speculative_config=tree_config(head_dir))
    lured(monkeypatch, llm)
    got = llm.generate(PROMPTS[0], params)[0]
    assert got.token_ids == want.token_ids and got.metrics.spec_accepted > 0
    for a, b in zip(got.logprobs, want.logprobs):
        assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4


def test_a_chain_is_proposed_where_the_step_cannot_verify_a_tree(head_dir, reference):
    """The ``sdpa`` backend attends without ancestor bits: the same configuration proposes chains."""
    llm = LLM(TARGET, dtype="fp32", attention_backend="sdpa", speculative_config=tree_config(head_dir))
    assert not llm.engine.runner.supports_trees()
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=24, ignore_eos=True))
    assert [o.token_ids for o in outs] == reference and sum(o.metrics.spec_proposed for o in outs) > 0


def test_sampled_tree_verification_is_distributed_as_the_target():
    """``accept_tree_sampled`` over a tree of deterministic guesses: the first token emitted is
    distributed as the target's row 0, and the second, after an accepted child, as the target's
    row after that child (chi-square, 40,000 draws)."""
    gen = torch.Generator().manual_seed(0)
    V = 6
    parents, drafts = [-1, -1, -1, 0, 0, 1], [2, 0, 5, 1, 2, 4]
    probs = torch.softmax(torch.randn(len(parents) + 1, V, generator=gen) * 1.5, -1)
    n = 40_000
    first = torch.zeros(V)
    second = {0: torch.zeros(V), 1: torch.zeros(V)}
    for _ in range(n):
        path, emitted = accept_tree_sampled(probs, parents, drafts, gen)
        assert len(emitted) == len(path) + 1 and [drafts[i] for i in path] == emitted[: len(path)]
        first[emitted[0]] += 1
        if path and path[0] in second:
            second[path[0]][emitted[1]] += 1

    assert chi2_ok(first, probs[0])
    assert chi2_ok(second[0], probs[1]) and chi2_ok(second[1], probs[2])


def chi2_ok(counts, p):
    expected = counts.sum() * p
    stat = float(((counts - expected) ** 2 / expected.clamp(min=1e-9)).sum())
    return stat < 20.5  # 5 degrees of freedom: p < 0.001 of a false alarm


def test_the_distribution_test_catches_a_rule_that_forgets_rejected_guesses():
    """A rule that tries each child against the target's whole distribution (not what is left
    after the rejected siblings) and falls back to it over-emits the guessed tokens: caught."""
    gen = torch.Generator().manual_seed(1)
    V = 6
    drafts = [2, 0, 5]  # three children of the root
    probs = torch.softmax(torch.randn(4, V, generator=gen) * 1.5, -1)

    def forgetful(p):
        for token in drafts:
            if torch.rand((), generator=gen) < p[token]:
                return token
        return int(torch.multinomial(p, 1, generator=gen))

    counts = torch.zeros(V)
    for _ in range(20_000):
        counts[forgetful(probs[0])] += 1
    assert not chi2_ok(counts, probs[0])


def test_sampled_requests_with_trees_are_reproducible_by_seed(head_dir, monkeypatch):
    llm = LLM(TARGET, dtype="fp32", speculative_config=tree_config(head_dir))
    lured(monkeypatch, llm)
    params = SamplingParams(max_tokens=20, temperature=0.8, seed=7, ignore_eos=True)
    a = llm.generate(PROMPTS[:2], params)
    b = llm.generate(PROMPTS[:2], params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert sum(o.metrics.spec_proposed for o in a) > 0


@pytest.mark.parametrize(
    "extra, message",
    [({"topk": 0}, "topk=0 must be >= 1"), ({"topk": 9}, "topk=9 is above 8"), ({"depth": 17}, "depth=17 is above 16"),
     ({"topk": "3"}, "topk='3' must be an integer"), ({"ngram_branch": -1}, "ngram_branch=-1 must be >= 0"),
     ({"ngram_branch": 17}, "ngram_branch=17 is above 16"), ({"ngram_branch": 2.0}, "ngram_branch=2.0 must be an integer"),
     ({"topk": 1, "ngram_branch": 2}, "ngram_branch=2 grafts prompt lookup's guess onto a tree: it needs topk > 1"),
     ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_min=3 is above prompt_lookup_max=2")],
)  # fmt: skip
def test_bad_tree_options_are_named(head_dir, extra, message):
    with pytest.raises(ValueError, match=message):
        LLM(TARGET, speculative_config={**tree_config(head_dir), **extra})


def test_prompt_lookups_branch_is_verified_with_the_tree(head_dir, reference, monkeypatch):
    """By default a tree also carries prompt lookup's guess as a branch (``ngram_branch``): the
    random head's trees are rarely right, the tiny model's text repeats itself, and the grafted
    branch's tokens are accepted — the tokens stay the target's own. ``ngram_branch: 0`` turns
    it off; a chain (``topk`` 1) never has it."""
    grafted = []
    graft = speculator_module.graft_chain

    def counting(drafts, parents, chain):
        out = graft(drafts, parents, chain)
        grafted.append(len(out[0]) - len(drafts))
        return out

    monkeypatch.setattr(speculator_module, "graft_chain", counting)
    accepted = {}
    for branch in (4, 0):
        llm = LLM(TARGET, dtype="fp32", speculative_config={**tree_config(head_dir), "ngram_branch": branch})
        assert ("prompt-lookup branch of up to 4" in llm.engine.resolved.speculation) == (branch == 4)
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=24, ignore_eos=True))
        assert [o.token_ids for o in outs] == reference
        accepted[branch] = sum(o.metrics.spec_accepted for o in outs)
        if branch:
            assert grafted and max(grafted) > 0 and max(grafted) <= 4  # new nodes beyond the tree's k
            grafted.clear()
    assert not grafted  # ngram_branch 0: never called
    assert accepted[4] > accepted[0], accepted
    chain = LLM(TARGET, dtype="fp32", speculative_config={**tree_config(head_dir), "topk": 1})
    assert "prompt-lookup" not in chain.engine.resolved.speculation and chain.engine.speculator.config.ngram_branch == 0


def proposals_by_kind(llm: LLM, copies: bool) -> dict[str, int]:
    """Wrap ``llm``'s speculator: count the chains and trees it proposes, checking that a chain
    goes to a sequence copying its text (and no further than its match vouches for), a tree to
    every other."""
    speculator = llm.engine.speculator
    speculator.copies = copies
    propose, kinds = speculator.propose, {"chain": 0, "tree": 0, "both in one step": 0}

    def checked(running, waiting=0):
        propose(running, waiting)
        step = set()
        for seq in running:
            if not seq.draft_tokens:
                continue
            n = match_length(seq.token_ids)
            kind = "chain" if seq.draft_parents is None else "tree"
            assert kind == ("chain" if copies and n >= COPYING else "tree"), (copies, n, kind)
            if kind == "chain":
                assert len(seq.draft_tokens) <= reach(n, 5 + 4)
            kinds[kind] += 1
            step.add(kind)
        kinds["both in one step"] += len(step) == 2

    speculator.propose = checked
    return kinds


def test_a_sequence_copying_its_text_gets_prompt_lookups_chain_instead_of_a_tree(head_dir, reference):
    """A sequence whose last 3 tokens or more occur earlier is copying: it gets prompt lookup's
    chain, as deep as its match vouches for up to the tree's nodes and branch together (k + 4),
    verified as a chain; the others get trees — in the same steps, the tokens the target's own.
    ``Speculator.copies`` off: trees for every sequence."""
    seen = {}
    for copies in (True, False):
        llm = LLM(TARGET, dtype="fp32", speculative_config=tree_config(head_dir, k=5))
        assert llm.engine.speculator.copies
        assert "copying text: prompt lookup's chain of up to k + 4" in llm.engine.resolved.speculation
        kinds = proposals_by_kind(llm, copies)
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=24, ignore_eos=True))
        assert [o.token_ids for o in outs] == reference
        seen[copies] = dict(kinds)
    assert seen[True]["chain"] and seen[True]["tree"] and seen[True]["both in one step"], seen
    assert seen[False]["chain"] == 0 and seen[False]["tree"], seen
    # with its governor, the tree engine measures copying and free text apart at every batch size
    llm = LLM(TARGET, dtype="fp32", speculative_config={**tree_config(head_dir, k=5), "adaptive": True})
    assert [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=24, ignore_eos=True))] == reference
    said = llm.engine.resolved.speculation
    assert "1 running, " not in said or re.search(r"1 running, (copying|free text): ", said), said
    assert re.search(r"[248]\+ running, copying: ", said) and re.search(r"[248]\+ running, free text: ", said), said


@pytest.mark.slow
def test_smollm2_eagle_trees_in_fp32_reproduce_the_target_alone():
    """The committed head's own trees over the real model (top-3, depth 4, 8 nodes): SmolLM2's
    greedy tokens in fp32, and more proposals accepted per verify step than its chain of 4."""
    chats = [[{"role": "user", "content": q}] for q in ("Explain how a rainbow forms.", "Why do we need sleep?")]
    params = SamplingParams(max_tokens=40)
    plain = [o.token_ids for o in LLM("smollm2-135m", dtype="fp32").generate(chats, params)]
    chain = {"method": "eagle", "model": "smollm2-eagle", "num_speculative_tokens": 4, "adaptive": False}
    tree = {**chain, "num_speculative_tokens": 8, "topk": 3, "depth": 4}
    per_step = {}
    for name, spec in (("chain", chain), ("tree", tree)):
        outs = LLM("smollm2-135m", dtype="fp32", speculative_config=spec).generate(chats, params)
        assert [o.token_ids for o in outs] == plain, name
        per_step[name] = sum(o.metrics.spec_accepted for o in outs) / sum(o.metrics.num_verify_steps for o in outs)
    assert per_step["tree"] > per_step["chain"] > 0, per_step


def test_pruned_growth_keeps_the_same_tree(head_dir):
    """``_grow_tree`` skips expanding nodes that cannot have a descendant among the k best: the
    tree (tokens and parents) is the one full growth gives, step after step of a generation."""
    llm = LLM(TARGET, dtype="fp32", speculative_config=tree_config(head_dir, k=6, topk=3, depth=4))
    proposer = llm.engine.speculator.draft
    grow, compared = EagleProposer._grow_tree, []

    def both(self, seq, state, k, topk, depth, prune=True):
        filled = state.filled
        full = grow(self, seq, state, k, topk, depth, prune=False)
        state.filled = filled  # the catch-up again, from where it started
        pruned = grow(self, seq, state, k, topk, depth, prune=True)
        compared.append(full == pruned)
        return pruned

    proposer._grow_tree = both.__get__(proposer)
    for k in (2, 6):
        llm.engine.speculator.configure(k, adaptive=False)
        llm.generate(PROMPTS[:2], SamplingParams(max_tokens=16, ignore_eos=True))
    assert compared and all(compared)


def test_a_tree_step_that_finishes_a_request_leaves_only_its_own_kv_in_the_prefix_cache(head_dir, monkeypatch):
    """A request that stops inside an accepted tree run: its full blocks go to the prefix cache,
    so the branch's K/V must have moved up first, and the bonus token's slot (never computed)
    must not be registered. A second request resending the first's prompt and answer hits
    those blocks and must continue exactly as an engine without a cache."""
    plain = LLM(TARGET, dtype="fp32", enable_prefix_caching=False, block_size=4)
    first = plain.generate(PROMPTS[1], SamplingParams(max_tokens=30, ignore_eos=True))[0].token_ids
    prompt_ids = plain.tokenizer.encode(PROMPTS[1])
    llm = LLM(TARGET, dtype="fp32", speculative_config=tree_config(head_dir), block_size=4)
    lured(monkeypatch, llm)
    hits = 0
    for stop_at in range(4, 28):  # stops at every offset in a step and in a block
        stop = first[stop_at]
        if stop in first[:stop_at]:
            continue
        out = llm.generate(PROMPTS[1], SamplingParams(max_tokens=30, ignore_eos=True, stop_token_ids=[stop]))[0]
        assert out.token_ids == first[: stop_at + 1] and out.metrics.spec_accepted > 0
        again = prompt_ids + out.token_ids
        params = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=1)  # logprobs: a wrong key shows
        want = plain.generate([again], params)[0]
        got = llm.generate([again], params)[0]
        hits += got.num_cached_tokens > 0
        assert got.token_ids == want.token_ids, stop_at
        assert all(abs(a.logprob - b.logprob) < 1e-4 for a, b in zip(got.logprobs, want.logprobs)), stop_at
    assert hits
