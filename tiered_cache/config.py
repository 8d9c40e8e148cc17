"""Configuration: dataclasses validated on construction, loaded from YAML or a plain dict.

Every section knows its place in the tree (`_PATH`), so a bad value raises ConfigError with the
full key path whether the section came from a file or was built in Python:

    >>> CacheConfig.from_dict({"tiers": {"host": {"capacity": "lots"}}})
    ConfigError: tiers.host.capacity: expected a size like '64GiB' or '70%', got 'lots'

Unknown keys are rejected with the closest valid key suggested. Every input, a mapping of
anything or any YAML text, either loads or raises ConfigError: every number has an upper bound
(a 400-digit value is an error naming its key, not an OverflowError later), every pattern is
matched in full, and the YAML loader turns each malformed scalar, tag or nesting into an error
with its line (tests/test_config_fuzz.py). `docs/configuration.md` lists every key and bound.
This module imports no torch (only `block_size: auto` asks torch, lazily, for the L2 size).
"""

from __future__ import annotations

import dataclasses
import difflib
import ipaddress
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import yaml

from tiered_cache import sizing
from tiered_cache.errors import ConfigError
from tiered_cache.sizing import MAX_NUM_BLOCKS, MAX_SIZE_BYTES, short_repr

KV_DTYPES: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8_e4m3": 1}
"""KV storage dtypes and their bytes per element."""

FP8_SCALE_BYTES = 4
"""fp8 KV keeps one float32 scale per (layer, K|V) per block."""

DEVICES_HINT = "'auto', 'cpu', 'cuda' or 'cuda:N'"

# Upper bounds. Every number in the config has one, so that no value can overflow a float, a
# C timeout, an int64 byte offset or an int32 slot id further down, and so that a typo of a few
# extra digits is an error here instead of a crash (or a 10**400-thread pool) later. Each is far
# above anything real; docs/configuration.md lists them.
MAX_NUM_LAYERS = 1024
MAX_NUM_HEADS = 4096
"""For num_kv_heads and num_q_heads."""
MAX_HEAD_DIM = 4096
MAX_NUM_PARAMS = 1e15
MAX_NAME_CHARS = 256
"""model.name and adapter_id: both go into the block-hash namespace."""
MAX_NUM_WORKERS = 256
MAX_RETRIES = 100
MAX_TIMEOUT_S = 86400.0
"""migrator.wait_timeout_s: one day. threading's waits raise OverflowError past ~292 years."""
MAX_INTERVAL_S = 3600.0
MAX_COMPACT_THRESHOLD = 1e6
MAX_YAML_DEPTH = 64
"""Nesting of YAML collections. The config itself is 3 deep; the limit keeps PyYAML's recursive
composer far from Python's recursion limit, whatever the caller's stack depth."""
MAX_YAML_INT_DIGITS = 4300
"""CPython's default int/str conversion limit: a longer YAML integer is an error at its line
(converting it would raise ValueError, or take quadratic time with the limit lifted)."""


# --------------------------------------------------------------------------------------------
# value checks: each raises ConfigError(path, "expected ..., got <repr>")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    """A finite int or float. An int is never passed to math.isfinite (float conversion of a
    400-digit int raises OverflowError); ints compare exactly with float bounds."""
    if _is_int(v):
        return True
    return isinstance(v, float) and math.isfinite(v)


def _positive_int(path: str, v: Any, hi: int) -> int:
    if not _is_int(v) or v < 1:
        raise ConfigError(path, f"expected a positive integer, got {short_repr(v)}")
    if v > hi:
        raise ConfigError(path, f"expected a positive integer at most {hi:,}, got {short_repr(v)}")
    return v


def _non_negative_int(path: str, v: Any, hi: int) -> int:
    if not _is_int(v) or v < 0:
        raise ConfigError(path, f"expected a non-negative integer, got {short_repr(v)}")
    if v > hi:
        raise ConfigError(path, f"expected a non-negative integer at most {hi:,}, "
                                f"got {short_repr(v)}")
    return v


def _positive_number(path: str, v: Any, hi: float) -> float:
    if not _is_number(v) or v <= 0:
        raise ConfigError(path, f"expected a positive number, got {short_repr(v)}")
    if v > hi:
        raise ConfigError(path, f"expected a positive number at most {hi:,g}, got {short_repr(v)}")
    return float(v)


def _fraction(path: str, v: Any, *, upper_open: bool = False) -> float:
    ok = _is_number(v) and 0 < v and (v < 1 if upper_open else v <= 1)
    if not ok:
        interval = "(0, 1)" if upper_open else "(0, 1]"
        raise ConfigError(path, f"expected a number in {interval}, got {short_repr(v)}")
    return float(v)


def _bool(path: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise ConfigError(path, f"expected true or false, got {short_repr(v)}")
    return v


def _choice(path: str, v: Any, choices: Any) -> str:
    if not isinstance(v, str) or v not in choices:
        listed = ", ".join(repr(c) for c in choices)
        raise ConfigError(path, f"expected one of {listed}, got {short_repr(v)}")
    return v


def check_identifier(path: str, v: Any, *, optional: bool = False) -> str | None:
    """Check a name that goes into the block-hash namespace (model.name, adapter_id): a string of
    1..MAX_NAME_CHARS printable characters without leading or trailing whitespace. Raises
    ConfigError(path, ...) otherwise.

    NOTE: printable (str.isprintable) rules out control characters, line breaks, lone surrogates
    and invisible format characters: two ids that print the same must be the same id, or a
    tenant could not tell why its prefixes never hit. The cache should check a per-request
    `open(adapter_id=...)` with this same function.
    """
    if v is None and optional:
        return None
    if not isinstance(v, str) or not v.strip():
        what = "a non-empty string or null" if optional else "a non-empty string"
        raise ConfigError(path, f"expected {what}, got {short_repr(v)}")
    if len(v) > MAX_NAME_CHARS:
        raise ConfigError(path, f"expected at most {MAX_NAME_CHARS} characters, got "
                                f"{len(v):,}: {short_repr(v)}")
    if not v.isprintable():
        raise ConfigError(path, f"expected printable characters (no control, line-break or "
                                f"format characters), got {short_repr(v)}")
    if v != v.strip():
        raise ConfigError(path, f"expected no leading or trailing whitespace, got {short_repr(v)}")
    return v


_HOST_CHARS_RE = re.compile(r"[0-9A-Za-z.:%_-]{1,253}", re.ASCII)
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"  # RFC 1123: 1..63, no edge hyphen
_HOSTNAME_RE = re.compile(rf"{_LABEL}(?:\.{_LABEL})*", re.ASCII)


def _host(path: str, v: Any) -> str:
    """An IPv4 or IPv6 address (IPv6 unbracketed, optionally with a %scope) or an RFC 1123
    hostname. A name whose last label is all digits ('1.2.3', '999.1.1.1') is refused: the
    resolver would read it as a (wrong) IPv4 address."""
    hint = "expected an IP address ('127.0.0.1', '0.0.0.0', '::1') or a hostname"
    if not isinstance(v, str) or not _HOST_CHARS_RE.fullmatch(v):
        raise ConfigError(path, f"{hint}, got {short_repr(v)}")
    try:
        ipaddress.ip_address(v)
        return v
    except ValueError:
        pass
    if _HOSTNAME_RE.fullmatch(v) and not v.rsplit(".", 1)[-1].isdigit():
        return v
    raise ConfigError(path, f"{hint}, got {short_repr(v)}")


def _size(path: str, v: Any) -> None:
    if v is not None:
        sizing.parse_size(v, path)


_PLAIN_KEY_RE = re.compile(r"[A-Za-z0-9_-]{1,80}", re.ASCII)


def _key_text(key: Any) -> str:
    """A mapping key as it appears in an error path: a short word as is, anything else (an
    empty string, one with a dot or a newline, a megabyte string, an int of 5000 digits) as a
    short repr, so that the path stays one unambiguous line."""
    if isinstance(key, str) and _PLAIN_KEY_RE.fullmatch(key):
        return key
    return short_repr(key)


def _overcommit(v: Any) -> None:
    names = ("gpu", "host", "disk")
    # NOTE: item types first: a set of YAML-aliased nested lists must never be built or repr'd
    if not isinstance(v, list) or len(v) > len(names) \
            or not all(isinstance(x, str) and x in names for x in v) or len(set(v)) != len(v):
        raise ConfigError("overcommit", f"expected a list of distinct tier names from "
                                        f"{', '.join(names)} (tiers allowed to ask for more "
                                        f"than this machine can give), got {short_repr(v)}")


class _Section:
    """Mixin: a config section that knows its key path in the tree."""

    _PATH: ClassVar[str] = ""
    _NESTED: ClassVar[dict[str, type]] = {}

    @classmethod
    def _key(cls, name: str) -> str:
        return f"{cls._PATH}.{name}" if cls._PATH else name

    def _nested(self, name: str) -> None:
        """Accept a nested section given as a plain mapping; reject anything else."""
        section_cls = self._NESTED[name]
        value = getattr(self, name)
        if isinstance(value, section_cls):
            return
        if value is None:
            value = _section_default(type(self), name)
        elif isinstance(value, Mapping):
            value = _from_mapping(section_cls, value)
        else:
            raise ConfigError(self._key(name), _not_a_mapping(value))
        setattr(self, name, value)


def _section_default(cls: type, name: str) -> Any:
    """The default of a nested section field (what a missing or null section gets)."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    return f.default_factory()


