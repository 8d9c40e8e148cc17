"""policies/ghost.py: the array ghost answers what the two dicts it replaced answered (current
generation first, a new one every `half` entries, resize keeping the entries), on random
streams of filings, lookups and resizes; `take_run` is checked against `offer` through real
caches (tests/policies/test_fast_paths.py, tests/test_policy_adaptive.py)."""

from __future__ import annotations

import random

import pytest

from tiered_cache.policies.ghost import Ghost


class DictGhost:
    """The reference: what AdaptivePolicy kept before (two dicts of tuples)."""

    def __init__(self, half: int) -> None:
        self.half, self.cur, self.old = half, {}, {}

    def get(self, key):
        return self.cur.get(key) or self.old.get(key)

    def put(self, key, *v):
        self.cur[key] = v
        if len(self.cur) >= self.half:
            self.old, self.cur = self.cur, {}


@pytest.mark.parametrize("seed", range(20))
def test_the_same_answers_as_two_dicts(seed):
    rng = random.Random(seed)
    half = rng.choice([1, 2, 5, 16, 100])
    g, d = Ghost(half), DictGhost(half)
    keys = [rng.randbytes(16) for _ in range(rng.choice([8, 50, 400]))]
    # keys that differ in one word only, and the all-zero key
    keys += [bytes(8) + k[8:] for k in keys[:4]] + [k[:8] + bytes(8) for k in keys[:4]]
    keys.append(bytes(16))
    for step in range(3000):
        r = rng.random()
        k = rng.choice(keys)
        if r < 0.45:
            v = (rng.randrange(1, 1 << 30), rng.randrange(-5, 1 << 62), rng.randrange(1 << 62),
                 rng.randrange(1 << 30))
            g.put(k, *v)
            d.put(k, *v)
        elif r < 0.995:
            assert g.get(k) == d.get(k), step
        else:
            half = rng.choice([1, 3, 16, 200, 1000])
            g.resize(half)
            d.half = half
        if step % 97 == 0:
            assert g.current() == d.cur and g.old() == d.old, step
            assert len(g) == len(d.cur)
    assert g.current() == d.cur and g.old() == d.old


def test_a_full_generation_never_loses_a_key():
    g = Ghost(1000)
    keys = [i.to_bytes(16, "big") for i in range(999)]
    for i, k in enumerate(keys):
        g.put(k, i + 1, i, i, 0)
    assert all(g.get(k) == (i + 1, i, i, 0) for i, k in enumerate(keys))
    g.put(bytes([1]) * 16, 1, 1, 1, 1)          # the 1000th: a new generation starts
    assert len(g) == 0 and len(g.old()) == 1000
    g.put(bytes([2]) * 16, 2, 2, 2, 2)
    assert g.get(keys[0]) == (1, 0, 0, 0) and len(g) == 1


def test_equality_is_by_entries():
    a, b = Ghost(4), Ghost(400)
    for g in (a, b):
        g.resize(4)
        g.put(bytes(16), 1, 2, 3, 4)
    assert a == b
    b.put(bytes([1]) * 16, 1, 1, 1, 1)
    assert a != b
