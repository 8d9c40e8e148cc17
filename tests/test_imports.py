"""The import rules of docs/architecture.md ("Import direction"), checked on the source.

Every module of the library (everything under tiered_cache/) is parsed; every `import` / `from
... import` is an edge, at module level or inside a function (imports under `if TYPE_CHECKING:`
are type names only and are not edges). `from tiered_cache import TieredKVCache` is an edge to
the module the package's lazy attribute loads (tiered_cache/__init__.py), `from pkg import sub`
one to the submodule. Then:

1. each group of modules imports only the groups `ALLOWED` lists for it;
2. only the entry points (tiered_cache/cli.py, __main__.py) import tools/;
3. only integrations/ and tools/ import the facade (tiered_cache.cache);
4. no cycle among module-level imports, and no function-local import that closes a cycle
   (a function-local import from A to B where B reaches A again: a cycle hidden by deferring
   it); function-local imports that remain defer heavy or optional packages (torch through
   the data plane, kernels, redis-py, cuda-python, prometheus-client, the daemon's service);
5. the lower layers import torch nowhere at module level (core/ not even in a function);
6. `import tiered_cache.core` (and `.core.index`) loads neither the facade nor torch, and the
   public names still import from the package.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PUBLIC = {"TieredKVCache": "tiered_cache.cache", "CacheConfig": "tiered_cache.config",
          "Sequence": "tiered_cache.core.sequence"}
"""The package's lazy attributes (tiered_cache/__init__.py) and the modules they load."""

GROUPS = [
    # (group, module prefixes); the first group whose prefix matches a module is its group
    ("entry", ("tiered_cache.cli", "tiered_cache.__main__")),
    ("package", ("tiered_cache",)),             # exact: the package itself (lazy)
    ("leaves", ("tiered_cache.errors", "tiered_cache.hashing", "tiered_cache.locking",
                "tiered_cache.records", "tiered_cache.sizing", "tiered_cache.sections",
                "tiered_cache.costs", "tiered_cache.admission", "tiered_cache.jit",
                "tiered_cache.xxh3")),
    ("core", ("tiered_cache.core",)),
    ("policies", ("tiered_cache.policies",)),
    ("kernels", ("tiered_cache.kernels",)),
    ("wire", ("tiered_cache.wire",)),
    ("stores", ("tiered_cache.stores",)),
    ("data", ("tiered_cache.data",)),
    ("stack", ("tiered_cache.tiers.stack",)),
    ("kinds", ("tiered_cache.tiers",)),
    ("config", ("tiered_cache.config",)),
    ("migrator", ("tiered_cache.migrator",)),
    ("metrics", ("tiered_cache.metrics",)),
    ("facade", ("tiered_cache.cache",)),
    ("pages", ("tiered_cache.pages",)),
    ("daemon", ("tiered_cache.daemon",)),
    ("integrations", ("tiered_cache.integrations",)),
    ("tools", ("tiered_cache.tools",)),
]

ALLOWED: dict[str, set[str]] = {
    "leaves": {"leaves"},
    # core imports only core, the leaves it needs and policies.base (rule 1, PER_MODULE)
    "core": {"core", "leaves", "policies"},
    "policies": {"policies", "core", "leaves"},
    "kernels": {"kernels", "leaves"},
    "wire": {"wire", "leaves"},
    "stores": {"stores", "leaves"},
    "data": {"data", "core", "leaves", "kernels", "stores", "wire"},
    # the kinds: config imports them (for their sections), so never config or above at run time
    "kinds": {"kinds", "core", "leaves", "policies", "data", "stores", "wire", "kernels"},
    "config": {"leaves", "policies", "kinds"},
    "migrator": {"migrator", "core", "leaves", "config", "kernels"},
    "stack": {"kinds", "core", "leaves", "policies", "data", "migrator"},
    "metrics": {"leaves"},
    "facade": {"leaves", "core", "config", "kinds", "stack", "data", "metrics"},
    # the page store (engines' own page keys): over DiskPool, the stores and the daemon's wire
    "pages": {"pages", "data", "stores", "wire", "config", "kinds", "leaves"},
    "daemon": {"daemon", "leaves", "core", "config", "kinds", "stack", "wire", "metrics",
               "kernels", "pages", "data"},
    # integrations are the top of the library: the vLLM connector embeds a node service
    # (daemon) in vLLM's scheduler process and speaks the daemon's wire from its workers
    "integrations": {"integrations", "facade", "config", "core", "data", "leaves", "kernels",
                     "pages", "wire", "daemon"},
    "tools": {g for g, _ in GROUPS},
    "entry": {"tools"},
    "package": set(),
}
PER_MODULE = {
    # group -> modules of another group that are the only ones it may import from that group
    "core": {"policies": {"tiered_cache.policies.base", "tiered_cache.policies"},
             "leaves": {"tiered_cache.errors", "tiered_cache.hashing", "tiered_cache.locking",
                        "tiered_cache.jit"}},
    "policies": {"core": {"tiered_cache.core.blocks"}},
}
NO_TORCH_AT_MODULE_LEVEL = ("tiered_cache.core", "tiered_cache.wire", "tiered_cache.config",
                            "tiered_cache.sections", "tiered_cache.sizing",
                            "tiered_cache.costs", "tiered_cache.tiers", "tiered_cache.cache",
                            "tiered_cache.metrics", "tiered_cache.policies",
                            "tiered_cache.stores", "tiered_cache.migrator")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


