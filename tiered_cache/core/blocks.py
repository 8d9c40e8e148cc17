"""`BlockTable`: the metadata of every live block, as parallel arrays indexed by block id.

A block is `block_size` tokens of one sequence, in every layer. It is *private* while a sequence
is still writing it and *published* (it has a `key` and sits in the prefix index) once it is full
and every layer has been written. A block id is a row of this table: a plain int that can cross
a process boundary (a transfer plan, a daemon message) and means nothing without the table.

NOTE: struct of arrays, not an object per block. A `__slots__` object with per-tier lists and a
children dict cost ~850 bytes of Python objects per cached block; here a block costs its array
cells (~80 bytes with two tiers), its token ids (4 bytes per token, for verification) and its
key in the prefix dict. `array.array` rather than numpy for the cells: the control plane reads
and writes single cells, where `array` is 2-8x faster than numpy scalar indexing; `view()` gives
zero-copy numpy views for the rare vectorised pass.

NOTE: rows are recycled (`free` puts a row back on a free list), so an id alone does not name a
block forever. `gen[b]` changes every time row b is freed: state kept about a block beyond its
candidacy (policies' parked tables) stores the generation with it and ignores a mismatch.

Only `BlockIndex` (core/index.py) writes these arrays; everything else reads them.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator

import numpy as np

NO_SLOT = -1
NO_BLOCK = -1
_DTYPES = {code: np.dtype(code) for code in "bBhHiIlLqQ"}
_VECTOR_MIN = 16
"""Runs of at least this many blocks are updated with numpy (a call costs about as much as
16 single-cell writes); shorter ones cell by cell."""


def _cells(typecode: str, n: int, fill: int = 0) -> array:
    return array(typecode, [fill]) * n


class BlockTable:
    """Per-block metadata. Read-only outside core/index.py."""

    # NOTE: the columns are made from `_FIELDS` / `_PER_TIER` below; these annotations name
    # them for the type checker (tests/core/test_state.py checks that the two agree).
    parent: array[int]
    depth: array[int]
    ref_count: array[int]
    in_flight: array[int]
    hits: array[int]
    last_access: array[int]
    inserted_at: array[int]
    root_id: array[int]
    published: array[int]
    stored: array[int]
    candidate: array[int]
    busy_tiers: array[int]
    first_child: array[int]
    next_sibling: array[int]
    prev_sibling: array[int]
    gen: array[int]
    slots: list[array[int]]
    resident_children: list[array[int]]

    # per block: (attribute, array typecode, initial value)
    _FIELDS: tuple[tuple[str, str, int], ...] = (
        ("parent", "i", NO_BLOCK),      # published parent's id; NO_BLOCK at depth 0 or private
        ("depth", "i", 0),              # block `depth` covers tokens [depth*bs, (depth+1)*bs)
        ("ref_count", "i", 0),          # open sequences whose block table holds it (pinned > 0)
        ("in_flight", "i", 0),          # copies under way (or zero-copy reads) that use it
        ("hits", "q", 0),               # times a request reused it
        ("last_access", "q", 0),        # logical clock of the last use
        ("inserted_at", "q", 0),        # logical clock of publication
        ("root_id", "i", -1),           # depth-0 blocks: namespace + salt they were made under
        ("published", "B", 0),          # 1 while in the prefix index (key is not None)
        ("stored", "B", 0),             # bit k: put to keyed tier k (remote) by this process
        ("candidate", "B", 0),          # bit t: a candidate of tier t's policy (invariant 4)
        ("busy_tiers", "B", 0),         # bit t: a move in flight reads the copy in tier t
        ("first_child", "i", NO_BLOCK),     # published children, as a doubly linked list
        ("next_sibling", "i", NO_BLOCK),
        ("prev_sibling", "i", NO_BLOCK),
        ("gen", "I", 0),                # bumped when the row is freed (see the module NOTE)
    )
    _PER_TIER: tuple[tuple[str, str, int], ...] = (
        ("slots", "i", NO_SLOT),                # slots[t][b]: b's slot in tier t, or NO_SLOT
        ("resident_children", "i", 0),          # children of b with a copy in tier t
    )

    def __init__(self, num_tiers: int, block_size: int, capacity: int = 1024) -> None:
        self.num_tiers = num_tiers
        self.block_size = block_size
        self.capacity = 0
        self.num_live = 0
        self._free: list[int] = []
        self._views: dict[str | tuple[str, int], np.ndarray] = {}
        self._tier_views: dict[str, tuple[np.ndarray, ...]] = {}
        for name, code, fill in self._FIELDS:
            setattr(self, name, _cells(code, 0, fill))
        for name, code, fill in self._PER_TIER:
            setattr(self, name, [_cells(code, 0, fill) for _ in range(num_tiers)])
        self.key: list[bytes | None] = []           # 128-bit chained key; None while private
        self.tokens = np.zeros((0, block_size), dtype=np.int32)     # token ids, when published
        self.grow(max(1, capacity))

    # ------------------------------------------------------------------ rows
    def new(self, depth: int, ref_count: int = 0) -> int:
        """A fresh private block: no copy, no parent, no key, no history."""
        if not self._free:
            self.grow(2 * self.capacity)
        b = self._free.pop()
        self.depth[b] = depth
        self.ref_count[b] = ref_count
        self.parent[b] = NO_BLOCK
        self.hits[b] = 0
        self.key[b] = None
        self.published[b] = 0
        self.stored[b] = 0
        self.num_live += 1
        return b

    def new_run_ids(self, depth: int, n: int,
                    ref_count: int = 0) -> tuple[list[int], np.ndarray | None]:
        """n fresh private blocks at depths depth, depth + 1, ...: the ids n calls of `new`
        would return, set up in one pass (vectorised for long runs: a prompt's new blocks), and
        the ids as an intp array where it made one (n >= _VECTOR_MIN)."""
        free = self._free
        while len(free) < n:
            self.grow(2 * self.capacity)
        ids = free[len(free) - n:]
        del free[len(free) - n:]
        ids.reverse()                       # `new` pops from the end
        self.num_live += n
        key = self.key
        if n < _VECTOR_MIN:
            d, r, p, h, pub, st = (self.depth, self.ref_count, self.parent, self.hits,
                                   self.published, self.stored)
            for b in ids:
                d[b] = depth
                depth += 1
                r[b] = ref_count
                p[b] = NO_BLOCK
                h[b] = 0
                key[b] = None
                pub[b] = 0
                st[b] = 0
            return ids, None
        at = np.asarray(ids, dtype=np.intp)
        self.view("depth")[at] = np.arange(depth, depth + n, dtype=np.int32)
        self.view("ref_count")[at] = ref_count
        self.view("parent")[at] = NO_BLOCK
        self.view("hits")[at] = 0
        self.view("published")[at] = 0
        self.view("stored")[at] = 0
        for b in ids:
            key[b] = None
        return ids, at

    def free(self, b: int) -> None:
        """Return row b for reuse. The caller has cleared it: no copy, unpublished, unpinned,
        not in flight, no children, not a candidate (check_invariants verifies free rows).

        NOTE: only what `new` does not set is reset here, and the copies once more: a row
        that kept a slot would hand the next block that slot's KV."""
        for slots in self.slots:
            slots[b] = NO_SLOT
        self.gen[b] = (self.gen[b] + 1) & 0xFFFFFFFF
        self._free.append(b)
        self.num_live -= 1

    def grow(self, capacity: int) -> None:
        """Room for `capacity` rows (never shrinks; the control plane sizes it up front)."""
        extra = capacity - self.capacity
        if extra <= 0:
            return
        # NOTE: an array cannot be resized while a numpy view exports its buffer.
        self._views.clear()
        self._tier_views.clear()
        if self.capacity == 0:
            self._first(capacity)
            return
        for name, code, fill in self._FIELDS:
            getattr(self, name).extend(_cells(code, extra, fill))
        for name, code, fill in self._PER_TIER:
            for cells in getattr(self, name):
                cells.extend(_cells(code, extra, fill))
        self.key.extend([None] * extra)
        self.tokens = np.concatenate(
            [self.tokens, np.zeros((extra, self.block_size), dtype=np.int32)])
        # Lowest ids are handed out first (pop from the end).
        self._free.extend(range(capacity - 1, self.capacity - 1, -1))
        self.capacity = capacity

    def _first(self, capacity: int) -> None:
        """`grow` of an empty table: every column made at its size in one allocation.

        NOTE: no temporary of the table's size is made and freed (as extending would): glibc
        serves large blocks with mmap and, once one is freed, raises the size it mmaps above to
        that block's size, so a freed temporary of a column's size would make every later
        allocation below it (the prefix dict's tables as it grows) come from the heap, whose
        freed holes are never given back: ~60 resident bytes per cached block here."""
        for name, code, fill in self._FIELDS:
            setattr(self, name, _cells(code, capacity, fill))
        for name, code, fill in self._PER_TIER:
            setattr(self, name, [_cells(code, capacity, fill) for _ in range(self.num_tiers)])
        self.key = [None] * capacity
        self.tokens = np.zeros((capacity, self.block_size), dtype=np.int32)
        self._free = list(range(capacity - 1, -1, -1))      # lowest ids first (pop: the end)
        self.capacity = capacity

    # ------------------------------------------------------------------ reads
    def is_live(self, b: int) -> bool:
        """Row b holds a block (not on the free list). O(capacity): tests and checks only."""
        return 0 <= b < self.capacity and b not in set(self._free)

    def free_ids(self) -> list[int]:
        return list(self._free)

    def live_ids(self) -> list[int]:
        """Every live block id (O(capacity); tests and invariant checks)."""
        free = set(self._free)
        return [b for b in range(self.capacity) if b not in free]

    def token_bytes(self, b: int) -> bytes:
        return self.tokens[b].tobytes()

    def children(self, b: int) -> Iterator[int]:
        """Published children of b (a snapshot is safe to mutate under)."""
        c = self.first_child[b]
        nxt = self.next_sibling
        while c != NO_BLOCK:
            yield c
            c = nxt[c]

    def has_children(self, b: int) -> bool:
        return self.first_child[b] != NO_BLOCK

    def fastest_tier(self, b: int) -> int:
        """Index of the fastest tier holding a copy of b, or -1."""
        for t, slots in enumerate(self.slots):
            if slots[b] != NO_SLOT:
                return t
        return -1

    def copies(self, b: int) -> list[int]:
        """Slot of b in every tier (NO_SLOT where it has no copy)."""
        return [slots[b] for slots in self.slots]

    def is_cached(self, b: int) -> bool:
        return any(slots[b] != NO_SLOT for slots in self.slots)

    def view(self, name: str, tier: int | None = None) -> np.ndarray:
        """Zero-copy numpy view of a field (cached; `grow` drops the cache, so never keep one
        across a call that can allocate a block)."""
        # NOTE: a field's view is cached under its name alone (the hot path asks for a dozen
        # per request: no tuple to build and hash), a tier's under (name, tier).
        v = self._views.get(name if tier is None else (name, tier))
        if v is None:
            cells = getattr(self, name) if tier is None else getattr(self, name)[tier]
            v = np.frombuffer(cells, dtype=_DTYPES[cells.typecode])
            self._views[name if tier is None else (name, tier)] = v
        return v

    def tier_views(self, name: str) -> tuple[np.ndarray, ...]:
        """`view(name, t)` of every tier, as a tuple (cached, like the views)."""
        v = self._tier_views.get(name)
        if v is None:
            v = self._tier_views[name] = tuple(self.view(name, t) for t in range(self.num_tiers))
        return v

    def describe(self, b: int) -> str:
        state = "published" if self.key[b] is not None else "private"
        return (f"block {b} ({state}, depth {self.depth[b]}, slots {self.copies(b)}, "
                f"ref {self.ref_count[b]}, in flight {self.in_flight[b]})")
