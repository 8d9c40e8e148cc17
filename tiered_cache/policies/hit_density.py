"""Hit density: evict what is expected to earn the fewest hits per slot-tick, learned online.

After LHD (Beckmann, Chen and Cidon, "LHD: Improving Cache Hit Rate by Maximizing Hit Density",
NSDI 2018), adapted to a prefix cache. A slot is worth the hits it earns per tick it is held:

    density(class, age) = max over horizons T of
        P(reused in (age, age + T] | not reused by age) / E[ticks held over that horizon]

- `class`: the block's uses (requests for its content, counted across evictions by a ghost of
  content keys, as in `reuse_credit`) in doublings: 1, 2-3, 4-7, 8-15, 16+.
- `age`: clock ticks since the block's last use, in buckets of half a doubling.
- The distribution of reuse distances (ticks from a use of some content to its next use) is
  measured per class, from hits in this tier *and* from returns of evicted content found in
  the ghost. LHD counts only hits in the cache, so it never sees a reuse later than the age at
  which it evicts; the ghost keeps the measurement uncensored for 32 tier turnovers.
- Why an age curve and not LRU plus credit: when reuse distances have a mode (an agent's tool
  call, a chat user's think time), the block just used is the one *furthest* from its next
  use, and the blocks worth keeping are those about to be reused. LRU evicts exactly those
  first; on a loop slightly larger than the tier it never hits. The density curve rises towards
  the mode and sees it.

Deviate from LRU only on evidence. Every density is an estimate from counts, so the table
holds two bounds, `z` Poisson standard errors each way: `(hits -/+ z sqrt(hits + 1)) / ticks`,
at the horizon whose estimate is best (ties: the longest, which has the most exposure). The LRU
victim (the oldest candidate) goes, unless some candidate's upper bound is below the LRU
victim's lower bound: then the lowest such candidate goes instead. With z = 3 (see `z`), on
streams whose age curve is flat or thinly measured the policy stays close to LRU (0.97-1.08x
on the shared trace), and where the curve is steep and well measured it follows it (1.3x / 1.44x
LRU on agent loops at 500 / 1,000 blocks; the optimum, 15 hits in 19, on a loop of 20 blocks
through 16 slots, where LRU gets none).

Spare copies first: with two tiers, a copy whose block also has a copy in the other tier costs
no hit when it goes, as in `reuse_credit`.

Counts are halved every 32 trials per slot (the ghost's horizon); a reuse is weighted by the
halvings since its trial began, so late successes of halved trials do not inflate the rates.
Nothing is fitted to a trace: the constants are LHD's sample size (64 per victim), the ghost's
horizon shared with `reuse_credit`, and the confidence `z`.

Cost. Candidates live in a list with O(1) swap-remove plus two numpy columns (class, last use).
`victims` ranks all candidates (up to 512) or 512 random ones in one numpy pass and keeps the 8
best as a batch, about 64 samples per victim as in LHD. The batch is dropped when the clock
moves (its ages are stale); a candidate that appears while it is pending (the parent a victim
exposed) is ranked on insert and joins it if it beats its worst entry; an entry that has left
the candidates is skipped. The table is rebuilt in one vectorised pass every half capacity of
evictions. insert/remove/access are O(1).

NOTE: per-block state kept past `remove` (the trial, the uses resumed from the ghost) is keyed by
block id and carries the row's generation (`blocks.gen[b]`); ids are recycled, and an entry of
another generation reads as absent, so a block never continues the trial of the block that had
its id before.
"""

from __future__ import annotations

import bisect
import math
from collections import OrderedDict

import numpy as np

from tiered_cache.policies.base import CachePolicy
from tiered_cache.policies.reuse_credit import GHOST_PER_SLOT, _redundant

SUB = 2
"""Age buckets per doubling of age."""

NB = SUB * 40
"""Age buckets: ages up to 2**40 ticks."""

NCLASS = 6
"""Row 0 is spare copies; rows 1-5 are uses.bit_length() capped at 5."""

SPARE = 0
SAMPLES = 64
"""Candidates sampled per victim (LHD's choice)."""

BATCH = 8
"""Victims chosen per sampling pass."""

_LO = np.array([2.0 ** (b / SUB) - 1.0 for b in range(NB)])          # bucket b: ages [LO, HI)
_HI = np.array([2.0 ** ((b + 1) / SUB) - 1.0 for b in range(NB)])
_MID = (_LO + _HI) / 2.0
_LATER = np.triu(np.ones((NB, NB), dtype=bool))                       # [b, e]: e >= b