def _not_a_mapping(value: Any) -> str:
    return f"expected a mapping of keys, got {type(value).__name__} {short_repr(value)}"


def _from_mapping(cls: type, data: Any) -> Any:
    """Build `cls` from a mapping: reject unknown keys (suggesting the closest valid one), build
    nested sections recursively, let `__post_init__` check the values. A missing key takes the
    dataclass default; a missing or null section takes its defaults."""
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        where = cls._PATH
        msg = _not_a_mapping(data)
        raise ConfigError(where, msg if where else f"config: {msg}")
    valid = [f.name for f in dataclasses.fields(cls) if f.init]
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if not isinstance(key, str) or key not in valid:
            path = cls._key(_key_text(key))
            close = (difflib.get_close_matches(key, valid, n=1)
                     if isinstance(key, str) and len(key) <= 80 else [])
            if close:
                raise ConfigError(path, f"unknown key; did you mean {close[0]!r}?")
            listed = ", ".join(repr(k) for k in sorted(valid))
            raise ConfigError(path, f"unknown key; valid keys are {listed}")
        if key in cls._NESTED:
            if value is None:  # `migrator:` with nothing under it: the section's defaults
                continue
            if not isinstance(value, cls._NESTED[key]):
                if not isinstance(value, Mapping):
                    raise ConfigError(cls._key(key), _not_a_mapping(value))
                value = _from_mapping(cls._NESTED[key], value)
        kwargs[key] = value
    return cls(**kwargs)


# --------------------------------------------------------------------------------------------
# sections


@dataclass
class ModelConfig(_Section):
    """The model whose KV is cached: geometry and KV dtype."""

    _PATH: ClassVar[str] = "model"

    name: str = "tiny-llama"
    """Model id; part of the block-hash namespace: printable, at most MAX_NAME_CHARS."""
    num_layers: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    num_q_heads: int | None = None
    """Query heads; None means num_kv_heads. Must be a multiple of num_kv_heads (GQA)."""
    dtype: str = "float32"
    """KV storage dtype, one of KV_DTYPES."""
    num_params: float | None = None
    """Parameter count (e.g. 70.6e9), for cost models; optional."""

    def __post_init__(self) -> None:
        check_identifier(self._key("name"), self.name)
        _positive_int(self._key("num_layers"), self.num_layers, MAX_NUM_LAYERS)
        _positive_int(self._key("num_kv_heads"), self.num_kv_heads, MAX_NUM_HEADS)
        _positive_int(self._key("head_dim"), self.head_dim, MAX_HEAD_DIM)
        if self.num_q_heads is None:
            self.num_q_heads = self.num_kv_heads
        _positive_int(self._key("num_q_heads"), self.num_q_heads, MAX_NUM_HEADS)
        if self.num_q_heads % self.num_kv_heads:
            raise ConfigError(
                self._key("num_q_heads"),
                f"must be a multiple of num_kv_heads ({self.num_kv_heads}), "
                f"got {self.num_q_heads}")
        _choice(self._key("dtype"), self.dtype, KV_DTYPES)
        if self.num_params is not None:
            self.num_params = _positive_number(self._key("num_params"), self.num_params,
                                               MAX_NUM_PARAMS)

    @property
    def dtype_size(self) -> int:
        """Bytes per KV element."""
        return KV_DTYPES[self.dtype]

    @property
    def kv_hidden(self) -> int:
        """num_kv_heads * head_dim: elements of K (or V) per token per layer."""
        return self.num_kv_heads * self.head_dim

    @property
    def bytes_per_token(self) -> int:
        """K and V of every layer of one token: num_layers * 2 * kv_hidden * dtype_size."""
        return self.num_layers * 2 * self.kv_hidden * self.dtype_size

    @property
    def block_scale_bytes(self) -> int:
        """Per-block bytes besides the tokens: fp8 keeps a float32 scale per layer for K and V."""
        return self.num_layers * 2 * FP8_SCALE_BYTES if self.dtype == "fp8_e4m3" else 0


