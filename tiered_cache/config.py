"""Configuration: dataclasses validated on construction, loaded from YAML or a plain dict.

Every section knows its place in the tree (`_PATH`), so a bad value raises ConfigError with the
full key path whether the section came from a file or was built in Python:

    >>> CacheConfig.from_dict({"tiers": {"host": {"capacity": "lots"}}})
    ConfigError: tiers.host.capacity: expected a size like '64GiB' or '70%', got 'lots'

Unknown keys are rejected with the closest valid key suggested. `docs/configuration.md` lists
every key. This module imports no torch (only `block_size: auto` asks torch, lazily, for the L2
size).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import yaml

from tiered_cache import sizing
from tiered_cache.errors import ConfigError

KV_DTYPES: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8_e4m3": 1}
"""KV storage dtypes and their bytes per element."""

FP8_SCALE_BYTES = 4
"""fp8 KV keeps one float32 scale per (layer, K|V) per block."""

DEVICES_HINT = "'auto', 'cpu', 'cuda' or 'cuda:N'"
_DEVICE_RE = re.compile(r"^(auto|cpu|cuda(?::\d+)?)$")


# --------------------------------------------------------------------------------------------
# value checks: each raises ConfigError(path, "expected ..., got <repr>")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _positive_int(path: str, v: Any) -> int:
    if not _is_int(v) or v < 1:
        raise ConfigError(path, f"expected a positive integer, got {v!r}")
    return v


def _non_negative_int(path: str, v: Any) -> int:
    if not _is_int(v) or v < 0:
        raise ConfigError(path, f"expected a non-negative integer, got {v!r}")
    return v


def _positive_number(path: str, v: Any) -> float:
    if not _is_number(v) or v <= 0:
        raise ConfigError(path, f"expected a positive number, got {v!r}")
    return float(v)


def _fraction(path: str, v: Any, *, upper_open: bool = False) -> float:
    ok = _is_number(v) and 0 < v and (v < 1 if upper_open else v <= 1)
    if not ok:
        interval = "(0, 1)" if upper_open else "(0, 1]"
        raise ConfigError(path, f"expected a number in {interval}, got {v!r}")
    return float(v)


def _bool(path: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise ConfigError(path, f"expected true or false, got {v!r}")
    return v


def _choice(path: str, v: Any, choices: Any) -> str:
    if not isinstance(v, str) or v not in choices:
        listed = ", ".join(repr(c) for c in choices)
        raise ConfigError(path, f"expected one of {listed}, got {v!r}")
    return v


def _name(path: str, v: Any, *, optional: bool = False) -> str | None:
    if v is None and optional:
        return None
    if not isinstance(v, str) or not v.strip():
        what = "a non-empty string or null" if optional else "a non-empty string"
        raise ConfigError(path, f"expected {what}, got {v!r}")
    return v


def _size(path: str, v: Any) -> None:
    if v is not None:
        sizing.parse_size(v, path)


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
    return f"expected a mapping of keys, got {type(value).__name__} {value!r}"


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
        if key not in valid:
            path = cls._key(str(key))
            close = difflib.get_close_matches(str(key), valid, n=1)
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
    """Model id; part of the block-hash namespace."""
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
        _name(self._key("name"), self.name)
        _positive_int(self._key("num_layers"), self.num_layers)
        _positive_int(self._key("num_kv_heads"), self.num_kv_heads)
        _positive_int(self._key("head_dim"), self.head_dim)
        if self.num_q_heads is None:
            self.num_q_heads = self.num_kv_heads
        _positive_int(self._key("num_q_heads"), self.num_q_heads)
        if self.num_q_heads % self.num_kv_heads:
            raise ConfigError(
                self._key("num_q_heads"),
                f"must be a multiple of num_kv_heads ({self.num_kv_heads}), "
                f"got {self.num_q_heads}")
        _choice(self._key("dtype"), self.dtype, KV_DTYPES)
        if self.num_params is not None:
            self.num_params = _positive_number(self._key("num_params"), self.num_params)

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
            check(self._key("num_blocks"), self.num_blocks)
        for key in ("max_num_blocks", "segment_blocks"):
            if getattr(self, key) is not None:
                _positive_int(self._key(key), getattr(self, key))
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
        if not isinstance(self.device, str) or not _DEVICE_RE.match(self.device):
            raise ConfigError(self._key("device"),
                              f"expected one of {DEVICES_HINT}, got {self.device!r}")
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
class TiersConfig(_Section):
    _PATH: ClassVar[str] = "tiers"
    _NESTED: ClassVar[dict[str, type]] = {"gpu": GpuTierConfig, "host": HostTierConfig}

    gpu: GpuTierConfig = field(default_factory=lambda: GpuTierConfig(num_blocks=256))
    host: HostTierConfig = field(default_factory=lambda: HostTierConfig(num_blocks=1024))

    def __post_init__(self) -> None:
        self._nested("gpu")
        self._nested("host")


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
        _positive_int(self._key("num_workers"), self.num_workers)
        _positive_int(self._key("batch_blocks"), self.batch_blocks)
        self.wait_timeout_s = _positive_number(self._key("wait_timeout_s"), self.wait_timeout_s)
        _non_negative_int(self._key("max_retries"), self.max_retries)
        _non_negative_int(self._key("promotion_chunk_bytes"), self.promotion_chunk_bytes)


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
        self.threshold = _positive_number(self._key("threshold"), self.threshold)
        self.interval_s = _positive_number(self._key("interval_s"), self.interval_s)
        _positive_int(self._key("max_moves_per_step"), self.max_moves_per_step)


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

    def __post_init__(self) -> None:
        p = self.http_port
        if p is not None and (not _is_int(p) or not 1 <= p <= 65535):
            raise ConfigError(self._key("http_port"),
                              f"expected a port in 1..65535 or null, got {p!r}")


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
    }

    model: ModelConfig = field(default_factory=ModelConfig)
    block_size: int | str = 16
    """Tokens per block: a power of two in 1..4096, or "auto" (resolved here to an int)."""
    tiers: TiersConfig = field(default_factory=TiersConfig)
    policy: str = "lru"
    """Eviction policy: a registered name (tiered_cache.policies.POLICIES) or 'pkg.module:Class'."""
    write_policy: str = "write_back"
    verify_tokens: bool = True
    storage: str = "tensors"
    """tensors | none (metadata only: simulation, trace replay)."""
    adapter_id: str | None = None
    migrator: MigratorConfig = field(default_factory=MigratorConfig)
    compactor: CompactorConfig = field(default_factory=CompactorConfig)
    kernels: KernelsConfig = field(default_factory=KernelsConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)

    def __post_init__(self) -> None:
        self._nested("model")
        self._nested("tiers")
        self._resolve_block_size()
        from tiered_cache.policies import resolve

        resolve(self.policy, "policy")
        _choice("write_policy", self.write_policy, WRITE_POLICIES)
        _bool("verify_tokens", self.verify_tokens)
        _choice("storage", self.storage, STORAGE_MODES)
        _name("adapter_id", self.adapter_id, optional=True)
        for name in ("migrator", "compactor", "kernels", "metrics"):
            self._nested(name)

    def _resolve_block_size(self) -> None:
        bs = self.block_size
        if bs == "auto":
            l2 = sizing.l2_cache_bytes(self.tiers.gpu.device)
            self.block_size = sizing.auto_block_size(l2, self.model.kv_hidden,
                                                     self.model.dtype_size)
            return
        if not _is_int(bs) or not 1 <= bs <= 4096 or bs & (bs - 1):
            raise ConfigError("block_size",
                              f"expected a power of two in 1..4096 or 'auto', got {bs!r}")

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
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ConfigError(str(path), "no such config file") from None
        except (OSError, UnicodeDecodeError) as exc:
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


class _Loader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 booleans (true/false only) and floats (`1e9`, `70.6e9`), and an
    error on duplicate keys."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, (str, int, float, bool)) or key is None:
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {key!r}", key_node.start_mark)
                seen.add(key)
        return super().construct_mapping(node, deep=deep)


_BOOL_TAG = "tag:yaml.org,2002:bool"
_FLOAT_TAG = "tag:yaml.org,2002:float"
_Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag not in (_BOOL_TAG, _FLOAT_TAG)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(
    _BOOL_TAG, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
_Loader.add_implicit_resolver(
    _FLOAT_TAG,
    re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*\.[0-9_]*|\.[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)?
                  |[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+
                  |[-+]?\.(?:inf|Inf|INF)
                  |\.(?:nan|NaN|NAN))$""", re.X),
    list("-+0123456789."))


def load_yaml(text: str, source: str = "<string>") -> Any:
    """Parse YAML text with the config loader; syntax errors raise ConfigError(source, ...)."""
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 - _Loader is a SafeLoader
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(source, f"invalid YAML{where}: {problem}") from None


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

policy: lru               # eviction policy: a registered name or "pkg.module:Class"
write_policy: write_back  # write_back: copy to host on eviction | write_through: as soon as full
verify_tokens: true       # compare stored token ids on a hash match
storage: tensors          # tensors | none (metadata only: simulation and trace replay)
adapter_id: null          # LoRA/adapter id; part of the hash namespace

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

metrics:
  http_port: null         # null: never start an HTTP server; else the Prometheus port
"""
