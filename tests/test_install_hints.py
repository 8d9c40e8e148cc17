"""Every message that tells the user to install an extra names a command that works: the
package is not on an index, so `pip install 'tiered-cache[remote]'` fails. The one place that
builds the line is `tiered_cache.errors.install_hint`; nothing else spells a pip line."""

from __future__ import annotations

import ast
import builtins
import re
from pathlib import Path

import pytest

from tiered_cache.errors import ConfigError, install_hint

ROOT = Path(__file__).resolve().parents[1]
# A pip line that installs the package by its name from an index (what cannot work).
BY_NAME = re.compile(r"pip install\s+['\"]?tiered-cache(\[|['\"\s]|$)")


def _library_strings():
    for top in ("tiered_cache",):
        for path in sorted((ROOT / top).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            for node in ast.walk(tree):
                if isinstance(node, ast.Constant) and isinstance(node.value, str):
                    yield path.relative_to(ROOT).as_posix(), node.lineno, node.value


def test_no_library_string_installs_the_package_by_name_from_an_index():
    bad = [f"{p}:{line}" for p, line, s in _library_strings() if BY_NAME.search(s)]
    assert not bad, f"pip lines naming the package on an index: {bad}"


def test_no_doc_installs_the_package_by_name_from_an_index():
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
            *sorted((ROOT / "deploy").glob("*"))]
    bad = [f"{p.relative_to(ROOT)}:{i}" for p in docs if p.is_file()
           for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
           if BY_NAME.search(line)]
    assert not bad, f"docs telling users to install from an index: {bad}"


def test_the_hint_installs_the_extra_from_this_source_tree():
    hint = install_hint("remote")
    assert hint == f"pip install -e '{ROOT}[remote]'"
    assert (ROOT / "pyproject.toml").is_file()
    assert "remote" in (ROOT / "pyproject.toml").read_text()


def test_a_missing_redis_client_names_the_hint(monkeypatch):
    from tiered_cache.tiers import remote

    real = builtins.__import__

    def no_redis(name, *args, **kwargs):
        if name.startswith("tiered_cache.stores.redis") or name == "redis":
            raise ImportError("No module named 'redis'")
        return real(name, *args, **kwargs)

    monkeypatch.delitem(__import__("sys").modules, "tiered_cache.stores.redis", raising=False)
    monkeypatch.setattr(builtins, "__import__", no_redis)
    cfg = remote.RemoteTierConfig(url="redis://127.0.0.1:1/0")
    with pytest.raises(ConfigError) as exc:
        remote.connect(cfg, namespace=b"\0" * 16, num_tokens=4, payload_bytes=64)
    assert install_hint("remote") in str(exc.value)


def test_a_missing_tools_extra_names_the_hint():
    from tiered_cache.tools import extras

    with pytest.raises(extras.MissingExtraError) as exc:
        extras.require("tiered_cache_no_such_module", "the widget", instead="--no-widget")
    assert str(exc.value) == ("the widget needs tiered_cache_no_such_module, which is not "
                              f"installed: {install_hint('tools')}, or pass --no-widget")
