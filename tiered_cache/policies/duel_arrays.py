"""`ArrayDuel`: the duel of `duel.Duel`, its shadow state in arrays and its loops compiled.

The same sample, the same mini caches, the same paired scores and the same choices, use by use
(tests/policies/test_duel_arrays.py replays random streams through both and compares every
score, entry and resident set); `duel.Duel` with `shadow` stays the readable reference. The
adaptive policy uses this one: a use of a sampled key costs the reference 3-9 us of
interpreted heap and dict work under the control-plane lock, here a share of one compiled call
per chain (a request's sampled keys are handed in together: `hits`, `publish_keys`,
`publish_walk`).

State (see duel_kernels for the layout): per sampled key a row of an int64 table (its
history entry, its place in the history's order, its resident value and child count in each
mini cache), an open-addressing hash table from key to column, and per mini cache a heap in two
arrays. Rows and heaps grow by doubling, so memory follows what is held: at most
`hist_limit` + k entries (as the reference) of 8 * (13 + 2k) bytes, and heaps of at most
`2 * cap + 64` live and stale entries (the reference sheds at twice that) of 32 bytes plus
`cap + 8` of scratch.

NOTE: keys must be 16 bytes (content keys are 128-bit): a key is two int64 words here.

NOTE: numba compiles the kernels once per installation and source change (cached on disk
under `__pycache__`: about 20 s of CPU), and every process loads them (about 0.2 s, plus 0.3 s
to import numba). Both happen when the first ArrayDuel is built (`warm_up`), with the cache
being built, never inside a policy hook under the control-plane lock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from tiered_cache.policies.duel import MAX_RATE, MINI_SLOTS, Z, sample_rate
from tiered_cache.policies.reuse_credit import GHOST_PER_SLOT
from tiered_cache.policies.shadow import EXPERTS, Expert

_EMPTY = b""


class _Kernels:
    """duel_kernels, imported at the first use of one of its names (then `K` is the module).

    NOTE: numba (and llvmlite with it) loads only when a duel is built or warmed up, not when
    the policies are imported: vLLM's CPU platform scans every loaded module's objects when a
    worker starts (vllm.triton_utils.dispatcher) and fails on llvmlite's ffi object, and the
    vLLM connector imports the policies (through the config) before vLLM's workers start."""

    def __getattr__(self, name: str):
        from tiered_cache.policies import duel_kernels

        globals()["K"] = duel_kernels
        return getattr(duel_kernels, name)


K = _Kernels()


_warm = False


def warm_up() -> None:
    """Compile (or load from numba's disk cache) every kernel, once per process, on a throwaway
    duel: the first real use must not stall a request under the lock."""
    global _warm
    if _warm:
        return
    _warm = True
    d = ArrayDuel(64, mini_slots=4, max_rate=1)
    keys = [bytes([i]) * 16 for i in range(3)]
    ids = np.arange(3, dtype=np.int64)
    la = np.zeros(3, np.int64)
    dep32 = np.arange(3, dtype=np.int32)
    d.publish_keys(keys, [1, 1, 1], [0, 1, 2], None, True)
    d.hits(keys, [2, 2, 2], [0, 1, 2], None)
    d.first_announced(keys, [1, 1, 1])
    for dep in (ids, dep32):                # the table's depth is int32, tests pass int64
        d.hit_chain(keys, ids, la, dep, 0, None, 0, 0, 0, -1, 1)
        d.deepest_announced(keys, ids, la, 0)
        d.walk_publish(keys, ids, la, la, dep, 0, None)
    par = np.full(3, -1, np.int32)
    K.walk_up(par, la, 0, 1, np.empty(2, np.int64))
    d._choose()


def _words(key: bytes | None) -> tuple[int, int, int]:
    """(hi, lo, none) of a parent key, as the kernels name it."""
    if key is None:
        return 0, 0, 1
    if len(key) != 16:
        raise ValueError(f"duel keys are 16 bytes, got {len(key)}")
    return (int.from_bytes(key[:8], "big", signed=True),
            int.from_bytes(key[8:], "big", signed=True), 0)


def _key(hi: int, lo: int) -> bytes:
    return int(hi).to_bytes(8, "big", signed=True) + int(lo).to_bytes(8, "big", signed=True)


@dataclass
class MiniView:
    """A snapshot of one mini cache (tests and inspection): `res` (a set for LRU; key ->
    serial, or -1 with no heap entry, for a credit expert), `kids` (key -> resident children),
    `heap` (its entries)."""

    kind: str
    cap: int
    res: set | dict
    kids: dict = field(default_factory=dict)
    heap: list = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.res)


