"""Data parallelism's front door: which replica serves a request.

Replicas are whole copies of the engine (one per device or process); a router spreads requests
over them. Three rules:

- **round robin** — the next replica in turn: fair in counts, blind to load and to caches;
- **least loaded** — the replica with the fewest outstanding requests;
- **prefix aware** — the replica that most likely holds this prompt's prefix in its prefix
  cache (chapter 03): the router remembers the block hashes (``block_hash``, the same chained
  names the block manager uses) of the prompts it sent to each replica, and picks the one
  matching the most leading blocks. Sending a shared system prompt to one replica turns every
  later request's prefill of it into a cache hit; sending it everywhere computes it once per
  replica. Load still matters: a replica more than ``max_imbalance`` requests busier than the
  least loaded one is passed over, so one hot prefix cannot pile everything onto one replica.

Each decision is recorded (``Router.decisions``), so a run can be explained afterwards. A rule
of one's own (``rule=``, chapter 09's exercise) gets the same facts the built-in policies use.

A replica can die. One marked down (``mark_down``: the serving router's health checks, or a
connection it could not open) gets nothing: every rule chooses among the live replicas only —
a dead replica's zero load would otherwise make it everyone's favourite — and what it was
believed to cache is forgotten (a restarted replica starts empty). ``mark_up`` brings it back.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from minillm.config import ROUTER_POLICIES
from minillm.kvcache.block_manager import prompt_block_hashes

POLICIES = ROUTER_POLICIES  # the one list, declared with the engine's options (config/options.py)
__all__ = ["POLICIES", "Decision", "NoLiveReplica", "Router", "prompt_block_hashes"]


class NoLiveReplica(RuntimeError):
    """Every replica is marked down."""


@dataclass
class Decision:
    request_id: object
    replica: int
    policy: str
    matched_blocks: int  # leading prompt blocks the chosen replica was believed to hold
    load: list[int]  # outstanding requests per replica when the choice was made


@dataclass
class Router:
    num_replicas: int
    policy: str = "prefix_aware"
    block_size: int = 16
    max_imbalance: int = 4
    remembered_blocks: int = 4096  # per replica, least recently used forgotten first
    load: list[int] = field(default_factory=list)
    max_decisions: int | None = 100_000  # the most recent decisions kept (a long-running router must not grow)
    # rule(matched_blocks, load, max_imbalance) -> replica: replaces the policy when given.
    rule: Callable[[list[int], list[int], int], int] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.num_replicas, bool) or not isinstance(self.num_replicas, int) or self.num_replicas < 1:
            raise ValueError(f"num_replicas={self.num_replicas!r} must be a positive integer")
        if self.policy not in POLICIES:
            raise ValueError(f"policy={self.policy!r} must be one of {POLICIES}")
        self.load = [0] * self.num_replicas
        self.decisions: deque[Decision] = deque(maxlen=self.max_decisions)
        self.num_routed = 0
        self._next = 0
        self._cached: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(self.num_replicas)]
        self.down: set[int] = set()

    @property
    def live(self) -> list[int]:
        """The replicas not marked down, in order."""
        return [r for r in range(self.num_replicas) if r not in self.down]

    def mark_down(self, replica: int) -> None:
        """``replica`` cannot serve: route around it, and forget what it was believed to cache."""
        self.down.add(replica)
        self._cached[replica].clear()

    def mark_up(self, replica: int) -> None:
        self.down.discard(replica)

    def route(self, request_id, token_ids: list[int]) -> int:
        """Choose a live replica for a request and count it as outstanding there
        (``NoLiveReplica`` when every one is down)."""
        live = self.live
        if not live:
            raise NoLiveReplica(f"all {self.num_replicas} replicas are down")
        hashes = prompt_block_hashes(token_ids, self.block_size)  # every policy records what it would reuse
        matched = [self._matched(r, hashes) for r in range(self.num_replicas)]
        if self.rule is not None:
            choice = self.rule(list(matched), list(self.load), self.max_imbalance)
            if isinstance(choice, bool) or not isinstance(choice, int) or not 0 <= choice < self.num_replicas:
                raise ValueError(
                    f"the routing rule returned {choice!r}; expected a replica index in [0, {self.num_replicas})"
                )
            if choice in self.down:  # the rule does not know who is down: the least loaded live one instead
                choice = min(live, key=lambda r: (self.load[r], r))
        elif self.policy == "round_robin":
            while self._next in self.down:
                self._next = (self._next + 1) % self.num_replicas
            choice = self._next
            self._next = (self._next + 1) % self.num_replicas
        elif self.policy == "least_loaded":
            choice = min(live, key=lambda r: (self.load[r], r))
        else:
            lightest = min(self.load[r] for r in live)
            eligible = [r for r in live if self.load[r] - lightest <= self.max_imbalance]
            choice = max(eligible, key=lambda r: (matched[r], -self.load[r], -r))
        policy = "custom" if self.rule is not None else self.policy
        self.decisions.append(Decision(request_id, choice, policy, matched[choice], list(self.load)))
        self.load[choice] += 1
        self.num_routed += 1
        cache = self._cached[choice]
        for h in hashes:  # the replica will hold these blocks once it has prefilled the prompt
            cache[h] = None
            cache.move_to_end(h)
        while len(cache) > self.remembered_blocks:
            cache.popitem(last=False)
        return choice

    def finished(self, replica: int) -> None:
        """A request routed to ``replica`` is done."""
        if self.load[replica] <= 0:
            raise ValueError(f"replica {replica} has no outstanding request to finish")
        self.load[replica] -= 1

    def _matched(self, replica: int, hashes: list[int]) -> int:
        cache, n = self._cached[replica], 0
        for h in hashes:
            if h not in cache:
                break
            n += 1
        return n
