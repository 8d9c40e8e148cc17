"""Typed exceptions. Every public call that rejects its input raises one of these before it
changes any state, so a caught error leaves the cache exactly as it was."""

from __future__ import annotations


class TieredCacheError(Exception):
    """Base class of every error raised by tiered-cache."""


class ConfigError(TieredCacheError, ValueError):
    """A configuration key is unknown or its value is invalid. The message starts with the key
    path (`tiers.host.capacity: ...`)."""

    def __init__(self, path: str, message: str):
        self.path = path
        super().__init__(f"{path}: {message}" if path else message)


class InsufficientMemoryError(ConfigError):
    """What a configuration asks for does not fit in what this machine can give (memory or disk
    space), checked at start before anything was allocated. Its path names the key(s) that
    sized the tiers; its message the bytes asked and available. A ConfigError, not a
    CapacityError: no request can end the shortage, only another config (or `overcommit`)."""


class CapacityError(TieredCacheError):
    """A tier cannot hold what was asked: every slot is pinned or in flight."""

    transient: bool = False     # True when copies under way will free enough slots soon


class ShapeError(TieredCacheError, ValueError):
    """A tensor has the wrong shape, or a write goes past the sequence's declared tokens."""


class DTypeError(TieredCacheError, TypeError):
    """A tensor has the wrong dtype or device."""


class TokenError(TieredCacheError, ValueError):
    """Token ids are not a flat sequence of non-negative integers below 2**31."""


class LayerError(TieredCacheError, IndexError):
    """A layer index is outside [0, num_layers)."""


class SequenceClosedError(TieredCacheError):
    """A sequence was used after `close()`, or belongs to another cache."""


class BusySequenceError(TieredCacheError, RuntimeError):
    """A sequence is being written by another thread: the same layer written twice at once, or
    a close while a write is under way."""


class TierUnavailableError(TieredCacheError):
    """A tier's backing memory cannot be had here (managed memory without CUDA, a device that is
    not present)."""


class StorageDisabledError(TieredCacheError):
    """A data operation was called on a cache built with `storage: none` (metadata only)."""


class TransferError(TieredCacheError):
    """A copy between tiers failed; the block stays valid in its source tier."""


class PrefixAbortedError(TransferError):
    """Blocks this sequence shares with another open sequence that was computing them will
    never be written: that sequence closed first. Compute those tokens yourself (close the
    sequence and open it again)."""


class PromotionTimeout(TieredCacheError, TimeoutError):
    """A layer of an in-flight promotion did not land within the wait timeout."""


class CacheClosedError(TieredCacheError, RuntimeError):
    """The cache was shut down; every call after `shutdown()` raises this."""


class KVValueError(TieredCacheError, ValueError):
    """KV values the cache refuses to store: NaN or infinity (see `allow_non_finite_kv`)."""


class ArgumentError(TieredCacheError, ValueError, TypeError):
    """A call argument has the wrong type or is out of range (e.g. `resize("gpu", 0)`)."""


class IdentityError(TieredCacheError, ValueError):
    """KV would be reused or published under another identity than the one it was computed
    under: a forward whose attention mask or positions differ from those the sequence was
    opened with, KV computed from embeddings (no token ids to key it by), or KV written outside
    a forward of the model the sequence was opened for. Raised before anything is written."""


class UnsupportedError(TieredCacheError, NotImplementedError):
    """A use the integration cannot serve correctly, refused before anything is written:
    assisted decoding (which needs `crop`), beam search, layers that are not full attention."""
