"""README.md says what the code does: the defaults in its config table are the dataclasses'
defaults, every repository path it names is shipped (no design file outside the repository), it
reads as a description (no dated log entries: dates live in benchmarks/RESULTS.md), every
`make` target and `tiered-cache` command it gives exists, every dependency in pyproject.toml
is in its table of libraries, and the feature table has the rows a newcomer looks for."""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

import pytest

from tiered_cache.config import CacheConfig
from tiered_cache.integrations.vllm.settings import ConnectorSettings
from tiered_cache.tiers import kinds

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
TEXT = README.read_text(encoding="utf-8")
TOP_DIRS = ("docs", "tests", "benchmarks", "configs", "deploy", "examples", "tiered_cache")


def config_table() -> dict[str, str]:
    """{section as written ("`tiers.disk` (optional)", "top level"): its keys cell}."""
    _, found, rest = TEXT.partition("| section | keys (default) |")
    assert found, "README has no config table"
    rows = {}
    for line in rest.splitlines()[2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        rows[cells[0]] = cells[1]
    return rows


def section_class(name: str):
    if name == "top level":
        return CacheConfig
    path = re.match(r"`([a-z_.]+)`", name).group(1)
    if path.startswith("tiers."):
        return kinds()[path.split(".", 1)[1]].section
    if path == "vllm":
        return ConnectorSettings
    return CacheConfig._NESTED[path]


def shown(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def defaults_given(cell: str) -> list[tuple[str, str]]:
    """(key, the first word of its parenthesis) for each "`key` (value ...)" in a cell."""
    return [(k, v) for k, v in re.findall(r"`([a-z_]+)` \(([^)\s;:,|\\]+)", cell)]


def test_every_default_in_the_config_table_is_the_codes():
    """The README once said `policy` (lru) while the code said adaptive."""
    checked = 0
    for section, cell in config_table().items():
        cls = section_class(section)
        fields = {f.name: f for f in dataclasses.fields(cls)}
        for key, value in defaults_given(cell):
            assert key in fields, f"README's config table: {section} has no key {key!r}"
            f = fields[key]
            if f.default is dataclasses.MISSING:
                continue                        # a factory: a section or a list
            default = shown(f.default)
            if value.strip('"') in ("auto",) and default != "auto":
                continue                        # `block_size` (16, or `auto`)
            if f.default is None and value != "null":
                continue                        # examples of a value, not a default
            given = value.strip('"')
            try:
                if re.fullmatch(r"0[0-7]{3}", given):   # a file mode, written as a string
                    same = int(given, 8) == f.default
                else:
                    same = float(given) == float(default)
            except ValueError:
                same = given == default
            assert same, f"README: {section} `{key}` ({value}), the code's default is {default!r}"
            checked += 1
    assert checked > 40


def test_the_policy_default_is_named_right():
    assert "`policy` (adaptive)" in TEXT
    assert CacheConfig().policy == "adaptive"


def test_every_config_key_is_in_the_config_table():
    table = config_table()
    for section, cell in table.items():
        cls = section_class(section)
        named = set(re.findall(r"`([a-z_]+)`", cell))
        keys = {f.name for f in dataclasses.fields(cls) if not f.name.startswith("_")}
        if cls is CacheConfig:
            keys -= set(CacheConfig._NESTED)
        assert keys <= named, f"README's config table, {section}: missing {sorted(keys - named)}"


def test_no_dated_log_entries():
    dates = re.findall(r"\b20\d\d-\d\d-\d\d\b", TEXT)
    assert not dates, f"README reads like a log: dated entries {dates} (they go in RESULTS.md)"
    assert not re.search(r"\b(this|last|next) (session|round)\b|\bso far\b|\bpending\b", TEXT,
                         re.I), "README reads like a work log"


def test_no_reference_to_files_outside_the_repository():
    assert "../" not in TEXT, "README points outside the repository"
    assert "DESIGN.md" not in TEXT and "shared/" not in TEXT


def test_every_path_it_names_is_shipped():
    pattern = re.compile(rf"\b((?:{'|'.join(TOP_DIRS)})/[A-Za-z0-9_./*-]*[A-Za-z0-9_*])")
    missing = []
    for path in sorted(set(pattern.findall(TEXT))):
        if path.startswith("tiered_cache/") and not (ROOT / path).exists():
            path = path.removeprefix("tiered_cache/")       # `stores/redis.py` style
        found = list(ROOT.glob(path)) if "*" in path else [ROOT / path]
        if not found or not all(p.exists() for p in found):
            # module paths written relative to the package (`wire/protocol.py`)
            if not (ROOT / "tiered_cache" / path).exists():
                missing.append(path)
    assert not missing, f"README names paths that do not exist: {missing}"


def test_every_make_target_it_gives_exists():
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z][a-z-]*):", makefile, re.M))
    given = set(re.findall(r"`make ([a-z][a-z-]*)", TEXT)) | set(
        re.findall(r"^make ([a-z][a-z-]*)", TEXT, re.M))
    assert {"run", "test"} <= given
    assert given <= targets, f"README gives make targets that do not exist: {given - targets}"
    if "test-fast" in targets:
        assert "test-fast" in given, "the Makefile has `make test-fast`; the README must say so"


