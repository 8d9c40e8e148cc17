"""A request's view of the cache: its tokens, its block table (ids), how far each layer is written.

NOTE: a handle of plain ids. `block_ids[i]` names the block covering tokens
`[i * block_size, (i + 1) * block_size)`; what a block holds and where its copies are is the
control plane's (`BlockIndex.info`), so nothing in a sequence keeps an object of the index alive
or lets a caller change it.
"""

from __future__ import annotations

import itertools

import numpy as np

from tiered_cache.core.blocks import NO_BLOCK

_ids = itertools.count()

_NO_IDS = np.zeros(0, dtype=np.intp)

BROKEN = -2
"""`Sequence.chain` once a block could not be published: the rest of the sequence stays private."""


class Sequence:
    """Handle returned by `TieredKVCache.open`. Read-only for callers.

    Blocks `[0, num_cached_tokens // block_size)` came from the cache; the rest are the
    sequence's own (private until full and written in every layer, then published).
    """

    def __init__(self, owner: int, root: bytes, root_id: int, tokens: np.ndarray,
                 num_layers: int, salt: str | bytes | None, adapter_id: str | None) -> None:
        self.id = next(_ids)
        self.owner = owner                      # id() of the index that opened it
        self.root = root                        # key of the empty prefix (namespace + salt)
        self.root_id = root_id                  # id of that namespace + salt (see hashing.root)
        self.salt = salt
        self.adapter_id = adapter_id
        if len(tokens) >= 16:
            self._tokens = np.array(tokens, dtype=np.int32)     # a copy, in one call
        else:
            self._tokens = np.empty(16, dtype=np.int32)     # room to append into
            self._tokens[:len(tokens)] = tokens
        self.num_tokens = len(tokens)
        self.blocks: list[int] = []             # block ids; written only by the BlockIndex
        # NOTE: `open` matched blocks[:len(match_ids)], as an intp array (close reuses it).
        # Never rewritten: blocks only ever change after the ones `open` counted published.
        self.match_ids: np.ndarray = _NO_IDS
        self.keys: list[bytes] = []             # chained keys of the leading full blocks
        # NOTE: keys the match computed past its first miss, joined: those of blocks
        # ahead_at.. (a block's key depends only on the root and the tokens up to its end,
        # so they stay its keys, whoever computed the ones before). Publishing takes those
        # from len(keys) on while len(keys) falls inside them.
        self.ahead = b""
        self.ahead_at = -1
        self.num_cached_tokens = 0
        self.cached_tokens_by_tier: dict[str, int] = {}
        self.written = [0] * num_layers         # tokens written so far, per layer
        self.num_published = 0                  # leading blocks that are published (or tried)
        self.chain = NO_BLOCK                   # published block standing for the last one
        self.pending: list = []                 # LayerReadiness of promotions it waits on
        self.writing: set[int] = set()          # layers with a write() copying right now
        self.readers = 0                        # attention calls reading its blocks right now
        self.closed = False
        self.collided = False                   # open() met a key whose block differed
        self.reserve_last = False               # open(reserve_last=True): last token uncached
        # In-flight sharing (core/inflight.py):
        self.registered: list[bytes] = []       # keys of own blocks others may take
        self.waiters: list = []                 # inflight.Waiter of sequences taking them
        self.awaiting = -1                      # first own block, after blocks taken
        self.write_events: dict[int, object] = {}   # layer -> device event of its last write

    @property
    def block_ids(self) -> tuple[int, ...]:
        return tuple(self.blocks)

    @property
    def token_ids(self) -> np.ndarray:
        return self._tokens[:self.num_tokens]

    @property
    def num_written(self) -> int:
        """Tokens written in every layer."""
        return min(self.written) if self.written else self.num_tokens

    def extend(self, tokens: np.ndarray) -> None:
        need = self.num_tokens + len(tokens)
        if need > len(self._tokens):
            # Doubling keeps token-by-token decoding amortised O(1) per token.
            grown = np.empty(max(need, 2 * len(self._tokens)), dtype=np.int32)
            grown[:self.num_tokens] = self._tokens[:self.num_tokens]
            self._tokens = grown
        self._tokens[self.num_tokens:need] = tokens
        self.num_tokens = need

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return (f"Sequence(id={self.id}, {state}, tokens={self.num_tokens}, "
                f"cached={self.num_cached_tokens}, blocks={len(self.blocks)})")