class _TierSize:
    """Shared check: exactly one of capacity / num_blocks; the resize bounds."""

    def _check_size(self: Any, min_blocks: int) -> None:
        _size(self._key("capacity"), self.capacity)
        if self.num_blocks is not None:
            check = _positive_int if min_blocks else _non_negative_int
            check(self._key("num_blocks"), self.num_blocks, MAX_NUM_BLOCKS)
        for key in ("max_num_blocks", "segment_blocks"):
            if getattr(self, key) is not None:
                _positive_int(self._key(key), getattr(self, key), MAX_NUM_BLOCKS)
        if self.max_num_blocks is not None and self.num_blocks is not None and \
                self.max_num_blocks < self.num_blocks:
            raise ConfigError(self._key("max_num_blocks"),
                              f"{self.max_num_blocks} is below num_blocks {self.num_blocks}")
        if (self.capacity is None) == (self.num_blocks is None):
            got = "both" if self.capacity is not None else "neither"
            raise ConfigError(self._PATH,
                              f"set exactly one of 'capacity' or 'num_blocks', got {got}")


@dataclass
class GpuTierConfig(_Section, _TierSize):
    """The fast tier: a device pool (CPU memory when there is no CUDA and device is auto/cpu)."""

    _PATH: ClassVar[str] = "tiers.gpu"

    device: str = "auto"
    """auto | cpu | cuda | cuda:N. auto: cuda when available, else cpu."""
    capacity: str | None = None
    """"40GiB", "512MiB" or "70%" (of the device's free memory)."""
    num_blocks: int | None = None
    """Exactly one of capacity / num_blocks must be set."""
    max_num_blocks: int | None = None
    """Largest size `cache.resize` may grow the tier to; address space for it is reserved up
    front (no memory). null: the machine's physical memory in blocks."""
    segment_blocks: int | None = None
    """Blocks per memory segment: resize backs and frees memory in these steps. null: about
    64 MiB of KV."""
    resizable: bool = False
    """CUDA only: lay the device pool over reserved device addresses mapped segment by segment
    (CUDA virtual memory API; needs the `cuda` extra), so cache.resize works on it. Off: one
    allocation. A device tier in CPU memory is always resizable."""

    def __post_init__(self) -> None:
        # fullmatch: re.match with `$` would accept "cpu\n" (`$` matches before a final newline)
        if not isinstance(self.device, str) or not sizing.DEVICE_RE.fullmatch(self.device):
            hint = DEVICES_HINT
            if isinstance(self.device, str) and re.fullmatch(r"cuda:[0-9]+", self.device,
                                                             re.ASCII):
                hint += " with N in 0..999 and no leading zeros"
            raise ConfigError(self._key("device"),
                              f"expected one of {hint}, got {short_repr(self.device)}")
        _bool(self._key("resizable"), self.resizable)
        self._check_size(min_blocks=1)


HOST_MEMORY = ("pinned", "managed", "pageable")


@dataclass
class HostTierConfig(_Section, _TierSize):
    """The slow tier: host memory. num_blocks 0 (or a capacity that holds no block) means no
    host tier."""

    _PATH: ClassVar[str] = "tiers.host"

    capacity: str | None = None
    num_blocks: int | None = None
    memory: str = "pinned"
    """pinned | managed | pageable. pinned falls back to pageable without CUDA; managed needs
    CUDA (and cupy)."""
    max_num_blocks: int | None = None
    """As for tiers.gpu."""
    segment_blocks: int | None = None
    """As for tiers.gpu."""

    def __post_init__(self) -> None:
        self._check_size(min_blocks=0)
        _choice(self._key("memory"), self.memory, HOST_MEMORY)


@dataclass
class DiskTierConfig(_Section):
    """A local disk (SSD) beneath host memory: one verified record per slot in a preallocated
    file, kept across restarts. Written and read only by background threads, never under the
    control-plane lock."""

    _PATH: ClassVar[str] = "tiers.disk"

    path: str | None = None
    """Directory of the tier (created if missing). Records of each namespace (model, dtype,
    geometry, block size) live in their own subdirectory. Required with `storage: tensors`."""
    capacity: str | None = None
    """"2TiB", "500GB", or "80%" of the free space at `path`."""
    num_blocks: int | None = None
    """Exactly one of capacity / num_blocks; 0 means no disk tier."""
    max_num_blocks: int | None = None
    """Largest size `cache.resize` may grow the tier to (null: as many as the disk holds)."""
    o_direct: bool = False
    """Payload I/O bypasses the page cache (so demoted blocks do not compete with the host tier
    for RAM); falls back, with a warning, where the filesystem refuses O_DIRECT."""
    admit_min_hits: int = 1
    """Only blocks reused at least this many times are written to disk (0: every demoted
    block), so one-shot traffic does not wear the SSD."""

    def __post_init__(self) -> None:
        if self.path is not None:
            ok = isinstance(self.path, str) and self.path.strip() and "\0" not in self.path \
                and self.path.isprintable() and len(self.path) <= 4096
            if not ok:
                raise ConfigError(self._key("path"), f"expected a directory path (printable, "
                                                     f"no NUL), got {short_repr(self.path)}")
        _size(self._key("capacity"), self.capacity)
        if self.num_blocks is not None:
            _non_negative_int(self._key("num_blocks"), self.num_blocks, MAX_NUM_BLOCKS)
        if self.max_num_blocks is not None:
            _positive_int(self._key("max_num_blocks"), self.max_num_blocks, MAX_NUM_BLOCKS)
            if self.num_blocks is not None and self.max_num_blocks < self.num_blocks:
                raise ConfigError(self._key("max_num_blocks"),
                                  f"{self.max_num_blocks} is below num_blocks {self.num_blocks}")
        if (self.capacity is None) == (self.num_blocks is None):
            got = "both" if self.capacity is not None else "neither"
            raise ConfigError(self._PATH,
                              f"set exactly one of 'capacity' or 'num_blocks', got {got}")
        _bool(self._key("o_direct"), self.o_direct)
        _non_negative_int(self._key("admit_min_hits"), self.admit_min_hits, 1 << 20)


_URL_SCHEMES = ("redis://", "rediss://", "valkey://", "valkeys://")
REMOTE_WRITES = ("on_host", "off")


