"""`GuardedPolicy`: a user policy (`"pkg.module:Class"`) that cannot break the cache.

A policy only orders a tier's candidates; which blocks are candidates is the index's to say
(`blocks.candidate`, invariant 4). So the index never has to trust a policy it did not ship:
every hook of a user policy runs inside this guard, which checks what the hook hands back and
falls back to LRU the first time the policy raises or answers something the index cannot use.

- **A hook raises** (any `Exception`): the failure is logged with its traceback (once per
  tier) and counted (`policy_failures` in the tier's stats, `tiered_cache_policy_failures_total`),
  the policy is replaced by an `LRUPolicy` that holds exactly the tier's candidates (read from
  the table, so whatever the user policy did to its own state before it raised does not
  matter), and the hook's call is answered by that LRU. The operation that called it goes on
  as if nothing had happened: no open, close or eviction fails because a policy did.
- **A hook answers what is not a candidate**: `victim`/`victims` must return candidates of this
  tier (an id whose candidate bit is set, each once, at most `n`); `victim` may say -1 (no
  candidate) only when there is none; `offer` says a bool, `offer_run` a count within the run.
  Anything else is a failure as above, *before* the index acts on the answer: a victim that
  is pinned, in flight or in another tier would otherwise be evicted under a reader, and its
  slot handed to another prompt's KV.

NOTE: the bits are the index's own and are set or cleared around each hook in a fixed order
(core/tree.py `_refresh`, core/eviction.py): a block's bit is set before `insert(b)` and
cleared before `remove(b)`; an offered block (`offer`, `offer_run`) has no bit yet. So the
candidates read at a failure are the set the policy was meant to hold once the hook returned,
the inserted block included (`add`) and the removed one excluded (`drop`).

NOTE: built-in and registered policies are not wrapped (they run on the hot path, and the
cache's state machine checks their invariants); `tiered_cache.policies.guarded` says which are.
The index calls their hooks inside `try` instead and, should one raise, puts `fail_over`'s
guard (already on LRU) in their place (core/tier.py `TierState.fail_over`); it checks the
candidate bit of every victim of any policy itself (core/eviction.py).
"""

from __future__ import annotations

import logging
import numbers

import numpy as np

from tiered_cache.core.blocks import BlockTable
from tiered_cache.policies.base import CachePolicy
from tiered_cache.policies.lru import LRUPolicy

log = logging.getLogger(__name__)


