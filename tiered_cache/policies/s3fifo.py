"""S3-FIFO: a small probationary FIFO, a main FIFO with 2-bit CLOCK, and a ghost FIFO.

Yang, Zhang, Qiu, Yue and Vinayak, "FIFO queues are all you need for cache eviction",
SOSP 2023.
"""

from __future__ import annotations

from collections import OrderedDict

from tiered_cache.block import Block
from tiered_cache.policies.base import CachePolicy

# Where a block goes when it (re)joins the candidate set.
NEW, SMALL, MAIN = 0, 1, 2


def ghost_id(block: Block) -> bytes | int:
    """What a ghost remembers: the block's content key.

    NOTE: not `block.id`: evicted content comes back as a new Block with a new id, so ghosts
    keyed by id would never hit. Unpublished blocks (tests) fall back to the id.
    """
    return block.key if block.key is not None else block.id


class Parked:
    """Per-block policy state of blocks that left the candidate set, keyed by `block.id`.

    A block leaves the candidate set while pinned and comes back when unpinned; queue-based
    policies must then put it back where it was, with its access bits. The cache does not say
    whether a `remove` is a pin (the block will be back) or a dropped copy (it will not), so the
    entries cannot be deleted on `remove`; instead at most `limit` are kept and the oldest are
    forgotten first. `limit = capacity_blocks` suffices: no more blocks than that can be in the
    tier and out of the candidate set at once, so an entry is only lost early when blocks that
    have left the tier fill the table (the block then simply rejoins as new).

    NOTE: the `Block` object is kept with its state and compared by identity on lookup, so a
    block id that is reused for another block never inherits stale state.
    """

    __slots__ = ("limit", "_entries")

    def __init__(self, limit: int) -> None:
        self.limit = max(1, limit)
        self._entries: OrderedDict[int, tuple[Block, object]] = OrderedDict()

    def get(self, block: Block) -> object | None:
        entry = self._entries.get(block.id)
        return entry[1] if entry is not None and entry[0] is block else None

    def pop(self, block: Block) -> object | None:
        entry = self._entries.pop(block.id, None)
        return entry[1] if entry is not None and entry[0] is block else None

    def put(self, block: Block, state: object) -> None:
        self._entries[block.id] = (block, state)
        self._entries.move_to_end(block.id)
        while len(self._entries) > self.limit:
            self._entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)


class S3FIFOPolicy(CachePolicy):
    """S3-FIFO (Yang et al., SOSP'23) over the tier's candidates.

    - New blocks enter the small FIFO S (target 10% of `capacity_blocks`): most blocks are used
      once (one-hit wonders), and S lets them go quickly, before they disturb the main FIFO M.
    - Each block has a frequency in 0..3 (2 bits), incremented by `access`.
    - Evicting from S (when S is over its target, or M is empty): the oldest block in S moves to
      M if it was used while in S (freq > 0, access bits cleared on the move, as in the paper),
      otherwise it is evicted and its id remembered in the ghost FIFO G.
    - Evicting from M: the oldest block with freq > 0 is decremented and reinserted at M's tail
      (2-bit CLOCK); one with freq 0 is evicted.
    - A block whose id is in G when it is inserted again was evicted too early from S: it goes
      straight to M. G holds at most `capacity_blocks` ids.

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
        self._small: OrderedDict[int, Block] = OrderedDict()   # oldest first
        self._main: OrderedDict[int, Block] = OrderedDict()    # oldest first
        self._freq: dict[int, int] = {}                        # candidates only
        self._ghost: OrderedDict[bytes | int, None] = OrderedDict()  # evicted from S, oldest first
        self._parked = Parked(capacity_blocks)                 # id -> (queue, freq)

    def resize(self, capacity_blocks: int) -> None:
        super().resize(capacity_blocks)
        self.small_target = max(1, int(capacity_blocks * self.SMALL_FRACTION))
        self.ghost_limit = max(1, capacity_blocks)
        self._parked.limit = max(1, capacity_blocks)

    def insert(self, block: Block) -> None:
        bid = block.id
        if bid in self._freq:          # already a candidate
            return
        state = self._parked.pop(block)
        queue, freq = state if state is not None else (NEW, 0)
        if queue == NEW:
            gid = ghost_id(block)
            if gid in self._ghost:     # evicted from S too early last time: admit to M
                del self._ghost[gid]
                queue = MAIN
            else:
                queue = SMALL
        (self._main if queue == MAIN else self._small)[bid] = block
        self._freq[bid] = freq

    def remove(self, block: Block) -> None:
        bid = block.id
        freq = self._freq.pop(bid, None)
        if freq is None:
            return
        if self._small.pop(bid, None) is not None:
            queue = SMALL
        else:
            del self._main[bid]
            queue = MAIN
        self._parked.put(block, (queue, freq))

    def access(self, block: Block) -> None:
        bid = block.id
        freq = self._freq.get(bid)
        if freq is not None:
            self._freq[bid] = min(freq + 1, self.MAX_FREQ)
            return
        state = self._parked.get(block)
        queue, freq = state if state is not None else (NEW, 0)
        self._parked.put(block, (queue, min(freq + 1, self.MAX_FREQ)))

    def victims(self, n: int) -> list[Block]:
        out: list[Block] = []
        small, main, freq = self._small, self._main, self._freq
        while len(out) < n and (small or main):
            if small and (len(small) > self.small_target or not main):
                bid, block = small.popitem(last=False)
                if freq[bid] > 0:
                    freq[bid] = 0      # used while on probation: promote, bits cleared
                    main[bid] = block
                    continue
                del freq[bid]
                out.append(block)
                gid = ghost_id(block)
                self._ghost[gid] = None
                self._ghost.move_to_end(gid)
                if len(self._ghost) > self.ghost_limit:
                    self._ghost.popitem(last=False)
            else:
                bid, block = main.popitem(last=False)
                if freq[bid] > 0:
                    freq[bid] -= 1     # second chance: back to the tail, one bit spent
                    main[bid] = block
                    continue
                del freq[bid]
                out.append(block)
        return out

    def __len__(self) -> int:
        return len(self._freq)
