"""Chapter 09 (parallelism): a prefix-aware routing rule, run by the real Router."""

from __future__ import annotations

import random

from minillm.course.results import CheckFailed, LearnerRaised, check

# Exercise 3: a prefix-aware routing rule
# ---------------------------------------------------------------------------------------------

REPLICAS, BLOCK, MAX_IMBALANCE = 4, 16, 4
REMEMBERED = 48  # blocks per replica: a few prompts' worth, so a prefix sent everywhere gets evicted
OUTSTANDING = 8  # requests in flight: the oldest finishes when one more arrives


def routing_workload() -> list[list[int]]:
    """8 system prompts (8 blocks each) × 12 questions, shuffled: the prompts compete for cache."""
    from minillm.tools.workloads import shared_prefix_workload

    prompts = []
    for g in range(8):
        work = shared_prefix_workload(12, None, prefix_length=128, suffix_lengths=(16, 48), vocab_size=4000, seed=g)
        prompts += [r.prompt_token_ids for r in work]
    random.Random(0).shuffle(prompts)
    return prompts


def route_all(prompts, policy: str = "prefix_aware", rule=None) -> float:
    """Route every prompt (finishing the oldest request beyond ``OUTSTANDING``); the share of full
    prompt blocks the chosen replica already held. A rule that chooses a replica more than
    ``MAX_IMBALANCE`` busier than the lightest is stopped there."""
    from minillm.cluster.router import Router

    router = Router(REPLICAS, policy, BLOCK, MAX_IMBALANCE, remembered_blocks=REMEMBERED, rule=rule)
    flight, blocks = [], 0
    for i, ids in enumerate(prompts):
        load = list(router.load)
        try:
            choice = router.route(i, ids)
        except ValueError as err:
            raise CheckFailed(
                f"{err}: return a Python int from 0 to {REPLICAS - 1} (not a float, not a numpy integer)"
            ) from None
        idle = load.index(min(load))
        if load[choice] - load[idle] > MAX_IMBALANCE:
            raise CheckFailed(
                f"replica {choice} got {load[choice] + 1} outstanding requests while replica {idle} had {load[idle]} "
                f"(request {i}): pass over replicas more than max_imbalance={MAX_IMBALANCE} busier than the least "
                "loaded one, or one popular prefix piles every request onto one replica"
            )
        flight.append(choice)
        blocks += len(ids) // BLOCK
        if len(flight) > OUTSTANDING:
            router.finished(flight.pop(0))
    return sum(d.matched_blocks for d in router.decisions) / blocks


#: (matched_blocks, load, max_imbalance, the replica to choose, why): hand-made decisions, loads
#: far from zero too, where a cap on the load itself instead of on its distance from the lightest shows.
RULE_CASES = [
    ([0, 6, 2, 0], [5, 6, 2, 9], 4, 1, "replica 1 (6 matched blocks) is 4 above the lightest (2): within the cap"),
    ([0, 5, 0, 0], [10, 12, 9, 11], 4, 1, "every replica is busy, all within 4 of the lightest (9)"),
    ([3, 0, 0, 3], [2, 0, 1, 6], 4, 0, "replica 3 is 6 above the lightest: out; replica 0 matches as much"),
    ([0, 0, 0, 0], [3, 1, 1, 2], 4, 1, "nothing matches: the least loaded, the lowest index on ties"),
    ([2, 2, 0, 1], [4, 3, 0, 1], 2, 3, "replicas 0 and 1 are more than 2 above the lightest: out"),
]


def _absolute_cap(matched, load, max_imbalance):
    """The mistake: the cap applied to the load itself, not to its distance from the lightest."""
    eligible = [r for r in range(len(load)) if load[r] <= max_imbalance] or list(range(len(load)))
    return max(eligible, key=lambda r: (matched[r], -load[r], -r))


@check
def check_prefix_rule(rule) -> str:
    """``rule(matched_blocks, load, max_imbalance) -> int``: hand-made decisions first (each names
    its reason), then run by the real ``Router`` and compared with its built-in prefix-aware policy."""
    # Decisions by hand first, loads far from zero too: a cap on the load itself would pass the workload below.
    chosen_all = []
    for matched, load, cap, _expected, _why in RULE_CASES:
        call = f"rule({matched}, {load}, {cap})"
        try:
            chosen = rule(list(matched), list(load), cap)
        except LearnerRaised as err:
            if isinstance(err.__cause__, NotImplementedError):
                raise  # not written yet: the check says "not attempted"
            chosen_all.append(err)
            continue
        if type(chosen) is not int or not 0 <= chosen < len(load):  # what the Router refuses too
            raise CheckFailed(
                f"{call}: the routing rule returned {chosen!r}; expected a replica index in [0, {len(load)}) — return "
                "a Python int (not a float, not a numpy integer)"
            )
        chosen_all.append(chosen)
    absolute = [_absolute_cap(m, ld, c) for m, ld, c, *_ in RULE_CASES]
    capped_load_itself = all(isinstance(g, LearnerRaised) or g == a for g, a in zip(chosen_all, absolute))
    for (matched, load, cap, expected, why), chosen in zip(RULE_CASES, chosen_all):
        call = f"rule({matched}, {load}, {cap})"
        if isinstance(chosen, LearnerRaised):
            raise CheckFailed(
                f"{call} raised {type(chosen.__cause__).__name__}: {chosen.__cause__} — {why}; the cap is relative: "
                "a replica is eligible when load[r] − min(load) ≤ max_imbalance"
            ) from None
        if chosen == expected:
            continue
        if capped_load_itself:
            raise CheckFailed(
                f"{call} chose replica {chosen}, expected {expected} ({why}): you capped load[r] itself at "
                "max_imbalance — the cap is on the distance from the least loaded replica, "
                "load[r] − min(load) ≤ max_imbalance"
            )
        raise CheckFailed(f"{call} chose replica {chosen!r}, expected {expected}: {why}")
    prompts = routing_workload()
    got = route_all(prompts, rule=rule)
    builtin, round_robin = route_all(prompts, "prefix_aware"), route_all(prompts, "round_robin")
    if got < 0.9 * builtin:
        raise CheckFailed(
            f"your rule reused {got:.0%} of the prompt blocks, the built-in prefix-aware policy {builtin:.0%} (round "
            f"robin: {round_robin:.0%}) on the same {len(prompts)} requests: among the replicas within max_imbalance "
            "of the least loaded, choose the one with the most matched blocks (ties: the least loaded)"
        )
    return (
        f"your rule reused {got:.0%} of the prompt blocks (built-in prefix-aware: {builtin:.0%}, round robin: "
        f"{round_robin:.0%}) without letting a replica get more than {MAX_IMBALANCE} requests ahead of the lightest"
    )