class GuardedPolicy(CachePolicy):
    """Tier `tier`'s policy, checked; LRU from its first failure on."""

    name = "guarded"

    def __init__(self, inner: CachePolicy, tier: int, blocks: BlockTable) -> None:
        super().__init__(int(getattr(inner, "capacity_blocks", 0) or 0), blocks=blocks,
                         block_size=int(getattr(inner, "block_size", 16)),
                         cost_context_tokens=float(getattr(inner, "cost_context_tokens",
                                                           53_000.0)))
        self.inner = inner
        self.tier = tier
        self._bit = 1 << tier
        self.policy_failures = 0
        self.failed_policy: str | None = None     # the class that failed (None: it has not)
        self._flags()

    def _flags(self) -> None:
        inner = self.inner
        self.name = str(getattr(inner, "name", type(inner).__name__))
        self.offers_runs = bool(getattr(inner, "offers_runs", False))
        self.hears_every_access = bool(getattr(inner, "hears_every_access", True))
        self.takes_chain_keys = bool(getattr(inner, "takes_chain_keys", False))

    def __getattr__(self, attr: str):
        # Anything else a caller reads (a policy's own statistics, `set_oracle`) is the
        # policy's. NOTE: only called for attributes the guard itself lacks.
        if attr == "inner":
            raise AttributeError(attr)
        return getattr(self.inner, attr)

    # -- failure ---------------------------------------------------------------------------
    def _members(self, add: int = -1, drop: int = -1) -> list[int]:
        cand = self.blocks.view("candidate")
        ids = np.flatnonzero(cand & self._bit).tolist()
        if drop >= 0:
            ids = [b for b in ids if b != drop]
        if add >= 0 and add not in ids:
            ids.append(add)
        return ids

    def _fail(self, hook: str, exc: BaseException, add: int = -1, drop: int = -1,
              capacity: int | None = None) -> None:
        """Replace the policy by an LRU holding the tier's candidates (see the module
        docstring); log the first failure with its traceback, count every one."""
        self.policy_failures += 1
        if self.failed_policy is None:
            self.failed_policy = type(self.inner).__qualname__
            log.error("tier %d: eviction policy %s failed in %s (%s: %s); the tier uses LRU "
                      "from now on", self.tier, self.failed_policy, hook, type(exc).__name__,
                      exc, exc_info=(type(exc), exc, exc.__traceback__))
        cap = self.capacity_blocks if capacity is None else capacity
        lru = LRUPolicy(cap, blocks=self.blocks, block_size=self.block_size,
                        cost_context_tokens=self.cost_context_tokens)
        for b in self._members(add, drop):
            lru.insert(b)
        self.inner = lru
        self._flags()

    # NOTE: a wrong answer is raised as a ValueError inside the hook's own `try`, so that it
    # takes the same way as an exception of the policy's (`_fail`, then LRU answers).
    def _candidate(self, v: object) -> bool:
        cand = self.blocks.candidate
        return (isinstance(v, numbers.Integral) and not isinstance(v, bool)
                and 0 <= v < len(cand) and bool(cand[v] & self._bit))

    # -- hooks -----------------------------------------------------------------------------
    def insert(self, b: int) -> None:
        try:
            self.inner.insert(b)
        except Exception as exc:
            self._fail("insert", exc, add=b)

    def remove(self, b: int) -> None:
        try:
            self.inner.remove(b)
        except Exception as exc:
            self._fail("remove", exc, drop=b)

    def access(self, b: int) -> None:
        try:
            self.inner.access(b)
        except Exception as exc:
            self._fail("access", exc)
            self.inner.access(b)

    def access_many(self, blocks, keys: bytes | None = None) -> None:
        try:
            if keys is not None and self.takes_chain_keys:
                self.inner.access_many(blocks, keys=keys)
            else:
                self.inner.access_many(blocks)
        except Exception as exc:
            self._fail("access_many", exc)
            self.inner.access_many(blocks)

    def victims(self, n: int) -> list[int]:
        try:
            got = list(self.inner.victims(n))
            if len(got) > n or len(set(got)) != len(got) or \
                    not all(map(self._candidate, got)) or (not got and n > 0 and
                                                          self._members()):
                raise ValueError(f"victims({n}) returned {got[:8]!r}"
                                 f"{'...' if len(got) > 8 else ''}: not {n} or fewer "
                                 "distinct candidates of this tier")
            return [int(v) for v in got]
        except Exception as exc:
            self._fail("victims", exc)
            return self.inner.victims(n)

    def victim(self) -> int:
        try:
            v = self.inner.victim()
            if v == -1 and not isinstance(v, bool):
                if not self._members():
                    return -1
                raise ValueError("victim() returned -1 while the tier has candidates")
            if not self._candidate(v):
                raise ValueError(f"victim() returned {v!r}, not a candidate of this tier")
            return int(v)
        except Exception as exc:
            self._fail("victim", exc)
            return self.inner.victim()

    def offer(self, b: int) -> bool:
        try:
            took = self.inner.offer(b)
            if not isinstance(took, (bool, np.bool_)):
                raise ValueError(f"offer({b}) returned {took!r}, not a bool")
            return bool(took)
        except Exception as exc:
            self._fail("offer", exc)
            return self.inner.offer(b)

    def offer_run(self, run: list[int]) -> int:
        try:
            k = self.inner.offer_run(run)
            if not isinstance(k, numbers.Integral) or isinstance(k, bool) or \
                    not 0 <= k <= len(run):
                raise ValueError(f"offer_run of {len(run)} blocks returned {k!r}")
            return int(k)
        except Exception as exc:
            self._fail("offer_run", exc)
            return self.inner.offer_run(run)

    def resize(self, capacity_blocks: int) -> None:
        self.capacity_blocks = capacity_blocks
        try:
            self.inner.resize(capacity_blocks)
        except Exception as exc:
            self._fail("resize", exc, capacity=capacity_blocks)

    def __len__(self) -> int:
        try:
            n = len(self.inner)
        except Exception as exc:
            self._fail("__len__", exc)
            n = len(self.inner)
        return n


def fail_over(policy: CachePolicy, tier: int, blocks: BlockTable, hook: str,
              exc: BaseException, add: int = -1, drop: int = -1,
              capacity: int | None = None) -> GuardedPolicy:
    """The policy that takes over tier `tier` from `policy`, which raised `exc` in `hook` (or
    answered what `exc` says): a `GuardedPolicy` already on LRU over the tier's candidates
    (`add`: the block being inserted, `drop`: the one being removed). For a built-in policy:
    the index calls its hooks directly and, should one fail, puts this in its place
    (core/tier.py `TierState.fail_over`); a user policy is guarded from the start."""
    g = policy if isinstance(policy, GuardedPolicy) else GuardedPolicy(policy, tier, blocks)
    g._fail(hook, exc, add, drop, capacity)
    return g