MODULES = {_module_name(p): p for p in sorted((ROOT / "tiered_cache").rglob("*.py"))}


def group_of(module: str) -> str:
    for group, prefixes in GROUPS:
        for prefix in prefixes:
            if module == prefix or (group != "package" and module.startswith(prefix + ".")):
                return group
    raise AssertionError(f"{module} is in no group of tests/test_imports.py")


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports(module: str) -> list[tuple[str, bool, int]]:
    """(imported module, inside a function, line) of every import of `module`."""
    path = MODULES[module]
    is_pkg = path.name == "__init__.py"
    out: list[tuple[str, bool, int]] = []

    def resolve(node: ast.ImportFrom) -> list[str]:
        base = node.module or ""
        if node.level:
            pkg = module.split(".") if is_pkg else module.split(".")[:-1]
            pkg = pkg[:len(pkg) - (node.level - 1)]
            base = ".".join([*pkg, base] if base else pkg)
        found = []
        for alias in node.names:
            full = f"{base}.{alias.name}"
            if full in MODULES:
                found.append(full)
            elif base == "tiered_cache" and alias.name in PUBLIC:
                found.append(PUBLIC[alias.name])
            else:
                found.append(base)
        return found

    def walk(node: ast.AST, local: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for sub in child.orelse:
                    walk_one(sub, local)
                continue
            walk_one(child, local)

    def walk_one(child: ast.AST, local: bool) -> None:
        if isinstance(child, ast.Import):
            out.extend((alias.name, local, child.lineno) for alias in child.names)
        elif isinstance(child, ast.ImportFrom):
            out.extend((name, local, child.lineno) for name in resolve(child))
        walk(child, local or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                ast.Lambda)))

    walk(ast.parse(path.read_text(), str(path)), False)
    return out


def _internal(target: str) -> str | None:
    """The library module an import names (a submodule's package if need be), or None."""
    while target and target not in MODULES:
        target = target.rpartition(".")[0]
    return target or None


EDGES = [(m, t, local, line) for m in MODULES for target, local, line in imports(m)
         if (t := _internal(target)) is not None and t != m]


def _where(m: str, line: int) -> str:
    return f"{MODULES[m].relative_to(ROOT)}:{line}"


def test_every_module_is_in_a_group():
    for module in MODULES:
        group_of(module)


def layering_violations(edges) -> list[str]:
    bad = []
    for m, t, local, line in edges:
        g, h = group_of(m), group_of(t)
        if g == h:
            continue
        only = PER_MODULE.get(g, {}).get(h)
        if h not in ALLOWED[g] or (only is not None and t not in only):
            bad.append(f"{_where(m, line)}: {g} ({m}) imports {h} ({t})"
                       f"{' in a function' if local else ''}")
    return bad


def test_each_group_imports_only_what_it_may():
    bad = layering_violations(EDGES)
    assert not bad, "imports against the layering rules:\n" + "\n".join(bad)