@dataclass
class RemoteTierConfig(_Section):
    """A shared keyed store (Redis or Valkey, standalone or cluster) beneath the slot tiers:
    consulted after a local miss under a hard deadline, loaded from in the background, written
    in the background. The server alone evicts (its maxmemory policy)."""

    _PATH: ClassVar[str] = "tiers.remote"

    url: str | None = None
    """redis://host:port/db, or rediss:// for TLS (valkey:// and valkeys:// alike)."""
    cluster: bool = False
    """Redis Cluster: keys spread over the masters by the cluster's own slot hashing."""
    username: str | None = None
    password: str | None = None
    """Prefer password_env: a password in a YAML file is readable by whoever reads the file."""
    password_env: str | None = None
    """Name of an environment variable holding the password."""
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_check_hostname: bool = True
    prefix: str = "tc"
    """First part of every server key: tc:v1:<namespace>:<tenant root>:<block key>."""
    ttl_s: float | None = None
    """Expire values after this many seconds (null: only the server's eviction removes them)."""
    lookup_deadline_ms: float = 5.0
    """Hard deadline of the existence check in open(): a slow or dead server answers "absent"
    after it, so open() never waits longer for this tier."""
    lookahead_blocks: int = 256
    """Most blocks past the local match one open() looks up."""
    write: str = "on_host"
    """on_host: blocks that reach the host tier are put to the store in the background; off:
    this cache only reads."""
    put_queue_mib: int = 256
    """Bound of the background put queue (what does not fit is dropped and counted)."""
    latency_ms: float = 1.0
    """Prior of the load cost model until the tier has been measured."""
    bandwidth_gbps: float = 1.0
    """Prior of the load cost model until the tier has been measured."""

    def __post_init__(self) -> None:
        if not isinstance(self.url, str) or not self.url.startswith(_URL_SCHEMES) \
                or not self.url.isprintable() or len(self.url) > 2048:
            raise ConfigError(self._key("url"), f"expected a URL like redis://host:6379/0 "
                                                f"(or rediss://), got {short_repr(self.url)}")
        _bool(self._key("cluster"), self.cluster)
        _bool(self._key("tls_check_hostname"), self.tls_check_hostname)
        for key in ("username", "password", "password_env", "tls_ca", "tls_cert", "tls_key"):
            v = getattr(self, key)
            if v is not None and (not isinstance(v, str) or not v or len(v) > 4096
                                  or "\0" in v):
                shown = "***" if key == "password" else short_repr(v)
                raise ConfigError(self._key(key), f"expected a string or null, got {shown}")
        if self.password is not None and self.password_env is not None:
            raise ConfigError(self._key("password"), "set password or password_env, not both")
        if not isinstance(self.prefix, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,32}",
                                                                 self.prefix):
            raise ConfigError(self._key("prefix"), f"expected 1-32 letters, digits, '_', '.' "
                                                   f"or '-', got {short_repr(self.prefix)}")
        if self.ttl_s is not None:
            self.ttl_s = _positive_number(self._key("ttl_s"), self.ttl_s, 365 * 86400)
        self.lookup_deadline_ms = _positive_number(self._key("lookup_deadline_ms"),
                                                   self.lookup_deadline_ms, 60_000)
        _positive_int(self._key("lookahead_blocks"), self.lookahead_blocks, 1 << 20)
        _choice(self._key("write"), self.write, REMOTE_WRITES)
        _positive_int(self._key("put_queue_mib"), self.put_queue_mib, 1 << 20)
        self.latency_ms = _positive_number(self._key("latency_ms"), self.latency_ms, 60_000)
        self.bandwidth_gbps = _positive_number(self._key("bandwidth_gbps"),
                                               self.bandwidth_gbps, 10_000)


@dataclass
class DaemonTierConfig(_Section):
    """An engine attached to the node daemon (`tiered-cache serve`): the daemon's tiers (its
    shared host pool, and disk when configured) sit beneath this engine's GPU tier. The engine
    keeps its GPU tier and kernels; KV moves through shared memory, never the socket."""

    _PATH: ClassVar[str] = "tiers.daemon"

    socket: str | None = None
    """The daemon's Unix socket (daemon.socket in its config)."""
    timeout_s: float = 5.0
    """Longest wait for one reply of the daemon (then it counts as gone)."""
    lookup_deadline_ms: float = 2000.0
    """Longest the daemon may take in open() to make the blocks it found ready (a read from
    its disk tier) before it answers "absent"; the reply itself is bounded by timeout_s."""
    write: str = "on_compute"
    """on_compute: every block this engine computes is published to the daemon (in the
    background), where the other engine processes of the node find it; off: only read."""

    def __post_init__(self) -> None:
        if not isinstance(self.socket, str) or not self.socket or "\0" in self.socket \
                or len(self.socket) > 107 or not self.socket.isprintable():
            raise ConfigError(self._key("socket"), f"expected a Unix socket path (at most 107 "
                                                   f"bytes), got {short_repr(self.socket)}")
        self.timeout_s = _positive_number(self._key("timeout_s"), self.timeout_s, 3600)
        self.lookup_deadline_ms = _positive_number(self._key("lookup_deadline_ms"),
                                                   self.lookup_deadline_ms, 60_000)
        _choice(self._key("write"), self.write, ("on_compute", "off"))


@dataclass
class TiersConfig(_Section):
    _PATH: ClassVar[str] = "tiers"
    _NESTED: ClassVar[dict[str, type]] = {"gpu": GpuTierConfig, "host": HostTierConfig,
                                          "disk": DiskTierConfig, "remote": RemoteTierConfig,
                                          "daemon": DaemonTierConfig}

    gpu: GpuTierConfig = field(default_factory=lambda: GpuTierConfig(num_blocks=256))
    host: HostTierConfig = field(default_factory=lambda: HostTierConfig(num_blocks=1024))
    disk: DiskTierConfig | None = None
    """Optional; absent (or null): no disk tier."""
    remote: RemoteTierConfig | None = None
    """Optional; absent (or null): no remote tier."""
    daemon: DaemonTierConfig | None = None
    """Optional: attach this engine to a node daemon (its tiers replace host/disk/remote)."""

    def __post_init__(self) -> None:
        self._nested("gpu")
        self._nested("host")
        for name in ("disk", "remote", "daemon"):
            if getattr(self, name) is not None:
                self._nested(name)