class ArrayDuel:
    """`duel.Duel` over arrays: the same constructor, attributes and uses; see the module
    docstring."""

    def __init__(self, capacity: int, experts: tuple[Expert, ...] = EXPERTS, z: float = Z,
                 mini_slots: int = MINI_SLOTS, max_rate: int = MAX_RATE) -> None:
        if not experts or experts[0].lifetimes != 0.0:
            raise ValueError("the first expert must be LRU (lifetimes 0): it is the floor")
        if max_rate > 256 or max_rate & (max_rate - 1):
            raise ValueError(f"max_rate: a power of two up to 256, got {max_rate}")
        if len(experts) > 16:
            raise ValueError(f"at most 16 experts, got {len(experts)}")
        self.experts = experts
        self.z = z
        self.rate = sample_rate(max(1, capacity), mini_slots, max_rate)
        self.mask = self.rate - 1
        self.cap = max(1, capacity // self.rate)
        self.hist_limit = GHOST_PER_SLOT * self.cap
        self.window = GHOST_PER_SLOT * self.cap
        k = self._k = len(experts)
        rows, ng, nf = K.layout(k)
        G = self._G = np.zeros(ng, np.int64)
        F = self._F = np.zeros(nf)
        G[K.G_K], G[K.G_CAP], G[K.G_HLIMIT], G[K.G_WINDOW] = k, self.cap, self.hist_limit, \
            self.window
        G[[K.G_FIXED, K.G_HEAD, K.G_TAIL, K.G_FREE]] = -1
        F[K.F_Z] = z
        for m, e in enumerate(experts):
            g, f = K.G_MINI + K.M_STRIDE * m, K.F_MINI + K.FM_STRIDE * m
            G[g + K.M_KIND] = 0 if e.lifetimes == 0.0 else 1
            G[g + K.M_BATCH], G[g + K.M_SINCE] = 1, -1
            F[f + K.FM_LIFETIMES], F[f + K.FM_GAPS] = e.lifetimes, e.gaps
        w = K.F_MINI + K.FM_STRIDE * k
        self.wins = F[w:w + k * k].reshape(k, k)
        """Paired scores: wins[i][j] counts the sampled uses expert i hit and j missed (a
        view of the state: writable, as the reference's lists)."""
        self._S = np.zeros((0, rows), np.int64)
        self._T = np.zeros(1, np.int64)
        self._grow_slots(min(1024, self.hist_limit + k + 2))
        self._HF = np.zeros((k, 0))
        self._HI = np.zeros((k, 0, K.H_ROWS), np.int64)
        self._reserve = self.cap + 8           # set-aside scratch (duel_kernels._short)
        self._grow_heaps(min(2 * self.cap + 64, 1024) + self._reserve)
        self._ints = np.zeros(96, np.int64)
        self._chain = np.zeros(32, np.int64)
        warm_up()

    # -- state read back ---------------------------------------------------------------------
    @property
    def choice(self) -> int:
        return int(self._G[K.G_CHOICE])

    @choice.setter
    def choice(self, c: int) -> None:
        self._G[K.G_CHOICE] = c

    @property
    def switches(self) -> int:
        return int(self._G[K.G_SWITCHES])

    @property
    def fixed(self) -> int | None:
        f = int(self._G[K.G_FIXED])
        return None if f < 0 else f

    @fixed.setter
    def fixed(self, c: int | None) -> None:
        self._G[K.G_FIXED] = -1 if c is None else c

    @property
    def tails_dead(self) -> bool:
        return bool(self._G[K.G_TAILS_DEAD])

    @property
    def now(self) -> int:
        return int(self._G[K.G_NOW])

    def _choose(self) -> None:
        K.choose(self._G, self._F)

    # -- room ---------------------------------------------------------------------------------
    def _grow_slots(self, n: int) -> None:
        S = self._S
        have = S.shape[0]
        # NOTE: doubling, but never past what the history can hold (hist_limit entries, plus
        # the k + 1 a trim may keep, plus a call's own new ones: `_grow` asks for those).
        size = max(n, min(2 * have, self.hist_limit + self._k + 2 + 64))
        new = np.zeros((size, S.shape[1]), np.int64)
        new[:have] = S
        self._S = new
        self._T = np.zeros(1 << (2 * size - 1).bit_length(), np.int64)     # load <= 1/2
        K.rebuild_table(self._T, self._S, self._G)

    def _grow_heaps(self, n: int) -> None:
        HF, HI = self._HF, self._HI
        have = HF.shape[1]
        size = max(n, 2 * have)
        live = int(self._G[K.G_HEAPMAX])
        nf = np.zeros((self._k, size))
        ni = np.zeros((self._k, size, K.H_ROWS), np.int64)
        nf[:, :live] = HF[:, :live]
        ni[:, :live] = HI[:, :live]
        self._HF, self._HI = nf, ni

    def _grow(self, n: int) -> None:
        """Room for a call that handles n keys (a kernel answered NEED_ROOM; see
        duel_kernels._short)."""
        G = self._G
        if self._S.shape[0] - G[K.G_FRESH] < n:
            self._grow_slots(int(G[K.G_FRESH]) + n)
        need = int(G[K.G_HEAPMAX]) + 2 * n + self._reserve
        if need > self._HF.shape[1]:
            self._grow_heaps(need)

    def _pack(self, keys: Sequence[bytes], *columns: Sequence[int]) -> tuple[bytes, np.ndarray]:
        n = len(keys)
        kb = _EMPTY.join(keys)
        if len(kb) != 16 * n:
            raise ValueError("duel keys are 16 bytes")
        ints = self._ints
        if len(ints) < len(columns) * n:
            ints = self._ints = np.zeros(2 * len(columns) * n, np.int64)
        if len(columns) == 2 and type(columns[0]) is list and type(columns[1]) is list:
            ints[:2 * n] = columns[0] + columns[1]        # one conversion
        else:
            for i, col in enumerate(columns):
                ints[i * n:(i + 1) * n] = col
        return kb, ints

    def _scratch(self, n: int) -> np.ndarray:
        if len(self._chain) < n:
            self._chain = np.zeros(2 * n, np.int64)
        return self._chain

    # -- uses ---------------------------------------------------------------------------------
    def hit(self, h: bytes, t: int, parent: bytes | None, depth: int) -> None:
        """Sampled key `h` was used at clock `t` (a hit in the live tier); `parent` is its
        nearest sampled ancestor."""
        self.hits([h], [t], [depth], parent)

    def hits(self, keys: Sequence[bytes], clocks: Sequence[int], depths: Sequence[int],
             parent: bytes | None, stop: int = -1) -> int:
        """`hit` of each key in order, each one's parent the one before (the first one's
        `parent`): the sampled blocks of one reused chain, root first. With `stop` >= 0, stops
        after the key that moved the choice off `stop`; returns the keys handled."""
        n = len(keys)
        if not n:
            return 0
        kb, ints = self._pack(keys, clocks, depths)
        phi, plo, pnone = _words(parent)
        while True:
            got = K.hits(self._S, self._T, self._G, self._F, self._HF, self._HI, kb, ints, n,
                         phi, plo, pnone, stop)
            if got != K.NEED_ROOM:
                return got
            self._grow(n)

    def publish(self, chain: list[tuple[bytes, int, int]], parent: bytes | None,
                tail: bool = False) -> None:
        """A new chain was published in the live tier: (key, clock, depth) of its sampled
        blocks, root first (as `duel.Duel.publish`)."""
        if chain:
            self.publish_keys([c[0] for c in chain], [c[1] for c in chain],
                              [c[2] for c in chain], parent, tail)

    def publish_keys(self, keys: Sequence[bytes], clocks: Sequence[int],
                     depths: Sequence[int], parent: bytes | None, tail: bool = False) -> None:
        """`publish` with the chain in columns."""
        n = len(keys)
        if not n:
            return
        kb, ints = self._pack(keys, clocks, depths)
        phi, plo, pnone = _words(parent)
        while K.publish(self._S, self._T, self._G, self._F, self._HF, self._HI, kb, ints, n,
                        phi, plo, pnone, tail, self._scratch(n)) == K.NEED_ROOM:
            self._grow(n)

    def first_announced(self, keys: Sequence[bytes], seen: Sequence[int]) -> int:
        """The first i whose key is in the history at a last use >= seen[i], or -1."""
        if not keys:
            return -1
        kb, ints = self._pack(keys, seen)
        return K.first_announced(self._S, self._T, kb, ints, len(keys))

    # -- a chain of blocks (the live policy's loops; see duel_kernels) ----------------------
    def hit_chain(self, keys: Sequence[bytes] | bytes, ids: np.ndarray, la: np.ndarray,
                  dep: np.ndarray, start: int, parent: bytes | None, mask: int, stop: int,
                  calls0: int, switched_at: int, cap: int) -> tuple[int, int]:
        """`hit` of the sampled keys among blocks start.. of a reused chain, root first
        (`ids`, their keys: a list, or joined in one bytes object; `la`, `dep`: the table's
        last-use and depth arrays): (the position after whose hit the choice moved off `stop`
        while the live policy may follow it, else len(ids); the chain's latest last use).
        See duel_kernels.hit_chain. TypeError, before any change, if a key is None."""
        n = len(ids)
        kb = keys if type(keys) is bytes else _EMPTY.join(keys)
        if len(kb) != 16 * n:
            raise ValueError("duel keys are 16 bytes")
        phi, plo, pnone = _words(parent)
        while True:
            pos = K.hit_chain(self._S, self._T, self._G, self._F, self._HF, self._HI, kb, ids,
                              la, dep, n, start, mask, phi, plo, pnone, stop, calls0,
                              switched_at, cap)
            if pos != K.NEED_ROOM:
                return pos, int(self._G[K.G_OUT])
            self._grow(n)

    def deepest_announced(self, keys: Sequence[bytes], ids: np.ndarray, la: np.ndarray,
                          mask: int) -> int:
        """Of a walk's blocks (deepest first), the first sampled one whose key is in the
        history at a last use >= its own last use, or -1."""
        kb = _EMPTY.join(keys)
        if len(kb) != 16 * len(keys):
            raise ValueError("duel keys are 16 bytes")
        return K.deepest_announced(self._S, self._T, kb, ids, la, len(keys), mask)

    def walk_publish(self, keys: Sequence[bytes], ids: np.ndarray, la: np.ndarray,
                     born: np.ndarray, dep: np.ndarray, mask: int,
                     parent: bytes | None) -> int:
        """A walk's blocks, deepest first: the sampled ones below the deepest announced one
        are published, root first (see duel_kernels.walk_publish); returns how many."""
        n = len(keys)
        kb = _EMPTY.join(keys)
        if len(kb) != 16 * n:
            raise ValueError("duel keys are 16 bytes")
        phi, plo, pnone = _words(parent)
        while True:
            got = K.walk_publish(self._S, self._T, self._G, self._F, self._HF, self._HI, kb,
                                 ids, la, born, dep, n, mask, phi, plo, pnone,
                                 self._scratch(2 * n))
            if got != K.NEED_ROOM:
                return got
            self._grow(n)

    # -- inspection (tests; O(entries)) ----------------------------------------------------------
    @property
    def hist(self) -> OrderedDict[bytes, list]:
        """A snapshot of the history, oldest first: key -> [uses, first, last, parent key,
        depth, tail], as the reference's."""
        S, out = self._S, OrderedDict()
        s = int(self._G[K.G_HEAD])
        while s >= 0:
            parent = None if S[s, K.PNONE] else _key(S[s, K.PHI], S[s, K.PLO])
            out[_key(S[s, K.KHI], S[s, K.KLO])] = [int(S[s, K.USES]), int(S[s, K.FIRST]),
                                                 int(S[s, K.LAST]), parent,
                                                 int(S[s, K.DEPTH]), int(S[s, K.TAIL])]
            s = int(S[s, K.NEXT])
        return out

    @property
    def minis(self) -> list[MiniView]:
        """Snapshots of the mini caches, in expert order."""
        S, k, out = self._S, self._k, []
        cols = []
        s = int(self._G[K.G_HEAD])
        while s >= 0:
            cols.append(s)
            s = int(S[s, K.NEXT])
        for m in range(k):
            g = K.G_MINI + K.M_STRIDE * m
            lru = self._G[g + K.M_KIND] == 0
            n = int(self._G[g + K.M_HEAPN])
            keys = {s: _key(S[s, K.KHI], S[s, K.KLO]) for s in cols}
            res = S[:, K.RES0 + m]
            kids = S[:, K.RES0 + k + m]
            if lru:
                view = MiniView("lru", self.cap, {keys[s] for s in cols if res[s]})
                view.heap = [(self._HF[m, i], int(self._HI[m, i, K.H_NEGD]),
                              _key(self._HI[m, i, K.H_A], self._HI[m, i, K.H_B]))
                             for i in range(n)]
            else:
                view = MiniView("credit", self.cap, {keys[s]: int(res[s]) for s in cols
                                                     if res[s]},
                                {keys[s]: int(kids[s]) for s in cols if kids[s]})
                view.heap = [(self._HF[m, i], int(self._HI[m, i, K.H_NEGD]),
                              int(self._HI[m, i, K.H_A]), int(self._HI[m, i, K.H_B]))
                             for i in range(n)]
            out.append(view)
        return out

    @property
    def lifetimes(self) -> list[float]:
        """Each mini cache's measured turnover time."""
        return [float(self._F[K.F_MINI + K.FM_STRIDE * m + K.FM_LIFETIME])
                for m in range(self._k)]
