"""The machinery every config section shares: value checks that raise `ConfigError` with the
key's path, the `Section` base (a section knows its place in the tree) and `from_mapping`
(unknown keys refused with the closest valid one suggested, nested sections built recursively).

`tiered_cache.config` builds the whole tree from these; each tier kind (`tiered_cache.tiers`)
declares its own `tiers.<kind>` section with them, so that a new kind's section is accepted
without an edit of config.py. No torch, no other tiered_cache module than errors and sizing.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
from collections.abc import Mapping
from typing import Any, ClassVar, TypeGuard

from tiered_cache import sizing
from tiered_cache.errors import ConfigError
from tiered_cache.sizing import MAX_NUM_BLOCKS, short_repr

# value checks: each raises ConfigError(path, "expected ..., got <repr>")


def is_int(v: Any) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    """A finite int or float. An int is never passed to math.isfinite (float conversion of a
    400-digit int raises OverflowError); ints compare exactly with float bounds."""
    if is_int(v):
        return True
    return isinstance(v, float) and math.isfinite(v)


def positive_int(path: str, v: Any, hi: int) -> int:
    if not is_int(v) or v < 1:
        raise ConfigError(path, f"expected a positive integer, got {short_repr(v)}")
    if v > hi:
        raise ConfigError(path, f"expected a positive integer at most {hi:,}, got {short_repr(v)}")
    return v


def non_negative_int(path: str, v: Any, hi: int) -> int:
    if not is_int(v) or v < 0:
        raise ConfigError(path, f"expected a non-negative integer, got {short_repr(v)}")
    if v > hi:
        raise ConfigError(path, f"expected a non-negative integer at most {hi:,}, "
                                f"got {short_repr(v)}")
    return v


def positive_number(path: str, v: Any, hi: float) -> float:
    if not is_number(v) or v <= 0:
        raise ConfigError(path, f"expected a positive number, got {short_repr(v)}")
    if v > hi:
        raise ConfigError(path, f"expected a positive number at most {hi:,g}, got {short_repr(v)}")
    return float(v)


def fraction(path: str, v: Any, *, upper_open: bool = False) -> float:
    ok = is_number(v) and 0 < v and (v < 1 if upper_open else v <= 1)
    if not ok:
        interval = "(0, 1)" if upper_open else "(0, 1]"
        raise ConfigError(path, f"expected a number in {interval}, got {short_repr(v)}")
    return float(v)


def boolean(path: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise ConfigError(path, f"expected true or false, got {short_repr(v)}")
    return v


def choice(path: str, v: Any, choices: Any) -> str:
    if not isinstance(v, str) or v not in choices:
        listed = ", ".join(repr(c) for c in choices)
        raise ConfigError(path, f"expected one of {listed}, got {short_repr(v)}")
    return v


def size(path: str, v: Any) -> None:
    if v is not None:
        sizing.parse_size(v, path)


_PLAIN_KEY_RE = re.compile(r"[A-Za-z0-9_-]{1,80}", re.ASCII)


def key_text(key: Any) -> str:
    """A mapping key as it appears in an error path: a short word as is, anything else (an
    empty string, one with a dot or a newline, a megabyte string, an int of 5000 digits) as a
    short repr, so that the path stays one unambiguous line."""
    if isinstance(key, str) and _PLAIN_KEY_RE.fullmatch(key):
        return key
    return short_repr(key)


class Section:
    """Mixin: a config section that knows its key path in the tree."""

    _PATH: ClassVar[str] = ""
    _NESTED: ClassVar[dict[str, type]] = {}

    @classmethod
    def _key(cls, name: str) -> str:
        return f"{cls._PATH}.{name}" if cls._PATH else name

    @classmethod
    def _keys(cls) -> list[str]:
        """The keys this section accepts (a dataclass section: its init fields)."""
        return [f.name for f in dataclasses.fields(cls) if f.init]

    @classmethod
    def _nested_types(cls) -> Mapping[str, type]:
        """Key -> section class of the keys that are sections themselves."""
        return cls._NESTED

    @classmethod
    def _aliases(cls) -> Mapping[str, str]:
        """Other names users give some keys (alias -> key): an unknown alias suggests its key."""
        return {}

    def _nested(self, name: str) -> None:
        """Accept a nested section given as a plain mapping; reject anything else."""
        section_cls = self._nested_types()[name]
        value = getattr(self, name)
        if isinstance(value, section_cls):
            return
        if value is None:
            value = section_default(type(self), name)
        elif isinstance(value, Mapping):
            value = from_mapping(section_cls, value)
        else:
            raise ConfigError(self._key(name), not_a_mapping(value))
        setattr(self, name, value)


def section_default(cls: type, name: str) -> Any:
    """The default of a nested section field (what a missing or null section gets)."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    return f.default_factory()


