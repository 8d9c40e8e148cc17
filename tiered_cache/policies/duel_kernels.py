"""The duel's mini caches and scores over arrays, compiled: the loops of `duel_arrays.ArrayDuel`.

Operation for operation the algorithm of `duel.Duel` and `shadow.LruMini` / `shadow.MiniCache`
(the readable reference, kept beside it and checked against it use by use in
tests/policies/test_duel_arrays.py); only the containers differ:

- a sampled key's history entry is a *slot*: a row of `S` (fields below); the key itself is
  two int64 words (`KHI`, `KLO`: its 16 bytes, big-endian halves) and a slot is found by an
  open-addressing hash table `T` (slot + 1 per cell, 0 empty, linear probing, deletion by
  backward shift);
- the history's order (an OrderedDict in the reference) is a doubly linked list through the
  slots (`PREV`, `NEXT`), oldest first; a slot freed by `_trim` goes on a free list;
- a mini cache's resident set and child counts are rows of `S` (`RES0 + m`, `RES0 + k + m`):
  0 is "absent" for both (the reference's dicts hold no zero counts), -1 a resident key with no
  heap entry, else the serial of its live heap entry;
- each mini cache's heap is row m of `HF` (the priority) and `HI` (the rest; the last
  `cap + 2` columns of a row are scratch for entries set aside while evicting), lowest first with
  the reference's tuple order. A credit expert's entry is (priority, -depth, serial, slot): the
  serial is unique, so it decides every tie, and an entry is live while its slot's resident
  value is its serial (a reused slot's key has other serials). LRU's is (last use, -depth,
  key words): ties go to the key's bytes, as in the reference, and the key is found by its
  words (the reference looks it up by bytes). Both compare as (float, int, then two words
  unsigned).

NOTE: parents are named by their key (`PHI`, `PLO`, `PNONE`), never by slot: a parent's entry
may be trimmed and come back in another slot while a child's entry still names it, exactly
as the reference's entries name their parent by bytes.

NOTE: one divergence, by design. The reference drops the oldest history entries even while a
chain being published still holds them (a sampled chain longer than the history, impossible
for a tier at least 1/32 of its largest request); here an entry touched by the current call
(`STAMP`) is never trimmed during that call, so no slot is reused under it.

Everything is int64 / float64; every function is compiled once and cached on disk (`cache=True`).
"""

from __future__ import annotations

import math

import numpy as np

from tiered_cache.jit import njit

# -- fields of S (one row per slot) -----------------------------------------------------------
KHI, KLO, USES, FIRST, LAST, DEPTH, TAIL, PHI, PLO, PNONE, PREV, NEXT, STAMP = range(13)
RES0 = 13
"""Fields RES0 + m: mini cache m's resident set; RES0 + k + m: its child counts."""

# -- G: int64 globals ---------------------------------------------------------------------------
(G_K, G_CAP, G_HLIMIT, G_WINDOW, G_USES, G_NOW, G_CHOICE, G_SWITCHES, G_FIXED, G_TAILS_DEAD,
 G_HEAD, G_TAIL, G_HLEN, G_FREE, G_FRESH, G_NSLOTS, G_STAMP, G_HEAPMAX, G_OUT) = range(19)
G_MINI = 20
"""Per mini cache m, at G_MINI + M_STRIDE * m + field:"""
M_KIND, M_RESN, M_SERIAL, M_HEAPN, M_GONE, M_BATCH, M_SINCE = range(7)
M_STRIDE = 8

# -- F: float64 globals -------------------------------------------------------------------------
F_Z, F_TAILS0, F_TAILS1, F_ONCE0, F_ONCE1 = range(5)
F_MINI = 8
"""Per mini cache m, at F_MINI + FM_STRIDE * m + field:"""
FM_LIFETIMES, FM_GAPS, FM_LIFETIME = range(3)
FM_STRIDE = 4
# the scores wins[i][j] follow at F_MINI + FM_STRIDE * k, row-major

# -- fields of HI (HI[m, i]: heap m's entry i) ---------------------------------------------
H_NEGD, H_A, H_B = range(3)
"""(-depth, serial, slot) for a credit expert's entries, (-depth, key hi, key lo) for LRU's."""
H_ROWS = 3

