"""S3-FIFO: a small probationary FIFO, a main FIFO with 2-bit CLOCK, and a ghost FIFO.

Yang, Zhang, Qiu, Yue and Vinayak, "FIFO queues are all you need for cache eviction",
SOSP 2023.
"""

from __future__ import annotations

from collections import OrderedDict

from tiered_cache.core.blocks import BlockTable
from tiered_cache.policies.base import CachePolicy

# Where a block goes when it (re)joins the candidate set.
NEW, SMALL, MAIN = 0, 1, 2


def ghost_id(blocks: BlockTable, b: int) -> bytes | tuple[int, int]:
    """What a ghost remembers: block b's content key.

    NOTE: not the id: evicted content comes back as a new block under another id, and an id is
    recycled for other content once its block is gone, so ghosts keyed by id would miss the
    content they remember and hit content they never saw. Unpublished blocks (tests: the cache
    only makes published blocks candidates) fall back to (id, generation), which names that one
    block for its lifetime, as the id did when ids were never reused.
    """
    key = blocks.key[b]
    return key if key is not None else (b, blocks.gen[b])


class Parked:
    """Per-block policy state of blocks that left the candidate set, keyed by block id.

    A block leaves the candidate set while pinned and comes back when unpinned; queue-based
    policies must then put it back where it was, with its access bits. The cache does not say
    whether a `remove` is a pin (the block will be back) or a dropped copy (it will not), so the
    entries cannot be deleted on `remove`; instead at most `limit` are kept and the oldest are
    forgotten first. `limit = capacity_blocks` suffices: no more blocks than that can be in the
    tier and out of the candidate set at once, so an entry is only lost early when blocks that
    have left the tier fill the table (the block then simply rejoins as new).

    NOTE: ids are recycled, so each entry stores the row's generation (`blocks.gen[b]`) with the
    state, and an entry of another generation reads as absent: a block that gets the id of a
    block that is gone never inherits its stale state.
    """

    __slots__ = ("limit", "_blocks", "_entries")

    def __init__(self, limit: int, blocks: BlockTable) -> None:
        self.limit = max(1, limit)
        self._blocks = blocks
        self._entries: OrderedDict[int, tuple[int, object]] = OrderedDict()   # id -> (gen, state)

    def get(self, b: int) -> object | None:
        entry = self._entries.get(b)
        return entry[1] if entry is not None and entry[0] == self._blocks.gen[b] else None

    def pop(self, b: int) -> object | None:
        entry = self._entries.pop(b, None)
        return entry[1] if entry is not None and entry[0] == self._blocks.gen[b] else None

    def put(self, b: int, state: object) -> None:
        entries = self._entries
        entries[b] = (self._blocks.gen[b], state)
        entries.move_to_end(b)
        while len(entries) > self.limit:
            entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)


