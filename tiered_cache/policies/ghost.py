"""`Ghost`: the adaptive policy's memory of evicted content, in arrays; and its eviction run.

Content key -> (uses, first use, publication, hits) of blocks evicted from the tier, in two
generations of `half` entries each: entries go to the current generation, and when it holds
`half` the old one is dropped and the current one becomes the old one. A lookup asks the
current generation, then the old one. (What `adaptive` kept in two dicts of tuples: the same
entries, the same answers.)

Why arrays: the ghost holds up to 32 entries per slot of the tier (`reuse_credit` argues the
number), and a dict entry with its tuple, three ints and the key it keeps alive cost about 250
bytes: ~8 KB per cached block once the tier has turned over, 25 times what the block itself
costs. Here an entry is 44 bytes in open-addressing tables (load at most 0.7, so 63 bytes a cell
when full): the key's 16
bytes as two int64 words, uses and hits as int32, the two clocks as int64, and a generation
stamp per cell, so dropping a generation is a new stamp, not a pass over the cells.

`take_run` is `AdaptivePolicy.offer` over a chain leaving the tier (`offer_run`), compiled:
the ghost lookups and filings, the priorities and the comparison with the heap's best entry
for a whole run in one call.

NOTE: numba compiles the kernels once per installation and source change (cached on disk) and
every process loads them when the first `Ghost` is built, never inside a hook under the lock.
"""

from __future__ import annotations

import math

import numpy as np

from tiered_cache.jit import njit
from tiered_cache.policies.duel_kernels import _hash, _word

LOAD = 0.7
"""Highest load of a generation's table."""

# fields of V (int64): first use, publication; of W (int32): uses, hits
_FIRST, _BORN = 0, 1
_USES, _HITS = 0, 1
# G: the current generation (0/1), entries in it, half, stamps of generations 0 and 1
_CUR, _N, _HALF, _STAMP0 = 0, 1, 2, 3


@njit(cache=True)
def _find(K, S, g, stamp, size, hi, lo):
    """Cell of key (hi, lo) in generation g, or -(cell + 1) of the free cell ending its
    probe."""
    i = _hash(hi, lo) % size
    while S[g, i] == stamp:
        if K[g, i, 0] == hi and K[g, i, 1] == lo:
            return i
        i += 1
        if i == size:
            i = 0
    return -(i + 1)


@njit(cache=True)
def _lookup(G, K, S, hi, lo):
    """(generation, cell) of the key's entry, the current generation first; (-1, -1) if none."""
    size = S.shape[1]
    g = G[_CUR]
    for _ in range(2):
        i = _find(K, S, g, G[_STAMP0 + g], size, hi, lo)
        if i >= 0:
            return g, i
        g = 1 - g
    return -1, -1


@njit(cache=True)
def get(G, K, S, V, W, kb, out):
    """The entry of key kb[:16] into out (uses, first, born, hits): True if there is one."""
    g, i = _lookup(G, K, S, _word(kb, 0), _word(kb, 8))
    if g < 0:
        return False
    out[0] = W[g, i, _USES]
    out[1] = V[g, i, _FIRST]
    out[2] = V[g, i, _BORN]
    out[3] = W[g, i, _HITS]
    return True


@njit(cache=True)
def _put(G, K, S, V, W, hi, lo, uses, first, born, hits):
    g = G[_CUR]
    stamp = G[_STAMP0 + g]
    i = _find(K, S, g, stamp, S.shape[1], hi, lo)
    if i < 0:
        i = -i - 1
        S[g, i] = stamp
        K[g, i, 0] = hi
        K[g, i, 1] = lo
        G[_N] += 1
    W[g, i, _USES] = uses
    V[g, i, _FIRST] = first
    V[g, i, _BORN] = born
    W[g, i, _HITS] = hits
    if G[_N] >= G[_HALF]:               # the old generation goes, the current one ages
        old = 1 - g
        G[_STAMP0 + old] = max(G[_STAMP0], G[_STAMP0 + 1]) + 1
        G[_CUR] = old
        G[_N] = 0


@njit(cache=True)
def put(G, K, S, V, W, kb, uses, first, born, hits):
    """Key kb[:16] -> (uses, first, born, hits) in the current generation."""
    _put(G, K, S, V, W, _word(kb, 0), _word(kb, 8), uses, first, born, hits)


@njit(cache=True)
def entries(G, K, S, V, W, g, out_keys, out_vals):
    """Generation g's entries (cell order): keys into out_keys (n, 2), values into out_vals
    (n, 4: uses, first, born, hits); returns n."""
    n = 0
    stamp = G[_STAMP0 + g]
    for i in range(S.shape[1]):
        if S[g, i] == stamp:
            out_keys[n, 0] = K[g, i, 0]
            out_keys[n, 1] = K[g, i, 1]
            out_vals[n, 0] = W[g, i, _USES]
            out_vals[n, 1] = V[g, i, _FIRST]
            out_vals[n, 2] = V[g, i, _BORN]
            out_vals[n, 3] = W[g, i, _HITS]
            n += 1
    return n


