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
from tiered_cache.policies import resolve as resolve_policy
from tiered_cache.sections import (
    Section,
    TierSize,
    boolean,
    choice,
    fraction,
    from_mapping,
    is_int,
    non_negative_int,
    not_a_mapping,
    positive_int,
    positive_number,
    unknown_key,
)
from tiered_cache.sizing import MAX_NUM_BLOCKS, MAX_SIZE_BYTES, short_repr
from tiered_cache.tiers import SLOT
from tiered_cache.tiers import kinds as registered_kinds

KV_DTYPES: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8_e4m3": 1}
"""KV storage dtypes and their bytes per element."""

FP8_SCALE_BYTES = 4
"""fp8 KV keeps one float32 scale per (layer, K|V) per block."""

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


def _overcommit(v: Any) -> None:
    """`overcommit`: distinct names of registered slot tier kinds (tiered_cache/admission.py)."""
    names = tuple(name for name, kind in registered_kinds().items() if kind.shape == SLOT)
    # NOTE: item types first: a set of YAML-aliased nested lists must never be built or repr'd
    if not isinstance(v, list) or len(v) > len(names) \
            or not all(isinstance(x, str) and x in names for x in v) or len(set(v)) != len(v):
        raise ConfigError("overcommit", f"expected a list of distinct tier names from "
                                        f"{', '.join(names)} (tiers allowed to ask for more "
                                        f"than this machine can give), got {short_repr(v)}")


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


# --------------------------------------------------------------------------------------------
# sections


@dataclass
class ModelConfig(Section):
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
        positive_int(self._key("num_layers"), self.num_layers, MAX_NUM_LAYERS)
        positive_int(self._key("num_kv_heads"), self.num_kv_heads, MAX_NUM_HEADS)
        positive_int(self._key("head_dim"), self.head_dim, MAX_HEAD_DIM)
        if self.num_q_heads is None:
            self.num_q_heads = self.num_kv_heads
        positive_int(self._key("num_q_heads"), self.num_q_heads, MAX_NUM_HEADS)
        if self.num_q_heads % self.num_kv_heads:
            raise ConfigError(
                self._key("num_q_heads"),
                f"must be a multiple of num_kv_heads ({self.num_kv_heads}), "
                f"got {self.num_q_heads}")
        choice(self._key("dtype"), self.dtype, KV_DTYPES)
        if self.num_params is not None:
            self.num_params = positive_number(self._key("num_params"), self.num_params,
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




class TiersConfig(Section):
    """`tiers`: one section per registered tier kind (tiered_cache.tiers), `tiers.<kind>`. A
    kind that is always configured (gpu, host) gets its default section when absent; an
    optional one (disk, remote, daemon) is None. A kind registered later (one module, no edit
    here) is accepted from then on. Sections read as attributes: `config.tiers.host`."""

    _PATH: ClassVar[str] = "tiers"

    def __init__(self, **sections: Any) -> None:
        known = registered_kinds()
        for name in sections:
            if name not in known:
                raise unknown_key(type(self), name, list(known), aliases=self._aliases())
        self._sections: dict[str, Any] = {}
        for name, kind in known.items():
            value = sections.get(name)
            if value is None:
                value = kind.default_section()
            elif not isinstance(value, kind.section):
                if not isinstance(value, Mapping):
                    raise ConfigError(self._key(name), not_a_mapping(value))
                value = from_mapping(kind.section, value)
            self._sections[name] = value

    @classmethod
    def _keys(cls) -> list[str]:
        return list(registered_kinds())

    @classmethod
    def _nested_types(cls) -> dict[str, type]:
        return {name: kind.section for name, kind in registered_kinds().items()}

    @classmethod
    def _aliases(cls) -> dict[str, str]:
        return {a: name for name, kind in registered_kinds().items() for a in kind.aliases}

    def __getattr__(self, name: str) -> Any:
        sections = self.__dict__.get("_sections")
        if sections is None or name not in sections:
            raise AttributeError(f"no tier kind {name!r} is registered (tiers: "
                                 f"{list(sections or ())})")
        return sections[name]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TiersConfig) and self._sections == other._sections

    __hash__ = None  # type: ignore[assignment]  # mutable, as the dataclass sections are

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={v!r}" for k, v in self._sections.items())
        return f"TiersConfig({inner})"

    def items(self):
        """(kind name, section or None), in the registry's order."""
        return self._sections.items()

    def to_dict(self) -> dict[str, Any]:
        return {name: dataclasses.asdict(section) if section is not None else None
                for name, section in self._sections.items()}

    def compute_device(self) -> str:
        """The device the device tier runs on: the `device` key of the fastest configured
        section that has one ("auto" when none does); `block_size: auto` reads its L2."""
        return next((s.device for s in self._sections.values()
                     if s is not None and isinstance(getattr(s, "device", None), str)), "auto")


