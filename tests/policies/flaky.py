"""User policies that fail on purpose, loaded by path as a user's would be
(`policy: "tests.policies.flaky:FlakyPolicy"`): tests/core/test_policy_fail_over.py.

`FlakyPolicy` is LRU (a real `LRUPolicy` inside) with every hook written out, so each hook the
index calls is this class's and counted; `PLAN` says which hook fails, at which call and how:
raise, or answer a lie. Class-level state: the tests reset it (`reset`) before each cache.
"""

from __future__ import annotations

import random

from tiered_cache.core.blocks import NO_SLOT
from tiered_cache.policies.base import CachePolicy
from tiered_cache.policies.lru import LRUPolicy

HOOKS = ("insert", "remove", "access_many", "victims", "victim", "offer", "offer_run",
         "resize", "__len__")


class Plan:
    hook: str | None = None         # the hook that misbehaves
    at: int = 1                     # at its at-th call (1: the first)
    lie: str | None = None          # None: raise; else the kind of wrong answer
    rate: float = 0.0               # with `rng`: every hook raises with this probability
    rng: random.Random | None = None
    calls: dict[str, int] = {}
    raised = 0
    open_blocks: list[int] = []     # blocks the test keeps pinned (the "pinned" lie)


PLAN = Plan()


def reset(hook: str | None = None, at: int = 1, lie: str | None = None, rate: float = 0.0,
          seed: int | None = None) -> None:
    PLAN.hook, PLAN.at, PLAN.lie, PLAN.rate = hook, at, lie, rate
    PLAN.rng = random.Random(seed) if seed is not None else None
    PLAN.calls = dict.fromkeys(HOOKS, 0)
    PLAN.raised = 0
    PLAN.open_blocks = []


reset()


class PolicyBug(RuntimeError):
    pass


class FlakyPolicy(CachePolicy):
    name = "flaky"
    offers_runs = True

    def __init__(self, capacity_blocks: int, **kw) -> None:
        super().__init__(capacity_blocks, **kw)
        self.impl = LRUPolicy(capacity_blocks, **kw)

    def _due(self, hook: str) -> bool:
        PLAN.calls[hook] += 1
        if PLAN.rng is not None and PLAN.rng.random() < PLAN.rate:
            PLAN.raised += 1
            raise PolicyBug(f"{hook}: random failure")
        if PLAN.hook != hook or PLAN.calls[hook] != PLAN.at:
            return False
        if PLAN.lie is None:
            PLAN.raised += 1
            # half done first: the policy's own state changes, then it raises
            self.impl.victims(1)
            raise PolicyBug(f"{hook}: call {PLAN.at}")
        return True

    def _not_a_candidate(self) -> int:
        """A block that is no candidate of this policy's tier: one the test keeps pinned if
        it said which, else any live row that is not a candidate."""
        t = self.blocks
        for b in PLAN.open_blocks:
            if all(s[b] != NO_SLOT for s in t.slots[:1]):
                return b
        live = self.impl._live
        return next(b for b in range(len(t.candidate)) if b not in live)

    def insert(self, b: int) -> None:
        self._due("insert")
        self.impl.insert(b)

    def remove(self, b: int) -> None:
        self._due("remove")
        self.impl.remove(b)

    def access_many(self, blocks, keys=None) -> None:
        self._due("access_many")
        self.impl.access_many(blocks)

    def victims(self, n: int) -> list[int]:
        if self._due("victims"):
            got = self.impl.victims(n)
            if PLAN.lie == "duplicate" and got:
                return got + got[:1]
            if PLAN.lie == "empty":
                return []
            return [self._not_a_candidate()] + got[1:]
        return self.impl.victims(n)

    def victim(self) -> int:
        if self._due("victim"):
            if PLAN.lie == "empty":
                return -1
            if PLAN.lie == "out_of_range":
                return 10**9
            if PLAN.lie == "not_int":
                return "3"      # type: ignore[return-value]
            return self._not_a_candidate()
        return self.impl.victim()

    def offer(self, b: int) -> bool:
        if self._due("offer"):
            return 1            # type: ignore[return-value]  (not a bool)
        return self.impl.offer(b)

    def offer_run(self, run: list[int]) -> int:
        if self._due("offer_run"):
            return len(run) + 1
        return self.impl.offer_run(run)

    def resize(self, capacity_blocks: int) -> None:
        self._due("resize")
        super().resize(capacity_blocks)
        self.impl.resize(capacity_blocks)

    def __len__(self) -> int:
        self._due("__len__")
        return len(self.impl)


class FlakyOfferPolicy(FlakyPolicy):
    """The same, offered one block at a time (`offers_runs` False: eviction calls `offer` for
    each parent a victim leaves behind, not `offer_run`)."""

    name = "flaky_offer"
    offers_runs = False
