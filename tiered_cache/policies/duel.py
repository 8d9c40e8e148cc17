"""The duel: mini caches of every expert on one sample of the keys, and which one to follow.

A *miniature simulation* (Waldspurger et al., "Cache Modeling and Optimization using Miniature
Simulations", USENIX ATC 2017) replays only the keys in a fixed 1/R sample of the key space
through a cache of capacity/R slots, and its hit ratio tracks the full cache's. Here every
expert (`shadow.EXPERTS`) has such a cache over the *same* sample, so their outcomes are paired
use by use: `wins[i][j]` counts the sampled uses that expert i's cache hit and j's missed.

The choice starts at LRU and moves to a challenger only when it beats the incumbent by `z`
standard errors of the paired difference (McNemar's test: d = wins[i][c] - wins[c][i] against
sqrt(wins[i][c] + wins[c][i])), the same rule that brings it back to LRU when LRU pulls ahead.
Counts halve every `GHOST_PER_SLOT` mini-cache capacities of sampled uses, so the evidence is
about the stream as it is now (set dueling, DIP; Qureshi et al., ISCA 2007, with the duel run
on shadow caches instead of on sets of the real one).

The duel also measures whether requests' *tails* (a request's last block, usually partial: the
next request has other tokens there) are reused less often than other blocks used once, which
switches the credit experts' dead-tail rule (`class_credit`'s) on and off.

NOTE: keys are the 16-byte content keys, never block ids (ids are recycled; content comes back
under other ids). A key is sampled by its first byte (content keys are uniform hashes), so the
sample is the same in every process and run.

NOTE: cost, under the control-plane lock. A sampled use costs O(log cap) per mini cache plus
O(experts^2) for the scores (3 experts); the history is bounded (`hist_limit`) and trimmed one
entry per insertion; halving the scores is O(experts^2) once per window. Nothing here grows
with the number of cached blocks beyond log factors.
"""

from __future__ import annotations

import math
from collections import OrderedDict

from tiered_cache.policies.reuse_credit import GHOST_PER_SLOT
from tiered_cache.policies.shadow import (
    EXPERTS,
    LAST,
    PARENT,
    TAIL,
    USES,
    Expert,
    LruMini,
    MiniCache,
)

MINI_SLOTS = 32
"""Smallest mini cache wanted: R is the largest power of two (up to MAX_RATE) with
capacity / R at least this."""

MAX_RATE = 8
"""Largest sampling divisor R. The duel costs about 9 us per sampled use on the 2-core
development VM: one use in 8 keeps the adaptive replay above 0.7x LRU's speed, and mini caches
of capacity / 8 slots are large enough to rank the experts (on the tuning seeds, one in 16
lost 0.6% of the geometric mean)."""

LARGE_MINI = 8192
"""Mini-cache slots past which a larger tier samples more sparsely than 1 in MAX_RATE: R
doubles while capacity / R stays at least this (a 10^6-block tier samples 1 key in 64, into
mini caches of 15,625 slots). Spatial sampling ranks caches from a fixed-size sample of some
thousands of keys (SHARDS, Waldspurger et al., FAST'15), while the duel's arrays cost about
46 bytes per sampled key: at 1 in 8 that was 46 bytes per cached block of a 10^6-block tier
(benchmarks/control_plane.py --memory), at 1 in 64 it is under 6. A sparser sample also hears
fewer uses, so the duel needs proportionally more requests to reach significance; a tier this
large serves as many more between two turnovers. Tiers up to 131,071 blocks (every capacity of
the policy evaluation) keep their rate."""

TOP_RATE = 256
"""Sparsest sampling: a key is sampled when its first byte has no bit of R - 1 set."""

Z = 2.0
"""Standard errors by which a challenger must beat the incumbent (two-sided 95%)."""


def sample_rate(capacity: int, mini_slots: int = MINI_SLOTS, max_rate: int = MAX_RATE) -> int:
    """R: the largest power of two, at most `max_rate`, with capacity / R >= `mini_slots`
    (1 for caches smaller than that: then every key is sampled); past `max_rate`, R keeps
    doubling (up to `TOP_RATE`) while the mini caches keep at least `LARGE_MINI` slots."""
    rate = 1
    while rate < max_rate and capacity // (2 * rate) >= mini_slots:
        rate *= 2
    if rate == max_rate:
        while rate < TOP_RATE and capacity // (2 * rate) >= LARGE_MINI:
            rate *= 2
    return rate