@njit(cache=True)
def take_run(G, K, S, V, W, kb, run, n, hits, born, last, parent, gen, m, gaps, lifetime,
             has_top, top_p, top_d, spare, depth, left, out):
    """`AdaptivePolicy.offer`'s common case (the exposed parent of the last victim, one tier,
    nothing to re-key, no heap being drained) for run[0], run[1], ... in turn, each run[i+1]
    the parent of run[i], while each is taken: its uses from the ghost, its priority under
    the expert (m, gaps; the tier's `lifetime`), taken iff below the heap's best entry
    (has_top, top_p, top_d; never below an entry keyed as a spare copy, under `spare`), then
    filed in the ghost. Stops before a block that would not be
    taken, and after `left` blocks (the turnover's batch is due: the caller reports it).
    Returns how many were taken; out[0], out[1]: the last one's parent and its generation."""
    out[0] = -1
    out[1] = -1
    for i in range(min(n, left)):
        b = run[i]
        hi, lo = _word(kb, 16 * i), _word(kb, 16 * i + 8)
        h = hits[b]
        t0 = born[b]
        g, c = _lookup(G, K, S, hi, lo)
        if g < 0:
            uses, first = h + 1, t0
        elif V[g, c, _BORN] == t0:
            uses, first = W[g, c, _USES] - W[g, c, _HITS] + h, V[g, c, _FIRST]
        else:
            uses, first = W[g, c, _USES] + h + 1, V[g, c, _FIRST]
        t = last[b]
        p = float(t)
        if m != 0.0 and uses > 1 and t > first:
            cr = m * lifetime * math.log2(uses)
            cap = gaps * (t - first) / (uses - 1)
            p += cr if cr < cap else cap
        if has_top:
            d = -depth[b]
            if top_p < p or (top_p == p and top_d <= d) or top_p < spare:
                return i
        q = parent[b]
        out[0] = q
        if q >= 0:
            out[1] = gen[q]
        _put(G, K, S, V, W, hi, lo, uses, first, t0, h)
    return min(n, left)


class Ghost:
    """Content key -> (uses, first use, publication, hits), two generations of `half` entries
    (see the module docstring). `get` answers a tuple or None, as the dicts did."""

    def __init__(self, half: int) -> None:
        self._alloc(max(1, half))
        self._out = np.zeros(4, np.int64)
        warm_up()

    def _alloc(self, half: int) -> None:
        size = max(16, math.ceil(half / LOAD) + 1)
        self.G = np.zeros(_STAMP0 + 2, np.int64)
        self.G[_HALF] = half
        self.G[_STAMP0:] = (1, 2)
        self.K = np.zeros((2, size, 2), np.int64)
        self.S = np.zeros((2, size), np.int32)
        self.V = np.zeros((2, size, 2), np.int64)
        self.W = np.zeros((2, size, 2), np.int32)

    @property
    def half(self) -> int:
        return int(self.G[_HALF])

    def resize(self, half: int) -> None:
        """Generations of `half` entries from now on (the tier was resized); the entries
        stay."""
        half = max(1, half)
        if math.ceil(half / LOAD) + 1 <= self.S.shape[1]:
            self.G[_HALF] = half
            return
        old, cur = self.generation(1 - int(self.G[_CUR])), self.generation(int(self.G[_CUR]))
        self._alloc(half)
        for gen in (old, cur):          # the old one first: it becomes the old one again
            for key, v in gen.items():
                self.put(key, *v)
            if gen is old:
                self.G[_CUR] = 1
                self.G[_N] = 0

    def get(self, key: bytes) -> tuple[int, int, int, int] | None:
        out = self._out
        if not get(self.G, self.K, self.S, self.V, self.W, key, out):
            return None
        return int(out[0]), int(out[1]), int(out[2]), int(out[3])

    def put(self, key: bytes, uses: int, first: int, born: int, hits: int) -> None:
        put(self.G, self.K, self.S, self.V, self.W, key, uses, first, born, hits)

    def generation(self, g: int) -> dict[bytes, tuple[int, int, int, int]]:
        """Generation g's entries (0/1; `G[0]` names the current one), as a dict (tests)."""
        n = self.S.shape[1]
        keys, vals = np.zeros((n, 2), np.int64), np.zeros((n, 4), np.int64)
        m = entries(self.G, self.K, self.S, self.V, self.W, g, keys, vals)
        return {int(k[0]).to_bytes(8, "big", signed=True) + int(k[1]).to_bytes(8, "big",
                                                                              signed=True):
                tuple(int(x) for x in v) for k, v in zip(keys[:m], vals[:m])}

    def current(self) -> dict[bytes, tuple[int, int, int, int]]:
        return self.generation(int(self.G[_CUR]))

    def old(self) -> dict[bytes, tuple[int, int, int, int]]:
        return self.generation(1 - int(self.G[_CUR]))

    def __len__(self) -> int:
        """Entries in the current generation."""
        return int(self.G[_N])

    def __eq__(self, other: object) -> bool:
        """The same entries in the same generations (tests)."""
        if not isinstance(other, Ghost):
            return NotImplemented
        return self.current() == other.current() and self.old() == other.old()

    __hash__ = None  # type: ignore[assignment]

    def nbytes(self) -> int:
        return self.K.nbytes + self.S.nbytes + self.V.nbytes + self.W.nbytes


def warm_up() -> None:
    """Compile (or load) the kernels, once per process."""
    global _warm
    if _warm:
        return
    _warm = True
    g = Ghost(2)
    k = bytes(16)
    g.put(k, 1, 2, 3, 0)
    g.get(k)
    g.current()
    ids = np.zeros(1, np.intp)
    col = np.zeros(1, np.int64)
    i32 = np.zeros(1, np.int32)
    u32 = np.zeros(1, np.uint32)
    take_run(g.G, g.K, g.S, g.V, g.W, k, ids, 1, col, col, col, i32, u32, 0.0, 2.0, 0.0,
             True, 0.0, 0, -1.0, i32, 1, np.zeros(2, np.int64))


_warm = False
