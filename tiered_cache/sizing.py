"""Sizes and free memory: the size syntax of the config, how many blocks a tier gets, the L2
size behind `block_size: auto`.

Pure Python at import time: torch is imported lazily inside the functions that ask CUDA, so
`tiered_cache.config` stays fast to import and usable on a machine without torch.
"""

from __future__ import annotations

import re
import reprlib
import stat
from decimal import Decimal, localcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tiered_cache.errors import ConfigError, TierUnavailableError

if TYPE_CHECKING:
    from tiered_cache.config import CacheConfig

KiB = 1024
MiB = 1024**2
GiB = 1024**3
TiB = 1024**4
PiB = 1024**5

# Binary units are powers of 1024, decimal units powers of 1000 (as in IEC 80000-13).
_UNITS = {
    "": 1, "b": 1,
    "kib": KiB, "mib": MiB, "gib": GiB, "tib": TiB, "pib": PiB,
    "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4, "pb": 1000**5,
}

MAX_SIZE_BYTES = PiB
"""Largest size anywhere in the config (a capacity, a tier, a byte count): 1 PiB. Far above any
machine, and it keeps every byte offset computed from it (times a block count) inside int64."""

MAX_NUM_BLOCKS = 2**31 - 1
"""Most slots one tier may have: block tables and slot ids are int32 in the kernels."""

# ASCII digits and blanks only: `\d` and `\s` would also take Arabic-Indic digits, which float()
# accepts, and form feeds or a trailing newline. Every pattern is applied with fullmatch.
_NUMBER = r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)"
_SIZE_RE = re.compile(rf"[ \t]*{_NUMBER}[ \t]*([A-Za-z]*)[ \t]*", re.ASCII)
_PCT_RE = re.compile(rf"[ \t]*{_NUMBER}[ \t]*%[ \t]*", re.ASCII)
# Significant digits before the point past which a size is certainly above MAX_SIZE_BYTES:
# checked before any arithmetic, so that a 400-digit size costs nothing and cannot overflow.
_MAX_SIZE_DIGITS = len(str(MAX_SIZE_BYTES))

SIZE_HINT = "expected a size like '64GiB' or '70%'"

# block_size: auto is clamped to this range (tokens per block).
AUTO_BLOCK_MIN = 8
AUTO_BLOCK_MAX = 256
DEFAULT_L2_BYTES = 1 * MiB
_SYS_L2 = Path("/sys/devices/system/cpu/cpu0/cache/index2/size")
DEVICE_RE = re.compile(r"auto|cpu|cuda(?::(?:0|[1-9][0-9]{0,2}))?", re.ASCII)
"""Valid `tiers.gpu.device` values (use with fullmatch): N of `cuda:N` is 0..999, no leading
zeros, so that one device has one spelling."""