@dataclass
class MigratorConfig(_Section):
    """Background demotion (GPU -> host above high_watermark, down to low_watermark) and
    promotion of host blocks that opened sequences need."""

    _PATH: ClassVar[str] = "migrator"

    enabled: bool = True
    high_watermark: float = 0.9
    low_watermark: float = 0.8
    num_workers: int = 2
    batch_blocks: int = 64
    wait_timeout_s: float = 30.0
    max_retries: int = 3
    promotion_chunk_bytes: int = 8 << 20

    def __post_init__(self) -> None:
        _bool(self._key("enabled"), self.enabled)
        self.high_watermark = _fraction(self._key("high_watermark"), self.high_watermark)
        self.low_watermark = _fraction(self._key("low_watermark"), self.low_watermark,
                                       upper_open=True)
        if self.low_watermark >= self.high_watermark:
            raise ConfigError(self._key("low_watermark"),
                              f"must be below high_watermark ({self.high_watermark}), "
                              f"got {self.low_watermark}")
        _positive_int(self._key("num_workers"), self.num_workers, MAX_NUM_WORKERS)
        _positive_int(self._key("batch_blocks"), self.batch_blocks, MAX_NUM_BLOCKS)
        self.wait_timeout_s = _positive_number(self._key("wait_timeout_s"), self.wait_timeout_s,
                                               MAX_TIMEOUT_S)
        _non_negative_int(self._key("max_retries"), self.max_retries, MAX_RETRIES)
        _non_negative_int(self._key("promotion_chunk_bytes"), self.promotion_chunk_bytes,
                          MAX_SIZE_BYTES)


@dataclass
class CompactorConfig(_Section):
    """Background compaction of live blocks into low slots."""

    _PATH: ClassVar[str] = "compactor"

    enabled: bool = True
    threshold: float = 0.25
    interval_s: float = 0.05
    max_moves_per_step: int = 64

    def __post_init__(self) -> None:
        _bool(self._key("enabled"), self.enabled)
        self.threshold = _positive_number(self._key("threshold"), self.threshold,
                                          MAX_COMPACT_THRESHOLD)
        self.interval_s = _positive_number(self._key("interval_s"), self.interval_s,
                                           MAX_INTERVAL_S)
        _positive_int(self._key("max_moves_per_step"), self.max_moves_per_step, MAX_NUM_BLOCKS)


@dataclass
class DaemonConfig(_Section):
    """`tiered-cache serve`: the node daemon. Its tiers are this config's host (in shared
    memory) and disk tiers (tiers.gpu is ignored: the daemon owns no GPU; tiers.remote is
    refused: not supported inside the daemon yet)."""

    _PATH: ClassVar[str] = "daemon"

    socket: str = "/run/tiered-cache/daemon.sock"
    """Unix socket engines attach to (mode 0600 in a directory the daemon owns, 0700)."""
    socket_mode: int | str = 0o600
    """"0600" (the daemon's user only) or "0660" (its group too: engines running as other users
    of the socket directory's group; with allow_gids)."""
    allow_uids: list = field(default_factory=list)
    """Client uids admitted (SO_PEERCRED); empty with allow_gids empty: only the daemon's uid."""
    allow_gids: list = field(default_factory=list)
    tenants: dict = field(default_factory=dict)
    """"uid:N" or "gid:N" -> tenant name. A client's tenant decides which blocks it can read and
    publish; by default every uid is its own tenant. The daemon assigns it, never the client."""
    lease_s: float = 10.0
    """A client's pins are a lease renewed by its heartbeat; a client gone this long (or whose
    socket closed) has its pins released."""
    max_frame_mib: int = 8
    """Largest control message (token ids of a lookup: 4 bytes a token)."""
    max_clients: int = 256
    staging_blocks: int = 32
    """Slots of each client's staging area (shared pages it copies blocks to publish into;
    the daemon copies them into the pool). A client publishes at most this many at once."""
    log_format: str = "text"
    """text | json (one JSON object a line: for a log shipper)."""
    page_pool_mib: int = 256
    """Pages named by an engine's own keys (the `page_*` ops: SGLang's HiCache backend, the
    vLLM secondary tier): MiB of shared memory per tenant and page format (0: no page ops)."""
    page_disk_mib: int = 0
    """MiB of disk per tenant and page format beneath its page pool, under
    `<tiers.disk.path>/<tenant>/pages/` (0: pages live in memory and tiers.remote only)."""

    def __post_init__(self) -> None:
        if not isinstance(self.socket, str) or not self.socket.startswith("/") \
                or len(self.socket) > 107 or "\0" in self.socket:
            raise ConfigError(self._key("socket"), "expected an absolute Unix socket path (at "
                                                   "most 107 bytes), got "
                                                   f"{short_repr(self.socket)}")
        # NOTE: YAML 1.2 as loaded here has no octal ints: the mode is written as a string.
        modes = {"0600": 0o600, "0o600": 0o600, "0660": 0o660, "0o660": 0o660}
        mode = self.socket_mode
        if isinstance(mode, str) and mode in modes:
            self.socket_mode = modes[mode]
        elif not _is_int(mode) or mode not in (0o600, 0o660):
            raise ConfigError(self._key("socket_mode"), "expected \"0600\" or \"0660\" (a "
                                                        "string: YAML has no octal numbers), "
                                                        f"got {short_repr(mode)}")
        for key in ("allow_uids", "allow_gids"):
            v = getattr(self, key)
            if not isinstance(v, list) or len(v) > 4096 or not all(
                    _is_int(x) and 0 <= x < 2**32 for x in v):
                raise ConfigError(self._key(key), f"expected a list of ids in 0..2**32-1, got "
                                                  f"{short_repr(v)}")
        if not isinstance(self.tenants, dict) or len(self.tenants) > 4096:
            raise ConfigError(self._key("tenants"), f"expected a mapping, got "
                                                    f"{short_repr(self.tenants)}")
        for who, name in self.tenants.items():
            if not isinstance(who, str) or not re.fullmatch(r"(uid|gid):[0-9]{1,10}", who):
                raise ConfigError(self._key("tenants"), f"expected keys 'uid:N' or 'gid:N', "
                                                        f"got {short_repr(who)}")
            if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}",
                                                             name):
                raise ConfigError(self._key(f"tenants.{who}"),
                                  "expected a tenant name of 1..64 letters, digits, '_', '.' or "
                                  f"'-' (it names the tenant's disk directory), got "
                                  f"{short_repr(name)}")
        self.lease_s = _positive_number(self._key("lease_s"), self.lease_s, 86400)
        _positive_int(self._key("max_frame_mib"), self.max_frame_mib, 1024)
        _positive_int(self._key("max_clients"), self.max_clients, 65536)
        _positive_int(self._key("staging_blocks"), self.staging_blocks, 4096)
        _choice(self._key("log_format"), self.log_format, ("text", "json"))
        _non_negative_int(self._key("page_pool_mib"), self.page_pool_mib, 1 << 24)
        _non_negative_int(self._key("page_disk_mib"), self.page_disk_mib, 1 << 32)