class Duel:
    """Mini caches of every expert over one sample of the keys, paired scores, the choice."""

    def __init__(self, capacity: int, experts: tuple[Expert, ...] = EXPERTS, z: float = Z,
                 mini_slots: int = MINI_SLOTS, max_rate: int = MAX_RATE) -> None:
        if not experts or experts[0].lifetimes != 0.0:
            raise ValueError("the first expert must be LRU (lifetimes 0): it is the floor")
        if max_rate > 256 or max_rate & (max_rate - 1):
            raise ValueError(f"max_rate: a power of two up to 256, got {max_rate}")
        self.experts = experts
        self.z = z
        self.rate = sample_rate(max(1, capacity), mini_slots, max_rate)
        self.mask = self.rate - 1
        self.cap = max(1, capacity // self.rate)
        # key -> [uses, first, last, parent key, depth, tail], least recently used first
        self.hist: OrderedDict[bytes, list] = OrderedDict()
        self.hist_limit = GHOST_PER_SLOT * self.cap
        self.minis: list[MiniCache | LruMini] = [
            LruMini(self.cap, self) if e.lifetimes == 0.0 else MiniCache(e, self.cap, self)
            for e in experts]
        k = len(experts)
        self.wins = [[0.0] * k for _ in range(k)]
        self.window = GHOST_PER_SLOT * self.cap
        self._uses = 0
        self.now = 0
        self.choice = 0
        self.switches = 0
        self.fixed: int | None = None   # follow this expert whatever the scores (evaluation)
        # [trials, reuses] of sampled blocks used once: requests' tails, and the others
        self._tails = [0.0, 0.0]
        self._once = [0.0, 0.0]
        self.tails_dead = False

    # -- uses ---------------------------------------------------------------------------------
    def hit(self, h: bytes, t: int, parent: bytes | None, depth: int) -> None:
        """Sampled key `h` was used at clock `t` (a hit in the live tier); `parent` is its
        nearest sampled ancestor."""
        e = self._record(h, t, parent, depth)
        if e is None:
            return
        got = [m.hit(h, e) for m in self.minis]
        if any(got) and not all(got):   # some expert hit where another missed
            wins = self.wins
            for i, gi in enumerate(got):
                if gi:
                    row = wins[i]
                    for j, gj in enumerate(got):
                        if not gj:
                            row[j] += 1.0
            self._choose()
        self._count(1)

    def publish(self, chain: list[tuple[bytes, int, int]], parent: bytes | None,
                tail: bool = False) -> None:
        """A new chain was published in the live tier: (key, clock, depth) of its sampled
        blocks, root first; the first one's nearest sampled ancestor is `parent`; `tail`: the
        last of them is the request's last block.

        Each mini cache holds a prefix of the chain (`MiniCache`), so the uses that expert i
        hit and j missed are the difference of their prefixes' lengths."""
        keys, entries = [], []
        rest: list[tuple[bytes, int, int]] = []
        for i, (h, t, depth) in enumerate(chain):
            e = self._record(h, t, parent, depth)
            parent = h
            if e is None:               # announced already (a walk seen twice): the rest
                rest = chain[i + 1:]    # is no chain of fresh uses
                break
            keys.append(h)
            entries.append(e)
        if keys:
            self._publish(keys, entries, tail and not rest and len(keys) == len(chain))
        for h, t, depth in rest:
            self.hit(h, t, parent, depth)
            parent = h

    # -- a chain at once (the interface `duel_arrays.ArrayDuel` compiles) ----------------------
    def hits(self, keys: list[bytes], clocks: list[int], depths: list[int],
             parent: bytes | None, stop: int = -1) -> int:
        """`hit` of each key in order, each one's parent the one before (the first one's
        `parent`): the sampled blocks of one reused chain, root first. With `stop` >= 0, stops
        after the key that moved the choice off `stop`; returns the keys handled."""
        for i, h in enumerate(keys):
            self.hit(h, clocks[i], parent, depths[i])
            parent = h
            if stop >= 0 and self.choice != stop:
                return i + 1
        return len(keys)

    def publish_keys(self, keys: list[bytes], clocks: list[int], depths: list[int],
                     parent: bytes | None, tail: bool = False) -> None:
        """`publish` with the chain in columns."""
        if keys:
            self.publish(list(zip(keys, clocks, depths)), parent, tail)

    def first_announced(self, keys: list[bytes], seen: list[int]) -> int:
        """The first i whose key is in the history at a last use >= seen[i], or -1."""
        hist = self.hist
        for i, h in enumerate(keys):
            e = hist.get(h)
            if e is not None and e[LAST] >= seen[i]:
                return i
        return -1

    # -- a chain of blocks (the live policy's loops, as `duel_arrays.ArrayDuel` runs them) ----
    def hit_chain(self, keys, ids, la, dep, start: int, parent: bytes | None, mask: int,
                  stop: int, calls0: int, switched_at: int, cap: int) -> tuple[int, int]:
        """`hit` of the sampled keys among blocks start.. of a reused chain, root first
        (`ids`; `la`, `dep`: the table's last-use and depth arrays): (the position after
        whose hit the choice moved off `stop` while the live policy may follow it, else
        len(keys); the chain's latest last use). TypeError, before any change, if a key is
        None."""
        if None in keys[start:]:
            raise TypeError("hit_chain: a block without a key")
        latest = max(int(la[b]) for b in ids)
        for i in range(start, len(keys)):
            h = keys[i]
            if h[0] & mask:
                continue
            b = int(ids[i])
            self.hit(h, int(la[b]), parent, int(dep[b]))
            parent = h
            if stop >= 0 and self.choice != stop and (
                    switched_at < 0 or calls0 + i + 1 - switched_at >= cap):
                return i, latest
        return len(keys), latest

    def deepest_announced(self, keys, ids, la, mask: int) -> int:
        """Of a walk's blocks (deepest first), the first sampled one whose key is in the
        history at a last use >= its own last use, or -1."""
        for i, h in enumerate(keys):
            if h[0] & mask:
                continue
            e = self.hist.get(h)
            if e is not None and e[LAST] >= la[ids[i]]:
                return i
        return -1

    def walk_publish(self, keys, ids, la, born, dep, mask: int, parent: bytes | None) -> int:
        """A walk's blocks, deepest first from the block it started at: the sampled ones
        below the deepest announced one are published root first at their publication
        clocks, the announced one's key their parent (else `parent`), the tail flag set when
        the walk's first block is among them; returns how many."""
        end = self.deepest_announced(keys, ids, la, mask)
        if end >= 0:
            parent = keys[end]
        else:
            end = len(keys)
        sel = [i for i in range(end - 1, -1, -1) if not keys[i][0] & mask]
        if sel:
            self.publish([(keys[i], int(born[ids[i]]), int(dep[ids[i]])) for i in sel],
                         parent, not keys[0][0] & mask)
        return len(sel)

    def _publish(self, keys: list[bytes], entries: list[list], tail: bool) -> None:
        if tail and entries[-1][USES] == 1:
            entries[-1][TAIL] = 1
            tails, once = self._tails, self._once
            once[0] -= 1.0
            tails[0] += 1.0
            self.tails_dead = ((tails[1] + 0.5) / (tails[0] + 1.0)
                               < (once[1] + 0.5) / (once[0] + 1.0))
        held = [m.publish(keys, entries, entries[0][PARENT]) for m in self.minis]
        lo = min(held)
        if lo != max(held):
            wins = self.wins
            for i, a in enumerate(held):
                if a > lo:
                    row = wins[i]
                    for j, b in enumerate(held):
                        if a > b:
                            row[j] += a - b
            self._choose()
        self._count(len(keys))

    def _record(self, h: bytes, t: int, parent: bytes | None, depth: int) -> list | None:
        """The shared history of `h` after a use at `t`; None if that use was announced."""
        hist = self.hist
        e = hist.get(h)
        if e is None:
            e = hist[h] = [1, t, t, parent, depth, 0]
            if len(hist) > self.hist_limit:
                self._trim()
            self._once[0] += 1.0
        elif t <= e[LAST]:
            return None
        else:
            if e[USES] == 1:            # reused after one use: a success of its kind
                (self._tails if e[TAIL] else self._once)[1] += 1.0
                e[TAIL] = 0
            e[USES] += 1
            e[LAST] = t
            hist.move_to_end(h)
        if t > self.now:
            self.now = t
        return e

    def _count(self, n: int) -> None:
        self._uses += n
        if self._uses >= self.window:   # older evidence counts half
            self._uses = 0
            for row in self.wins:
                for j in range(len(row)):
                    row[j] *= 0.5
            for kind in (self._tails, self._once):
                kind[0] *= 0.5
                kind[1] *= 0.5

    def _trim(self) -> None:
        # The oldest entry goes, unless a mini cache holds it (it is ranked by it).
        hist, minis = self.hist, self.minis
        for _ in range(len(minis) + 1):
            h, e = hist.popitem(last=False)
            for m in minis:
                if h in m.res:
                    break
            else:
                return
            hist[h] = e

    def _choose(self) -> None:
        if self.fixed is not None:
            self.choice = self.fixed
            return
        c = self.choice
        wins = self.wins
        best, margin = c, 0.0
        for i in range(len(self.experts)):
            if i == c:
                continue
            a, b = wins[i][c], wins[c][i]
            d = a - b
            if d > margin and d > self.z * math.sqrt(a + b):
                best, margin = i, d
        if best != c:
            self.choice = best
            self.switches += 1
