"""Per-tier slot allocator: hands out fixed-size slots 0..num_slots-1, preferring contiguous runs
so that a sequence's blocks and a migration batch coalesce into few large copies.

Free space is kept as maximal runs `(start, length)`, TLSF style:

- `_run_at_start {start: length}` and `_run_at_end {end_exclusive: start}` let `free` find and
  merge both neighbours of a freed piece with two dict look-ups;
- every run is also filed in a size-class bin: bin k holds runs with length in [2^k, 2^(k+1)).
  A bin is a dict used as an ordered set (O(1) add/remove), and `_bin_mask` has bit k set while
  bin k is non-empty, so "lowest non-empty bin above k" and "highest non-empty bin" are a couple
  of integer bit operations;
- `_free` is a bytearray of per-slot flags (1 = free) for O(1) `is_free` and for validating
  `free` before anything changes.

NOTE: why allocate/free are O(1) amortised. The number of bins is num_slots.bit_length(), i.e.
bounded by log2(num_slots) + 1, and bins are found through the bit mask, never by scanning
slots. `allocate` probes at most `_PROBE` runs of the one bin where a run may be too short (bin
floor(log2 n)); every run of a higher bin fits. Gathering looks at O(_PROBE) runs per piece it
hands out. `free` does O(1) dict work per piece of consecutive slots. The only per-slot work is
writing the flags and building the returned list, proportional to the slots moved.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from itertools import islice

from tiered_cache.errors import CapacityError

# Runs looked at in the bin of floor(log2 n), where some runs may be shorter than n. Bounded so
# that a bin full of slightly-too-short runs cannot make allocate linear; a fit missed beyond the
# window only costs contiguity (the gather step still finds the slots), never correctness.
_PROBE = 8


class SlotAllocator:
    """Fixed-size slot pool with O(1) amortised allocate/free that prefers contiguous runs."""

    def __init__(self, num_slots: int):
        num_slots = operator.index(num_slots)
        if num_slots < 0:
            raise ValueError(f"num_slots must be >= 0, got {num_slots}")
        self._n = 0
        self._num_free = 0
        self._free = bytearray()
        self._run_at_start: dict[int, int] = {}
        self._run_at_end: dict[int, int] = {}
        self._bins: list[dict[int, None]] = [{}]
        self._bin_mask = 0
        # Shrinking: slots at or above `_limit` are being drained. They are never handed out;
        # when freed they are only flagged free and counted in `_retired`, not filed in a run.
        self._limit = 0
        self._retired = 0
        self.grow(num_slots)

    @property
    def num_slots(self) -> int:
        return self._n

    @property
    def capacity(self) -> int:
        """Slots the pool offers: num_slots, or the target of a shrink under way."""
        return self._limit

    @property
    def num_free(self) -> int:
        """Free slots that can be allocated (drained slots of a shrink are not counted)."""
        return self._num_free

    @property
    def num_used(self) -> int:
        return self._n - self._num_free - self._retired

    @property
    def shrinking(self) -> bool:
        return self._limit < self._n

    @property
    def draining(self) -> int:
        """Used slots at or above a shrink's limit (0 when not shrinking)."""
        return self._n - self._limit - self._retired

    def can_allocate(self, n: int) -> bool:
        """Whether `allocate(n)` would succeed."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of slots ({n})")
        return n <= self._num_free

    def allocate(self, n: int, hint: int | None = None) -> list[int]:
        """Take `n` slots: the run starting at `hint` first, then best fit, then largest runs."""
        n = operator.index(n)
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of slots ({n})")
        if n > self._num_free:
            raise CapacityError(
                f"asked for {n} slots but only {self._num_free} of {self._n} are free"
            )
        out: list[int] = []
        if n == 0:
            return out
        # (1) Extend the caller's run in place: a sequence passes last_slot + 1.
        if hint is not None and hint in self._run_at_start:
            self._take(hint, min(n, self._run_at_start[hint]), out)
        remaining = n - len(out)
        if remaining == 0:
            return out
        # (2) Best fit: the smallest run that holds everything keeps big runs for big requests.
        start = self._best_fit(remaining)
        if start is not None:
            self._take(start, remaining, out)
            return out
        # (3) No single run is big enough: fewest pieces come from the largest runs. Once the
        # rest fits in one run, best fit again spares the big runs.
        while remaining:
            start = self._best_fit(remaining)
            if start is None:
                start = self._largest()
            count = min(remaining, self._run_at_start[start])
            self._take(start, count, out)
            remaining -= count
        return out

    def allocate_at(self, slot: int) -> None:
        """Take one specific free slot (the compactor uses it to fill low slots)."""
        slot = self._check_range(slot)
        if not self._free[slot] or slot >= self._limit:
            raise ValueError(f"slot {slot} is not free")
        # The run's start is just past the nearest used slot below: a C-level backwards byte scan,
        # O(1) when `slot` starts its run (the usual lowest_free() case), else O(offset in run).
        start = self._free.rfind(0, 0, slot) + 1
        end = start + self._remove_run(start)
        self._free[slot] = 0
        self._num_free -= 1
        if start < slot:
            self._add_run(start, slot - start)
        if slot + 1 < end:
            self._add_run(slot + 1, end - slot - 1)

    def free(self, slots: Iterable[int]) -> None:
        """Return slots to the pool. Atomic: on any bad slot nothing is freed."""
        batch = list(map(operator.index, slots))
        if not batch:
            return
        if batch == sorted(batch):
            self._free_sorted(batch)
            return
        flags = self._free
        # NOTE: checked in C-speed passes (range, flags, distinct); only a bad batch walks
        # slot by slot, to name the first bad slot.
        if (min(batch) < 0 or max(batch) >= self._n or any(map(flags.__getitem__, batch))
                or len(set(batch)) != len(batch)):
            self._reject(batch)
        # Freeing piece by piece (maximal ascending consecutive stretches of the batch) keeps the
        # dict work per piece, not per slot, for the usual case of freeing whole runs.
        i = 0
        while i < len(batch):
            j = i + 1
            while j < len(batch) and batch[j] == batch[j - 1] + 1:
                j += 1
            self._free_piece(batch[i], j - i)
            i = j

    def _free_sorted(self, batch: list[int]) -> None:
        """`free` of an ascending batch (eviction frees its victims' slots sorted): its pieces
        are found by bisection and each checked with one flag scan, before anything changes.

        NOTE: in an ascending batch of distinct slots `batch[j] - j` never decreases, and a
        piece (consecutive slots) is a stretch where it stays the same: O(pieces * log n)
        instead of a step per slot. The pieces are freed in the same order as below."""
        n = len(batch)
        if batch[0] < 0 or batch[-1] >= self._n or len(set(batch)) != n:
            self._reject(batch)
        pieces = []
        i = 0
        while i < n:
            base = batch[i] - i
            lo, hi = i + 1, n
            while lo < hi:
                mid = (lo + hi) // 2
                if batch[mid] - mid == base:
                    lo = mid + 1
                else:
                    hi = mid
            pieces.append((batch[i], lo - i))
            i = lo
        flags = self._free
        for start, count in pieces:
            if flags.find(1, start, start + count) >= 0:
                self._reject(batch)
        for start, count in pieces:
            self._free_piece(start, count)

    def _free_piece(self, start: int, count: int) -> None:
        """Free the checked slots [start, start + count)."""
        self._free[start : start + count] = b"\x01" * count
        kept = max(0, min(count, self._limit - start))   # the part below a shrink's limit
        if kept:
            self._num_free += kept
            self._insert_free(start, kept)
        self._retired += count - kept

    def _reject(self, batch: list[int]) -> None:
        """Raise for the first bad slot of a batch `free` refused (out of range, already free,
        or twice in the batch)."""
        seen: set[int] = set()
        for s in batch:
            self._check_range(s)
            if self._free[s]:
                raise ValueError(f"slot {s} is already free (double free)")
            if s in seen:
                raise ValueError(f"slot {s} appears more than once in one free() call")
            seen.add(s)
        raise AssertionError("unreachable: the batch was refused")

    def free_one(self, slot: int) -> None:
        """Return one slot: the eviction hot path's `free`, same checks, no batch overhead."""
        if not 0 <= slot < self._n:
            raise ValueError(f"slot {slot} is out of range [0, {self._n})")
        if self._free[slot]:
            raise ValueError(f"slot {slot} is already free (double free)")
        self._free[slot] = 1
        if slot >= self._limit:
            self._retired += 1
            return
        self._num_free += 1
        self._insert_free(slot, 1)

    def is_free(self, slot: int) -> bool:
        """O(1) look-up in the free flags."""
        return bool(self._free[self._check_range(slot)])

    def lowest_free(self, start: int = 0) -> int | None:
        """Lowest free slot at or above `start`, or None.

        NOTE: a memchr over the free flags (C speed, ~30 us per million slots worst case); the
        compactor walks upward with `start`, so a whole step scans each flag at most once.
        """
        i = self._free.find(1, start, self._limit)
        return None if i < 0 else i

    def highest_used_below(self, end: int) -> int | None:
        """Highest allocated slot below `end`, or None (memchr from the top, like lowest_free)."""
        i = self._free.rfind(0, 0, end)
        return None if i < 0 else i

    def highest_used(self) -> int | None:
        """Highest allocated slot, or None. O(1): every slot above it is in the run that ends at
        num_slots, if there is one; otherwise it is num_slots - 1. (While a shrink is under way
        the tail is in no run: a memchr from the top.)"""
        if self.num_used == 0:
            return None
        if self._limit < self._n:       # shrinking: the tail is not one run any more
            return self._free.rfind(0)
        tail_start = self._run_at_end.get(self._n)
        return self._n - 1 if tail_start is None else tail_start - 1

    def fragmentation(self) -> float:
        """Free slots below highest_used() per used slot; 0.0 when nothing is used."""
        used = self.num_used
        if used == 0:
            return 0.0
        highest = self.highest_used()
        assert highest is not None
        # All used slots lie in [0, highest], so the holes there are the rest of that range.
        return (highest + 1 - used) / used

    def runs(self) -> list[tuple[int, int]]:
        """Free runs as sorted (start, length) pairs, for tests and debugging."""
        return sorted(self._run_at_start.items())

    def grow(self, n: int) -> None:
        """Add `n` free slots at the end, merged with a trailing free run."""
        n = operator.index(n)
        if n < 0:
            raise ValueError(f"cannot grow by a negative number of slots ({n})")
        if self.shrinking:
            raise ValueError("cannot grow while a shrink is under way")
        if n == 0:
            return
        old = self._n
        self._n += n
        self._limit = self._n
        self._free.extend(b"\x01" * n)
        self._num_free += n
        # A run can now be as long as the whole pool, so make room for its bin.
        while len(self._bins) < self._n.bit_length():
            self._bins.append({})
        self._insert_free(old, n)

    def shrink(self, n: int) -> None:
        """Remove the last `n` slots, which must all be free. Atomic."""
        n = operator.index(n)
        if n < 0:
            raise ValueError(f"cannot shrink by a negative number of slots ({n})")
        if n > self._n:
            raise ValueError(f"cannot shrink by {n} slots: the pool has only {self._n}")
        used = self._free.find(0, self._n - n)
        if used != -1:
            raise ValueError(f"cannot shrink by {n} slots: slot {used} is in use")
        self.begin_shrink(self._n - n)
        self.finish_shrink()

    # A shrink in three steps, for a pool whose tail still holds live slots: `begin_shrink`
    # stops handing out the tail, the owner moves or frees what lives there, `finish_shrink`
    # drops the tail once it is all free (or `cancel_shrink` gives it back).

    def begin_shrink(self, new_size: int) -> None:
        """Stop handing out slots >= new_size; free ones there leave the free runs now, ones
        freed later never enter them. O(free runs in the tail)."""
        new_size = operator.index(new_size)
        if not 0 <= new_size <= self._n:
            raise ValueError(f"cannot shrink to {new_size} slots: the pool has {self._n}")
        if self.shrinking:
            raise ValueError("a shrink is already under way")
        self._limit = new_size
        i = self._free.find(1, new_size)
        while i != -1:
            start = self._free.rfind(0, 0, i) + 1       # start of the run holding slot i
            length = self._remove_run(start)
            if start < new_size:                        # the run straddles the limit
                self._add_run(start, new_size - start)
            tail = start + length - max(start, new_size)
            self._num_free -= tail
            self._retired += tail
            i = self._free.find(1, start + length)

    def drained(self) -> bool:
        """Every slot at or above the shrink's limit is free."""
        return self._retired == self._n - self._limit

    def finish_shrink(self) -> None:
        if not self.drained():
            used = self._free.find(0, self._limit)
            raise ValueError(f"cannot finish the shrink to {self._limit} slots: slot {used} "
                             "is in use")
        del self._free[self._limit:]
        self._n = self._limit
        self._retired = 0

    def cancel_shrink(self) -> None:
        """Give the tail's free slots back to the free runs; the pool keeps its size."""
        i = self._free.find(1, self._limit)
        self._limit = self._n
        while i != -1:
            end = self._free.find(0, i)
            end = self._n if end == -1 else end
            self._retired -= end - i
            self._num_free += end - i
            self._insert_free(i, end - i)
            i = self._free.find(1, end)
        assert self._retired == 0

    # -- internals ---------------------------------------------------------------------------

    def _check_range(self, slot: int) -> int:
        slot = operator.index(slot)
        if not 0 <= slot < self._n:
            raise ValueError(f"slot {slot} is out of range [0, {self._n})")
        return slot

    def _best_fit(self, n: int) -> int | None:
        """Start of the smallest run (within the probe window) of length >= n, or None."""
        k = n.bit_length() - 1
        best: int | None = None
        best_len = 0
        if self._bin_mask >> k & 1:
            for i, start in enumerate(self._bins[k]):
                length = self._run_at_start[start]
                if length >= n and (best is None or length < best_len):
                    best, best_len = start, length
                    if length == n:
                        break
                if i + 1 >= _PROBE:
                    break
        if best is not None:
            return best
        # Every run of a bin above k has length >= 2^(k+1) > n; take the lowest such bin.
        above = self._bin_mask >> (k + 1)
        if not above:
            return None
        j = k + 1 + (above & -above).bit_length() - 1
        return next(iter(self._bins[j]))

    def _largest(self) -> int:
        """Start of the longest of the first `_PROBE` runs in the highest non-empty bin."""
        top = self._bins[self._bin_mask.bit_length() - 1]
        return max(islice(top, _PROBE), key=self._run_at_start.__getitem__)

    def _take(self, start: int, count: int, out: list[int]) -> None:
        """Allocate the low `count` slots of the run at `start`."""
        length = self._remove_run(start)
        end = start + count
        self._free[start:end] = bytes(count)
        self._num_free -= count
        if count < length:
            self._add_run(end, length - count)
        out.extend(range(start, end))

    def _insert_free(self, start: int, length: int) -> None:
        """File [start, start + length) as free, merged with the runs on either side."""
        end = start + length
        left = self._run_at_end.get(start)
        if left is not None:
            self._remove_run(left)
            start = left
        right_len = self._run_at_start.get(end)
        if right_len is not None:
            self._remove_run(end)
            end += right_len
        self._add_run(start, end - start)

    def _add_run(self, start: int, length: int) -> None:
        self._run_at_start[start] = length
        self._run_at_end[start + length] = start
        k = length.bit_length() - 1
        self._bins[k][start] = None
        self._bin_mask |= 1 << k

    def _remove_run(self, start: int) -> int:
        length = self._run_at_start.pop(start)
        del self._run_at_end[start + length]
        k = length.bit_length() - 1
        bin_k = self._bins[k]
        del bin_k[start]
        if not bin_k:
            self._bin_mask &= ~(1 << k)
        return length
