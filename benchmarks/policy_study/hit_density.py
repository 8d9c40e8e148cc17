"""Study policy (not registered): hit density by use class and idle age, LHD-style.

Kept to reproduce the measurement in docs/replay.md ("What limits it"); it is not part of the
package because it misses the replay speed target (20-80K block ops/s, sampled eviction in
Python) and falls to 0.89-1.06x LRU on the shared trace at 1,000 blocks. Run it through the
plug-in path:

    PYTHONPATH=benchmarks/policy_study tiered-cache replay --workload agent --gpu-blocks 1000 \\
        --policy hit_density:HitDensityPolicy

How it ranks (after Beckmann et al., "LHD: Improving Cache Hit Rate by Maximizing Hit
Density", NSDI 2018):

- A block's *class* is its number of uses in doublings (1, 2-3, 4-7, 8-15, 16+), uses counted
  across evictions by a content-keyed ghost (32 keys per slot), as in `reuse_credit`.
- For every class the policy measures the distribution of reuse distances (clock ticks from a
  use to the next use of the same content): hits in the tier, and returns of evicted content
  found in the ghost (which LHD, counting only in-cache events, cannot see). Counts are halved
  every 32 trials per slot; a reuse is weighted by the halvings since its trial began, so the
  reuse rate is not inflated by late successes of halved trials.
- The hit density of a block of class c at idle age a is the best ratio, over retention
  horizons T, of P(reused in (a, a+T] | not reused by a) to the expected slot-ticks it would
  hold, E[min(R, a+T) - a | R > a]. Evict the lowest density among 64 sampled candidates
  (ties: the older). Spare copies (a copy in every tier) go first.
- Tables are rebuilt every max(16, capacity / 8) evictions (numpy, O(classes x buckets^2)).
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict

import numpy as np

from tiered_cache.block import NO_SLOT, Block
from tiered_cache.policies.base import CachePolicy

SUB = 2                                 # age buckets per doubling
NB = SUB * 40                           # covers ages up to 2**40 ticks
LO = np.array([2.0 ** (b / SUB) - 1 for b in range(NB)])             # bucket start
HI = np.array([2.0 ** ((b + 1) / SUB) - 1 for b in range(NB)])       # bucket end
MID = (LO + HI) / 2
NCLASS = 6                              # uses.bit_length() capped at 5 (index 0 unused)
SAMPLES = 64
GHOST_PER_SLOT = 32


def bucket(age: float) -> int:
    return min(NB - 1, int(math.log2(age + 1) * SUB))


class HitDensityPolicy(CachePolicy):
    name = "hit_density"

    def __init__(self, capacity_blocks: int, **kw) -> None:
        super().__init__(capacity_blocks, **kw)
        self._cap = max(1, capacity_blocks)
        self._cands: list[Block] = []               # candidates, O(1) swap-remove
        self._pos: dict[int, int] = {}
        # block id -> (class, last access at trial start, hits at trial start, halvings then)
        self._state: dict[int, tuple[int, int, int, int]] = {}
        self._resumed: dict[int, tuple[int, int, int, int]] = {}
        self._ghost: OrderedDict[int, tuple[int, int, int, int]] = OrderedDict()
        self._trials = np.zeros(NCLASS)
        self._reuse = np.zeros((NCLASS, NB))
        self._total = 0.0
        self._halvings = 0
        self._now = 0
        self._evictions = 0
        self._table = np.zeros((NCLASS, NB))
        self._rng = random.Random(0)

    def resize(self, capacity_blocks: int) -> None:
        super().resize(capacity_blocks)
        self._cap = max(1, capacity_blocks)

    # -- measurement -------------------------------------------------------------------------
    def _uses(self, block: Block) -> int:
        prev = self._resumed.get(block.id)
        return block.hits + 1 + (prev[0] if prev else 0)

    def _trial(self, block: Block) -> None:
        c = min(self._uses(block).bit_length(), NCLASS - 1)
        self._state[block.id] = (c, block.last_access, block.hits, self._halvings)
        self._trials[c] += 1.0
        self._total += 1.0
        if self._total > GHOST_PER_SLOT * self._cap:
            self._trials *= 0.5
            self._reuse *= 0.5
            self._total *= 0.5
            self._halvings += 1

    def _reused(self, cls: int, distance: int, halvings_then: int) -> None:
        self._reuse[cls, bucket(max(0, distance))] += 0.5 ** (self._halvings - halvings_then)

    def _rebuild(self) -> None:
        tab = np.zeros((NCLASS, NB))
        for c in range(NCLASS):
            trials = self._trials[c]
            if trials < 1.0:
                continue
            r = self._reuse[c]
            cum = np.concatenate([[0.0], np.cumsum(r)])
            for b in range(NB):
                alive = trials - cum[b]
                if alive <= 1e-9:
                    continue
                a = LO[b]
                hits = cum[b + 1:] - cum[b]                 # reused in buckets b..e
                held = np.cumsum(r[b:] * np.maximum(MID[b:] - a, 0.5)) + \
                    (alive - hits) * (HI[b:] - a)
                tab[c, b] = float((hits / np.maximum(held, 1e-9)).max())
        self._table = tab

    # -- hooks -------------------------------------------------------------------------------
    def insert(self, block: Block) -> None:
        self._now = max(self._now, block.last_access)
        st = self._state.get(block.id)
        if st is not None and block.hits != st[2]:          # hit while pinned
            self._reused(st[0], block.last_access - 1 - st[1], st[3])
            self._trial(block)
        elif st is None:
            if block.hits == 0 and block.key is not None:
                prev = self._ghost.pop(hash(block.key), None)
                if prev is not None:                        # content back after an eviction
                    self._reused(prev[2], block.last_access - prev[1], prev[3])
                    self._resumed[block.id] = prev
            self._trial(block)
        self._pos[block.id] = len(self._cands)
        self._cands.append(block)

    def remove(self, block: Block) -> None:
        i = self._pos.pop(block.id, None)
        if i is None:
            return
        last = self._cands.pop()
        if last is not block:
            self._cands[i] = last
            self._pos[last.id] = i

    def access(self, block: Block) -> None:
        self._now = max(self._now, block.last_access)
        st = self._state.get(block.id)
        if st is not None and block.hits != st[2]:
            self._reused(st[0], block.last_access - st[1], st[3])
            self._trial(block)

    def victims(self, n: int) -> list[Block]:
        out: list[Block] = []
        tab, now, cands = self._table, self._now, self._cands
        while len(out) < n and cands:
            k = len(cands)
            picks = range(k) if k <= SAMPLES else self._rng.sample(range(k), SAMPLES)
            best, best_d = None, 0.0
            for i in picks:
                b = cands[i]
                if len(b.slots) > 1 and NO_SLOT not in b.slots:
                    d = -1.0                                # a spare copy
                else:
                    d = tab[self._state[b.id][0], bucket(now - b.last_access)]
                if best is None or d < best_d or (
                        d == best_d and b.last_access < best.last_access):
                    best, best_d = b, d
            self.remove(best)
            out.append(best)
            self._on_evict(best)
        return out

    def _on_evict(self, block: Block) -> None:
        st = self._state.pop(block.id)
        prev = self._resumed.pop(block.id, None)
        if block.key is not None:
            uses = block.hits + 1 + (prev[0] if prev else 0)
            k = hash(block.key)
            self._ghost.pop(k, None)
            self._ghost[k] = (uses, block.last_access, st[0], st[3])
            if len(self._ghost) > GHOST_PER_SLOT * self._cap:
                self._ghost.popitem(last=False)
        self._evictions += 1
        if self._evictions >= max(16, self._cap // 8):
            self._evictions = 0
            self._rebuild()

    def __len__(self) -> int:
        return len(self._cands)
