"""The connector's configuration: `kv_connector_extra_config` of vLLM's KVTransferConfig.

    kv_connector_extra_config = {"tiered_cache": "/etc/tiered-cache/vllm.yaml"}
    kv_connector_extra_config = {"tiered_cache": {"tiers": {"host": {"capacity": "64GiB"}},
                                                  "vllm": {"lookup_deadline_ms": 5}}}

The value under `tiered_cache` is a tiered-cache config (a YAML file or the same mapping
inline) with one more section, `vllm:` (ConnectorSettings). What the engine already says is
taken from vLLM (`Geometry`): the model geometry and dtype, vLLM's block size. A `model:` key
given anyway must agree with vLLM (except `name`, the namespace name); `block_size` may be a
power-of-two divisor of vLLM's. Two ways to run:

- `tiers.daemon.socket` set: the connector is a client of that `tiered-cache serve` (whose own
  config holds the host, disk and remote tiers: giving them here is an error).
- otherwise: the scheduler side starts an embedded node service built from `tiers.host`,
  `tiers.disk`, `tiers.remote`, `policy`, `cost_model`, `migrator`, `metrics` and `daemon:`
  (lease, staging size) of this config; its socket and allowlist are the connector's.

Every error is a ConfigError whose path starts with `kv_connector_extra_config.tiered_cache`
(or the YAML file's name).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from tiered_cache.config import CacheConfig, load_yaml
from tiered_cache.errors import ConfigError
from tiered_cache.integrations.vllm.identity import Geometry, check_block_size

KEY = "tiered_cache"
ROOT = f"kv_connector_extra_config.{KEY}"
DEFAULT_HOST = {"capacity": "4GiB"}
"""The embedded service's pool when `tiers.host` is not given."""
ENGINE_OWNED = ("gpu",)
DAEMON_OWNED = ("host", "disk", "remote")


@dataclass
class ConnectorSettings:
    """The `vllm:` section."""

    lookup_deadline_ms: float = 5.0
    """Longest `get_num_new_matched_tokens` waits on the daemon (every rank's part together):
    the scheduler's critical path. Past it the request is a miss."""
    promote_wait_ms: float = 2000.0
    """How long a request may wait (asked again each step, not scheduled meanwhile) for blocks
    the daemon holds only on disk or in the remote store to come up into its pool; then it is
    served with what is there."""
    load: str = "sync"
    """sync: loads run layer by layer inside the step that needs them (attention on layer l
    waits for layer l only); async: the request waits for its load outside the forward
    (vLLM's WAITING_FOR_REMOTE_KVS) while other requests run."""
    save: bool = True
    """Publish every full block vLLM computes (false: read only)."""
    socket_dir: str | None = None
    """Where the embedded service's private socket directory goes (default:
    $XDG_RUNTIME_DIR, else the temp directory)."""
    attach_timeout_s: float = 60.0
    """Longest a worker waits for the embedded service to come up on its first load (vLLM
    starts workers before the scheduler)."""
    load_timeout_s: float = 5.0
    """Longest a worker waits for one daemon reply while loading or saving."""

    def __post_init__(self) -> None:
        p = f"{ROOT}.vllm"
        self.lookup_deadline_ms = _positive(f"{p}.lookup_deadline_ms", self.lookup_deadline_ms,
                                            60_000)
        self.promote_wait_ms = _non_negative(f"{p}.promote_wait_ms", self.promote_wait_ms,
                                             600_000)
        if self.load not in ("sync", "async"):
            raise ConfigError(f"{p}.load", f"expected 'sync' or 'async', got {self.load!r}")
        if not isinstance(self.save, bool):
            raise ConfigError(f"{p}.save", f"expected true or false, got {self.save!r}")
        if self.socket_dir is not None and (not isinstance(self.socket_dir, str)
                                            or not self.socket_dir or "\0" in self.socket_dir):
            raise ConfigError(f"{p}.socket_dir", f"expected a directory path, got "
                                                 f"{self.socket_dir!r}")
        self.attach_timeout_s = _positive(f"{p}.attach_timeout_s", self.attach_timeout_s, 3600)
        self.load_timeout_s = _positive(f"{p}.load_timeout_s", self.load_timeout_s, 3600)

    @classmethod
    def from_dict(cls, data: Any) -> ConnectorSettings:
        if data is None:
            return cls()
        if not isinstance(data, Mapping):
            raise ConfigError(f"{ROOT}.vllm", f"expected a mapping, got {type(data).__name__}")
        valid = {f.name for f in fields(cls)}
        for key in data:
            if key not in valid:
                raise ConfigError(f"{ROOT}.vllm.{key}", "unknown key; valid keys are "
                                  + ", ".join(sorted(valid)))
        return cls(**dict(data))


def _non_negative(path: str, v: Any, hi: float) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
            or not 0 <= v <= hi:
        raise ConfigError(path, f"expected a number in [0, {hi:g}], got {v!r}")
    return float(v)


def _positive(path: str, v: Any, hi: float) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
            or not 0 < v <= hi:
        raise ConfigError(path, f"expected a positive number at most {hi:g}, got {v!r}")
    return float(v)


@dataclass
class Resolved:
    """The connector's configuration once vLLM's geometry is known."""

    cache: CacheConfig          # the embedded service's config, or the daemon client's
    settings: ConnectorSettings
    geometry: Geometry
    socket: str | None          # an external daemon's socket; None: embedded
    staging_given: bool = False  # daemon.staging_blocks was set (else sized for a step's saves)

    @property
    def embedded(self) -> bool:
        return self.socket is None