TAIL_FIRST = 2.0**38        # shadow.TAIL_FIRST
_M1 = np.uint64(0x9E3779B97F4A7C15)
_M2 = np.uint64(0xBF58476D1CE4E5B9)


def layout(k: int) -> tuple[int, int, int]:
    """(rows of S, length of G, length of F) for k mini caches."""
    return RES0 + 2 * k, G_MINI + M_STRIDE * k, F_MINI + FM_STRIDE * k + k * k


# ---------------------------------------------------------------------------- keys and the table


@njit(cache=True, inline="always")
def _hash(hi, lo):
    x = np.uint64(hi) ^ (np.uint64(lo) * _M1)
    x ^= x >> np.uint64(29)
    x *= _M2
    x ^= x >> np.uint64(32)
    return np.int64(x >> np.uint64(1))


@njit(cache=True, inline="always")
def _word(kb, off):
    """The big-endian int64 (bit pattern) of kb[off:off + 8]."""
    x = np.uint64(0)
    for j in range(8):
        x = (x << np.uint64(8)) | np.uint64(kb[off + j])
    return np.int64(x)


@njit(cache=True)
def _find(T, S, hi, lo):
    mask = T.shape[0] - 1
    i = _hash(hi, lo) & mask
    while True:
        v = T[i]
        if v == 0:
            return -1
        s = v - 1
        if S[s, KHI] == hi and S[s, KLO] == lo:
            return s
        i = (i + 1) & mask


@njit(cache=True)
def _table_add(T, S, s):
    mask = T.shape[0] - 1
    i = _hash(S[s, KHI], S[s, KLO]) & mask
    while T[i] != 0:
        i = (i + 1) & mask
    T[i] = s + 1


@njit(cache=True)
def _table_remove(T, S, s):
    mask = T.shape[0] - 1
    i = _hash(S[s, KHI], S[s, KLO]) & mask
    while T[i] != s + 1:
        i = (i + 1) & mask
    j = i
    while True:                         # backward shift: no tombstones
        j = (j + 1) & mask
        v = T[j]
        if v == 0:
            break
        h = _hash(S[v - 1, KHI], S[v - 1, KLO]) & mask
        if i <= j:
            if i < h <= j:
                continue
        elif h <= j or h > i:
            continue
        T[i] = v
        i = j
    T[i] = 0


@njit(cache=True)
def rebuild_table(T, S, G):
    """Every live slot into an empty table `T` (after the arrays grew)."""
    T[:] = 0
    s = G[G_HEAD]
    while s >= 0:
        _table_add(T, S, s)
        s = S[s, NEXT]


# ---------------------------------------------------------------------------- the history


@njit(cache=True, inline="always")
def _append(S, G, s):
    t = G[G_TAIL]
    S[s, PREV] = t
    S[s, NEXT] = -1
    if t >= 0:
        S[t, NEXT] = s
    else:
        G[G_HEAD] = s
    G[G_TAIL] = s
    G[G_HLEN] += 1


@njit(cache=True, inline="always")
def _unlink(S, G, s):
    p, n = S[s, PREV], S[s, NEXT]
    if p >= 0:
        S[p, NEXT] = n
    else:
        G[G_HEAD] = n
    if n >= 0:
        S[n, PREV] = p
    else:
        G[G_TAIL] = p
    G[G_HLEN] -= 1


@njit(cache=True)
def _trim(S, T, G):
    """Duel._trim: the oldest entry goes, unless a mini cache holds it (then it moves to the
    end), at most k + 1 tries."""
    k = G[G_K]
    for _ in range(k + 1):
        s = G[G_HEAD]
        _unlink(S, G, s)
        held = S[s, STAMP] == G[G_STAMP]
        for m in range(k):
            if S[s, RES0 + m] != 0:
                held = True
                break
        if not held:
            _table_remove(T, S, s)
            S[s, NEXT] = G[G_FREE]
            G[G_FREE] = s
            return
        _append(S, G, s)


