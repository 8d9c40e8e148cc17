"""Config fuzz: every input either loads or raises ConfigError, and whatever loads round-trips.

Inputs are built from the real key names (so that most examples get past the unknown-key check and
reach the value checks) mixed with junk keys, and from values of every type: near-valid ones
(`"cpu\\n"`, `"cuda:01"`, `"9" * 400 + "GiB"`, `":Foo"`), huge ints, non-finite floats, strings
with control characters and lone surrogates, bytes, lists, nested and self-referencing
containers. YAML text is built from fragments that exercise the loader's own rules (1.1 vs 1.2
scalars, explicit tags, anchors and aliases, merge keys, duplicate keys, deep nesting) and from
arbitrary text and bytes.

Fast by default (a few seconds); set TIERED_CACHE_FUZZ_EXAMPLES=20000 for a long local run.
"""

from __future__ import annotations

import os
import pickle
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tiered_cache import sizing
from tiered_cache.config import DEFAULT_YAML, CacheConfig, load_yaml
from tiered_cache.errors import ConfigError

EXAMPLES = int(os.environ.get("TIERED_CACHE_FUZZ_EXAMPLES", "150"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.fixture(autouse=True, scope="module")
def _fixed_l2():
    """`block_size: auto` asks torch for the L2 size; a constant keeps the fuzz fast and
    torch-free (the auto rule itself is tested in test_config.py)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sizing, "l2_cache_bytes", lambda device: 1 << 20)
        yield


# -- values -----------------------------------------------------------------------------------

NEAR_MISSES = [
    # sizes
    "40GiB", "512 MiB", "70%", "100%", "0%", "150%", "1.5GB", "1PiB", "2PiB", "40GiB\n",
    "9" * 400 + "GiB", "1e400GiB", "٤٠GiB", "4G", "-1GiB", "9" * 400 + "%",
    # devices
    "auto", "cpu", "cuda", "cuda:0", "cuda:999", "cpu\n", "cuda:01", "cuda:1000", "cuda:٣", "CPU",
    # policies
    "lru", "lfu", "arc", "s3fifo", "cost_aware", "belady", "hit_density", ":Foo", ".rel:Foo",
    "pkg:", "a b:C", "tiered_cache.policies.base:CachePolicy",
    "tiered_cache.policies.base:PriorityPolicy", "tiered_cache.policies:LRUPolicy",
    "tiered_cache.policies:POLICIES", "no_such_module_xyz:Policy", "lru\n",
    # choices
    "float32", "float16", "bfloat16", "fp8_e4m3", "int8", "pinned", "managed", "pageable",
    "write_back", "write_through", "tensors", "none", "triton", "torch", "zero_copy", "wait",
    # addresses and names
    "127.0.0.1", "0.0.0.0", "::", "::1", "fe80::1%eth0", "localhost", "1.2.3", "host_name",
    "[::1]", "127.0.0.1\n", "tiny-llama", "lora-v1", "a\x00b", " x", "\u200b", "x" * 300,
    # other strings
    "", " ", "yes", "true", "null", "30s", "1:30", "010", "nan", "inf", "\ud800",
]

class BigInt(int):
    """An int past CPython's 4300-digit str limit whose repr still works, so that hypothesis can
    print a failing example. (The plain-int repr path of the error messages is tested in
    test_config.py.)"""

    def __repr__(self) -> str:
        return f"BigInt(<{self.bit_length()} bits>)"


HUGE_NUMBERS = [
    10**400, -(10**400), BigInt(10**5000), BigInt(-(10**5000)), 2**31, 2**31 - 1, 2**63, 2**64,
    1 << 50, (1 << 50) + 1, 1e15, 1e16, 1e308, -1e308, 5e-324, float("inf"), float("-inf"),
    float("nan"), 0, -0.0, 1, -1, 0.5, 65535, 65536, 86400, 86401, 4096, 8192,
]

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=-(10**600), max_value=10**600),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(HUGE_NUMBERS),
    st.sampled_from(NEAR_MISSES),
    st.text(max_size=12),
    st.text(st.characters(codec=None, exclude_categories=()), max_size=8),  # controls, surrogates
    st.binary(max_size=8),
)

# Real key names at every level: most examples reach the value checks of a real key.
KEYS = sorted({name for cls in (CacheConfig, *CacheConfig._NESTED.values())
               for name in cls._keys()} | {"gpu", "host"})
keys = st.one_of(st.sampled_from(KEYS), st.text(max_size=6), st.integers(), st.none(),
                 st.booleans(), st.sampled_from([BigInt(10**5000), "x" * 10_000, "pol\ncy", 1.5]))

junk = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=3),
                            st.dictionaries(keys, inner, max_size=3),
                            st.tuples(inner), st.frozensets(st.integers(), max_size=2)),
    max_leaves=6,
)


def _good(path: str) -> st.SearchStrategy:
    """Plausible values for one key: valid ones and their edges, so that many configs load."""
    key = path.rsplit(".", 1)[-1]
    ints = st.integers(min_value=0, max_value=4096)
    by_key: dict[str, st.SearchStrategy] = {
        "capacity": st.sampled_from(["1MiB", "64MiB", "10%", "100%", 1 << 20, 4096.5, None]),
        "num_blocks": st.one_of(st.integers(0, 300), st.none()),
        "max_num_blocks": st.one_of(st.integers(1, 4096), st.none()),
        "segment_blocks": st.one_of(st.integers(1, 64), st.none()),
        "device": st.sampled_from(["auto", "cpu", "cuda:1"]),
        "block_size": st.sampled_from([1, 16, 64, 4096, "auto", 24]),
        "high_watermark": st.floats(0.5, 1.0), "low_watermark": st.floats(0.01, 0.6),
        "threshold": st.floats(0.001, 1e6), "interval_s": st.floats(0.001, 3600),
        "wait_timeout_s": st.one_of(st.floats(0.001, 86400), st.integers(1, 86400)),
        "num_params": st.one_of(st.none(), st.floats(1.0, 1e15)),
        "num_q_heads": st.one_of(st.none(), st.sampled_from([2, 4, 8, 3])),
        "dtype": st.sampled_from(["float32", "float16", "bfloat16", "fp8_e4m3"]),
        "http_port": st.one_of(st.none(), st.integers(1, 65535)),
        "http_addr": st.sampled_from(["127.0.0.1", "0.0.0.0", "::1", "localhost"]),
        "adapter_id": st.one_of(st.none(), st.text(min_size=1, max_size=8)),
        "name": st.text(min_size=1, max_size=8),
        "policy": st.sampled_from(["lru", "lfu", "arc", "tiered_cache.policies:LRUPolicy"]),
        "enabled": st.booleans(), "resizable": st.booleans(), "verify_tokens": st.booleans(),
        "memory": st.sampled_from(["pinned", "pageable"]),
        "write_policy": st.sampled_from(["write_back", "write_through"]),
        "storage": st.sampled_from(["tensors", "none"]),
        "attention_backend": st.sampled_from(["auto", "torch"]),
        "missing_blocks": st.sampled_from(["zero_copy", "wait"]),
    }
    return by_key.get(key, ints)


def _section(cls: type, path: str) -> st.SearchStrategy:
    """A mapping for one section: any subset of its keys, each good, junk or a nested section,
    now and then a junk key or a non-mapping in its place."""
    optional: dict[str, st.SearchStrategy] = {}
    nested = cls._nested_types()          # (tiers: one section per registered tier kind)
    for name in cls._keys():
        sub = f"{path}.{name}" if path else name
        if name in nested:
            value = _section(nested[name], sub)
        else:
            value = _good(sub)
        optional[name] = st.one_of(value, value, value, junk)
    mapping = st.fixed_dictionaries({}, optional=optional)
    with_junk_key = st.builds(lambda m, k, v: {**m, k: v}, mapping, keys, junk)
    return st.one_of(mapping, mapping, mapping, mapping, mapping, with_junk_key, st.none(), junk)


configs = _section(CacheConfig, "")


def check(data: Any) -> CacheConfig | None:
    """The property: from_dict either builds a config that round-trips through to_dict, or
    raises ConfigError whose message starts with its key path and is one short line. Any other
    exception fails the test. The input is never mutated."""
    before = pickle.dumps(data)
    try:
        cfg = CacheConfig.from_dict(data)
    except ConfigError as exc:
        msg = str(exc)
        assert isinstance(exc.path, str)
        assert msg.startswith(f"{exc.path}: " if exc.path else "config: "), msg
        assert len(msg) < 1000, msg[:200]
        cfg = None
    else:
        d = cfg.to_dict()
        again = CacheConfig.from_dict(d)
        assert again == cfg
        assert again.to_dict() == d
    assert pickle.dumps(data) == before
    return cfg


@FUZZ
@given(configs)
def test_from_dict_loads_or_raises_config_error(data):
    check(data)


@FUZZ
@given(st.dictionaries(keys, junk, max_size=6))
def test_from_dict_with_junk_top_level(data):
    check(data)


def _leaves(cls: type, path: str = "") -> list[str]:
    out = []
    for name in cls._keys():
        sub = f"{path}.{name}" if path else name
        nested_cls = cls._nested_types().get(name)
        out.extend(_leaves(nested_cls, sub) if nested_cls else [sub])
    return out


LEAVES = _leaves(CacheConfig)
_BLOCK_COUNTS = [f"tiers.{t}.{k}" for t in ("gpu", "host")
                 for k in ("num_blocks", "max_num_blocks", "segment_blocks")] + [
                     "tiers.disk.num_blocks", "tiers.disk.max_num_blocks"]
# Errors that may legitimately name another key than the one changed: the constraints that tie
# keys together (both watermarks, the GQA multiple, capacity xor num_blocks, a tier's bytes).
_GEOMETRY = ["model.num_layers", "model.num_kv_heads", "model.head_dim", "model.dtype",
             "block_size"]
RELATED: dict[str, set[str]] = {key: set() for key in LEAVES}
RELATED["migrator.high_watermark"].add("migrator.low_watermark")
RELATED["model.num_kv_heads"].add("model.num_q_heads")
for _key in _GEOMETRY:
    RELATED[_key].update(_BLOCK_COUNTS)
for _tier in ("gpu", "host", "disk"):
    for _key in ("num_blocks", "max_num_blocks", "capacity"):
        RELATED[f"tiers.{_tier}.{_key}"].update({f"tiers.{_tier}", *_BLOCK_COUNTS})
BASE = CacheConfig.from_dict({"tiers": {"gpu": {"device": "cpu", "num_blocks": 8},
                                         "disk": {"path": "/tmp/x", "num_blocks": 8},
                                         "remote": {"url": "redis://127.0.0.1:6379/0"}}}
                             ).to_dict()
# An engine attached to a node daemon has no disk or remote tier of its own.
BASE_DAEMON = CacheConfig.from_dict({"tiers": {"gpu": {"device": "cpu", "num_blocks": 8},
                                                "daemon": {"socket": "/tmp/x/daemon.sock"}}}
                                    ).to_dict()

one_bad_value = st.one_of(
    st.sampled_from([10**400, -(10**400), BigInt(10**5000), float("inf"), float("nan"), 1e308]),
    st.sampled_from(HUGE_NUMBERS), st.sampled_from(NEAR_MISSES), junk)


@FUZZ
@given(st.sampled_from(LEAVES), one_bad_value)
def test_one_bad_value_names_its_key(key, value):
    """A valid config with one value replaced: it loads, or the error names that key (or a key
    it is tied to). This finds a missing check on every key quickly, where a random mapping
    often fails first on another key."""
    data = pickle.loads(pickle.dumps(BASE_DAEMON if key.startswith("tiers.daemon.") else BASE))
    *parents, leaf = key.split(".")
    node = data
    for part in parents:
        node = node[part]
    node[leaf] = value
    try:
        check(data)
    except ConfigError:
        raise AssertionError("check() swallows ConfigError") from None
    try:
        CacheConfig.from_dict(data)
    except ConfigError as exc:
        assert exc.path == key or exc.path in RELATED[key], (key, str(exc))


def test_the_strategies_reach_both_outcomes():
    """A fuzz that only ever hits the first unknown key proves nothing: check (without
    hypothesis' own randomness) that the config strategy yields loads and failures alike."""
    outcomes = {"loaded": 0, "refused": 0}

    @settings(max_examples=200, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(configs)
    def count(data):
        outcomes["loaded" if check(data) is not None else "refused"] += 1

    count()
    assert outcomes["loaded"] >= 10 and outcomes["refused"] >= 10, outcomes


# -- YAML text --------------------------------------------------------------------------------

YAML_SCALARS = [
    "1", "-1", "+5", "0", "010", "0x1F", "0o17", "0b101", "1_000", "1:30", "1e9", "70.6e9",
    "1e400", "-1e400", "9" * 400, "9" * 5000, ".inf", "-.inf", ".nan", "true", "True", "yes",
    "on", "~", "null", "", "2024-01-01", "2024-13-45", "2001-12-14t21:59:43.10-05:00", "<<",
    "=", "'quoted'", '"a\\x00b"', '"\\ud800"', '"cpu\\n"', "cpu", "cuda:0", "cuda:01", "40GiB",
    "70%", "lru", '":Foo"', '".rel:Foo"', "tiered_cache.policies.base:CachePolicy", "[1, 2]",
    "{a: 1}", "[]", "{}", "&a 1", "*a", "&b [*b]", "*undefined", "!!int abc", "!!int 1:30",
    "!!bool abc", "!!bool yes", "!!float x", "!!float 3", "!!timestamp 2024-13-45",
    "!!timestamp x", "!!binary aGk=", "!!binary ???", "!!set {a, b}", "!!set [1]", "!!omap [a: 1]",
    "!!omap x", "!!pairs [a: 1]", "!!map x", "!!seq x", "!!str 3", "!!null x", "!!merge x",
    "!!python/object:os.system x", "!custom x", "!<tag:x> y", "|\n  x", ">-\n  y", "\t",
    "@", "`", "%", "[[[[", "]", "}", "{a: [1, {b: 2}]}", "? [1]", "127.0.0.1", "::1",
]
yaml_keys = st.one_of(st.sampled_from(KEYS), st.sampled_from(
    ["<<", "? [1, 2]", "? {a: 1}", "~", "1", "true", "1.0", "'x'", "&k key", "*k", "!!int 3",
     "? !!set {a}", "-", "=", "[a]"]))


@st.composite
def yaml_documents(draw) -> str:
    """Block-style YAML assembled line by line from real keys and tricky scalars, at random
    indents (so both valid nesting and indentation errors come out)."""
    lines = []
    for _ in range(draw(st.integers(1, 12))):
        indent = "  " * draw(st.integers(0, 3))
        key = draw(yaml_keys)
        kind = draw(st.integers(0, 4))
        if kind == 0:
            lines.append(f"{indent}{key}:")
        elif kind == 1:
            lines.append(f"{indent}- {draw(st.sampled_from(YAML_SCALARS))}")
        elif kind == 2:
            lines.append(f"{indent}{key}: &{draw(st.sampled_from('abc'))} "
                         f"{draw(st.sampled_from(YAML_SCALARS))}")
        else:
            lines.append(f"{indent}{key}: {draw(st.sampled_from(YAML_SCALARS))}")
    text = "\n".join(lines)
    if draw(st.booleans()):
        text += "\n" + draw(st.sampled_from(["---\nb: 1", "...", "%YAML 1.1\n---", "#c", "\x85"]))
    return text


_DEFAULT_LINES = DEFAULT_YAML.splitlines()
_VALUE_LINES = [i for i, line in enumerate(_DEFAULT_LINES)
                if ": " in line and not line.lstrip().startswith("#")]


@st.composite
def default_yaml_with_bad_scalars(draw) -> str:
    """The shipped default config with one to three values replaced by tricky scalars: valid
    YAML around them, so the loader's scalar constructors (not the parser) are what is tested."""
    lines = list(_DEFAULT_LINES)
    for _ in range(draw(st.integers(1, 3))):
        i = draw(st.sampled_from(_VALUE_LINES))
        key = lines[i].split(": ", 1)[0]
        indent = " " * (len(key) - len(key.lstrip()) + 2)
        scalar = draw(st.sampled_from(YAML_SCALARS)).replace("\n", "\n" + indent)
        lines[i] = f"{key}: {scalar}"
    return "\n".join(lines) + "\n"


flow_mappings = st.lists(st.sampled_from(YAML_SCALARS).filter(lambda t: "\n" not in t),
                         min_size=1, max_size=4).map(
    lambda vals: "{" + ", ".join(f"k{i}: {v}" for i, v in enumerate(vals)) + "}")


def _nest(n: int, open_: str, close: str) -> str:
    return "a: " + open_ * n + close * n


deep = st.one_of(
    st.integers(1, 3000).map(lambda n: _nest(n, "[", "]")),
    st.integers(1, 3000).map(lambda n: _nest(n, "{a: ", "}")),
    st.sampled_from([70, 400, 2000]).map(lambda n: _nest(n, "[", "]")),
    st.integers(1, 1200).map(lambda n: "".join("  " * i + f"k{i}:\n" for i in range(n))),
    # aliases of aliases: a billion laughs if anything expanded them
    st.integers(1, 40).map(lambda n: "a0: &a0 [x]\n" + "".join(
        f"a{i}: &a{i} [*a{i - 1}, *a{i - 1}, *a{i - 1}]\n" for i in range(1, n))),
    # merge keys of merge keys
    st.integers(1, 40).map(lambda n: "m0: &m0 {name: x}\n" + "".join(
        f"m{i}: &m{i} {{<<: [*m{i - 1}, *m{i - 1}], k{i}: 1}}\n" for i in range(1, n))),
)

yaml_texts = st.one_of(
    default_yaml_with_bad_scalars(), default_yaml_with_bad_scalars(), flow_mappings,
    yaml_documents(), yaml_documents(), deep,
    st.text(max_size=40),
    st.text(st.characters(codec=None, exclude_categories=()), max_size=20),
    st.binary(max_size=40),
    st.binary(max_size=40).map(lambda b: b.decode("latin-1")),
)


def check_yaml(text: str | bytes) -> None:
    try:
        data = load_yaml(text, "fuzz.yaml")
    except ConfigError as exc:
        assert exc.path == "fuzz.yaml"
        assert str(exc).startswith("fuzz.yaml: ")
        assert len(str(exc)) < 1000
        return
    check(data)


@FUZZ
@given(yaml_texts)
def test_yaml_text_loads_or_raises_config_error(text):
    check_yaml(text)


@FUZZ
@given(configs)
def test_yaml_dump_of_any_mapping(data):
    """What PyYAML writes for a mapping (its 1.1 quoting, our 1.2 reading) loads or fails typed."""
    import yaml

    try:
        text = yaml.safe_dump(data, allow_unicode=True)
    except (yaml.YAMLError, TypeError, ValueError, RecursionError):
        return  # PyYAML cannot write it (bytes keys, 5000-digit ints, ...): nothing to read
    check_yaml(text)