def test_the_layering_rules_refuse_what_they_should():
    fake = [("tiered_cache.data.pools", "tiered_cache.cache", True, 1),
            ("tiered_cache.data.daemon_tier", "tiered_cache.daemon.partition", False, 2),
            ("tiered_cache.core.index", "tiered_cache.sizing", False, 3),
            ("tiered_cache.tiers.disk", "tiered_cache.config", True, 4),
            ("tiered_cache.wire.shm", "tiered_cache.data.pools", True, 5)]
    assert len(layering_violations(fake)) == len(fake)
    assert not layering_violations([("tiered_cache.core.tier", "tiered_cache.policies.base",
                                     False, 1)])


def test_tools_are_imported_only_by_the_entry_points():
    bad = [f"{_where(m, line)}: {m} imports {t}" for m, t, _, line in EDGES
           if group_of(t) == "tools" and group_of(m) not in ("tools", "entry")]
    assert not bad, "\n".join(bad)


def test_nothing_below_the_facade_imports_it():
    bad = [f"{_where(m, line)}: {m} imports the facade" for m, t, _, line in EDGES
           if t == "tiered_cache.cache" and group_of(m) not in ("integrations", "tools")]
    assert not bad, "\n".join(bad)


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_no_import_cycle_and_no_function_local_import_hides_one():
    top: dict[str, set[str]] = {}
    every: dict[str, set[str]] = {}
    for m, t, local, _ in EDGES:
        every.setdefault(m, set()).add(t)
        if not local:
            top.setdefault(m, set()).add(t)
    cycles = [m for m in top if m in _reachable(top, m)]
    assert not cycles, f"modules on a cycle of module-level imports: {sorted(cycles)}"
    hidden = [f"{_where(m, line)}: {m} imports {t} in a function, and {t} reaches {m}"
              for m, t, local, line in EDGES if local and m in _reachable(every, t)]
    assert not hidden, "function-local imports that hide a cycle:\n" + "\n".join(hidden)


def test_the_lower_layers_import_no_torch_at_module_level():
    bad = []
    for m in MODULES:
        if not m.startswith(NO_TORCH_AT_MODULE_LEVEL):
            continue
        for target, local, line in imports(m):
            if target.split(".")[0] == "torch" and (not local or group_of(m) == "core"):
                bad.append(f"{_where(m, line)}: {m} imports torch")
    assert not bad, "\n".join(bad)


def test_the_rules_see_a_violation(tmp_path, monkeypatch):
    """The walker itself: a function-local import and a TYPE_CHECKING one are told apart."""
    src = tmp_path / "probe.py"
    src.write_text("from typing import TYPE_CHECKING\n"
                   "if TYPE_CHECKING:\n    from tiered_cache.cache import TieredKVCache\n"
                   "def f():\n    from tiered_cache.data import pools\n"
                   "from tiered_cache import CacheConfig\n")
    monkeypatch.setitem(MODULES, "tiered_cache.core.probe", src)
    got = [(t, local) for t, local, _ in imports("tiered_cache.core.probe")]
    assert got == [("typing", False), ("tiered_cache.data.pools", True),
                   ("tiered_cache.config", False)]


@pytest.mark.slow
@pytest.mark.parametrize("what", ["tiered_cache.core", "tiered_cache.core.index"])
def test_importing_the_control_plane_loads_neither_the_facade_nor_torch(what):
    code = (f"import sys; import {what}; "
            "bad = [m for m in ('torch', 'tiered_cache.cache', 'tiered_cache.data', "
            "'tiered_cache.config') if m in sys.modules]; "
            "assert not bad, bad; "
            "from tiered_cache import TieredKVCache, CacheConfig, Sequence; "
            "import tiered_cache; "
            "assert tiered_cache.TieredKVCache is TieredKVCache and 'tiered_cache.cache' in "
            "sys.modules; assert 'torch' not in sys.modules; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


@pytest.mark.slow
def test_importing_the_config_and_the_policies_loads_no_numba():
    """numba (llvmlite) loads when a duel is built, not at import: vLLM's CPU platform scans
    every loaded module's objects at worker start and fails on llvmlite's ffi object, and the
    vLLM connector imports the config and the policies before vLLM's workers start
    (policies/duel_arrays.py, the NOTE of `_Kernels`)."""
    code = ("import sys; import tiered_cache.config, tiered_cache.policies; "
            "bad = [m for m in ('numba', 'llvmlite') if m in sys.modules]; "
            "assert not bad, bad; "
            "from tiered_cache.policies.adaptive import AdaptivePolicy; "
            "assert 'numba' not in sys.modules; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
