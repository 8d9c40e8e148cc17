"""The page store's configuration: a tiered-cache YAML file, or the same keys as a mapping.

An engine integration (SGLang's `--hicache-storage-backend-extra-config`, a vLLM secondary
tier's entry) names either a path to a YAML file or an inline mapping. Only the tiers beneath
the engine's own host pool are ours to configure, so only these keys are read::

    tiers:
      disk:   {path, capacity | num_blocks (= pages), o_direct}
      remote: {url, cluster, username, password | password_env, tls_*, prefix, ttl_s,
               lookup_deadline_ms, write}
      daemon: {socket, timeout_s, lookup_deadline_ms, write}
    pages:
      tenant_salt: null         # isolates this engine's pages from others' on the same tiers
      lookup_deadline_ms: 5.0   # bound of an existence check (batch_exists, lookup)
      fill_disk: true           # pages a remote read brings are written to the disk too

Every other key of a tiered-cache config (model, block_size, tiers.gpu / host, migrator, ...)
belongs to the engine here, which owns its geometry, pools and threads: it is refused with its
key path, never silently ignored. So are the tier keys that mean nothing for pages (a disk's
admission and resize bounds, the remote tier's lookahead and cost priors, its put queue).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tiered_cache.config import load_yaml
from tiered_cache.errors import ConfigError
from tiered_cache.sections import from_mapping as _from_mapping
from tiered_cache.tiers.daemon import DaemonKind, DaemonTierConfig
from tiered_cache.tiers.disk import DiskKind, DiskTierConfig
from tiered_cache.tiers.remote import RemoteKind, RemoteTierConfig

DISK, REMOTE, DAEMON = DiskKind.name, RemoteKind.name, DaemonKind.name
"""The tier sections a page store is configured by (their kinds' sections)."""
_SECTIONS = {DISK: DiskKind.section, REMOTE: RemoteKind.section, DAEMON: DaemonKind.section}
_UNUSED = {
    DISK: ("admit_min_hits", "max_num_blocks"),
    REMOTE: ("lookahead_blocks", "latency_ms", "bandwidth_gbps", "put_queue_mib"),
    DAEMON: (),
}
_PAGES_KEYS = ("tenant_salt", "lookup_deadline_ms", "fill_disk")


@dataclass
class PageStoreConfig:
    disk: DiskTierConfig | None = None
    remote: RemoteTierConfig | None = None
    daemon: DaemonTierConfig | None = None
    tenant_salt: str | None = None
    lookup_deadline_ms: float = 5.0
    fill_disk: bool = True
    source: str = "<mapping>"

    @classmethod
    def load(cls, source: str | os.PathLike | Mapping[str, Any], where: str) -> PageStoreConfig:
        """From a YAML path or a mapping; `where` names the engine's key that gave it (for
        messages: `hicache-storage-backend-extra-config.config`)."""
        if isinstance(source, (str, os.PathLike)):
            path = Path(source)
            try:
                text = path.read_text(encoding="utf-8")
            except (OSError, ValueError) as exc:
                reason = getattr(exc, "strerror", None) or str(exc)
                raise ConfigError(where, f"cannot read the config file {path}: {reason}") \
                    from None
            data = load_yaml(text, str(path))
            label = str(path)
        elif isinstance(source, Mapping):
            data, label = source, where
        else:
            raise ConfigError(where, f"expected a path to a tiered-cache YAML file or a "
                                     f"mapping, got {type(source).__name__}")
        try:
            return cls._from(data, label)
        except ConfigError as exc:
            if label != where and hasattr(exc, "add_note"):
                exc.add_note(f"in config file {label} (from {where})")
            raise

    @classmethod
    def _from(cls, data: Any, label: str) -> PageStoreConfig:
        if data is None:
            data = {}
        if not isinstance(data, Mapping):
            raise ConfigError("", f"{label}: expected a mapping of keys, got "
                                  f"{type(data).__name__}")
        for key in data:
            if key not in ("tiers", "pages"):
                raise ConfigError(str(key), "set by the engine, not by the page store (only "
                                            "'tiers' (disk, remote, daemon) and 'pages' are "
                                            "read here)")
        out = cls(source=label)
        tiers = data.get("tiers") or {}
        if not isinstance(tiers, Mapping):
            raise ConfigError("tiers", f"expected a mapping, got {type(tiers).__name__}")
        for name, section in tiers.items():
            if name not in _SECTIONS:
                raise ConfigError(f"tiers.{name}", "the engine's own tier: the page store "
                                                   "sits beneath it (disk, remote, daemon)")
            if section is None:
                continue
            if not isinstance(section, Mapping):
                raise ConfigError(f"tiers.{name}", f"expected a mapping, got "
                                                   f"{type(section).__name__}")
            for key in _UNUSED[name]:
                if key in section:
                    raise ConfigError(f"tiers.{name}.{key}", "has no meaning for pages")
            setattr(out, name, _from_mapping(_SECTIONS[name], section))
        pages = data.get("pages") or {}
        if not isinstance(pages, Mapping):
            raise ConfigError("pages", f"expected a mapping, got {type(pages).__name__}")
        for key, value in pages.items():
            if key not in _PAGES_KEYS:
                raise ConfigError(f"pages.{key}", f"unknown key; valid keys are "
                                                  f"{', '.join(map(repr, _PAGES_KEYS))}")
            setattr(out, key, value)
        out._check()
        return out

    def _check(self) -> None:
        if self.daemon is not None and (self.disk is not None or self.remote is not None):
            raise ConfigError("tiers.daemon", "the daemon's disk and remote tiers serve this "
                              "engine: set tiers.disk / tiers.remote in the daemon's config, "
                              "not here")
        if self.disk is not None and self.disk.path is None:
            raise ConfigError("tiers.disk.path", "required: the directory the pages go under")
        if self.disk is None and self.remote is None and self.daemon is None:
            raise ConfigError("tiers", "the page store needs at least one of disk, remote or "
                                       "daemon")
        salt = self.tenant_salt
        if salt is not None and (not isinstance(salt, str) or not 1 <= len(salt) <= 256):
            raise ConfigError("pages.tenant_salt", f"expected a string of 1..256 characters "
                                                   f"or null, got {salt!r:.60}")
        d = self.lookup_deadline_ms
        if isinstance(d, bool) or not isinstance(d, (int, float)) or not 0 < d <= 60_000:
            raise ConfigError("pages.lookup_deadline_ms", f"expected a number of milliseconds "
                                                          f"in (0, 60000], got {d!r:.60}")
        self.lookup_deadline_ms = float(d)
        if not isinstance(self.fill_disk, bool):
            raise ConfigError("pages.fill_disk", f"expected true or false, got "
                                                 f"{self.fill_disk!r:.60}")
