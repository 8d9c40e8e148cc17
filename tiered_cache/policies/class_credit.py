"""Class credit: reuse credit scaled by how often blocks of the same class are measured reused,
and the dead tails of requests first.

`reuse_credit` (see that module) with two changes, both driven by what the tier measures on its
own stream:

    priority = last_access + min(lifetime * log2(uses) * max(1, odds(class)), 2 * span / (uses - 1))
               - TAIL if the block is a dead tail                     (lowest evicted first)

- `class`: the block's number of uses in doublings (`uses.bit_length()`: 1, 2-3, 4-7, ...) and,
  for blocks used once, whether it was published as the *tail* of its request. `odds(class)` is
  the measured reuse rate of the class (one standard error low) divided by the reuse rate of all
  blocks of the tier.
- A *tail* is a block that had no child when it first became a candidate here (the last block of
  the request that published it) and has been used once (its content was never requested again,
  in this block or, by the ghost, before). A *dead tail* is a tail while the tier measures tails
  reused less often than other blocks used once.

Why each part, and why nothing in it is fitted to a trace:

- Scaled credit. `reuse_credit` gives one LRU lifetime per doubling of uses, which assumes that a
  block used twice is as likely to come back as any other block used twice, whatever the
  workload. How likely it really is depends on the stream (a document pool with Zipf popularity
  keeps returning to blocks used a few times; an agent session that ended never does), so the
  tier measures it: every block is a *trial* of its class from the moment the policy first sees
  it or it is hit, and a *success* when it is hit again or its content comes back from the ghost
  after an eviction. A class measured k times as likely to be reused as the average block
  gets k times the credit: the credit is residence bought with evidence of reuse, and evidence
  is worth what it predicts on this stream (hit-density policies such as LHD value a block by
  its hit probability per slot-tick in the same spirit). The scale is never below 1 (a class reused
  less often than average keeps `reuse_credit`'s credit, which is already zero for blocks used
  once), and the cap at twice the content's own mean reuse interval still stops finished
  sessions from lingering on a large scale.
- Dead tails first. The last block of a prompt is usually partial: the next turn of a
  conversation has different tokens in that position, so it is published as a different block
  and the old tail is never hit (on the shared Mooncake trace 5% of tail blocks are requested
  again, against 63-67% of the blocks before them). The rest of the chain, reused by the next
  turn, stays. The rule is on only while the measured reuse rate of tails (their own class) is
  below that of other once-used blocks, so on a stream whose prompts are full blocks that later
  requests extend, tails are ordinary blocks.
- Counts are halved every `GHOST_PER_SLOT` trials per slot: a success can arrive as late as the
  ghost remembers the content (32 tier turnovers), so the counts remember at least that many
  trials. A class's rate is shrunk towards the tier's mean by one pseudo-trial and then taken one
  standard error low (`r - sqrt(r (1 - r) / n)`): credit is extended only as far as the evidence
  supports it, so a class with few trials gets no scaling and a large class nearly its estimate.
- Everything else (ghost of 32 keys per slot keyed by content, lifetime measured online, spare
  copies first with two tiers) is `reuse_credit`'s and argued there.

Ties: the deeper block first (the leaf of its chain), then the older entry. Every hook is
O(log n) (a binary heap with lazy deletion, from PriorityPolicy) plus O(1) dict and list work.

NOTE: per-block state (class, "had a child") is keyed by block id and dropped when the
block is evicted here; a block that leaves the tier otherwise (dropped, invalidated) is not
announced, so the tables are pruned to their newest entries when they outgrow 4x the capacity
(amortised O(1); it never happens in a single-tier replay). Ids are recycled, so every entry
carries the row's generation (`blocks.gen[b]`) and one of another generation reads as absent:
a block never inherits the class or the child of the block that had its id before.
"""

from __future__ import annotations

import heapq
import itertools
import math

from tiered_cache.core.blocks import NO_BLOCK, NO_SLOT
from tiered_cache.policies.base import PriorityPolicy
from tiered_cache.policies.reuse_credit import (
    GHOST_PER_SLOT,
    REDUNDANT,
    ReuseCreditPolicy,
    _redundant,
    uses_and_first,
)

TAIL = 2.0**38
"""Subtracted from the priority of a dead tail: it goes before every other only copy but after
the spare copies (REDUNDANT = 2**40; a priority below -REDUNDANT / 2 marks a spare copy)."""

