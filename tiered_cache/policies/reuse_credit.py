"""Reuse credit: LRU in which a block earns extra residence from how often its content was used.

The default policy of `tiered-cache replay`. It keeps LRU's ordering (a block's last use) and
adds a credit for reuse:

    priority = last_access + min(lifetime * log2(uses), 2 * span / (uses - 1))
                                                        (lowest evicted first; 0 if uses == 1)

- `uses`: times the block's content was requested, 1 for a block seen once. Remembered across
  evictions: a block's own `hits` restart at zero when its content comes back after an eviction
  (a new block is published), so frequency would otherwise be forgotten for exactly the blocks
  that a small cache keeps evicting. A bounded *ghost* table maps the content key of evicted
  blocks to their use count and first use; a block published again with a key in the ghost
  resumes them.
- `lifetime`: the tier's turnover time, `capacity_blocks` / (evictions per clock tick), measured
  online (weighted average over about `capacity_blocks` evictions).
- `span / (uses - 1)`: the mean interval between the content's uses so far (`span` = last use
  - first use).

Why this shape, and why nothing in it is fitted to a trace:

- One lifetime per doubling of uses: a lifetime is how long LRU keeps any block after its last
  use, so a block used twice gets one more LRU lifetime, four uses two more, and so on. The
  logarithm gives each doubling of evidence the same weight (LFU's linear count keeps a block
  used 1,000 times 1,000 times longer: yesterday's favourites never leave). The time scale is
  the tier's own, so the credit grows with capacity and shrinks under load by itself.
- Never past twice its own mean reuse interval: content whose uses came every g ticks and that
  has been silent for 2g is probably no longer in demand (for uses arriving as a Poisson stream,
  86% of gaps are shorter than twice the mean: 1 - e^-2). A session or conversation that reused
  its blocks every few seconds and then ended is not kept for log2(uses) lifetimes; a document
  queried every few minutes is kept a few minutes. (Without this bound a large cache loses to
  LRU on agent loops: dead sessions linger on their use counts.)
- Ageing comes for free: the credit is added once, to a last use that stops moving.
- Blocks used once get no credit: on a stream without reuse structure the policy is LRU, and
  until the first evictions have measured a lifetime it is LRU too.
- Spare copies first: with two tiers, a block that has a copy in both costs no hit when one copy
  goes (a device victim with a host copy needs no demotion; a host copy of a device block is
  a spare), so those go before any block's only copy, in the same order among themselves.
  A copy keyed as spare whose other copy has left since is re-keyed when it comes up as a
  victim instead of being evicted.
- Ghost of `GHOST_PER_SLOT` (32) keys per slot: enough to recognise content that comes back
  within the time a 32x larger cache would have kept it. An entry is the key's in-process hash
  and two small ints (~150 bytes of Python objects), about 0.1% of one 16-token block of a 70B
  model (5 MiB); a hash collision only misjudges one block's frequency.

Ties: the deeper block first (the leaf of its chain), then the older entry. Every hook is
O(log n) (a binary heap with lazy deletion, from PriorityPolicy) plus O(1) dict work.

NOTE: priorities are fixed when a block becomes a candidate (or is re-keyed by `access`), with
the lifetime of that moment; the lifetime moves slowly, as GreedyDual's clock does.
"""

from __future__ import annotations

import math
from collections import OrderedDict

from tiered_cache.core.blocks import NO_SLOT, BlockTable
from tiered_cache.policies.base import PriorityPolicy

GHOST_PER_SLOT = 32
"""Ghost keys kept per slot of the tier (see the module docstring)."""

REDUNDANT = 2.0**40
"""Subtracted from the priority of a block with a copy in every tier: dropping one of its copies
loses no hit, so such copies go before any block's only copy. (2**40 clock ticks is far beyond
any run, and keeps a float resolution of 2**-12 ticks on the priorities it shifts.)"""