@njit(cache=True)
def _record(S, T, G, F, hi, lo, t, phi, plo, pnone, depth):
    """Duel._record: the slot of key (hi, lo) after a use at clock t; -1 if that use was
    announced already (t <= its last use)."""
    s = _find(T, S, hi, lo)
    if s < 0:
        s = G[G_FREE]
        if s >= 0:
            G[G_FREE] = S[s, NEXT]
        else:
            s = G[G_FRESH]
            G[G_FRESH] = s + 1
        S[s, KHI] = hi
        S[s, KLO] = lo
        S[s, USES] = 1
        S[s, FIRST] = t
        S[s, LAST] = t
        S[s, PHI] = phi
        S[s, PLO] = plo
        S[s, PNONE] = pnone
        S[s, DEPTH] = depth
        S[s, TAIL] = 0
        S[s, STAMP] = G[G_STAMP]
        for r in range(RES0, RES0 + 2 * G[G_K]):
            S[s, r] = 0
        _table_add(T, S, s)
        _append(S, G, s)
        if G[G_HLEN] > G[G_HLIMIT]:
            _trim(S, T, G)
        F[F_ONCE0] += 1.0
    elif t <= S[s, LAST]:
        return -1
    else:
        if S[s, USES] == 1:             # reused after one use: a success of its kind
            if S[s, TAIL]:
                F[F_TAILS1] += 1.0
            else:
                F[F_ONCE1] += 1.0
            S[s, TAIL] = 0
        S[s, USES] += 1
        S[s, LAST] = t
        S[s, STAMP] = G[G_STAMP]
        if G[G_TAIL] != s:
            _unlink(S, G, s)
            _append(S, G, s)
    if t > G[G_NOW]:
        G[G_NOW] = t
    return s


@njit(cache=True, inline="always")
def _parent_slot(S, T, s):
    """The slot of s's parent key, -1 if it has none or the key has no entry."""
    if S[s, PNONE]:
        return -1
    return _find(T, S, S[s, PHI], S[s, PLO])


# ---------------------------------------------------------------------------- heaps


@njit(cache=True, inline="always")
def _less(HF, HI, m, i, j):
    """Entry i of heap m before entry j: (priority, -depth, then A and B unsigned)."""
    a, b = HF[m, i], HF[m, j]
    if a != b:
        return a < b
    x, y = HI[m, i, H_NEGD], HI[m, j, H_NEGD]
    if x != y:
        return x < y
    for r in (H_A, H_B):
        u, v = np.uint64(HI[m, i, r]), np.uint64(HI[m, j, r])
        if u != v:
            return u < v
    return False


@njit(cache=True, inline="always")
def _swap(HF, HI, m, i, j):
    HF[m, i], HF[m, j] = HF[m, j], HF[m, i]
    for r in range(H_ROWS):
        HI[m, i, r], HI[m, j, r] = HI[m, j, r], HI[m, i, r]


@njit(cache=True)
def _sift_up(HF, HI, m, i):
    while i > 0:
        p = (i - 1) >> 1
        if _less(HF, HI, m, i, p):
            _swap(HF, HI, m, i, p)
            i = p
        else:
            return


@njit(cache=True)
def _sift_down(HF, HI, m, i, n):
    while True:
        c = 2 * i + 1
        if c >= n:
            return
        if c + 1 < n and _less(HF, HI, m, c + 1, c):
            c += 1
        if _less(HF, HI, m, c, i):
            _swap(HF, HI, m, c, i)
            i = c
        else:
            return


@njit(cache=True)
def _push(HF, HI, G, m, p, negd, a, b):
    g = G_MINI + M_STRIDE * m
    n = G[g + M_HEAPN]
    if n >= HF.shape[1] - G[G_CAP] - 2:
        raise IndexError("duel heap full: the caller reserves room before each call")
    HF[m, n] = p
    HI[m, n, H_NEGD] = negd
    HI[m, n, H_A] = a
    HI[m, n, H_B] = b
    G[g + M_HEAPN] = n + 1
    _sift_up(HF, HI, m, n)


@njit(cache=True)
def _pop_to(HF, HI, G, m, dst):
    """Move the top entry of heap m to column `dst` (past the end) and restore the heap."""
    g = G_MINI + M_STRIDE * m
    n = G[g + M_HEAPN] - 1
    _copy(HF, HI, m, 0, dst)
    if n > 0:
        _copy(HF, HI, m, n, 0)
    G[g + M_HEAPN] = n
    _sift_down(HF, HI, m, 0, n)


