"""ARC: Adaptive Replacement Cache.

Megiddo and Modha, "ARC: A Self-Tuning, Low Overhead Replacement Cache", FAST 2003.
"""

from __future__ import annotations

from collections import OrderedDict

from tiered_cache.policies.base import CachePolicy
from tiered_cache.policies.s3fifo import Parked, ghost_id

# Where a block goes when it (re)joins the candidate set. NEW_HIT: never a candidate here yet,
# but already reused (hit while pinned from birth), so it is frequent, not recent.
NEW, NEW_HIT, T1, T2 = 0, 1, 2, 3


class ARCPolicy(CachePolicy):
    """ARC (Megiddo and Modha, FAST'03) over the tier's candidates.

    - T1 holds blocks used once (recency), T2 blocks used at least twice (frequency); both are
      LRU lists, least recent first.
    - B1 and B2 remember the content keys of blocks evicted from T1 and T2 (ghosts, no data).
    - `p` is the adaptive target size of T1. A block re-entering the tier while its key is in B1
      means T1 was too small: p grows by max(1, |B2|/|B1|); found in B2, p shrinks by
      max(1, |B1|/|B2|). Either way the block goes to T2's MRU end.
    - `access` moves a candidate to T2's MRU end.
    - `victims` applies ARC's REPLACE: take T1's LRU block if |T1| > p, else T2's, falling back
      to the other list when the chosen one is empty. The ghost-hit tie rule (|T1| = p and the
      request is in B2) has no request to look at here, since eviction is decoupled from
      insertion, so a tie goes to T2.

    Directory bounds as in ARC: |T1| + |B1| <= c and |B1| + |B2| <= c, c = `capacity_blocks`
    (the oldest ghost is dropped; B2 first when both ghosts together are full). All hooks O(1).

    Adapted to candidates: T1/T2 only hold candidates. A pinned block leaves its list; which
    list, and whether it was hit meanwhile (then it rejoins T2), is kept in a bounded `Parked`
    table, and it rejoins at the MRU end, since a pin means it was just in use. Ghosts are keyed
    by content (`ghost_id`) and parked entries carry the id's generation, so a block that gets a
    recycled id inherits neither the ghost nor the parked state of the block that had it.
    """

    name = "arc"

    def __init__(self, capacity_blocks: int, **kw) -> None:
        super().__init__(capacity_blocks, **kw)
        self.c = max(1, capacity_blocks)
        self.p = 0.0
        self._t1: OrderedDict[int, None] = OrderedDict()    # block ids, LRU first, MRU last
        self._t2: OrderedDict[int, None] = OrderedDict()
        self._b1: OrderedDict[bytes | tuple, None] = OrderedDict()    # ghost_id, oldest first
        self._b2: OrderedDict[bytes | tuple, None] = OrderedDict()
        self._parked = Parked(capacity_blocks, self.blocks)

    def resize(self, capacity_blocks: int) -> None:
        # The directory bounds follow c at the next replace; p keeps its learned split.
        super().resize(capacity_blocks)
        self.c = max(1, capacity_blocks)
        self.p = min(self.p, float(self.c))
        self._parked.limit = max(1, capacity_blocks)

    def insert(self, b: int) -> None:
        if b in self._t1 or b in self._t2:
            return
        where = self._parked.pop(b)
        if where is None or where in (NEW, NEW_HIT):
            # The block enters the tier: an ARC miss. A ghost hit adapts p.
            gid = ghost_id(self.blocks, b)
            if gid in self._b1:
                self.p = min(float(self.c), self.p + max(1.0, len(self._b2) / len(self._b1)))
                del self._b1[gid]
                where = T2
            elif gid in self._b2:
                self.p = max(0.0, self.p - max(1.0, len(self._b1) / len(self._b2)))
                del self._b2[gid]
                where = T2
            else:
                where = T2 if where == NEW_HIT else T1
        if where == T2:
            self._t2[b] = None
        else:
            self._t1[b] = None
            self._trim_ghosts()        # |T1| grew: keep |T1| + |B1| <= c

    def remove(self, b: int) -> None:
        if b in self._t1:
            del self._t1[b]
            self._parked.put(b, T1)
        elif b in self._t2:
            del self._t2[b]
            self._parked.put(b, T2)

    def access(self, b: int) -> None:
        if b in self._t1:              # second use: recency -> frequency
            del self._t1[b]
            self._t2[b] = None
        elif b in self._t2:
            self._t2.move_to_end(b)
        else:
            where = self._parked.get(b)
            self._parked.put(b, T2 if where in (T1, T2) else NEW_HIT)

    def victims(self, n: int) -> list[int]:
        out: list[int] = []
        t1, t2, b1, b2 = self._t1, self._t2, self._b1, self._b2
        keys, gens = self.blocks.key, self.blocks.gen
        while len(out) < n and (t1 or t2):
            if t1 and (len(t1) > self.p or not t2):
                b, _ = t1.popitem(last=False)
                ghost = b1
            else:
                b, _ = t2.popitem(last=False)
                ghost = b2
            gid = keys[b]              # ghost_id, inlined
            if gid is None:
                gid = (b, gens[b])
            ghost[gid] = None
            ghost.move_to_end(gid)
            out.append(b)
            self._trim_ghosts()
        return out

    def _trim_ghosts(self) -> None:
        # Amortized O(1): every ghost entry is dropped at most once.
        b1, b2 = self._b1, self._b2
        while b1 and len(self._t1) + len(b1) > self.c:
            b1.popitem(last=False)
        while len(b1) + len(b2) > self.c:
            (b2 if b2 else b1).popitem(last=False)

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)