class ReuseCreditPolicy(PriorityPolicy):
    """`last_access + min(lifetime * log2(uses), 2 * mean reuse interval)`; see the module
    docstring."""

    name = "reuse_credit"

    def __init__(self, capacity_blocks: int, **kw) -> None:
        super().__init__(capacity_blocks, **kw)
        self._cap = max(1, capacity_blocks)
        # hash of the content key -> (uses, first use) of an evicted block, oldest first. The
        # in-process hash of the 16-byte key: a collision only misjudges one block's frequency.
        self._ghost: OrderedDict[int, tuple[int, int]] = OrderedDict()
        # block id -> (uses, first use, ..., gen) resumed from the ghost, for blocks in the tier;
        # bounded because a block that leaves without being evicted here (dropped, invalidated)
        # is not announced as such.
        # NOTE: the entry ends with the row's generation (`blocks.gen[b]`) and reads as absent
        # under another one (`_prev`): ids are recycled, and a block that gets the id of one
        # that left unannounced must not resume that block's uses.
        self._resumed: OrderedDict[int, tuple[int, ...]] = OrderedDict()
        self._now = 0                   # latest logical clock seen
        self._lifetime = 0.0            # tier turnover in clock ticks; 0 until evictions start
        self._evictions = 0             # evictions since the last lifetime update
        self._since = -1                # clock of the last lifetime update (-1: none yet)
        self._ghost_limit = GHOST_PER_SLOT * self._cap
        self._update_every = max(16, self._cap // 8)
        self._stale: int | None = None

    def resize(self, capacity_blocks: int) -> None:
        # The ghost shrinks lazily (oldest keys go at the next evictions); the lifetime
        # re-measures itself at the new turnover.
        super().resize(capacity_blocks)
        self._cap = max(1, capacity_blocks)
        self._ghost_limit = GHOST_PER_SLOT * self._cap
        self._update_every = max(16, self._cap // 8)

    def _prev(self, b: int) -> tuple[int, ...] | None:
        """What the ghost resumed for block b (uses, first use, ..., gen), or None; an entry
        left by an earlier block with the same id is None."""
        prev = self._resumed.get(b)
        if prev is not None and prev[-1] != self.blocks.gen[b]:
            return None
        return prev

    def _resume(self, b: int, entry: tuple) -> None:
        """Block b's content is back from the ghost: remember its earlier uses (newest last)."""
        # NOTE: only called when b has no entry of its own generation, so any entry popped here
        # is an earlier block's with this id; it must not lend the new one its (older) place.
        resumed = self._resumed
        resumed.pop(b, None)
        resumed[b] = (*entry, self.blocks.gen[b])
        if len(resumed) > 2 * self._cap:
            resumed.popitem(last=False)

    # -- the priority -----------------------------------------------------------------------
    def uses(self, b: int) -> int:
        """Times block b's content was requested (first use, hits here, uses before an
        eviction)."""
        prev = self._prev(b)
        return self.blocks.hits[b] + 1 + (prev[0] if prev else 0)

    def first_use(self, b: int) -> int:
        prev = self._prev(b)
        return prev[1] if prev else self.blocks.inserted_at[b]

    @property
    def lifetime(self) -> float:
        """Current turnover time of the tier, in clock ticks (0 before the first evictions)."""
        return self._lifetime

    def credit(self, b: int) -> float:
        t = self.blocks
        hits = t.hits[b]
        prev = self._resumed.get(b)     # self._prev(b), inlined (once per insert)
        if prev is None or prev[-1] != t.gen[b]:
            if hits == 0:
                return 0.0              # used once: no credit
            uses, first = hits + 1, t.inserted_at[b]
        else:
            uses, first = hits + 1 + prev[0], prev[1]
        span = t.last_access[b] - first
        if span <= 0:
            return 0.0
        c = self._lifetime * math.log2(uses) * self.scale(b)
        overdue = 2.0 * span / (uses - 1)      # twice the mean interval between its uses
        return c if c < overdue else overdue

    def scale(self, b: int) -> float:
        """Multiplier of the lifetime credit: 1 here (class_credit scales it by measured
        odds)."""
        return 1.0

    def priority(self, b: int) -> float:
        p = self.blocks.last_access[b] + self.credit(b)
        return p - REDUNDANT if _redundant(self.blocks, b) else p

    # -- hooks ------------------------------------------------------------------------------
    def insert(self, b: int) -> None:
        t = self.blocks
        last = t.last_access[b]
        if last > self._now:
            self._now = last
        if t.hits[b] == 0:
            key = t.key[b]
            if key is not None and self._prev(b) is None:
                prev = self._ghost.pop(hash(key), None)
                if prev is not None:
                    self._resume(b, prev)
        super().insert(b)

    def access(self, b: int) -> None:
        last = self.blocks.last_access[b]
        if last > self._now:
            self._now = last
        super().access(b)

    def victims(self, n: int) -> list[int]:
        out: list[int] = []
        while len(out) < n:
            got = super().victims(1)
            if not got:
                break
            if self._stale is not None:     # keyed as a spare copy, now the only one
                self._stale = None
                PriorityPolicy.insert(self, got[0])
                continue
            out.append(got[0])
        return out

    def on_evict(self, priority: float, b: int) -> None:
        t = self.blocks
        if priority < -REDUNDANT / 2 and not _redundant(t, b):
            # Its other copy left after it was keyed (a slot change that does not change
            # candidacy here is not announced): re-key it instead of evicting (see victims).
            self._stale = b
            return
        prev = self._resumed.pop(b, None)
        if prev is not None and prev[-1] != t.gen[b]:
            prev = None                 # left by an earlier block with this id
        key = t.key[b]
        if key is not None:
            self._file_ghost(key, uses_and_first(t, b, prev))
        self._count_eviction()

    def _file_ghost(self, key: bytes, entry: tuple) -> None:
        """Remember an evicted block's content as the newest ghost entry (oldest go first)."""
        ghost = self._ghost
        k = hash(key)
        ghost.pop(k, None)
        ghost[k] = entry
        if len(ghost) > self._ghost_limit:
            ghost.popitem(last=False)

    def _count_eviction(self) -> None:
        if self._since < 0:             # first eviction: the tier just filled up
            self._since = self._now
            return
        self._evictions += 1
        if self._evictions >= self._update_every:
            self._update_lifetime()

    def _update_lifetime(self) -> None:
        # turnover = capacity / (evictions per tick); moving average with weight n / capacity
        # per update of n evictions, i.e. about `capacity` evictions of memory.
        ticks = max(1, self._now - self._since)
        sample = self._cap * ticks / self._evictions
        w = min(1.0, self._evictions / self._cap)
        self._lifetime = sample if self._lifetime == 0.0 else (
            (1 - w) * self._lifetime + w * sample)
        self._evictions = 0
        self._since = self._now


def uses_and_first(blocks: BlockTable, b: int, prev: tuple | None) -> tuple[int, int]:
    """(uses, first use) of block b's content: its own hits plus what the ghost resumed (a
    `_prev` entry of b's current generation, or None)."""
    if prev is None:
        return blocks.hits[b] + 1, blocks.inserted_at[b]
    return blocks.hits[b] + 1 + prev[0], prev[1]


def _redundant(blocks: BlockTable, b: int) -> bool:
    """Block b has a copy in every tier (two tiers: device and host)."""
    slots = blocks.slots
    if len(slots) < 2:
        return False
    for tier in slots:
        if tier[b] == NO_SLOT:
            return False
    return True
