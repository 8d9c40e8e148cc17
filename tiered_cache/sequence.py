"""A request's view of the cache: its tokens, its block table, and how far each layer is written."""

from __future__ import annotations

import itertools

import numpy as np

from tiered_cache.block import Block

_ids = itertools.count()


class Sequence:
    """Handle returned by `TieredKVCache.open`. Read-only for callers.

    `blocks[i]` covers tokens `[i * block_size, (i + 1) * block_size)`; the last block may be
    partial. Blocks `[0, num_cached_tokens // block_size)` came from the cache; the rest are the
    sequence's own (private until full and written in every layer, then published).
    """

    def __init__(self, owner: int, root: bytes, tokens: np.ndarray, num_layers: int,
                 salt: str | bytes | None, adapter_id: str | None) -> None:
        self.id = next(_ids)
        self.owner = owner                      # id() of the cache that opened it
        self.root = root                        # key of the empty prefix (namespace + salt)
        self.root_id = -1                       # id of that namespace + salt (see hashing.root)
        self.salt = salt
        self.adapter_id = adapter_id
        self._tokens = np.empty(max(len(tokens), 16), dtype=np.int32)
        self._tokens[:len(tokens)] = tokens
        self.num_tokens = len(tokens)
        self.blocks: list[Block] = []
        self.keys: list[bytes] = []             # chained keys of the leading full blocks
        self.num_cached_tokens = 0
        self.cached_tokens_by_tier: dict[str, int] = {}
        self.written = [0] * num_layers         # tokens written so far, per layer
        self.num_published = 0                  # leading blocks that are published (or tried)
        self.chain: Block | None | bool = None  # published block standing for the last one
        self.pending: list = []                 # LayerReadiness of promotions it waits on
        self.writing: set[int] = set()          # layers with a write() copying right now
        self.closed = False
        self.collided = False                   # open() met a key whose block differed

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