def test_every_tiered_cache_command_it_gives_exists():
    from tiered_cache.tools.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    code = "\n".join(re.findall(r"```(?:bash)?\n(.*?)```", TEXT, re.S))
    given = set(re.findall(r"`tiered-cache ([a-z][a-z-]*)", TEXT)) | set(
        re.findall(r"^\s*tiered-cache ([a-z][a-z-]*)", code, re.M))
    assert {"run", "run-shared", "serve", "plan", "replay"} <= given
    assert given <= set(sub.choices), f"unknown commands: {given - set(sub.choices)}"


def test_every_dependency_is_in_the_libraries_table():
    pyproject = (ROOT / "pyproject.toml").read_text()
    deps = re.findall(r'^\s*"([A-Za-z0-9_.-]+)', pyproject.split("[project.scripts]")[0], re.M)
    _, found, table = TEXT.partition("## Libraries we chose")
    assert found
    table = table.lower()
    aliases = {"pyyaml": "pyyaml", "torch": "pytorch", "cupy-cuda12x": "cupy",
               "redis": "redis-py", "setuptools": None, "wheel": None}
    missing = []
    for dep in deps:
        name = aliases.get(dep.lower(), dep.lower())
        if name is not None and name not in table:
            missing.append(dep)
    assert not missing, f"dependencies the README's library table does not explain: {missing}"


@pytest.mark.parametrize("row", [
    "**gpu** tier", "**host** tier", "**disk** tier", "**remote** tier", "**daemon**",
    "prefix reuse", "async layer-wise loading", "vLLM KV connector", "vLLM secondary tier",
    "SGLang HiCache storage backend", "memory admission", "crash safety", "metrics",
    "adaptive eviction"])
def test_the_feature_table_has_the_row_and_every_peer_column(row):
    header = ("| | tiered-cache | vLLM prefix caching / offloading | SGLang HiCache | LMCache | "
              "Dynamo KVBM | Mooncake Store |")
    assert header in TEXT
    lines = [line for line in TEXT.splitlines() if line.startswith(f"| {row}")]
    assert len(lines) == 1, row
    cells = re.split(r"(?<!\\)\|", lines[0])[1:-1]
    assert len(cells) == 7 and all(c.strip() for c in cells), lines[0]


def results_sections() -> dict[str, str]:
    """{### heading of benchmarks/RESULTS.md: its text}."""
    text = (ROOT / "benchmarks" / "RESULTS.md").read_text(encoding="utf-8")
    parts = re.split(r"^### (.*)$", text, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def test_figures_cite_the_results_sections_they_come_from():
    """Each "[Section, Item]" of the README names a `### Section...` of RESULTS.md that has a
    `**Item...**` paragraph (or the section alone)."""
    sections = results_sections()
    cites = set(re.findall(r"(?<![.\w'])\[([A-Z][^\]]+)\]", TEXT))
    assert len(cites) > 8
    for cite in cites:
        for part in cite.split("; "):
            section, _, item = part.partition(", ")
            bodies = [body for head, body in sections.items() if head.startswith(section)]
            assert len(bodies) == 1, f"[{cite}]: no single RESULTS.md section {section!r}"
            assert not item or f"**{item}" in bodies[0], f"[{cite}]: no {item!r} in {section!r}"