_NCLASS = 2 * 65        # (uses.bit_length() <= 64) x (tail or not)


class ClassCreditPolicy(ReuseCreditPolicy):
    """`reuse_credit` whose credit is scaled by the measured reuse odds of the block's class, with
    dead request tails first; see the module docstring."""

    name = "class_credit"

    def __init__(self, capacity_blocks: int, **kw) -> None:
        super().__init__(capacity_blocks, **kw)
        # The ghost maps a content hash to (uses, first use, class at eviction).
        self._cls: dict[int, tuple[int, int]] = {}  # block id -> (class of its trial, gen)
        self._kids: dict[int, int] = {}     # id -> gen, of blocks that have had a candidate child
        self._trials = [0.0] * _NCLASS
        self._succ = [0.0] * _NCLASS
        self._all_trials = 0.0
        self._all_succ = 0.0
        self._window = GHOST_PER_SLOT * self._cap
        self._state_limit = 4 * self._cap
        self._tails_dead = False            # tails_dead(), re-evaluated with the lifetime

    def resize(self, capacity_blocks: int) -> None:
        super().resize(capacity_blocks)
        self._window = GHOST_PER_SLOT * self._cap
        self._state_limit = 4 * self._cap

    # -- classes and their measured odds -----------------------------------------------------
    def odds(self, cls: int) -> float:
        """One-standard-error lower bound of the class's reuse rate (shrunk to the mean by one
        pseudo-trial) over the reuse rate of all blocks."""
        mean = (self._all_succ + 1.0) / (self._all_trials + 2.0)
        n = self._trials[cls] + 1.0
        r = (self._succ[cls] + mean) / n
        if r < 1.0:
            r -= math.sqrt(r * (1.0 - r) / n)
        return r / mean

    def tails_dead(self) -> bool:
        """Tails are measured reused less often than other blocks used once."""
        t, o = 2 * 1 + 1, 2 * 1
        return ((self._succ[t] + 0.5) / (self._trials[t] + 1.0)
                < (self._succ[o] + 0.5) / (self._trials[o] + 1.0))

    def class_of(self, b: int) -> int | None:
        """Class of block b's current trial, None if it has none (never seen, or the entry is
        an earlier block's with the same id)."""
        e = self._cls.get(b)
        return e[0] if e is not None and e[1] == self.blocks.gen[b] else None

    def _trial(self, b: int, uses: int) -> None:
        c = 2 * uses.bit_length()           # a hit block is never a tail
        self._cls[b] = (c, self.blocks.gen[b])
        self._trials[c] += 1.0
        self._all_trials += 1.0
        if self._all_trials > self._window:
            self._halve()

    def _halve(self) -> None:
        self._trials = [x * 0.5 for x in self._trials]
        self._succ = [x * 0.5 for x in self._succ]
        self._all_trials *= 0.5
        self._all_succ *= 0.5

    def _success(self, cls: int) -> None:
        self._succ[cls] += 1.0
        self._all_succ += 1.0

    # -- the priority -----------------------------------------------------------------------
    def scale(self, b: int) -> float:
        """The measured odds of the block's class, never below 1 (see the module docstring)."""
        e = self._cls.get(b)            # self.class_of(b), inlined
        if e is None or e[1] != self.blocks.gen[b]:
            return 1.0
        k = self.odds(e[0])
        return k if k > 1.0 else 1.0

    def priority(self, b: int) -> float:
        t = self.blocks
        if t.hits[b] == 0 and ((prev := self._resumed.get(b)) is None or prev[-1] != t.gen[b]):
            p = float(t.last_access[b])         # used once: no credit (fast path)
        else:
            p = t.last_access[b] + self.credit(b)
        if _redundant(t, b):
            return p - REDUNDANT
        if self._tails_dead:
            e = self._cls.get(b)
            if e is not None and e[0] & 1 and e[1] == t.gen[b]:     # a tail used once
                return p - TAIL
        return p

    # -- hooks ------------------------------------------------------------------------------
    def insert(self, b: int) -> None:
        # NOTE: written out in one function (no helper calls on the common path): it runs once
        # per published block and per re-key, and replay speed is a target.
        t = self.blocks
        gen = t.gen
        g = gen[b]
        last = t.last_access[b]
        if last > self._now:
            self._now = last
        parent = t.parent[b]
        kids = self._kids
        if parent != NO_BLOCK:
            pg = gen[parent]
            if kids.get(parent) != pg:
                kids.pop(parent, None)          # an earlier block's with this id: not its child
                kids[parent] = pg
        classes = self._cls
        e = classes.get(b)
        if e is None or e[1] != g:              # first sight of this block: a new trial
            if e is not None:
                del classes[b]                  # an earlier block's with this id
            hits = t.hits[b]
            resumed = self._resumed
            prev = resumed.get(b)
            if prev is not None and prev[-1] != g:
                prev = None
            key = t.key[b]
            if prev is None and hits == 0 and key is not None:
                prev = self._ghost.pop(hash(key), None)
                if prev is not None:            # its content is back: a success of that class
                    self._succ[prev[2]] += 1.0
                    self._all_succ += 1.0
                    self._resume(b, prev)
            uses = hits + 1 + (prev[0] if prev is not None else 0)
            if uses == 1 and t.first_child[b] == NO_BLOCK and kids.get(b) != g:
                # NOTE: a leaf used once and never seen with a child: the request that
                # published it ended here (its tail). A body block becomes a candidate only
                # after its child left, and that child's insert put it in _kids.
                c = 3                           # 2 * (1).bit_length() + tail
            else:
                c = 2 * uses.bit_length()
            classes[b] = (c, g)
            self._trials[c] += 1.0
            self._all_trials += 1.0
            if self._all_trials > self._window:
                self._halve()
            if len(classes) > self._state_limit or len(kids) > self._state_limit:
                self._prune()
            if prev is None and hits == 0:      # used once: no credit
                p = float(last)
                slots = t.slots                 # a spare copy (_redundant, inlined)?
                spare = len(slots) > 1
                for tier in slots:
                    if tier[b] == NO_SLOT:
                        spare = False
                        break
                if spare:
                    p -= REDUNDANT
                elif c == 3 and self._tails_dead:
                    p -= TAIL
                n = next(self._seq)
                self._live[b] = n
                heapq.heappush(self._heap, (p, -t.depth[b], n, b))
                if self._old or len(self._heap) > 1024:
                    self._maybe_compact()
                return
        PriorityPolicy.insert(self, b)

    def access(self, b: int) -> None:
        t = self.blocks
        last = t.last_access[b]
        if last > self._now:
            self._now = last
        g = t.gen[b]
        e = self._cls.get(b)
        if e is not None:
            if e[1] == g:
                self._success(e[0])
            else:
                del self._cls[b]                # an earlier block's with this id
        prev = self._resumed.get(b)
        uses = t.hits[b] + 1 + (prev[0] if prev is not None and prev[-1] == g else 0)
        self._trial(b, uses)
        if b in self._live:             # re-key a candidate that was hit
            PriorityPolicy.insert(self, b)

    def victims(self, n: int) -> list[int]:
        # PriorityPolicy.victims and reuse_credit's re-keying of stale spare copies, in one loop
        out: list[int] = []
        t = self.blocks
        heap, live, pop = self._heap, self._live, heapq.heappop
        while len(out) < n:
            old = self._old
            if not heap and not old:
                break
            src = old if not heap or (old and old[0] < heap[0]) else heap
            prio, _, seq, b = pop(src)
            if live.get(b) != seq:
                continue
            del live[b]
            if prio < -REDUNDANT / 2 and not _redundant(t, b):
                # keyed as a spare copy, now the only one (its other copy left since)
                PriorityPolicy.insert(self, b)
                continue
            self.on_evict(prio, b)
            out.append(b)
        if self._old:
            self._drain()
        return out

    def on_evict(self, priority: float, b: int) -> None:
        t = self.blocks
        g = t.gen[b]
        prev = self._resumed.pop(b, None)
        if prev is not None and prev[-1] != g:
            prev = None
        e = self._cls.pop(b, None)
        cls = e[0] if e is not None and e[1] == g else 2
        self._kids.pop(b, None)
        key = t.key[b]
        if key is not None:
            self._file_ghost(key, (*uses_and_first(t, b, prev), cls))
        self._count_eviction()

    def _update_lifetime(self) -> None:
        super()._update_lifetime()
        self._tails_dead = self.tails_dead()

    def _prune(self) -> None:
        keep = 2 * self._cap                # the newest entries of each table
        self._cls, self._kids = (
            dict(itertools.islice(d.items(), max(0, len(d) - keep), None))
            for d in (self._cls, self._kids))