@dataclass
class CostModelConfig(_Section):
    """Load or recompute (tiered_cache.costs): a block only in a slow tier (disk, remote) is
    loaded only when that is faster than prefilling its tokens again."""

    _PATH: ClassVar[str] = "cost_model"

    enabled: bool = True
    prefill_tflops: float = 400.0
    """Achieved prefill throughput of the serving GPU(s), times the tensor-parallel degree."""
    margin: float = 1.1
    """A load must beat recompute by this factor."""
    disk_latency_ms: float = 0.2
    """Prior for the disk tier until measured."""
    disk_bandwidth_gbps: float = 2.0
    """Prior for the disk tier until measured."""

    def __post_init__(self) -> None:
        _bool(self._key("enabled"), self.enabled)
        self.prefill_tflops = _positive_number(self._key("prefill_tflops"),
                                               self.prefill_tflops, 1e6)
        self.margin = _positive_number(self._key("margin"), self.margin, 100.0)
        self.disk_latency_ms = _positive_number(self._key("disk_latency_ms"),
                                                self.disk_latency_ms, 60_000)
        self.disk_bandwidth_gbps = _positive_number(self._key("disk_bandwidth_gbps"),
                                                    self.disk_bandwidth_gbps, 10_000)


@dataclass
class KernelsConfig(_Section):
    _PATH: ClassVar[str] = "kernels"

    attention_backend: str = "auto"
    """auto | triton | torch."""
    missing_blocks: str = "zero_copy"
    """zero_copy (read host blocks in place) | wait (wait for their promotion)."""

    def __post_init__(self) -> None:
        _choice(self._key("attention_backend"), self.attention_backend,
                ("auto", "triton", "torch"))
        _choice(self._key("missing_blocks"), self.missing_blocks, ("zero_copy", "wait"))


@dataclass
class MetricsConfig(_Section):
    _PATH: ClassVar[str] = "metrics"

    http_port: int | None = None
    """None: never start an HTTP server. Else the port of the Prometheus endpoint."""
    http_addr: str = "127.0.0.1"
    """Address the Prometheus endpoint binds: an IP address or a hostname. Loopback unless
    configured, so that metrics are not exposed to the network by default; '0.0.0.0' (or '::')
    lets another container scrape them."""

    def __post_init__(self) -> None:
        p = self.http_port
        if p is not None and (not _is_int(p) or not 1 <= p <= 65535):
            raise ConfigError(self._key("http_port"),
                              f"expected a port in 1..65535 or null, got {short_repr(p)}")
        _host(self._key("http_addr"), self.http_addr)


WRITE_POLICIES = ("write_back", "write_through")
STORAGE_MODES = ("tensors", "none")