def not_a_mapping(value: Any) -> str:
    return f"expected a mapping of keys, got {type(value).__name__} {short_repr(value)}"


def from_mapping(cls: type, data: Any) -> Any:
    """Build `cls` from a mapping: reject unknown keys (suggesting the closest valid one), build
    nested sections recursively, let `__post_init__` check the values. A missing key takes the
    dataclass default; a missing or null section takes its defaults."""
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        where = cls._PATH
        msg = not_a_mapping(data)
        raise ConfigError(where, msg if where else f"config: {msg}")
    valid = cls._keys()
    nested = cls._nested_types()
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if not isinstance(key, str) or key not in valid:
            raise unknown_key(cls, key, valid, aliases=cls._aliases())
        if key in nested:
            if value is None:  # `migrator:` with nothing under it: the section's defaults
                continue
            if not isinstance(value, nested[key]):
                if not isinstance(value, Mapping):
                    raise ConfigError(cls._key(key), not_a_mapping(value))
                value = from_mapping(nested[key], value)
        kwargs[key] = value
    return cls(**kwargs)


def unknown_key(cls: type, key: Any, valid: list[str],
                aliases: Mapping[str, str] | None = None) -> ConfigError:
    """The error for a key `cls` does not accept, with the closest valid key if one is close.
    `aliases`: other names of valid keys (`redis` -> `remote`), suggested before spelling."""
    path = cls._key(key_text(key))
    alias = (aliases or {}).get(key.lower()) if isinstance(key, str) else None
    close = [alias] if alias is not None else (
        difflib.get_close_matches(key, valid, n=1)
        if isinstance(key, str) and len(key) <= 80 else [])
    if close:
        return ConfigError(path, f"unknown key; did you mean {close[0]!r}?")
    listed = ", ".join(repr(k) for k in sorted(valid))
    return ConfigError(path, f"unknown key; valid keys are {listed}")


class TierSize:
    """Shared check of a slot tier's size: exactly one of capacity / num_blocks; the resize
    bounds. A sized section also says how many blocks it must have at least (`MIN_BLOCKS`) and
    what free space a `"%"` capacity is a share of (`free_bytes`): sizing.tier_num_blocks."""

    MIN_BLOCKS: ClassVar[int] = 0
    SLOT_WORD: ClassVar[str] = "blocks"
    """What its messages call a slot ("blocks" in memory, "slots" on disk)."""

    def free_bytes(self, config: Any, tenant: str | None = None) -> int:
        """Free bytes a `"%"` capacity of this tier is a share of (`tenant`: a daemon
        partition's tier)."""
        raise NotImplementedError

    def slot_bytes(self, config: Any) -> int:
        """Bytes one slot takes where the tier lives: a block's KV (and FP8 scales) in memory.
        A capacity is divided by this, so that the tier fits in it."""
        return int(config.block_bytes)

    def _check_size(self: Any, min_blocks: int) -> None:
        size(self._key("capacity"), self.capacity)
        if self.num_blocks is not None:
            check = positive_int if min_blocks else non_negative_int
            check(self._key("num_blocks"), self.num_blocks, MAX_NUM_BLOCKS)
        for key in ("max_num_blocks", "segment_blocks"):
            if getattr(self, key) is not None:
                positive_int(self._key(key), getattr(self, key), MAX_NUM_BLOCKS)
        if self.max_num_blocks is not None and self.num_blocks is not None and \
                self.max_num_blocks < self.num_blocks:
            raise ConfigError(self._key("max_num_blocks"),
                              f"{self.max_num_blocks} is below num_blocks {self.num_blocks}")
        if (self.capacity is None) == (self.num_blocks is None):
            got = "both" if self.capacity is not None else "neither"
            raise ConfigError(self._PATH,
                              f"set exactly one of 'capacity' or 'num_blocks', got {got}")