@dataclass
class MigratorConfig(Section):
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
        boolean(self._key("enabled"), self.enabled)
        self.high_watermark = fraction(self._key("high_watermark"), self.high_watermark)
        self.low_watermark = fraction(self._key("low_watermark"), self.low_watermark,
                                       upper_open=True)
        if self.low_watermark >= self.high_watermark:
            raise ConfigError(self._key("low_watermark"),
                              f"must be below high_watermark ({self.high_watermark}), "
                              f"got {self.low_watermark}")
        positive_int(self._key("num_workers"), self.num_workers, MAX_NUM_WORKERS)
        positive_int(self._key("batch_blocks"), self.batch_blocks, MAX_NUM_BLOCKS)
        self.wait_timeout_s = positive_number(self._key("wait_timeout_s"), self.wait_timeout_s,
                                               MAX_TIMEOUT_S)
        non_negative_int(self._key("max_retries"), self.max_retries, MAX_RETRIES)
        non_negative_int(self._key("promotion_chunk_bytes"), self.promotion_chunk_bytes,
                          MAX_SIZE_BYTES)


@dataclass
class CompactorConfig(Section):
    """Background compaction of live blocks into low slots."""

    _PATH: ClassVar[str] = "compactor"

    enabled: bool = True
    threshold: float = 0.25
    interval_s: float = 0.05
    max_moves_per_step: int = 64

    def __post_init__(self) -> None:
        boolean(self._key("enabled"), self.enabled)
        self.threshold = positive_number(self._key("threshold"), self.threshold,
                                          MAX_COMPACT_THRESHOLD)
        self.interval_s = positive_number(self._key("interval_s"), self.interval_s,
                                           MAX_INTERVAL_S)
        positive_int(self._key("max_moves_per_step"), self.max_moves_per_step, MAX_NUM_BLOCKS)


@dataclass
class DaemonConfig(Section):
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
    hello_timeout_s: float = 5.0
    """A connection that has not said `hello` this long after it was accepted is closed (it
    holds one of `max_clients` slots meanwhile)."""
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
        elif not is_int(mode) or mode not in (0o600, 0o660):
            raise ConfigError(self._key("socket_mode"), "expected \"0600\" or \"0660\" (a "
                                                        "string: YAML has no octal numbers), "
                                                        f"got {short_repr(mode)}")
        for key in ("allow_uids", "allow_gids"):
            v = getattr(self, key)
            if not isinstance(v, list) or len(v) > 4096 or not all(
                    is_int(x) and 0 <= x < 2**32 for x in v):
                raise ConfigError(self._key(key), f"expected a list of ids in 0..2**32-1, got "
                                                  f"{short_repr(v)}")
        if not isinstance(self.tenants, dict) or len(self.tenants) > 4096:
            raise ConfigError(self._key("tenants"), f"expected a mapping, got "
                                                    f"{short_repr(self.tenants)}")
        for who, name in self.tenants.items():
            _tenant_key(self._key("tenants"), who)
            if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}",
                                                             name):
                raise ConfigError(self._key(f"tenants.{who}"),
                                  "expected a tenant name of 1..64 letters, digits, '_', '.' or "
                                  f"'-' (it names the tenant's disk directory), got "
                                  f"{short_repr(name)}")
        self.lease_s = positive_number(self._key("lease_s"), self.lease_s, 86400)
        positive_int(self._key("max_frame_mib"), self.max_frame_mib, 1024)
        positive_int(self._key("max_clients"), self.max_clients, 65536)
        self.hello_timeout_s = positive_number(self._key("hello_timeout_s"),
                                                self.hello_timeout_s, 3600)
        positive_int(self._key("staging_blocks"), self.staging_blocks, 4096)
        choice(self._key("log_format"), self.log_format, ("text", "json"))
        non_negative_int(self._key("page_pool_mib"), self.page_pool_mib, 1 << 24)
        non_negative_int(self._key("page_disk_mib"), self.page_disk_mib, 1 << 32)


def _tenant_key(path: str, who: Any) -> None:
    """A `daemon.tenants` key: "uid:N" or "gid:N", N in 0..2**32-1 written as a peer's id is
    (`f"uid:{uid}"`: no sign, no leading zeros), or no peer could ever match it."""
    m = re.fullmatch(r"(uid|gid):([0-9]{1,10})", who) if isinstance(who, str) else None
    if m is None:
        raise ConfigError(path, f"expected keys 'uid:N' or 'gid:N', got {short_repr(who)}")
    n = int(m.group(2))
    if n > 2**32 - 1:
        raise ConfigError(path, f"{who!r}: {m.group(1)}s are 0..4294967295; no peer has {n}")
    if m.group(2) != str(n):
        raise ConfigError(path, f"{who!r} can never match a peer: write {m.group(1)}:{n} (ids "
                                "are compared as written, without leading zeros)")