@dataclass
class CacheConfig(_Section):
    """The whole configuration. Build with `from_yaml`, `from_dict`, `default()`, or directly
    (nested sections may be given as plain mappings)."""

    _PATH: ClassVar[str] = ""
    _NESTED: ClassVar[dict[str, type]] = {
        "model": ModelConfig, "tiers": TiersConfig, "migrator": MigratorConfig,
        "compactor": CompactorConfig, "kernels": KernelsConfig, "metrics": MetricsConfig,
        "cost_model": CostModelConfig, "daemon": DaemonConfig,
    }

    model: ModelConfig = field(default_factory=ModelConfig)
    block_size: int | str = 16
    """Tokens per block: a power of two in 1..4096, or "auto" (resolved here to an int)."""
    tiers: TiersConfig = field(default_factory=TiersConfig)
    policy: str = "adaptive"
    """Eviction policy: a registered name (tiered_cache.policies.POLICIES) or 'pkg.module:Class'.
    The default, `adaptive`, follows per tier whichever of LRU and two credit orders its
    sampled simulations say fits the stream (docs/replay.md)."""
    write_policy: str = "write_back"
    verify_tokens: bool = True
    allow_non_finite_kv: bool = False
    """Store KV containing NaN or inf. Off: write() refuses it (KVValueError), at the cost of a
    pass over the KV (a device sync on a GPU). FP8 storage refuses it either way."""
    share_inflight: bool = False
    """open() also takes the full prompt blocks other open sequences are computing, and waits
    for them (core/inflight.py). Off by default: a waiter blocks in wait/attention until the
    writer writes, so an engine must keep its writers running (one thread serving both must
    run the writer's layer first)."""
    storage: str = "tensors"
    """tensors | none (metadata only: simulation, trace replay)."""
    adapter_id: str | None = None
    """LoRA/adapter id; part of the block-hash namespace: printable, at most MAX_NAME_CHARS."""
    overcommit: list = field(default_factory=list)
    """Tiers (gpu, host, disk) allowed to ask for more than this machine can give at start;
    the others are refused with InsufficientMemoryError (tiered_cache/admission.py)."""
    migrator: MigratorConfig = field(default_factory=MigratorConfig)
    compactor: CompactorConfig = field(default_factory=CompactorConfig)
    kernels: KernelsConfig = field(default_factory=KernelsConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    cost_model: CostModelConfig = field(default_factory=CostModelConfig)
    daemon: DaemonConfig = field(default_factory=DaemonConfig)
    """Used by `tiered-cache serve` only."""

    def __post_init__(self) -> None:
        self._nested("model")
        self._nested("tiers")
        self._resolve_block_size()
        self._check_tier_bytes()
        from tiered_cache.policies import resolve

        resolve(self.policy, "policy")
        _choice("write_policy", self.write_policy, WRITE_POLICIES)
        _bool("verify_tokens", self.verify_tokens)
        _bool("allow_non_finite_kv", self.allow_non_finite_kv)
        _bool("share_inflight", self.share_inflight)
        _choice("storage", self.storage, STORAGE_MODES)
        check_identifier("adapter_id", self.adapter_id, optional=True)
        _overcommit(self.overcommit)
        for name in ("migrator", "compactor", "kernels", "metrics", "cost_model", "daemon"):
            self._nested(name)

    def _check_tier_bytes(self) -> None:
        """A tier (or its resize ceiling, or one segment) holds at most MAX_SIZE_BYTES: each
        count is bounded on its own, but 2**31 blocks of a large geometry would still be
        2**78 bytes, past int64 in every offset computed from them."""
        block = self.block_bytes
        for name in ("gpu", "host"):
            tier = getattr(self.tiers, name)
            for key in ("num_blocks", "max_num_blocks", "segment_blocks"):
                n = getattr(tier, key)
                if n is not None and n * block > MAX_SIZE_BYTES:
                    raise ConfigError(
                        f"tiers.{name}.{key}",
                        f"{n:,} blocks of {block:,} bytes are {sizing.format_bytes(n * block)}, "
                        f"above the 1 PiB a tier may hold")

    def _resolve_block_size(self) -> None:
        bs = self.block_size
        if isinstance(bs, str) and bs == "auto":
            l2 = sizing.l2_cache_bytes(self.tiers.gpu.device)
            self.block_size = sizing.auto_block_size(l2, self.model.kv_hidden,
                                                     self.model.dtype_size)
            return
        if not _is_int(bs) or not 1 <= bs <= 4096 or bs & (bs - 1):
            raise ConfigError("block_size",
                              f"expected a power of two in 1..4096 or 'auto', "
                              f"got {short_repr(bs)}")

    # -- derived sizes --------------------------------------------------------------------

    @property
    def bytes_per_token(self) -> int:
        return self.model.bytes_per_token

    @property
    def block_bytes(self) -> int:
        """Bytes of one block in every tier: bytes_per_token * block_size (+ fp8 scales)."""
        return self.model.bytes_per_token * self.block_size + self.model.block_scale_bytes

    @property
    def num_q_heads(self) -> int:
        return self.model.num_q_heads

    # -- loading --------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> CacheConfig:
        """Build from a plain (possibly nested) mapping; missing keys take their defaults."""
        return _from_mapping(cls, data)

    @classmethod
    def from_yaml(cls, path: str | Path) -> CacheConfig:
        """Load a YAML file. A missing file, unreadable file or bad YAML raises ConfigError
        naming the file. YAML is read with 1.2 scalars: only true/false are booleans (`yes` stays
        a string), and `70.6e9` is a float."""
        if not isinstance(path, (str, os.PathLike)):
            raise ConfigError("config", f"expected a file path, got {short_repr(path)}")
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ConfigError(str(path), "no such config file") from None
        except (OSError, ValueError) as exc:  # ValueError: a NUL in the path, UnicodeDecodeError
            reason = getattr(exc, "strerror", None) or str(exc)
            raise ConfigError(str(path), f"cannot read config file: {reason}") from None
        data = load_yaml(text, str(path))
        try:
            return cls.from_dict(data)
        except ConfigError as exc:
            if hasattr(exc, "add_note"):  # Python >= 3.11
                exc.add_note(f"in config file {path}")
            raise

    @classmethod
    def default(cls) -> CacheConfig:
        """The embedded default config (the content of configs/default.yaml)."""
        return cls.from_dict(load_yaml(DEFAULT_YAML, "<default config>"))

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict (block_size resolved) that from_dict turns back into an equal
        config."""
        return dataclasses.asdict(self)


# --------------------------------------------------------------------------------------------
# YAML with 1.2 scalars

_BOOL_TAG = "tag:yaml.org,2002:bool"
_FLOAT_TAG = "tag:yaml.org,2002:float"
_INT_TAG = "tag:yaml.org,2002:int"
_MERGE_TAG = "tag:yaml.org,2002:merge"
_TIMESTAMP_TAG = "tag:yaml.org,2002:timestamp"
_VALUE_TAG = "tag:yaml.org,2002:value"

# Every pattern ends in \Z, not $: `$` also matches before a final newline. ASCII digits only.
_BOOL_RE = re.compile(r"^(?:true|True|TRUE|false|False|FALSE)\Z")
_FLOAT_RE = re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*\.[0-9_]*|\.[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)?
                          |[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+
                          |[-+]?\.(?:inf|Inf|INF)
                          |\.(?:nan|NaN|NAN))\Z""", re.X | re.ASCII)
# Integers: decimal (with `_` digit separators, as PyYAML has always read them) and 0x hex, the
# forms YAML 1.1 and 1.2 agree on. Not 1.1's sexagesimal (`1:30` is 90) or C octal (`010` is 8);
# not 1.2's `0o17` either, which PyYAML's (1.1) dumper writes unquoted for the *string* "0o17".
_INT_RE = re.compile(r"^(?:[-+]?[0-9][0-9_]*|0x[0-9a-fA-F]+)\Z", re.ASCII)