def raw_config(extra: Mapping[str, Any] | None) -> tuple[dict[str, Any], str]:
    """(the tiered-cache mapping, the prefix of its error paths) from kv_connector_extra_config."""
    extra = dict(extra or {})
    unknown = [k for k in extra if k != KEY]
    if unknown:
        raise ConfigError(f"kv_connector_extra_config.{unknown[0]}",
                          f"unknown key; the connector reads only {KEY!r} (a tiered-cache "
                          "YAML path or mapping)")
    value = extra.get(KEY)
    if value is None:
        return {}, ROOT
    if isinstance(value, (str, os.PathLike)):
        path = Path(value)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(ROOT, f"cannot read {str(path)!r}: "
                                    f"{exc.strerror or exc}") from None
        data = load_yaml(text, str(path))
        if data is None:
            data = {}
        if not isinstance(data, Mapping):
            raise ConfigError(str(path), f"expected a mapping of keys, got "
                                         f"{type(data).__name__}")
        return dict(data), str(path)
    if isinstance(value, Mapping):
        return dict(value), ROOT
    raise ConfigError(ROOT, f"expected a YAML file path or a mapping, got "
                            f"{type(value).__name__}")


def resolve(extra: Mapping[str, Any] | None, derived: Geometry) -> Resolved:
    """Merge kv_connector_extra_config with what vLLM says (`derived`, whose block_size is the
    default one); every inconsistency is a ConfigError naming its key."""
    data, where = raw_config(extra)
    settings = ConnectorSettings.from_dict(_pop(data, "vllm", where))

    def key(k: str) -> str:
        return f"{where}.{k}" if where == ROOT else f"{where}: {k}"

    model = dict(_pop(data, "model", where) or {})
    name = model.pop("name", derived.model)
    for k, v in model.items():
        if k in ("num_q_heads", "num_params"):
            continue                    # not part of the stored geometry
        want = derived.model_section().get(k)
        if want is None:
            raise ConfigError(key(f"model.{k}"), "unknown key for the vLLM connector (the "
                                                 "geometry comes from vLLM)")
        if v != want:
            raise ConfigError(key(f"model.{k}"), f"{v!r} disagrees with the vLLM engine "
                                                 f"({want!r} per rank); leave it out")
    bs = data.pop("block_size", derived.block_size)
    check_block_size(bs, derived.vllm_block_size, key("block_size"))
    geometry = Geometry(name, derived.dtype, derived.num_layers, derived.num_kv_heads,
                        derived.head_dim, bs, derived.vllm_block_size, derived.tp_size)

    tiers = data.get("tiers") or {}
    if not isinstance(tiers, Mapping):
        raise ConfigError(key("tiers"), f"expected a mapping, got {type(tiers).__name__}")
    for t in ENGINE_OWNED:
        if t in tiers:
            raise ConfigError(key(f"tiers.{t}"), "vLLM's GPU blocks are vLLM's: the connector "
                                                 "adds tiers beneath them (host, disk, remote, "
                                                 "or a daemon)")
    daemon_tier = tiers.get("daemon")
    socket = None
    own_daemon = data.get("daemon")
    staging_given = isinstance(own_daemon, Mapping) and "staging_blocks" in own_daemon
    if daemon_tier is not None:
        for t in DAEMON_OWNED:
            if t in tiers:
                raise ConfigError(key(f"tiers.{t}"), "with tiers.daemon the daemon's own config "
                                  "holds the host, disk and remote tiers; give them there")
        if "daemon" in data:
            raise ConfigError(key("daemon"), "with tiers.daemon this is the daemon's own "
                                             "section; give it in the daemon's config")
    else:
        own = data.get("daemon") or {}
        if isinstance(own, Mapping):
            for k in ("socket", "allow_uids", "allow_gids", "socket_mode"):
                if k in own:
                    raise ConfigError(key(f"daemon.{k}"), "the embedded service's socket and "
                                      "allowlist are the connector's (vllm.socket_dir); to use "
                                      "a daemon of your own, set tiers.daemon.socket")
    merged = dict(data)
    merged["model"] = {**geometry.model_section(), **{k: v for k, v in
                                                       (_given_q(model)).items()}}
    merged["block_size"] = bs
    merged["tiers"] = dict(tiers)
    if daemon_tier is None and "host" not in tiers:
        merged["tiers"]["host"] = dict(DEFAULT_HOST)
    try:
        cache = CacheConfig.from_dict(merged)
    except ConfigError as exc:
        raise ConfigError(key(exc.path) if exc.path else where,
                          str(exc)[len(exc.path) + 2:] if exc.path else str(exc)) from None
    if cache.tiers.daemon is not None:
        socket = cache.tiers.daemon.socket
    return Resolved(cache, settings, geometry, socket, staging_given)


def _given_q(model: Mapping[str, Any]) -> dict[str, Any]:
    return {k: model[k] for k in ("num_q_heads", "num_params") if k in model}


def _pop(data: dict[str, Any], name: str, where: str) -> Any:
    value = data.pop(name, None)
    if value is not None and not isinstance(value, Mapping):
        path = f"{where}.{name}" if where == ROOT else f"{where}: {name}"
        raise ConfigError(path, f"expected a mapping, got {type(value).__name__}")
    return value
