"""Nothing outside `tiered_cache/tiers/` names a tier kind, and the device tier's number is
defined once.

What counts as naming a kind, in every module of the library (everything under
tiered_cache/) outside `tiered_cache/tiers/` and `tiered_cache/tools/`:
- a string constant equal to a kind's name (`"host"`, `kind == "disk"`, a handler key
  `("gpu", "host")`, `getattr(config.tiers, "remote")`), docstrings excluded (the bare string
  statements of a module, class or function, and attribute docstrings), comments not seen
  (they are not in the AST);
- an attribute `<anything>.tiers.<kind>` (`config.tiers.daemon is not None`).

Allowed, and why:
- `tiered_cache/tiers/`: the kind modules and the stack builder are where kinds are named.
- `tiered_cache/tools/`: the applications (plan, run, replay, run-shared) map their flags
  onto config keys (`--gpu-blocks` is `tiers.gpu.num_blocks`): that is the config format, a
  public surface, not a decision by kind.
- `CONFIG_FORMAT` below: an integration's settings module that maps its engine's config onto
  ours (the vLLM connector's `kv_connector_extra_config.tiered_cache`).
- Messages naming config keys (`"tiers.host"`, `f"tiers.{name}"`): never equal to a kind's
  name, so the rule does not see them; they name the config, as the user writes it.
- The few entries of `ALLOWED` below, each with its reason.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
KINDS = ("gpu", "host", "disk", "remote", "daemon")
"""The built-in kinds (checked against the registry below)."""

CONFIG_FORMAT = {
    "tiered_cache/integrations/vllm/settings.py":
        "reads `kv_connector_extra_config.tiered_cache` as tools/ read their flags: which "
        "sections vLLM owns (`tiers.gpu` is vLLM's KV cache), which its service does (host, "
        "disk, remote), `daemon:` vs `tiers.daemon` (a shared daemon or an embedded service)",
}
"""Whole modules that are the config format of an integration, not decisions by kind."""

ALLOWED = {
    ("tiered_cache/kernels/api.py", "host"):
        "the kernels' own argument names: a block table entry reads the device pool or the "
        "host pool, the two pools a kernel is handed (not a tier kind)",
    ("tiered_cache/config.py", "daemon"):
        "the top-level `daemon:` section (the node daemon's own settings: socket, tenants, "
        "leases), a config section of its own, not `tiers.daemon`",
    ("tiered_cache/daemon/partition.py", "daemon"):
        "the section of a partition's stats() holding the daemon server's own counters",
    ("tiered_cache/daemon/observe.py", "daemon"):
        "the same stats section, read by the daemon's /metrics",
    # The vLLM connector maps `kv_connector_extra_config.tiered_cache` onto the config format
    # (as tools/ map their flags): which sections vLLM owns, which its service does.
    ("tiered_cache/integrations/vllm/embedded.py", "daemon"):
        "the embedded service's config: its top-level `daemon:` section (socket, uids) set, "
        "`tiers.daemon` cleared (the service is the daemon)",
    ("tiered_cache/integrations/vllm/embedded.py", "disk"):
        "whether the service warms a disk tier up at start (`tiers.disk` given)",
    ("tiered_cache/integrations/vllm/connector.py", "disk"):
        "vLLM's CacheHitSource: hits may come from below memory when `tiers.disk` is given",
    ("tiered_cache/integrations/vllm/connector.py", "remote"):
        "the same, when `tiers.remote` is given",
}


def _sources() -> list[Path]:
    out = []
    for top in ("tiered_cache",):
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel.startswith(("tiered_cache/tiers/", "tiered_cache/tools/")) \
                    or rel in CONFIG_FORMAT:
                continue
            out.append(path)
    return out


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the string constants that are docstrings (bare string statements)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) \
                and isinstance(node.value.value, str):
            out.add(id(node.value))
    return out


def kind_names(path: Path) -> list[tuple[int, str, str]]:
    """(line, kind, how) of every place `path` names a tier kind."""
    tree = ast.parse(path.read_text(), str(path))
    docs = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and node.value in KINDS and id(node) not in docs:
            found.append((node.lineno, node.value, "string"))
        elif isinstance(node, ast.Attribute) and node.attr in KINDS \
                and isinstance(node.value, ast.Attribute) and node.value.attr == "tiers":
            found.append((node.lineno, node.attr, "attribute .tiers." + node.attr))
    return found


def test_the_builtin_kinds_are_the_registered_ones():
    from tiered_cache import tiers

    assert set(KINDS) <= set(tiers.kinds())


def test_no_tier_kind_is_named_outside_the_tiers_package():
    bad, used = [], set()
    for path in _sources():
        rel = path.relative_to(ROOT).as_posix()
        for line, kind, how in kind_names(path):
            if (rel, kind) in ALLOWED:
                used.add((rel, kind))
                continue
            bad.append(f"{rel}:{line}: {how} {kind!r}")
    assert not bad, "tier kinds named outside tiered_cache/tiers/:\n" + "\n".join(bad)
    assert used == set(ALLOWED), f"stale ALLOWED entries: {set(ALLOWED) - used}"


def test_the_rule_sees_what_it_forbids(tmp_path):
    """The checker itself: a kind check, a handler key and a `.tiers.<kind>` read are seen; a
    docstring, a config key in a message and an unrelated word are not."""
    src = tmp_path / "m.py"
    src.write_text('"""A module about the host tier."""\n'
                   'def f(t, config):\n'
                   '    """Uses "disk"."""\n'
                   '    if t.kind == "host":\n'
                   '        pass\n'
                   '    handlers = {("gpu", "host"): f}\n'
                   '    x = config.tiers.daemon\n'
                   '    raise ValueError(f"tiers.disk: {t}", "tiers.remote", "hostname")\n')
    assert sorted((line, kind) for line, kind, _ in kind_names(src)) == [
        (4, "host"), (6, "gpu"), (6, "host"), (7, "daemon")]


@pytest.mark.parametrize("name", ["DEVICE", "POOL"])
def test_the_device_tier_number_is_defined_once(name):
    """`DEVICE = 0` in core/tier.py only (everything else imports it); no alias of it either
    (the daemon's `POOL = 0`)."""
    where = []
    for path in _sources() + sorted((ROOT / "tiered_cache" / "tiers").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Assign) and any(
                    isinstance(t, ast.Name) and t.id == name for t in node.targets):
                where.append(path.relative_to(ROOT).as_posix())
    assert where == (["tiered_cache/core/tier.py"] if name == "DEVICE" else [])