class S3FIFOPolicy(CachePolicy):
    """S3-FIFO (Yang et al., SOSP'23) over the tier's candidates.

    - New blocks enter the small FIFO S (target 10% of `capacity_blocks`): most blocks are used
      once (one-hit wonders), and S lets them go quickly, before they disturb the main FIFO M.
    - Each block has a frequency in 0..3 (2 bits), incremented by `access`.
    - Evicting from S (when S is over its target, or M is empty): the oldest block in S moves to
      M if it was used while in S (freq > 0, access bits cleared on the move, as in the paper),
      otherwise it is evicted and its content key (`ghost_id`) remembered in the ghost FIFO G.
    - Evicting from M: the oldest block with freq > 0 is decremented and reinserted at M's tail
      (2-bit CLOCK); one with freq 0 is evicted.
    - A block whose content key is in G when it is inserted again was evicted too early from S:
      it goes straight to M. G holds at most `capacity_blocks` keys.

    Adapted to candidates: every hook is O(1) on ordered dicts (`victims` amortized O(1) per
    victim: each reinsertion in M spends one access bit that an `access` paid for). A block that
    stops being a candidate (pinned) leaves its queue; its queue and frequency are kept in a
    bounded `Parked` table so that it rejoins the same queue, at the tail, with the same bits.
    Frequencies of candidates live in `_freq` and are dropped when the block is evicted through
    `victims`. A block hit before it was ever a candidate here (pinned from birth) keeps that
    count too, so its first unpin does not lose the reuse.

    Ordering is by the moment a block (re)joins the set, not by `last_access`: a parent that
    becomes a candidate when its last child leaves enters at the tail like a new block.
    """

    name = "s3fifo"
    SMALL_FRACTION = 0.1
    MAX_FREQ = 3

    def __init__(self, capacity_blocks: int, **kw) -> None:
        super().__init__(capacity_blocks, **kw)
        self.small_target = max(1, int(capacity_blocks * self.SMALL_FRACTION))
        self.ghost_limit = max(1, capacity_blocks)
        self._small: OrderedDict[int, None] = OrderedDict()    # block ids, oldest first
        self._main: OrderedDict[int, None] = OrderedDict()     # block ids, oldest first
        self._freq: dict[int, int] = {}                        # candidates only
        # ghost_id of blocks evicted from S, oldest first
        self._ghost: OrderedDict[bytes | tuple, None] = OrderedDict()
        self._parked = Parked(capacity_blocks, self.blocks)    # id -> (queue, freq)

    def resize(self, capacity_blocks: int) -> None:
        super().resize(capacity_blocks)
        self.small_target = max(1, int(capacity_blocks * self.SMALL_FRACTION))
        self.ghost_limit = max(1, capacity_blocks)
        self._parked.limit = max(1, capacity_blocks)

    def insert(self, b: int) -> None:
        if b in self._freq:            # already a candidate
            return
        state = self._parked.pop(b)
        queue, freq = state if state is not None else (NEW, 0)
        if queue == NEW:
            gid = ghost_id(self.blocks, b)
            if gid in self._ghost:     # evicted from S too early last time: admit to M
                del self._ghost[gid]
                queue = MAIN
            else:
                queue = SMALL
        (self._main if queue == MAIN else self._small)[b] = None
        self._freq[b] = freq

    def remove(self, b: int) -> None:
        freq = self._freq.pop(b, None)
        if freq is None:
            return
        if b in self._small:
            del self._small[b]
            queue = SMALL
        else:
            del self._main[b]
            queue = MAIN
        self._parked.put(b, (queue, freq))

    def access(self, b: int) -> None:
        freq = self._freq.get(b)
        if freq is not None:
            self._freq[b] = min(freq + 1, self.MAX_FREQ)
            return
        state = self._parked.get(b)
        queue, freq = state if state is not None else (NEW, 0)
        self._parked.put(b, (queue, min(freq + 1, self.MAX_FREQ)))

    def victims(self, n: int) -> list[int]:
        out: list[int] = []
        small, main, freq, ghost = self._small, self._main, self._freq, self._ghost
        keys, gens = self.blocks.key, self.blocks.gen
        while len(out) < n and (small or main):
            if small and (len(small) > self.small_target or not main):
                b, _ = small.popitem(last=False)
                if freq[b] > 0:
                    freq[b] = 0        # used while on probation: promote, bits cleared
                    main[b] = None
                    continue
                del freq[b]
                out.append(b)
                gid = keys[b]          # ghost_id, inlined
                if gid is None:
                    gid = (b, gens[b])
                ghost[gid] = None
                ghost.move_to_end(gid)
                if len(ghost) > self.ghost_limit:
                    ghost.popitem(last=False)
            else:
                b, _ = main.popitem(last=False)
                if freq[b] > 0:
                    freq[b] -= 1       # second chance: back to the tail, one bit spent
                    main[b] = None
                    continue
                del freq[b]
                out.append(b)
        return out

    def __len__(self) -> int:
        return len(self._freq)
