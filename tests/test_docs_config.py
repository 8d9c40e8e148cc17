"""docs/configuration.md names every config key the code accepts, each in its section: the
top-level keys, every nested section of CacheConfig, `tiers.<kind>` for every registered tier
kind, the page store's `pages.*` keys and the vLLM connector's `vllm:` section. A key added to
a dataclass without a line in the doc fails here."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from tiered_cache.config import CacheConfig
from tiered_cache.integrations.vllm.settings import ConnectorSettings
from tiered_cache.pages.config import PageStoreConfig
from tiered_cache.tiers import kinds

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "configuration.md"
HEADING = re.compile(r"^### (.*)$", re.M)


def sections() -> dict[str, str]:
    """{heading text: its body up to the next ### or ## heading}."""
    text = DOC.read_text(encoding="utf-8")
    out = {}
    marks = list(HEADING.finditer(text))
    for i, m in enumerate(marks):
        end = marks[i + 1].start() if i + 1 < len(marks) else len(text)
        body = text[m.end():end].split("\n## ", 1)[0]
        out[m.group(1).strip()] = body
    return out


def section(path: str) -> str:
    """The body of the heading whose first backticked name is `path` (or the named one)."""
    found = []
    for heading, body in sections().items():
        first = re.match(r"`([^`]+)`", heading)
        if (first and first.group(1) == path) or heading.startswith(path):
            found.append(body)
    assert len(found) == 1, f"docs/configuration.md: {len(found)} sections for {path!r}"
    return found[0]


def keys(cls) -> list[str]:
    return [f.name for f in dataclasses.fields(cls) if not f.name.startswith("_")]


def expected() -> list[tuple[str, str, str]]:
    """(where in the doc, key as written there, the key's full path)."""
    out = []
    nested = CacheConfig._NESTED
    for key in keys(CacheConfig):
        if key in nested:
            continue
        where = "`block_size`" if key == "block_size" else "Top level"
        out.append((where, key, key))
    for name, cls in nested.items():
        if name == "tiers":
            continue
        out += [(name, key, f"{name}.{key}") for key in keys(cls)]
    for name, kind in kinds().items():
        out += [(f"tiers.{name}", key, f"tiers.{name}.{key}") for key in keys(kind.section)]
    page_keys = [k for k in keys(PageStoreConfig)
                 if k not in ("disk", "remote", "daemon", "source")]
    out += [("The page store's config", f"pages.{k}", f"pages.{k}") for k in page_keys]
    out += [("vllm", key, f"vllm.{key}") for key in keys(ConnectorSettings)]
    return out


@pytest.mark.parametrize("where, key, path", expected(), ids=lambda v: v)
def test_every_config_key_is_documented_in_its_section(where, key, path):
    body = section(where.strip("`"))
    assert f"`{key}`" in body, f"docs/configuration.md does not document {path}"


def test_the_keys_landed_in_this_round_are_among_those_checked():
    paths = {p for _, _, p in expected()}
    assert {"tiers.disk.drain_on_shutdown", "tiers.remote.write", "daemon.page_pool_mib",
            "daemon.page_disk_mib", "vllm.load", "overcommit"} <= paths