@dataclass
class CostModelConfig(Section):
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
        boolean(self._key("enabled"), self.enabled)
        self.prefill_tflops = positive_number(self._key("prefill_tflops"),
                                               self.prefill_tflops, 1e6)
        self.margin = positive_number(self._key("margin"), self.margin, 100.0)
        self.disk_latency_ms = positive_number(self._key("disk_latency_ms"),
                                                self.disk_latency_ms, 60_000)
        self.disk_bandwidth_gbps = positive_number(self._key("disk_bandwidth_gbps"),
                                                    self.disk_bandwidth_gbps, 10_000)


@dataclass
class KernelsConfig(Section):
    _PATH: ClassVar[str] = "kernels"

    attention_backend: str = "auto"
    """auto | triton | torch."""
    missing_blocks: str = "zero_copy"
    """zero_copy (read host blocks in place) | wait (wait for their promotion)."""

    def __post_init__(self) -> None:
        choice(self._key("attention_backend"), self.attention_backend,
                ("auto", "triton", "torch"))
        choice(self._key("missing_blocks"), self.missing_blocks, ("zero_copy", "wait"))


@dataclass
class MetricsConfig(Section):
    _PATH: ClassVar[str] = "metrics"

    http_port: int | None = None
    """None: never start an HTTP server. Else the port of the Prometheus endpoint."""
    http_addr: str = "127.0.0.1"
    """Address the Prometheus endpoint binds: an IP address or a hostname. Loopback unless
    configured, so that metrics are not exposed to the network by default; '0.0.0.0' (or '::')
    lets another container scrape them."""

    def __post_init__(self) -> None:
        p = self.http_port
        if p is not None and (not is_int(p) or not 1 <= p <= 65535):
            raise ConfigError(self._key("http_port"),
                              f"expected a port in 1..65535 or null, got {short_repr(p)}")
        _host(self._key("http_addr"), self.http_addr)


WRITE_POLICIES = ("write_back", "write_through")
STORAGE_MODES = ("tensors", "none")


@dataclass
class CacheConfig(Section):
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
        resolve_policy(self.policy, "policy")
        choice("write_policy", self.write_policy, WRITE_POLICIES)
        boolean("verify_tokens", self.verify_tokens)
        boolean("allow_non_finite_kv", self.allow_non_finite_kv)
        boolean("share_inflight", self.share_inflight)
        choice("storage", self.storage, STORAGE_MODES)
        check_identifier("adapter_id", self.adapter_id, optional=True)
        _overcommit(self.overcommit)
        for name in ("migrator", "compactor", "kernels", "metrics", "cost_model", "daemon"):
            self._nested(name)

    def _check_tier_bytes(self) -> None:
        """A tier (or its resize ceiling, or one segment) holds at most MAX_SIZE_BYTES: each
        count is bounded on its own, but 2**31 blocks of a large geometry would still be
        2**78 bytes, past int64 in every offset computed from them."""
        block = self.block_bytes
        for name, tier in self.tiers.items():
            if not isinstance(tier, TierSize):
                continue
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
            l2 = sizing.l2_cache_bytes(self.tiers.compute_device())
            self.block_size = sizing.auto_block_size(l2, self.model.kv_hidden,
                                                     self.model.dtype_size)
            return
        if not is_int(bs) or not 1 <= bs <= 4096 or bs & (bs - 1):
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
        bs = self.block_size
        assert isinstance(bs, int)          # ("auto" is resolved on construction)
        return self.model.bytes_per_token * bs + self.model.block_scale_bytes

    @property
    def num_q_heads(self) -> int:
        n = self.model.num_q_heads
        assert n is not None                # (None means num_kv_heads, set on construction)
        return n

    # -- loading --------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> CacheConfig:
        """Build from a plain (possibly nested) mapping; missing keys take their defaults."""
        return from_mapping(cls, data)

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
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[f.name] = (value.to_dict() if isinstance(value, TiersConfig) else
                           dataclasses.asdict(value)
                           if dataclasses.is_dataclass(value) and not isinstance(value, type) else
                           value)
        return out


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


def _construct_bool(loader: _Loader, node: yaml.ScalarNode) -> bool:
    value = loader.construct_scalar(node)
    if not _BOOL_RE.match(value):
        raise _scalar_error(node, "true or false", value)
    return value.lower() == "true"


def _construct_int(loader: _Loader, node: yaml.ScalarNode) -> int:
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


def _construct_float(loader: _Loader, node: yaml.ScalarNode) -> float:
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


def _construct_str(loader: _Loader, node: yaml.ScalarNode) -> str:
    return loader.construct_yaml_str(node)


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
_Loader.add_constructor(_MERGE_TAG, _construct_str)


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


def __getattr__(name: str) -> Any:
    """The tier kinds' section classes by name (`from tiered_cache.config import
    HostTierConfig`): each is declared by its kind (tiered_cache.tiers)."""
    for kind in registered_kinds().values():
        if kind.section.__name__ == name:
            return kind.section
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