def _neg(e: tuple) -> tuple:
    return (-e[0], -e[1], -e[2])


def age_bucket(age: float) -> int:
    return min(NB - 1, int(math.log2(age + 1.0) * SUB)) if age > 0 else 0


def density_bounds(trials: np.ndarray, reuse: np.ndarray,
                   z: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """(classes x age buckets) hit density from per-class trial counts and reuse-distance
    histograms, `z` Poisson standard errors high and low (see the module docstring)."""
    c = len(trials)
    zeros = np.zeros((c, 1))
    cum = np.concatenate([zeros, np.cumsum(reuse, axis=1)], axis=1)            # (c, NB + 1)
    cmid = np.concatenate([zeros, np.cumsum(reuse * _MID, axis=1)], axis=1)
    hits = cum[:, None, 1:] - cum[:, :-1, None]            # [c, b, e]: reused in buckets b..e
    alive = trials[:, None] - cum[:, :-1]                  # [c, b]: not reused before bucket b
    lo = _LO[None, :, None]
    # ticks held from age LO[b]: until the reuse for those reused by bucket e, else to HI[e]
    held = (cmid[:, None, 1:] - cmid[:, :-1, None]) - lo * hits + \
        (alive[:, :, None] - hits) * (_HI[None, None, :] - lo)
    ok = _LATER[None] & (held > 0)
    held = np.where(ok, held, 1.0)
    # NOTE: the horizon is the one with the best *estimate* (ties: the longest, which has the
    # most exposure), and the bounds are those of that estimate. The best of the upper bounds
    # would favour the shortest horizons, whose few slot-ticks of evidence make any block
    # look possibly valuable.
    point = np.where(ok, hits / held, -np.inf)
    best = NB - 1 - np.argmax(point[:, :, ::-1], axis=2)          # [c, b]: horizon e
    h = np.take_along_axis(hits, best[:, :, None], axis=2)[:, :, 0]
    t = np.take_along_axis(held, best[:, :, None], axis=2)[:, :, 0]
    err = z * np.sqrt(np.maximum(h, 0.0) + 1.0)
    live = alive > 1e-9
    return (np.where(live, (h + err) / t, 0.0),
            np.where(live, np.maximum(h - err, 0.0) / t, 0.0))


class HitDensityPolicy(CachePolicy):
    """LRU order, left only for a candidate whose hit density is surely lower than the LRU
    victim's; see the module docstring."""

    name = "hit_density"
    guard = True
    """Deviate from LRU only on evidence (see the module docstring); False ranks by the upper
    bounds alone (kept for the comparison in docs/replay.md)."""
    z = 3.0
    """Standard errors in the bounds. The policy makes a decision per eviction, 10^5 of them
    in a replay, so a deviation from LRU must be wrong rarely: three standard errors (0.13% one
    side). With two, 2.3% of deviations may be noise: chat at 5,000 blocks measured 0.981x LRU,
    at the floor's edge (three: 0.988x)."""

    def __init__(self, capacity_blocks: int, **kw) -> None:
        super().__init__(capacity_blocks, **kw)
        self._cap = max(1, capacity_blocks)
        # candidates: a list of ids with swap-remove, and per position the class and last use in
        # numpy (sampled in bulk) and the serial of its insert (a batched victim must still match)
        self._cands: list[int] = []
        self._serial: list[int] = []
        self._pos: dict[int, int] = {}
        self._cls_col = np.zeros(self._cap + 16, dtype=np.int64)
        self._last_col = np.zeros(self._cap + 16, dtype=np.int64)
        self._next_serial = 0
        # block id -> (class, last use, hits, halvings, gen) when its current trial began
        self._state: dict[int, tuple[int, int, int, int, int]] = {}
        self._resumed: OrderedDict[int, tuple[int, int]] = OrderedDict()   # id -> (uses, gen)
        # hash of the content key -> (uses, last use, class, halvings) of an evicted block
        self._ghost: OrderedDict[int, tuple[int, int, int, int]] = OrderedDict()
        self._trials = [0.0] * NCLASS
        self._reuse = [[0.0] * NB for _ in range(NCLASS)]
        self._total = 0.0
        self._halvings = 0
        self._now = 0
        self._evictions = 0
        self._table = np.zeros((NCLASS, NB))     # upper bounds
        self._table[SPARE] = -1.0
        self._low = self._table.copy()             # lower bounds
        self._theta = 0.0                          # lower bound of the pending batch's LRU victim
        # chosen victims (density, -age, serial, block id), worst first
        self._batch: list[tuple[float, int, int, int]] = []
        self._rng = np.random.default_rng(0)

    def resize(self, capacity_blocks: int) -> None:
        super().resize(capacity_blocks)
        self._cap = max(1, capacity_blocks)

    # -- measurement -------------------------------------------------------------------------
    def _trial(self, b: int, uses: int) -> int:
        t = self.blocks
        c = min(uses.bit_length(), NCLASS - 1)
        self._state[b] = (c, t.last_access[b], t.hits[b], self._halvings, t.gen[b])
        self._trials[c] += 1.0
        self._total += 1.0
        if self._total > GHOST_PER_SLOT * self._cap:
            self._halve()
        if len(self._state) > 4 * self._cap:
            # blocks that left without being evicted here (dropped, invalidated) are not
            # announced: keep the newest entries
            keep = list(self._state.items())[-2 * self._cap:]
            self._state = dict(keep)
        return c

    def _halve(self) -> None:
        self._trials = [x * 0.5 for x in self._trials]
        self._reuse = [[x * 0.5 for x in row] for row in self._reuse]
        self._total *= 0.5
        self._halvings += 1

    def _reused(self, cls: int, distance: int, halvings_then: int) -> None:
        w = 0.5 ** (self._halvings - halvings_then)
        self._reuse[cls][age_bucket(distance)] += w

    def _resumed_uses(self, b: int, g: int) -> int:
        """Uses of b's content before its last eviction (0 if none, or the entry is an earlier
        block's with the same id)."""
        r = self._resumed.get(b)
        return r[0] if r is not None and r[1] == g else 0

    def _observe(self, b: int) -> int:
        """Start or continue block b's trial; return its class."""
        t = self.blocks
        g = t.gen[b]
        hits = t.hits[b]
        st = self._state.get(b)
        if st is not None and st[4] != g:       # an earlier block's with this id
            del self._state[b]
            st = None
        if st is None:                          # first sight here
            prev = 0
            key = t.key[b]
            if hits == 0 and key is not None:
                gh = self._ghost.pop(hash(key), None)
                if gh is not None:              # its content is back after an eviction
                    self._reused(gh[2], t.last_access[b] - gh[1], gh[3])
                    prev = gh[0]
                    resumed = self._resumed
                    r = resumed.get(b)
                    if r is not None and r[1] != g:
                        del resumed[b]          # an earlier block's: it must not keep its place
                    resumed[b] = (prev, g)
                    if len(resumed) > 2 * self._cap:
                        resumed.popitem(last=False)
            else:
                prev = self._resumed_uses(b, g)
            return self._trial(b, hits + 1 + prev)
        if hits != st[2]:
            # a reuse (reported by `access`, pinned or not; or seen first at a re-insert)
            self._reused(st[0], t.last_access[b] - st[1], st[3])
            return self._trial(b, hits + 1 + self._resumed_uses(b, g))
        return st[0]

    # -- hooks -------------------------------------------------------------------------------
    def insert(self, b: int) -> None:
        if b in self._pos:
            self.remove(b)
        t = self.blocks
        last = t.last_access[b]
        if last > self._now:
            self._now = last
            self._batch.clear()         # chosen at an earlier clock: the ages have moved
        c = self._observe(b)
        i = len(self._cands)
        if i == len(self._cls_col):
            self._cls_col = np.concatenate([self._cls_col, np.zeros_like(self._cls_col)])
            self._last_col = np.concatenate([self._last_col, np.zeros_like(self._last_col)])
        self._cands.append(b)
        self._next_serial += 1
        self._serial.append(self._next_serial)
        self._pos[b] = i
        code = SPARE if _redundant(t, b) else c
        self._cls_col[i] = code
        self._last_col[i] = last
        batch = self._batch
        if batch:
            # NOTE: a candidate that appears while a batch is pending (typically the parent
            # its last victim exposed) competes with the batch, so batching never hides a
            # better victim than those already chosen
            age = self._now - last
            d = self._table[code, age_bucket(age)]
            e = (d if d < self._theta or code == SPARE else math.inf, -age,
                 self._next_serial, b)
            if e < batch[0]:
                batch.pop(0)
                bisect.insort(batch, e, key=_neg)

    def remove(self, b: int) -> None:
        i = self._pos.pop(b, None)
        if i is None:
            return
        cands, serial = self._cands, self._serial
        j = len(cands) - 1
        if i != j:
            moved = cands[j]
            cands[i], serial[i] = moved, serial[j]
            self._pos[moved] = i
            self._cls_col[i] = self._cls_col[j]
            self._last_col[i] = self._last_col[j]
        cands.pop()
        serial.pop()

    def access(self, b: int) -> None:
        # a hit on a candidate (a spare lower-tier copy of a block pinned above)
        t = self.blocks
        last = t.last_access[b]
        if last > self._now:
            self._now = last
            self._batch.clear()
        c = self._observe(b)
        i = self._pos.get(b)
        if i is not None:
            self._cls_col[i] = SPARE if _redundant(t, b) else c
            self._last_col[i] = last

    def victims(self, n: int) -> list[int]:
        out: list[int] = []
        t = self.blocks
        pos, serial, batch = self._pos, self._serial, self._batch
        while len(out) < n:
            if not batch:
                self._refill()
                if not batch:
                    break
            _, _, s, b = batch.pop()
            i = pos.get(b)
            if i is None or serial[i] != s:
                continue                        # left the candidates (or re-keyed) since
            if self._cls_col[i] == SPARE and not _redundant(t, b):
                # ranked as a spare copy, and its other copy has left since: rank it by its
                # own class from now on
                st = self._state.get(b)
                self._cls_col[i] = st[0] if st is not None and st[4] == t.gen[b] else 1
                self._next_serial += 1
                serial[i] = self._next_serial
                continue
            self.remove(b)
            self._evict(b)
            out.append(b)
        return out

    def _refill(self) -> None:
        k = len(self._cands)
        if k == 0:
            return
        if k <= SAMPLES * BATCH:
            idx = np.arange(k)
        else:
            idx = np.unique(self._rng.integers(0, k, SAMPLES * BATCH))
        ages = self._now - self._last_col[idx]
        buckets = np.minimum(NB - 1, (np.log2(np.maximum(ages, 0) + 1.0) * SUB).astype(np.int64))
        cls = self._cls_col[idx]
        oldest = int(np.argmax(ages))                          # the LRU victim
        self._theta = theta = float(self._low[cls[oldest], buckets[oldest]]) if self.guard \
            else math.inf
        # NOTE: ahead of the LRU victim only a candidate whose density is below the victim's
        # *for sure* (upper bound under its lower bound); the rest in LRU order
        dens = self._table[cls, buckets]
        dens = np.where((dens < theta) | (cls == SPARE), dens, np.inf)     # spares: -1
        order = np.lexsort((-ages, dens))[:BATCH]
        cands, serial = self._cands, self._serial
        # worst first, so that pop() hands out the best
        self._batch[:] = [(d, -a, serial[j], cands[j]) for j, d, a in zip(
            idx[order].tolist()[::-1], dens[order].tolist()[::-1], ages[order].tolist()[::-1])]

    def _evict(self, b: int) -> None:
        t = self.blocks
        g = t.gen[b]
        st = self._state.pop(b, None)
        if st is not None and st[4] != g:
            st = None                           # an earlier block's with this id
        r = self._resumed.pop(b, None)
        prev = r[0] if r is not None and r[1] == g else 0
        key = t.key[b]
        if key is not None:
            cls, halvings = (st[0], st[3]) if st is not None else (1, self._halvings)
            k = hash(key)
            ghost = self._ghost
            ghost.pop(k, None)
            ghost[k] = (t.hits[b] + 1 + prev, t.last_access[b], cls, halvings)
            if len(ghost) > GHOST_PER_SLOT * self._cap:
                ghost.popitem(last=False)
        self._evictions += 1
        if self._evictions >= max(64, self._cap // 2):
            self._evictions = 0
            self._rebuild()

    def _rebuild(self) -> None:
        high, low = density_bounds(np.array(self._trials), np.array(self._reuse), self.z)
        high[SPARE] = low[SPARE] = -1.0
        self._table, self._low = high, low

    def __len__(self) -> int:
        return len(self._cands)


class UnguardedHitDensityPolicy(HitDensityPolicy):
    """Ranks by the density upper bounds alone, without the LRU guard. Not registered: kept so
    the comparison in docs/replay.md can be rerun (`--policy
    tiered_cache.policies.hit_density:UnguardedHitDensityPolicy`)."""

    name = "hit_density_unguarded"
    guard = False
