"""The data-parallel router: its three policies, the recorded decisions, and the prefix-aware
rule's cache hits on a shared-prefix workload."""

from __future__ import annotations

import pytest

from minillm.cluster.router import Router, prompt_block_hashes
from minillm.kvcache.block_manager import block_hash
from minillm.tools.workloads import shared_prefix_workload


def test_prompt_hashes_are_the_block_managers_chain():
    ids = list(range(40))
    hashes = prompt_block_hashes(ids, 16)
    assert len(hashes) == 2  # the last 8 tokens are not a full block
    assert hashes[0] == block_hash(None, ids[:16]) and hashes[1] == block_hash(hashes[0], ids[16:32])


def test_round_robin_and_least_loaded():
    rr = Router(3, "round_robin")
    assert [rr.route(i, [1, 2, 3]) for i in range(5)] == [0, 1, 2, 0, 1]
    ll = Router(3, "least_loaded")
    assert [ll.route(i, [1]) for i in range(3)] == [0, 1, 2]
    ll.finished(1)
    assert ll.route("next", [1]) == 1 and ll.decisions[-1].load == [1, 0, 1]


def _hit_blocks(policy: str) -> tuple[int, list[int]]:
    """Prompt blocks the chosen replica already held, summed over a shared-prefix workload."""
    router = Router(4, policy, block_size=16)
    work = shared_prefix_workload(40, None, prefix_length=256, suffix_lengths=(16, 48), vocab_size=4000, seed=0)
    for r in work:
        router.route(r.request_id, r.prompt_token_ids)
        router.finished(router.decisions[-1].replica)  # one at a time: load never forces a spread
    return sum(d.matched_blocks for d in router.decisions), [d.replica for d in router.decisions]


def test_prefix_aware_routing_reuses_the_cached_prefix():
    aware, replicas = _hit_blocks("prefix_aware")
    round_robin, _ = _hit_blocks("round_robin")
    # Round robin computes the 16-block prefix once on each of 4 replicas; prefix-aware once.
    assert round_robin == (40 - 4) * 16
    assert aware == (40 - 1) * 16  # every request after the first finds the whole shared prefix
    assert set(replicas) == {0}


def test_prefix_aware_passes_over_an_overloaded_replica():
    router = Router(2, "prefix_aware", block_size=4, max_imbalance=2)
    prompt = list(range(16))
    choices = [router.route(i, prompt) for i in range(8)]  # nobody finishes: replica 0 fills up
    assert choices[:3] == [0, 0, 0] and 1 in choices
    assert max(router.load) - min(router.load) <= 3


@pytest.mark.parametrize(("args", "message"), [((0,), "num_replicas"), ((2, "random"), "policy")])
def test_bad_routers_are_refused(args, message):
    with pytest.raises(ValueError, match=message):
        Router(*args)
    with pytest.raises(ValueError, match="no outstanding"):
        Router(2).finished(0)