@njit(cache=True, inline="always")
def _copy(HF, HI, m, src, dst):
    HF[m, dst] = HF[m, src]
    for r in range(H_ROWS):
        HI[m, dst, r] = HI[m, src, r]


@njit(cache=True)
def _heapify(HF, HI, m, n):
    for i in range(n // 2 - 1, -1, -1):
        _sift_down(HF, HI, m, i, n)


# ---------------------------------------------------------------------------- mini caches


@njit(cache=True)
def _turnover(G, F, m, now, n):
    """shadow.Turnover.evicted of mini cache m."""
    g = G_MINI + M_STRIDE * m
    f = F_MINI + FM_STRIDE * m
    cap = G[G_CAP]
    if G[g + M_SINCE] < 0:
        G[g + M_SINCE] = now
        G[g + M_BATCH] = max(16, cap // 8)
        return
    sample = (cap * max(1, now - G[g + M_SINCE])) / n
    w = min(1.0, n / cap)
    if F[f + FM_LIFETIME] == 0.0:
        F[f + FM_LIFETIME] = sample
    else:
        F[f + FM_LIFETIME] = (1 - w) * F[f + FM_LIFETIME] + w * sample
    G[g + M_SINCE] = now


@njit(cache=True)
def _count_gone(G, F, m, gone):
    g = G_MINI + M_STRIDE * m
    G[g + M_GONE] += gone
    if G[g + M_GONE] >= G[g + M_BATCH]:
        _turnover(G, F, m, G[G_NOW], G[g + M_GONE])
        G[g + M_GONE] = 0


@njit(cache=True)
def _set_res(S, G, m, s, value):
    """res[key] = value (value != 0), counting a newly resident key."""
    if S[s, RES0 + m] == 0:
        G[G_MINI + M_STRIDE * m + M_RESN] += 1
    S[s, RES0 + m] = value


@njit(cache=True)
def _credit_push(S, G, F, HF, HI, m, s):
    """MiniCache.push: key s is a candidate, ranked by its history."""
    g = G_MINI + M_STRIDE * m
    f = F_MINI + FM_STRIDE * m
    n = G[g + M_SERIAL] + 1
    G[g + M_SERIAL] = n
    _set_res(S, G, m, s, n)
    last = S[s, LAST]
    p = float(last)
    uses = S[s, USES]
    if uses > 1:
        span = last - S[s, FIRST]
        if span > 0:
            c = F[f + FM_LIFETIMES] * F[f + FM_LIFETIME] * math.log2(uses)
            cap = F[f + FM_GAPS] * span / (uses - 1)
            p += c if c < cap else cap
    elif S[s, TAIL] and G[G_TAILS_DEAD]:
        p -= TAIL_FIRST
    _push(HF, HI, G, m, p, -S[s, DEPTH], n, s)


@njit(cache=True)
def _credit_evict(S, T, G, F, HF, HI, m, pinned, has_pinned):
    """MiniCache.evict: down to capacity, lowest first, leaves only, none last used at
    `pinned` (set aside and put back)."""
    k = G[G_K]
    g = G_MINI + M_STRIDE * m
    cap = G[G_CAP]
    res, kids = RES0 + m, RES0 + k + m
    gone = 0
    hcap = HF.shape[1]
    aside = 0                           # set-aside entries sit at the end of the heap's row
    while G[g + M_RESN] > cap and G[g + M_HEAPN] > 0:
        dst = hcap - 1 - aside
        _pop_to(HF, HI, G, m, dst)
        v = HI[m, dst, H_B]
        if S[v, res] != HI[m, dst, H_A] or S[v, kids] != 0:
            continue                    # stale, or it has a resident child
        if has_pinned and S[v, LAST] == pinned:
            aside += 1
            continue
        S[v, res] = 0
        G[g + M_RESN] -= 1
        gone += 1
        ps = _parent_slot(S, T, v)
        if ps >= 0:
            c = S[ps, kids]
            if c > 1:
                S[ps, kids] = c - 1
            elif c == 1:                # its last resident child left: evictable again
                S[ps, kids] = 0
                _credit_push(S, G, F, HF, HI, m, ps)
    for i in range(aside):
        src = hcap - 1 - i
        n = G[g + M_HEAPN]
        _copy(HF, HI, m, src, n)
        G[g + M_HEAPN] = n + 1
        _sift_up(HF, HI, m, n)
    _count_gone(G, F, m, gone)
    n = G[g + M_HEAPN]
    # NOTE: the reference sheds at 4 * cap + 64; any point gives the same evictions (the heap's
    # order is total and shedding keeps every live entry), and half the room suffices here.
    if n > 2 * cap + 64:                # shed stale entries (amortised O(1) per push)
        w = 0
        for i in range(n):
            v = HI[m, i, H_B]
            if S[v, res] == HI[m, i, H_A] and S[v, kids] == 0:
                if w != i:
                    _copy(HF, HI, m, i, w)
                w += 1
        G[g + M_HEAPN] = w
        _heapify(HF, HI, m, w)


@njit(cache=True)
def _lru_evict(S, T, G, F, HF, HI, m):
    """LruMini.evict: oldest last use first; an entry older than its key's last use goes back
    in with that use (lazy re-keying)."""
    g = G_MINI + M_STRIDE * m
    cap = G[G_CAP]
    res = RES0 + m
    gone = 0
    while G[g + M_RESN] > cap and G[g + M_HEAPN] > 0:
        v = _find(T, S, HI[m, 0, H_A], HI[m, 0, H_B])
        if v >= 0 and S[v, LAST] > HF[m, 0]:
            HF[m, 0] = float(S[v, LAST])             # heapreplace: used since it was pushed
            _sift_down(HF, HI, m, 0, G[g + M_HEAPN])
            continue
        _pop_to(HF, HI, G, m, HF.shape[1] - 1)
        if v >= 0 and S[v, res] != 0:
            S[v, res] = 0
            G[g + M_RESN] -= 1
        gone += 1
    _count_gone(G, F, m, gone)


@njit(cache=True)
def _lru_push(S, G, HF, HI, m, s):
    _push(HF, HI, G, m, float(S[s, LAST]), -S[s, DEPTH], S[s, KHI], S[s, KLO])


@njit(cache=True)
def _mini_hit(S, T, G, F, HF, HI, m, s):
    """LruMini.hit / MiniCache.hit of key s: True if the mini cache held it."""
    k = G[G_K]
    g = G_MINI + M_STRIDE * m
    res = RES0 + m
    if G[g + M_KIND] == 0:              # LRU
        if S[s, res] != 0:
            return True
        _set_res(S, G, m, s, 1)
        _lru_push(S, G, HF, HI, m, s)
        if G[g + M_RESN] > G[G_CAP]:
            _lru_evict(S, T, G, F, HF, HI, m)
        return False
    kids = RES0 + k + m
    if S[s, res] != 0:
        if S[s, kids] == 0:             # a candidate: re-key it
            _credit_push(S, G, F, HF, HI, m, s)
        return True
    ps = _parent_slot(S, T, s)
    if ps >= 0 and S[ps, res] != 0:
        S[ps, kids] += 1
    _credit_push(S, G, F, HF, HI, m, s)
    if G[g + M_RESN] > G[G_CAP]:
        _credit_evict(S, T, G, F, HF, HI, m, S[s, LAST], True)
    return False


@njit(cache=True)
def _mini_publish(S, T, G, F, HF, HI, m, chain, n, ps):
    """LruMini.publish / MiniCache.publish of the slots chain[:n], root first (each one's parent
    the one before; the first one's parent has slot ps, -1 for none or absent): how many of
    them the mini cache held."""
    k = G[G_K]
    g = G_MINI + M_STRIDE * m
    res = RES0 + m
    j = 0
    while j < n and S[chain[j], res] != 0:
        j += 1
    if G[g + M_KIND] == 0:              # LRU
        for i in range(j, n):
            s = chain[i]
            if S[s, res] == 0:
                _set_res(S, G, m, s, 1)
            _lru_push(S, G, HF, HI, m, s)
        if G[g + M_RESN] > G[G_CAP]:
            _lru_evict(S, T, G, F, HF, HI, m)
        return j
    kids = RES0 + k + m
    if j == n:
        s = chain[n - 1]
        if S[s, kids] == 0:
            _credit_push(S, G, F, HF, HI, m, s)
        return j
    if j:
        ps = chain[j - 1]
    if ps >= 0 and S[ps, res] != 0:
        S[ps, kids] += 1
    for i in range(j, n - 1):           # each one's child follows: not evictable
        _set_res(S, G, m, chain[i], -1)
        S[chain[i], kids] = 1
    _credit_push(S, G, F, HF, HI, m, chain[n - 1])
    if G[g + M_RESN] > G[G_CAP]:
        _credit_evict(S, T, G, F, HF, HI, m, 0, False)
    return j


# ---------------------------------------------------------------------------- scores


@njit(cache=True)
def choose(G, F):
    """Duel._choose: a challenger replaces the incumbent when it beats it by z standard errors
    of their paired outcomes."""
    if G[G_FIXED] >= 0:
        G[G_CHOICE] = G[G_FIXED]
        return
    k = G[G_K]
    w = F_MINI + FM_STRIDE * k
    c = G[G_CHOICE]
    best, margin = c, 0.0
    z = F[F_Z]
    for i in range(k):
        if i == c:
            continue
        a, b = F[w + i * k + c], F[w + c * k + i]
        d = a - b
        if d > margin and d > z * math.sqrt(a + b):
            best, margin = i, d
    if best != c:
        G[G_CHOICE] = best
        G[G_SWITCHES] += 1


@njit(cache=True)
def _count(G, F, n):
    G[G_USES] += n
    if G[G_USES] >= G[G_WINDOW]:       # older evidence counts half
        G[G_USES] = 0
        k = G[G_K]
        w = F_MINI + FM_STRIDE * k
        for i in range(k * k):
            F[w + i] *= 0.5
        for i in (F_TAILS0, F_TAILS1, F_ONCE0, F_ONCE1):
            F[i] *= 0.5


@njit(cache=True)
def _hit(S, T, G, F, HF, HI, hi, lo, t, phi, plo, pnone, depth):
    """Duel.hit of one key."""
    s = _record(S, T, G, F, hi, lo, t, phi, plo, pnone, depth)
    if s < 0:
        return
    k = G[G_K]
    got = 0                             # bit m: mini cache m held it
    for m in range(k):
        if _mini_hit(S, T, G, F, HF, HI, m, s):
            got |= 1 << m
    if got != 0 and got != (1 << k) - 1:     # some expert hit where another missed
        w = F_MINI + FM_STRIDE * k
        for i in range(k):
            if got >> i & 1:
                for j in range(k):
                    if not got >> j & 1:
                        F[w + i * k + j] += 1.0
        choose(G, F)
    _count(G, F, 1)


@njit(cache=True)
def _publish(S, T, G, F, HF, HI, chain, n, tail):
    """Duel._publish of the recorded slots chain[:n]."""
    k = G[G_K]
    last = chain[n - 1]
    if tail and S[last, USES] == 1:
        S[last, TAIL] = 1
        F[F_ONCE0] -= 1.0
        F[F_TAILS0] += 1.0
        G[G_TAILS_DEAD] = 1 if ((F[F_TAILS1] + 0.5) / (F[F_TAILS0] + 1.0)
                                < (F[F_ONCE1] + 0.5) / (F[F_ONCE0] + 1.0)) else 0
    ps = _parent_slot(S, T, chain[0])
    held = np.empty(k, np.int64)
    for m in range(k):
        held[m] = _mini_publish(S, T, G, F, HF, HI, m, chain, n, ps)
    lo, hi = held.min(), held.max()
    if lo != hi:
        w = F_MINI + FM_STRIDE * k
        for i in range(k):
            a = held[i]
            if a > lo:
                for j in range(k):
                    if a > held[j]:
                        F[w + i * k + j] += float(a - held[j])
        choose(G, F)
    _count(G, F, n)


# ---------------------------------------------------------------------------- entry points

NEED_ROOM = -2
"""What an entry point returns, having changed nothing, when the arrays cannot take a call
that handles n keys: the caller grows them (`ArrayDuel._grow`) and calls again."""


@njit(cache=True, inline="always")
def _short(S, G, HF, n):
    """The arrays lack room for a call handling n keys: n new history entries, and in every
    heap 2n entries (a use pushes at most one, and one for a parent its eviction exposes)
    besides `cap + 8` columns of scratch."""
    return G[G_FRESH] + n > S.shape[0] or G[G_HEAPMAX] + 2 * n + G[G_CAP] + 8 > HF.shape[1]



@njit(cache=True)
def _done(G):
    """The longest heap, for the caller's room check before the next call."""
    top = 0
    for m in range(G[G_K]):
        top = max(top, G[G_MINI + M_STRIDE * m + M_HEAPN])
    G[G_HEAPMAX] = top


@njit(cache=True)
def hits(S, T, G, F, HF, HI, kb, ints, n, phi, plo, pnone, stop):
    """Duel.hit of n keys in order: key i is kb[16 i:16 i + 16], used at clock ints[i] with
    depth ints[n + i]; key i's parent is key i - 1, the first one's (phi, plo, pnone).

    Returns the number of keys handled: all n, or fewer when the choice moved off `stop`
    (>= 0) after one (the caller follows the new choice, then hands in the rest)."""
    if _short(S, G, HF, n):
        return NEED_ROOM
    G[G_STAMP] += 1
    for i in range(n):
        hi, lo = _word(kb, 16 * i), _word(kb, 16 * i + 8)
        _hit(S, T, G, F, HF, HI, hi, lo, ints[i], phi, plo, pnone, ints[n + i])
        phi, plo, pnone = hi, lo, 0
        if stop >= 0 and G[G_CHOICE] != stop:
            _done(G)
            return i + 1
    _done(G)
    return n


@njit(cache=True)
def publish(S, T, G, F, HF, HI, kb, ints, n, phi, plo, pnone, tail, chain):
    """Duel.publish of a new chain of n keys, root first (laid out as in `hits`; the first
    one's parent is (phi, plo, pnone)); `tail`: the last one is its request's last block.
    `chain`: scratch of at least n int64. Returns 0 (or NEED_ROOM)."""
    if _short(S, G, HF, n):
        return NEED_ROOM
    G[G_STAMP] += 1
    m = 0
    rest = n
    for i in range(n):
        hi, lo = _word(kb, 16 * i), _word(kb, 16 * i + 8)
        s = _record(S, T, G, F, hi, lo, ints[i], phi, plo, pnone, ints[n + i])
        phi, plo, pnone = hi, lo, 0
        if s < 0:                       # announced already (a walk seen twice): the rest
            rest = i + 1                # is no chain of fresh uses
            break
        chain[m] = s
        m += 1
    if m:
        _publish(S, T, G, F, HF, HI, chain, m, tail and rest == n and m == n)
    for i in range(rest, n):
        hi, lo = _word(kb, 16 * i), _word(kb, 16 * i + 8)
        _hit(S, T, G, F, HF, HI, hi, lo, ints[i], phi, plo, pnone, ints[n + i])
        phi, plo, pnone = hi, lo, 0
    _done(G)
    return 0


@njit(cache=True)
def first_announced(S, T, kb, ints, n):
    """The first i with key i (kb[16 i:16 i + 16]) in the history at a last use >= ints[i],
    or -1."""
    for i in range(n):
        s = _find(T, S, _word(kb, 16 * i), _word(kb, 16 * i + 8))
        if s >= 0 and S[s, LAST] >= ints[i]:
            return i
    return -1


@njit(cache=True)
def lookup(S, T, kb):
    """The slot of key kb[:16], or -1."""
    return _find(T, S, _word(kb, 0), _word(kb, 8))


# ---------------------------------------------------------------------------- a chain of blocks
# The live policy's own loops over the block table (`la`, `dep`, `born`, `par`, `hits`: numpy
# views of BlockTable fields), so it never steps through a chain in Python: `kb` holds the
# chain's keys, 16 bytes each, in the order of `ids`; a key is sampled when its first byte
# has no bit of `mask` set.


@njit(cache=True)
def hit_chain(S, T, G, F, HF, HI, kb, ids, la, dep, n, start, mask, phi, plo, pnone, stop,
              calls0, switched_at, cap):
    """Duel.hit of the sampled keys among blocks start..n-1 of a reused chain (root first;
    the first sampled one's parent is (phi, plo, pnone), each later one's the sampled one
    before it). Returns the position of the block after whose hit the choice moved off
    `stop` while the live policy may follow (`switched_at` < 0, or `calls0 + position + 1 -
    switched_at >= cap`: AdaptivePolicy._follow's pacing), else n. G[G_OUT]: the chain's
    latest last use."""
    if _short(S, G, HF, n):
        return NEED_ROOM
    G[G_STAMP] += 1
    latest = la[ids[0]]
    for i in range(n):
        if la[ids[i]] > latest:
            latest = la[ids[i]]
    G[G_OUT] = latest
    for i in range(start, n):
        if kb[16 * i] & mask:
            continue
        hi, lo = _word(kb, 16 * i), _word(kb, 16 * i + 8)
        b = ids[i]
        _hit(S, T, G, F, HF, HI, hi, lo, la[b], phi, plo, pnone, dep[b])
        phi, plo, pnone = hi, lo, 0
        if stop >= 0 and G[G_CHOICE] != stop and (
                switched_at < 0 or calls0 + i + 1 - switched_at >= cap):
            _done(G)
            return i
    _done(G)
    return n


@njit(cache=True)
def walk_up(par, hits, b, limit, out):
    """Block b and its ancestors while never hit, at most `limit` of them, into `out`
    (deepest first; `out` holds at least limit + 1): returns how many; out[limit] is the
    block the walk stopped at (-1: it passed the root)."""
    m = 0
    while b >= 0 and hits[b] == 0 and m < limit:
        out[m] = b
        m += 1
        b = par[b]
    out[limit] = b
    return m


@njit(cache=True)
def deepest_announced(S, T, kb, ids, la, n, mask):
    """The first sampled block from the deepest (position 0 of `ids`, deepest first) whose
    key is in the history at a last use >= its own last use, or -1."""
    for i in range(n):
        if kb[16 * i] & mask:
            continue
        s = _find(T, S, _word(kb, 16 * i), _word(kb, 16 * i + 8))
        if s >= 0 and S[s, LAST] >= la[ids[i]]:
            return i
    return -1


@njit(cache=True)
def walk_publish(S, T, G, F, HF, HI, kb, ids, la, born, dep, n, mask, phi, plo, pnone,
                 chain):
    """A walk's blocks, deepest first from the block it started at (`ids`, their keys in
    `kb`): the sampled ones below the deepest announced one (`deepest_announced`) go to
    `publish` root first, at their publication clocks, the announced one's key their parent
    (else (phi, plo, pnone)), the tail flag set when the walk's first block is one of them.
    `chain`: scratch of at least 2n. Returns how many were handed in (or NEED_ROOM)."""
    if _short(S, G, HF, n):
        return NEED_ROOM
    cut = deepest_announced(S, T, kb, ids, la, n, mask)
    end = n
    if cut >= 0:
        end = cut
        phi, plo, pnone = _word(kb, 16 * cut), _word(kb, 16 * cut + 8), 0
    m = 0                               # positions of the sampled ones, root first
    for i in range(end - 1, -1, -1):
        if not kb[16 * i] & mask:
            chain[n + m] = i
            m += 1
    if m == 0:
        return 0
    G[G_STAMP] += 1
    tail = not (kb[0] & mask)
    k = 0
    brk = m
    for j in range(m):                  # Duel.publish
        i = chain[n + j]
        hi, lo = _word(kb, 16 * i), _word(kb, 16 * i + 8)
        b = ids[i]
        s = _record(S, T, G, F, hi, lo, born[b], phi, plo, pnone, dep[b])
        phi, plo, pnone = hi, lo, 0
        if s < 0:                       # announced already: the rest is no fresh chain
            brk = j + 1
            break
        chain[k] = s
        k += 1
    if k:
        _publish(S, T, G, F, HF, HI, chain, k, tail and brk == m and k == m)
    for j in range(brk, m):
        i = chain[n + j]
        hi, lo = _word(kb, 16 * i), _word(kb, 16 * i + 8)
        b = ids[i]
        _hit(S, T, G, F, HF, HI, hi, lo, born[b], phi, plo, pnone, dep[b])
        phi, plo, pnone = hi, lo, 0
    _done(G)
    return m