class _Loader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 booleans (true/false only), floats (`1e9`, `70.6e9`) and ints
    (decimal or 0x; no `1:30` = 90, no `010` = 8); dates stay strings; an error on duplicate
    keys; merge keys (`<<`) work; nesting is bounded (MAX_YAML_DEPTH). Every malformed scalar is
    a YAML error with its line and column: PyYAML's own constructors let explicit tags raise
    ValueError (`!!int abc`, `!!timestamp 2024-13-45`), KeyError (`!!bool abc`) or
    AttributeError."""

    def __init__(self, stream: Any) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        self._depth += 1
        try:
            if self._depth > MAX_YAML_DEPTH:
                raise yaml.composer.ComposerError(
                    None, None, f"nesting deeper than {MAX_YAML_DEPTH} levels",
                    self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def flatten_mapping(self, node: yaml.MappingNode) -> None:
        # Duplicates are checked here, on the keys written in this mapping (merged keys may be
        # overridden: that is what `<<` is for), since every mapping, including one merged
        # inline, passes through here before it is flattened.
        seen: set = set()
        for key_node, _ in node.value:
            if key_node.tag == _MERGE_TAG or not isinstance(key_node, yaml.ScalarNode):
                continue  # non-scalar keys are unhashable: construct_mapping refuses them
            key = self.construct_object(key_node)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {short_repr(key)}", key_node.start_mark)
            seen.add(key)
        super().flatten_mapping(node)


def _scalar_error(node: yaml.Node, what: str, value: str) -> yaml.YAMLError:
    return yaml.constructor.ConstructorError(
        None, None, f"expected {what}, got {short_repr(value)}", node.start_mark)


def _construct_bool(loader: _Loader, node: yaml.Node) -> bool:
    value = loader.construct_scalar(node)
    if not _BOOL_RE.match(value):
        raise _scalar_error(node, "true or false", value)
    return value.lower() == "true"


def _construct_int(loader: _Loader, node: yaml.Node) -> int:
    value = loader.construct_scalar(node)
    if not _INT_RE.match(value):
        raise _scalar_error(node, "an integer", value)
    digits = value.replace("_", "")
    if len(digits) > MAX_YAML_INT_DIGITS:
        raise yaml.constructor.ConstructorError(
            None, None, f"integer of {len(digits):,} digits (at most {MAX_YAML_INT_DIGITS})",
            node.start_mark)
    if digits.startswith("0x"):
        return int(digits[2:], 16)
    return int(digits, 10)


def _construct_float(loader: _Loader, node: yaml.Node) -> float:
    value = loader.construct_scalar(node)
    if _INT_RE.match(value) and not value.startswith("0x"):
        return float(value.replace("_", ""))  # `!!float 3`
    if not _FLOAT_RE.match(value):
        raise _scalar_error(node, "a number", value)
    lowered = value.lower()
    if lowered.endswith(".inf"):
        return -math.inf if lowered.startswith("-") else math.inf
    if lowered == ".nan":
        return math.nan
    return float(value.replace("_", ""))


def _construct_timestamp(loader: _Loader, node: yaml.Node) -> Any:
    raise yaml.constructor.ConstructorError(
        None, None, "!!timestamp is not a config value (write the date as a string)",
        node.start_mark)


_Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers
            if tag not in (_BOOL_TAG, _FLOAT_TAG, _INT_TAG, _TIMESTAMP_TAG, _VALUE_TAG)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(_BOOL_TAG, _BOOL_RE, list("tTfF"))
_Loader.add_implicit_resolver(_FLOAT_TAG, _FLOAT_RE, list("-+0123456789."))
_Loader.add_implicit_resolver(_INT_TAG, _INT_RE, list("-+0123456789"))
_Loader.add_constructor(_BOOL_TAG, _construct_bool)
_Loader.add_constructor(_INT_TAG, _construct_int)
_Loader.add_constructor(_FLOAT_TAG, _construct_float)
_Loader.add_constructor(_TIMESTAMP_TAG, _construct_timestamp)
# `<<` outside a key (`name: <<`) is just the string; as a key, flatten_mapping has removed it.
_Loader.add_constructor(_MERGE_TAG, yaml.SafeLoader.construct_yaml_str)


def load_yaml(text: str | bytes, source: str = "<string>") -> Any:
    """Parse YAML text with the config loader; any malformed input raises
    ConfigError(source, "invalid YAML at line L, column C: ...")."""
    if not isinstance(text, (str, bytes)):
        raise ConfigError(source, f"expected YAML text, got {type(text).__name__}")
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 - _Loader is a SafeLoader
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        # context first: "expected a single document in the stream, but found another document"
        parts = [getattr(exc, "context", None), getattr(exc, "problem", None)]
        problem = ", ".join(p for p in parts if p) or str(exc)
        raise ConfigError(source, f"invalid YAML{where}: {problem}") from None
    except RecursionError:
        # NOTE: nesting is bounded in compose_node; this is for a caller already deep in its
        # own stack, where even MAX_YAML_DEPTH levels do not fit.
        raise ConfigError(source, "invalid YAML: nested too deeply to parse here") from None


# The content of configs/default.yaml, embedded so that CacheConfig.default() works from a wheel.
# tests/test_config.py checks that the two stay equal.
DEFAULT_YAML = """\
# tiered-cache: the embedded default config (CacheConfig.default() loads this same content).
# A tiny geometry that runs in seconds on a CPU. Every key is described in docs/configuration.md.

model:
  name: tiny-llama        # model id; part of the block-hash namespace
  num_layers: 4           # transformer layers
  num_kv_heads: 2         # KV heads per layer
  head_dim: 64            # elements per head
  num_q_heads: 8          # query heads; a multiple of num_kv_heads (GQA group of 4)
  dtype: float32          # KV storage dtype: float32 | float16 | bfloat16 | fp8_e4m3
  num_params: null        # parameter count, for cost models (e.g. 70.6e9); optional

block_size: 16            # tokens per block: a power of two in 1..4096, or auto

tiers:
  gpu:
    device: auto          # auto | cpu | cuda | cuda:N  (auto: cuda when available, else cpu)
    num_blocks: 256       # or capacity: "40GiB" / "70%" of free memory (exactly one of the two)
    max_num_blocks: null  # cache.resize ceiling (address space only); null: physical memory
    segment_blocks: null  # resize backs/frees memory in segments of this many blocks (~64 MiB)
    resizable: false      # CUDA: map the pool per segment (virtual memory API) so it can resize
  host:
    num_blocks: 1024      # or capacity; 0 means no host tier
    memory: pinned        # pinned | managed | pageable (pinned: pageable without CUDA)
    max_num_blocks: null
    segment_blocks: null

policy: adaptive          # eviction policy: a registered name or "pkg.module:Class"
write_policy: write_back  # write_back: copy to host on eviction | write_through: as soon as full
verify_tokens: true       # compare stored token ids on a hash match
allow_non_finite_kv: false  # store KV with NaN/inf (off: write() refuses it; costs a pass)
share_inflight: false     # open() takes prompt blocks other open sequences are computing
storage: tensors          # tensors | none (metadata only: simulation and trace replay)
adapter_id: null          # LoRA/adapter id; part of the hash namespace
overcommit: []            # tiers that may ask for more memory/disk than the machine has free

migrator:
  enabled: true           # run the background migrator
  high_watermark: 0.9     # demote GPU blocks when GPU usage passes this fraction ...
  low_watermark: 0.8      # ... down to this one (0 < low < high <= 1)
  num_workers: 2          # copy worker threads (CPU) / streams (GPU)
  batch_blocks: 64        # blocks per migration batch
  wait_timeout_s: 30.0    # longest wait for an in-flight promotion before giving up
  max_retries: 3          # retries of a failed copy before the block stays where it is
  promotion_chunk_bytes: 8388608  # promote at least this many bytes per copy (0: a layer each)

compactor:
  enabled: true           # run the background compactor
  threshold: 0.25         # compact past this: free slots below the highest used one / used slots
  interval_s: 0.05        # seconds between compaction steps
  max_moves_per_step: 64  # blocks moved per step (bounds each lock hold)

kernels:
  attention_backend: auto # auto (triton on CUDA, torch otherwise) | triton | torch
  missing_blocks: zero_copy  # zero_copy: read host blocks in place | wait: wait for promotion

cost_model:
  enabled: true           # load a block from disk/remote only when faster than recomputing it
  prefill_tflops: 400.0   # achieved prefill TFLOPS of the serving GPU(s) (x tensor parallel)
  margin: 1.1             # a load must beat recompute by this factor
  disk_latency_ms: 0.2    # disk priors until measured
  disk_bandwidth_gbps: 2.0

metrics:
  http_port: null         # null: never start an HTTP server; else the Prometheus port
  http_addr: 127.0.0.1    # address the endpoint binds; 0.0.0.0 (or "::") to serve the network
"""