class _ShortRepr(reprlib.Repr):
    """reprlib with bounds sized for one line of an error message. Also safe for the values a
    fuzzer finds: an int too long for `repr` (over 4300 digits raises ValueError), containers that
    contain themselves or nest deeply, or share one list a billion ways through YAML aliases."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel = 3
        self.maxstring = self.maxother = 80
        self.maxlong = 40
        self.maxlist = self.maxtuple = self.maxdict = 6
        self.maxset = self.maxfrozenset = self.maxdeque = self.maxarray = 6

    def repr_int(self, x: int, level: int) -> str:
        if x.bit_length() > 128:
            return f"<an integer of about {int(x.bit_length() * 0.30103) + 1} digits>"
        return super().repr_int(x, level)


_SHORT_REPR = _ShortRepr()


def short_repr(value: Any) -> str:
    """A bounded repr for error messages: a bad value is echoed back, but a megabyte string, a
    1000-digit int or a self-referencing list must not become a megabyte message or a crash."""
    try:
        text = _SHORT_REPR.repr(value)
    except Exception:  # noqa: BLE001 - a hostile __repr__ must not replace the real error
        return f"<{type(value).__name__} object>"
    # reprlib bounds each level, not the total: 6 items of 6 items of 80-character strings
    return text if len(text) <= _SHORT_REPR_MAX else text[:_SHORT_REPR_MAX - 3] + "..."


_SHORT_REPR_MAX = 160


def parse_size(text: str | int | float, path: str) -> tuple[str, float]:
    """Parse a config size.

    Returns `("bytes", n)` with `n` an int for an absolute size (`"40GiB"`, `"512 MiB"`,
    `"1.5GB"`, `"100KB"`, `"4096B"`, `"4096"`, `4096`), or `("fraction", f)` with `0 < f <= 1`
    for a percentage of free memory (`"70%"` -> 0.7). Units are case-insensitive. A size above
    MAX_SIZE_BYTES (1 PiB) is refused. Raises ConfigError(path, ...) for anything else.

    Byte counts are computed exactly (Decimal, not float): `"4.35GB"` is 4,350,000,000 bytes, not
    one less, and a 400-digit number is refused by its length before it reaches float() (where
    it would become inf and then OverflowError).
    """
    if isinstance(text, bool):
        raise ConfigError(path, f"{SIZE_HINT}, got {short_repr(text)}")
    if isinstance(text, (int, float)):
        # `not (x >= 0)` also rejects NaN; an int is compared exactly, never converted to float.
        if not text >= 0 or text == float("inf"):
            raise ConfigError(path, f"{SIZE_HINT}, got {short_repr(text)}")
        if text > MAX_SIZE_BYTES:
            raise ConfigError(path, f"{_TOO_BIG}, got {short_repr(text)}")
        return "bytes", int(text)
    if not isinstance(text, str):
        raise ConfigError(path, f"{SIZE_HINT}, got {short_repr(text)}")
    m = _PCT_RE.fullmatch(text)
    if m:
        pct = float(m.group(1))  # a huge digit string becomes inf here, refused just below
        if not 0 < pct <= 100:
            raise ConfigError(path, f"expected a percentage in (0%, 100%], got {short_repr(text)}")
        return "fraction", pct / 100.0
    m = _SIZE_RE.fullmatch(text)
    if m and m.group(2).lower() in _UNITS:
        number = m.group(1)
        if len(number.partition(".")[0].lstrip("0")) > _MAX_SIZE_DIGITS:
            raise ConfigError(path, f"{_TOO_BIG}, got {short_repr(text)}")
        with localcontext() as ctx:
            ctx.prec = len(number) + 30  # exact: every digit of the number times the unit
            n = Decimal(number) * _UNITS[m.group(2).lower()]
        if n > MAX_SIZE_BYTES:
            raise ConfigError(path, f"{_TOO_BIG}, got {short_repr(text)}")
        return "bytes", int(n)  # rounds a fractional byte count down
    raise ConfigError(path, f"{SIZE_HINT}, got {short_repr(text)}")


_TOO_BIG = f"expected a size of at most 1 PiB ({MAX_SIZE_BYTES:,} bytes)"


def format_bytes(n: float) -> str:
    """`5242880` -> `'5.00 MiB'` (binary units)."""
    for unit, scale in (("PiB", PiB), ("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def resolve_device(device: str) -> str:
    """`"auto"` -> `"cuda"` when CUDA is available, else `"cpu"`. `"cuda"`/`"cuda:N"` without
    CUDA (or with no device N) raises TierUnavailableError."""
    if not isinstance(device, str) or not DEVICE_RE.fullmatch(device):
        raise ConfigError("tiers.gpu.device",
                          f"expected one of 'auto', 'cpu', 'cuda', 'cuda:N', "
                          f"got {short_repr(device)}")
    if device == "cpu":
        return "cpu"
    if device == "auto":
        return "cuda" if _cuda_available() else "cpu"
    if not _cuda_available():
        raise TierUnavailableError(
            f"tiers.gpu.device is {device!r} but CUDA is not available here "
            "(use 'auto' to fall back to CPU memory, or 'cpu')")
    if ":" in device:
        import torch

        index = int(device.split(":", 1)[1])
        count = torch.cuda.device_count()
        if index >= count:
            raise TierUnavailableError(
                f"tiers.gpu.device is {device!r} but this machine has {count} CUDA device(s)")
    return device


def free_bytes(device: str) -> int:
    """Free memory that a `"%"` capacity applies to: available host memory (psutil) for
    `"cpu"`, `torch.cuda.mem_get_info(device)[0]` for a CUDA device."""
    if device == "cpu":
        import psutil

        return int(psutil.virtual_memory().available)
    device = resolve_device(device)
    if device == "cpu":
        return free_bytes("cpu")
    import torch

    return int(torch.cuda.mem_get_info(torch.device(device))[0])


def disk_free_bytes(path: str | None) -> int:
    """Free bytes of the filesystem holding `path` (its nearest existing ancestor), for a
    `"%"` disk capacity."""
    import os
    import shutil

    p = os.path.abspath(path or ".")
    while not os.path.exists(p) and os.path.dirname(p) != p:
        p = os.path.dirname(p)
    return int(shutil.disk_usage(p).free)


def tier_slot_bytes(config: CacheConfig, tier: str) -> int:
    """Bytes one slot of `tier` takes where it lives (its section's `slot_bytes`: a block's KV
    in memory; a record's header and payload areas on disk)."""
    return getattr(config.tiers, tier).slot_bytes(config)


def held_bytes(directory: Path | None) -> int:
    """Bytes the regular files in `directory` take on disk (a persistent tier's own files from
    an earlier run: reopening the pool reuses them, so they count as room for it)."""
    held = 0
    try:
        entries = list(directory.iterdir()) if directory is not None else []
    except OSError:
        return 0
    for entry in entries:
        try:
            st = entry.lstat()
            if stat.S_ISREG(st.st_mode):
                held += st.st_blocks * 512
        except OSError:
            pass
    return held


def tier_num_blocks(config: CacheConfig, tier: str, free: int | None = None, *,
                    slot_bytes: int | None = None, tenant: str | None = None) -> int:
    """Blocks a slot tier gets: its `num_blocks` if set; else capacity bytes // slot bytes, or,
    for a `"%"` capacity, fraction * free // slot bytes. Slot bytes: the section's `slot_bytes`
    unless given (the daemon's shared pool rounds slots to pages). `free` defaults to what the
    tier's section says a share is of (`free_bytes`: the device's free memory, the host's
    available memory, the disk's free space plus what its own files hold; `tenant`: a daemon
    partition's). Fewer than the section's `MIN_BLOCKS` (1 for the device tier; 0, no tier,
    for the others) or more than MAX_NUM_BLOCKS blocks raises ConfigError: a capacity in bytes
    or a share of a large machine can exceed it with small blocks."""
    tcfg = getattr(config.tiers, tier, None) if isinstance(tier, str) else None
    if tcfg is None and (not isinstance(tier, str) or not hasattr(config.tiers, tier)):
        raise ValueError(f"unknown tier {tier!r}; tiers: {list(config.tiers.to_dict())}")
    if tcfg is None:                    # an optional tier that is not configured
        return 0
    if not hasattr(tcfg, "num_blocks") or not hasattr(tcfg, "capacity"):
        raise ValueError(f"tier {tier!r} has no size in slots (a keyed tier)")
    if tcfg.num_blocks is not None:
        return tcfg.num_blocks
    path = f"tiers.{tier}.capacity"
    block = tier_slot_bytes(config, tier) if slot_bytes is None else slot_bytes
    kind, value = parse_size(tcfg.capacity, path)
    if kind == "bytes":
        n = int(value) // block
        what = f"{tcfg.capacity!r} ({int(value):,} bytes)"
    else:
        if free is None:
            free = tcfg.free_bytes(config, tenant)
        n = int(value * free) // block
        what = f"{tcfg.capacity!r} of {free:,} free bytes"
    unit = f"{getattr(tcfg, 'SLOT_WORD', 'blocks')} of"
    if n < getattr(tcfg, "MIN_BLOCKS", 0):
        raise ConfigError(path, f"{what} holds no block of {block:,} bytes")
    if n > MAX_NUM_BLOCKS:
        raise ConfigError(path, f"{what} is {n:,} {unit} {block:,} bytes, more than the "
                                f"{MAX_NUM_BLOCKS:,} a tier may have (use larger blocks)")
    return n


def _parse_sys_size(text: str) -> int | None:
    """`"1024K"` -> 1048576, `"2M"` -> 2097152, `"512"` -> 512 (sysfs cache sizes)."""
    m = re.fullmatch(r"\s*([0-9]{1,15})\s*([KMG]?)i?B?\s*", text, re.IGNORECASE | re.ASCII)
    if not m:
        return None
    return int(m.group(1)) * {"": 1, "K": KiB, "M": MiB, "G": GiB}[m.group(2).upper()]


def l2_cache_bytes(device: str = "auto") -> int:
    """L2 cache size for the `block_size: auto` heuristic: the CUDA device's L2 when CUDA is
    available and `device` isn't `"cpu"`; else cpu0's L2 from sysfs; else 1 MiB."""
    if device != "cpu" and _cuda_available():
        import torch

        index = 0
        if isinstance(device, str) and device.startswith("cuda:"):
            index = int(device.split(":", 1)[1])
        if index < torch.cuda.device_count():
            size = int(getattr(torch.cuda.get_device_properties(index), "L2_cache_size", 0))
            if size > 0:
                return size
    try:
        size = _parse_sys_size(_SYS_L2.read_text())
    except OSError:
        size = None
    return size if size else DEFAULT_L2_BYTES


def auto_block_size(l2_bytes: int, kv_hidden: int, dtype_size: int) -> int:
    """Heuristic block size: the tokens whose K and V of one layer fit in L2,
    `l2_bytes / (2 * kv_hidden * dtype_size)`, rounded down to a power of two and clamped to
    [8, 256]."""
    tokens = int(l2_bytes) // (2 * kv_hidden * dtype_size)
    if tokens < 1:
        return AUTO_BLOCK_MIN
    pow2 = 1 << (tokens.bit_length() - 1)
    return max(AUTO_BLOCK_MIN, min(AUTO_BLOCK_MAX, pow2))
