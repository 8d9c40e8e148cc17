"""Config loading and validation: every bad value fails with its full key path."""

from __future__ import annotations

import copy
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tiered_cache import sizing
from tiered_cache.config import (
    KV_DTYPES,
    CacheConfig,
    GpuTierConfig,
    HostTierConfig,
    MigratorConfig,
    ModelConfig,
    load_yaml,
)
from tiered_cache.errors import ConfigError, TierUnavailableError
from tiered_cache.policies import POLICIES

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
SHIPPED = ["default.yaml", "llama-70b-h200.yaml", "daemon.yaml", "engine-daemon.yaml"]


def error(data) -> str:
    with pytest.raises(ConfigError) as info:
        CacheConfig.from_dict(data)
    return str(info.value)


# -- defaults and shipped files ---------------------------------------------------------------


def test_default_config():
    cfg = CacheConfig.default()
    assert cfg.model.name == "tiny-llama"
    assert (cfg.model.num_layers, cfg.model.num_kv_heads, cfg.model.head_dim) == (4, 2, 64)
    assert cfg.num_q_heads == 8
    assert cfg.model.dtype == "float32" and cfg.model.dtype_size == 4
    assert cfg.block_size == 16
    assert cfg.tiers.gpu.num_blocks == 256 and cfg.tiers.gpu.capacity is None
    assert cfg.tiers.host.num_blocks == 1024 and cfg.tiers.host.memory == "pinned"
    assert (cfg.policy, cfg.write_policy, cfg.verify_tokens, cfg.storage) == (
        "adaptive", "write_back", True, "tensors")
    assert cfg.metrics.http_port is None and cfg.metrics.http_addr == "127.0.0.1"
    assert cfg.bytes_per_token == 4 * 2 * 2 * 64 * 4
    assert cfg.block_bytes == cfg.bytes_per_token * 16


def test_embedded_default_matches_configs_default_yaml():
    assert CacheConfig.from_yaml(CONFIGS / "default.yaml") == CacheConfig.default()


def test_dataclass_defaults_match_default_yaml_except_q_heads():
    # a missing section takes the dataclass defaults, which are those of default.yaml
    expected = CacheConfig.default().to_dict()
    expected["model"]["num_q_heads"] = 2  # None -> num_kv_heads
    assert CacheConfig().to_dict() == expected
    assert CacheConfig.from_dict({}) == CacheConfig()
    assert CacheConfig.from_dict(None) == CacheConfig()


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_configs_load_and_round_trip(name):
    cfg = CacheConfig.from_yaml(CONFIGS / name)
    d = cfg.to_dict()
    assert CacheConfig.from_dict(d) == cfg
    assert CacheConfig.from_dict(copy.deepcopy(d)).to_dict() == d
    assert CacheConfig.from_yaml(str(CONFIGS / name)) == cfg  # str path too


def test_70b_and_daemon_configs():
    cfg = CacheConfig.from_yaml(CONFIGS / "llama-70b-h200.yaml")
    assert cfg.model.name == "llama-3-70b"
    assert (cfg.model.num_layers, cfg.model.num_kv_heads, cfg.model.head_dim) == (80, 8, 128)
    assert cfg.num_q_heads == 64 and cfg.model.dtype == "bfloat16"
    assert cfg.model.num_params == pytest.approx(70.6e9)  # YAML 1.2 float, not a string
    assert cfg.tiers.gpu.capacity == "40GiB" and cfg.tiers.host.capacity == "480GiB"
    assert cfg.write_policy == "write_through"
    assert cfg.metrics.http_port is None
    daemon = CacheConfig.from_yaml(CONFIGS / "daemon.yaml")
    assert daemon.metrics.http_port == 9400
    assert daemon.daemon.socket == "/run/tiered-cache/daemon.sock"
    daemon.metrics.http_port = None
    daemon.daemon = cfg.daemon
    assert daemon == cfg
    # The engine attached to it names blocks the same way (same namespace) and finds its socket.
    engine = CacheConfig.from_yaml(CONFIGS / "engine-daemon.yaml")
    assert engine.tiers.daemon.socket == daemon.daemon.socket
    assert (engine.model, engine.block_size) == (daemon.model, daemon.block_size)


def test_to_dict_is_plain_and_block_size_resolved(monkeypatch):
    monkeypatch.setattr(sizing, "l2_cache_bytes", lambda device: 64 * 1024)
    cfg = CacheConfig.from_dict({"block_size": "auto", "model": {"num_kv_heads": 2}})
    d = cfg.to_dict()
    assert d["block_size"] == 64
    assert isinstance(d["tiers"]["gpu"], dict) and isinstance(d["model"], dict)
    assert CacheConfig.from_dict(d) == cfg


@pytest.mark.slow
def test_import_does_not_pull_torch():
    code = ("import sys; import tiered_cache.config, tiered_cache.sizing, "
            "tiered_cache.tools.planner; "
            "tiered_cache.config.CacheConfig.default(); assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_derived_sizes_and_fp8_scales():
    cfg = CacheConfig(model=ModelConfig(num_layers=80, num_kv_heads=8, head_dim=128,
                                        dtype="fp8_e4m3"), block_size=16)
    assert cfg.bytes_per_token == 80 * 2 * 8 * 128 * 1
    assert cfg.block_bytes == cfg.bytes_per_token * 16 + 80 * 2 * 4
    assert cfg.model.kv_hidden == 1024


def test_sections_given_as_mappings_and_nulls():
    cfg = CacheConfig(model={"num_layers": 8}, tiers={"gpu": {"capacity": "1GiB"}})
    assert cfg.model.num_layers == 8 and cfg.tiers.gpu.capacity == "1GiB"
    assert cfg.tiers.host.num_blocks == 1024  # missing section: defaults
    # `migrator:` with nothing under it in YAML is null: the section's defaults
    assert CacheConfig.from_dict({"migrator": None, "tiers": {"gpu": None}}) == CacheConfig()


# -- bad values: exact messages ---------------------------------------------------------------


def test_bad_capacity():
    assert error({"tiers": {"host": {"capacity": "lots"}}}) == (
        "tiers.host.capacity: expected a size like '64GiB' or '70%', got 'lots'")


def test_negative_layers():
    assert error({"model": {"num_layers": -3}}) == (
        "model.num_layers: expected a positive integer, got -3")


def test_bool_is_not_an_int():
    assert error({"model": {"num_layers": True}}) == (
        "model.num_layers: expected a positive integer, got True")


def test_bad_dtype():
    assert error({"model": {"dtype": "int8"}}) == (
        "model.dtype: expected one of 'float32', 'float16', 'bfloat16', 'fp8_e4m3', "
        "got 'int8'")
    assert set(KV_DTYPES) == {"float32", "float16", "bfloat16", "fp8_e4m3"}


def test_q_heads_multiple_of_kv_heads():
    assert error({"model": {"num_kv_heads": 8, "num_q_heads": 12}}) == (
        "model.num_q_heads: must be a multiple of num_kv_heads (8), got 12")


def test_bad_policy_name():
    assert error({"policy": "lfu-magic"}) == (
        f"policy: unknown policy 'lfu-magic'; expected one of {sorted(POLICIES)} "
        "or 'pkg.module:Class'")
    assert error({"policy": "no_such_module_xyz:Policy"}).startswith(
        "policy: cannot load policy 'no_such_module_xyz:Policy'")


def test_both_capacity_and_num_blocks():
    assert error({"tiers": {"gpu": {"capacity": "1GiB", "num_blocks": 8}}}) == (
        "tiers.gpu: set exactly one of 'capacity' or 'num_blocks', got both")


def test_neither_capacity_nor_num_blocks():
    assert error({"tiers": {"host": {"memory": "pageable"}}}) == (
        "tiers.host: set exactly one of 'capacity' or 'num_blocks', got neither")


def test_gpu_needs_a_block_host_may_have_none():
    assert error({"tiers": {"gpu": {"num_blocks": 0}}}) == (
        "tiers.gpu.num_blocks: expected a positive integer, got 0")
    assert CacheConfig.from_dict({"tiers": {"host": {"num_blocks": 0}}}).tiers.host.num_blocks == 0
    assert error({"tiers": {"host": {"num_blocks": -1}}}) == (
        "tiers.host.num_blocks: expected a non-negative integer, got -1")


def test_resize_bounds():
    cfg = CacheConfig.from_dict({"tiers": {"gpu": {"num_blocks": 8, "max_num_blocks": 64,
                                                   "segment_blocks": 4}}})
    assert (cfg.tiers.gpu.max_num_blocks, cfg.tiers.gpu.segment_blocks) == (64, 4)
    assert cfg.tiers.host.max_num_blocks is None and cfg.tiers.host.segment_blocks is None
    assert error({"tiers": {"gpu": {"num_blocks": 8, "max_num_blocks": 4}}}) == (
        "tiers.gpu.max_num_blocks: 4 is below num_blocks 8")
    assert error({"tiers": {"host": {"num_blocks": 8, "segment_blocks": 0}}}) == (
        "tiers.host.segment_blocks: expected a positive integer, got 0")


def test_low_watermark_not_below_high():
    assert error({"migrator": {"high_watermark": 0.8, "low_watermark": 0.8}}) == (
        "migrator.low_watermark: must be below high_watermark (0.8), got 0.8")
    assert error({"migrator": {"high_watermark": 1.5}}) == (
        "migrator.high_watermark: expected a number in (0, 1], got 1.5")
    with pytest.raises(ConfigError, match=r"^migrator\.low_watermark: "):
        MigratorConfig(low_watermark=0.95)  # built directly: full path too


def test_bool_given_as_string_or_int():
    assert error({"verify_tokens": "yes"}) == "verify_tokens: expected true or false, got 'yes'"
    assert error({"migrator": {"enabled": 1}}) == (
        "migrator.enabled: expected true or false, got 1")


def test_yaml_yes_is_a_string(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("verify_tokens: yes\n")
    with pytest.raises(ConfigError) as info:
        CacheConfig.from_yaml(f)
    assert str(info.value) == "verify_tokens: expected true or false, got 'yes'"


def test_unknown_key_with_suggestion():
    assert error({"polcy": "lru"}) == "polcy: unknown key; did you mean 'policy'?"


def test_unknown_key_deep_in_tiers():
    assert error({"tiers": {"gpu": {"capasity": "40GiB"}}}) == (
        "tiers.gpu.capasity: unknown key; did you mean 'capacity'?")


def test_unknown_key_without_close_match_lists_valid_keys():
    assert error({"tiers": {"tape": {}}}) == (
        "tiers.tape: unknown key; valid keys are 'daemon', 'disk', 'gpu', 'host', 'remote'")


def test_non_mapping_section():
    assert error({"tiers": {"gpu": "40GiB"}}) == (
        "tiers.gpu: expected a mapping of keys, got str '40GiB'")
    assert error({"migrator": [1, 2]}) == "migrator: expected a mapping of keys, got list [1, 2]"
    assert error(["model"]) == "config: expected a mapping of keys, got list ['model']"


def test_other_bad_values():
    cases = {
        "block_size: expected a power of two in 1..4096 or 'auto', got 24": {"block_size": 24},
        "block_size: expected a power of two in 1..4096 or 'auto', got 8192": {"block_size": 8192},
        "tiers.gpu.device: expected one of 'auto', 'cpu', 'cuda' or 'cuda:N', got 'gpu0'":
            {"tiers": {"gpu": {"device": "gpu0", "num_blocks": 4}}},
        "tiers.host.memory: expected one of 'pinned', 'managed', 'pageable', got 'huge'":
            {"tiers": {"host": {"num_blocks": 4, "memory": "huge"}}},
        "write_policy: expected one of 'write_back', 'write_through', got 'sometimes'":
            {"write_policy": "sometimes"},
        "storage: expected one of 'tensors', 'none', got None": {"storage": None},
        "kernels.attention_backend: expected one of 'auto', 'triton', 'torch', got 'cuda'":
            {"kernels": {"attention_backend": "cuda"}},
        "kernels.missing_blocks: expected one of 'zero_copy', 'wait', got 'skip'":
            {"kernels": {"missing_blocks": "skip"}},
        "metrics.http_port: expected a port in 1..65535 or null, got 70000":
            {"metrics": {"http_port": 70000}},
        "compactor.threshold: expected a positive number, got 0": {"compactor": {"threshold": 0}},
        "migrator.wait_timeout_s: expected a positive number, got '30s'":
            {"migrator": {"wait_timeout_s": "30s"}},
        "migrator.max_retries: expected a non-negative integer, got -1":
            {"migrator": {"max_retries": -1}},
        "model.num_params: expected a positive number, got '70B'": {"model": {"num_params": "70B"}},
        "model.name: expected a non-empty string, got ''": {"model": {"name": ""}},
        "adapter_id: expected a non-empty string or null, got 3": {"adapter_id": 3},
        "tiers.gpu.capacity: expected a percentage in (0%, 100%], got '150%'":
            {"tiers": {"gpu": {"capacity": "150%"}}},
    }
    for message, data in cases.items():
        assert error(data) == message


def test_direct_construction_reports_full_paths():
    with pytest.raises(ConfigError, match=r"^tiers\.gpu\.capacity: expected a size"):
        GpuTierConfig(capacity="big")
    with pytest.raises(ConfigError, match=r"^tiers\.host: set exactly one"):
        HostTierConfig()
    with pytest.raises(ConfigError, match=r"^model\.head_dim: "):
        ModelConfig(head_dim=0)


# -- files ------------------------------------------------------------------------------------


def test_missing_file(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError) as info:
        CacheConfig.from_yaml(missing)
    assert str(info.value) == f"{missing}: no such config file"


def test_bad_yaml(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("model:\n  name: x\n  num_layers: [1, 2\n")
    with pytest.raises(ConfigError) as info:
        CacheConfig.from_yaml(f)
    msg = str(info.value)
    assert msg.startswith(f"{f}: invalid YAML at line ")
    assert re.search(r"line \d+, column \d+: ", msg)


def test_duplicate_yaml_key(tmp_path):
    f = tmp_path / "dup.yaml"
    f.write_text("policy: lru\npolicy: lru\n")
    with pytest.raises(ConfigError, match=r"invalid YAML at line 2, column 1: duplicate key"):
        CacheConfig.from_yaml(f)


def test_empty_yaml_file_is_all_defaults(tmp_path):
    f = tmp_path / "empty.yaml"
    f.write_text("# nothing\n")
    assert CacheConfig.from_yaml(f) == CacheConfig()


def test_yaml_error_in_file_keeps_key_path(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("tiers:\n  host:\n    capacity: lots\n")
    with pytest.raises(ConfigError) as info:
        CacheConfig.from_yaml(f)
    assert info.value.path == "tiers.host.capacity"
    if sys.version_info >= (3, 11):
        assert info.value.__notes__ == [f"in config file {f}"]


def test_yaml_12_floats():
    assert load_yaml("a: 1e9\nb: 70.6e9\nc: 3\nd: .5\ne: '1e9'") == {
        "a": 1e9, "b": 70.6e9, "c": 3, "d": 0.5, "e": "1e9"}


# -- block_size auto --------------------------------------------------------------------------


def _auto(monkeypatch, l2, **model):
    seen = []

    def fake_l2(device):
        seen.append(device)
        return l2

    monkeypatch.setattr(sizing, "l2_cache_bytes", fake_l2)
    cfg = CacheConfig.from_dict({"block_size": "auto", "model": model,
                                 "tiers": {"gpu": {"device": "cpu", "num_blocks": 4}}})
    assert seen == ["cpu"]
    return cfg.block_size


def test_block_size_auto_formula(monkeypatch):
    # kv_hidden 128 (2 heads x 64), float32: one token's K and V of one layer = 2*128*4 = 1 KiB
    assert _auto(monkeypatch, 1024**2, num_kv_heads=2, head_dim=64) == 256  # 1024 -> clamp 256
    assert _auto(monkeypatch, 64 * 1024, num_kv_heads=2, head_dim=64) == 64  # 64
    assert _auto(monkeypatch, 100 * 1024, num_kv_heads=2, head_dim=64) == 64  # 100 -> 64
    assert _auto(monkeypatch, 4 * 1024, num_kv_heads=2, head_dim=64) == 8  # 4 -> clamp 8
    # 70B geometry, bf16, H200 L2 of 60 MiB: 60 MiB / (2*1024*2) = 15360 -> 256
    assert _auto(monkeypatch, 60 * 1024**2, num_kv_heads=8, head_dim=128,
                 dtype="bfloat16") == 256


def test_block_size_auto_real_machine():
    cfg = CacheConfig.from_dict({"block_size": "auto",
                                 "tiers": {"gpu": {"device": "cpu", "num_blocks": 4}}})
    bs = cfg.block_size
    assert isinstance(bs, int) and 8 <= bs <= 256 and bs & (bs - 1) == 0


def test_l2_cache_bytes_from_sysfs(monkeypatch, tmp_path):
    f = tmp_path / "size"
    f.write_text("2048K\n")
    monkeypatch.setattr(sizing, "_SYS_L2", f)
    assert sizing.l2_cache_bytes("cpu") == 2 * 1024**2
    f.write_text("2M\n")
    assert sizing.l2_cache_bytes("cpu") == 2 * 1024**2
    monkeypatch.setattr(sizing, "_SYS_L2", tmp_path / "missing")
    assert sizing.l2_cache_bytes("cpu") == 1024**2


# -- sizing -----------------------------------------------------------------------------------


@pytest.mark.parametrize("text,expected", [
    ("40GiB", ("bytes", 40 * 1024**3)),
    ("512 MiB", ("bytes", 512 * 1024**2)),
    ("1.5GB", ("bytes", 1_500_000_000)),
    ("100KB", ("bytes", 100_000)),
    ("100kb", ("bytes", 100_000)),
    ("2tib", ("bytes", 2 * 1024**4)),
    ("4096B", ("bytes", 4096)),
    ("4096", ("bytes", 4096)),
    (4096, ("bytes", 4096)),
    ("70%", ("fraction", 0.7)),
    ("100%", ("fraction", 1.0)),
])
def test_parse_size(text, expected):
    assert sizing.parse_size(text, "x") == expected


@pytest.mark.parametrize("text", ["lots", "", "40 GiBs", "-1GiB", "0%", "101%", True, None, "4G"])
def test_parse_size_rejects(text):
    with pytest.raises(ConfigError, match=r"^tiers\.gpu\.capacity: expected a"):
        sizing.parse_size(text, "tiers.gpu.capacity")


def test_tier_num_blocks():
    cfg = CacheConfig.from_dict({"tiers": {"gpu": {"capacity": "1MiB"},
                                           "host": {"capacity": "50%"}}})
    assert cfg.block_bytes == 65536
    assert sizing.tier_num_blocks(cfg, "gpu") == 16
    assert sizing.tier_num_blocks(cfg, "host", free=10 * 65536) == 5
    assert sizing.tier_num_blocks(cfg, "host", free=65536) == 0  # no host tier
    assert sizing.tier_num_blocks(CacheConfig(), "gpu") == 256
    small = CacheConfig.from_dict({"tiers": {"gpu": {"capacity": "1KiB"}}})
    with pytest.raises(ConfigError) as info:
        sizing.tier_num_blocks(small, "gpu")
    assert str(info.value) == (
        "tiers.gpu.capacity: '1KiB' (1,024 bytes) holds no block of 65,536 bytes")
    pct = CacheConfig.from_dict({"tiers": {"gpu": {"capacity": "10%"}}})
    with pytest.raises(ConfigError, match="'10%' of 100,000 free bytes holds no block"):
        sizing.tier_num_blocks(pct, "gpu", free=100_000)


def test_free_bytes_and_resolve_device():
    assert sizing.free_bytes("cpu") > 0
    assert sizing.resolve_device("cpu") == "cpu"
    assert sizing.resolve_device("auto") in ("cpu", "cuda")
    if not sizing._cuda_available():
        with pytest.raises(TierUnavailableError, match="CUDA is not available"):
            sizing.resolve_device("cuda")


# -- issue 12: every input loads or raises ConfigError naming the key ---------------------------

NUMERIC_KEYS = [
    ("model", "num_layers"), ("model", "num_kv_heads"), ("model", "head_dim"),
    ("model", "num_q_heads"), ("model", "num_params"),
    ("tiers.gpu", "num_blocks"), ("tiers.gpu", "max_num_blocks"), ("tiers.gpu", "segment_blocks"),
    ("tiers.gpu", "capacity"), ("tiers.host", "num_blocks"), ("tiers.host", "capacity"),
    ("tiers.host", "max_num_blocks"), ("tiers.host", "segment_blocks"),
    ("migrator", "high_watermark"), ("migrator", "low_watermark"), ("migrator", "num_workers"),
    ("migrator", "batch_blocks"), ("migrator", "wait_timeout_s"), ("migrator", "max_retries"),
    ("migrator", "promotion_chunk_bytes"), ("compactor", "threshold"),
    ("compactor", "interval_s"), ("compactor", "max_moves_per_step"),
    ("metrics", "http_port"), ("", "block_size"),
]
HUGE = [10**400, -(10**400), 10**5000, 1e308, float("inf"), float("-inf"), float("nan"),
        "9" * 400 + "GiB", "1e400GiB"]


def nested(section: str, key: str, value) -> dict:
    """{"a": {"b": {key: value}}} for section "a.b"; a tier also gets its other size key unset."""
    data: dict = {key: value}
    if section.startswith("tiers.") and key in ("num_blocks", "capacity"):
        data["num_blocks" if key == "capacity" else "capacity"] = None
    for part in reversed(section.split(".") if section else []):
        data = {part: data}
    return data


@pytest.mark.parametrize("section,key", NUMERIC_KEYS)
@pytest.mark.parametrize("value", HUGE, ids=["1e400", "-1e400", "1e5000", "1e308", "inf", "-inf",
                                             "nan", "400digitsGiB", "1e400GiB"])
def test_huge_and_non_finite_numbers_name_the_key(section, key, value):
    path = f"{section}.{key}" if section else key
    with pytest.raises(ConfigError) as info:
        CacheConfig.from_dict(nested(section, key, value))
    assert info.value.path == path
    assert len(str(info.value)) < 300  # a 5000-digit int is not echoed back in full


def test_upper_bounds_exact_messages():
    cases = {
        "model.num_layers: expected a positive integer at most 1,024, got 1025":
            {"model": {"num_layers": 1025}},
        "model.head_dim: expected a positive integer at most 4,096, got 8192":
            {"model": {"head_dim": 8192}},
        "model.num_params: expected a positive number at most 1e+15, got 1e+16":
            {"model": {"num_params": 1e16}},
        "tiers.gpu.num_blocks: expected a positive integer at most 2,147,483,647, got 2147483648":
            {"tiers": {"gpu": {"num_blocks": 2**31}}},
        "migrator.num_workers: expected a positive integer at most 256, got 257":
            {"migrator": {"num_workers": 257}},
        "migrator.wait_timeout_s: expected a positive number at most 86,400, got 1e+308":
            {"migrator": {"wait_timeout_s": 1e308}},
        "migrator.max_retries: expected a non-negative integer at most 100, got 101":
            {"migrator": {"max_retries": 101}},
        "compactor.interval_s: expected a positive number at most 3,600, got 3601":
            {"compactor": {"interval_s": 3601}},
        "migrator.high_watermark: expected a number in (0, 1], got <an integer of about 401 "
        "digits>": {"migrator": {"high_watermark": 10**400}},
        "tiers.gpu.capacity: expected a size of at most 1 PiB (1,125,899,906,842,624 bytes), "
        "got '2PiB'": {"tiers": {"gpu": {"capacity": "2PiB"}}},
    }
    for message, data in cases.items():
        assert error(data) == message
    # the bounds themselves are accepted
    cfg = CacheConfig.from_dict({"migrator": {"wait_timeout_s": 86400, "num_workers": 256,
                                              "max_retries": 100},
                                 "compactor": {"interval_s": 3600}})
    assert cfg.migrator.wait_timeout_s == 86400.0 and cfg.compactor.interval_s == 3600.0


def test_a_tier_holds_at_most_one_pib():
    # each count is in range, but 2**31 - 1 blocks of 64 KiB are 128 TiB; of 5 MiB, 10 PiB
    assert CacheConfig.from_dict({"tiers": {"host": {"num_blocks": 2**31 - 1}}})
    big = {"model": {"num_layers": 80, "num_kv_heads": 8, "head_dim": 128, "dtype": "bfloat16"},
           "tiers": {"host": {"num_blocks": 2**31 - 1}}}
    assert error(big) == (
        "tiers.host.num_blocks: 2,147,483,647 blocks of 5,242,880 bytes are 10.00 PiB, above "
        "the 1 PiB a tier may hold")
    big["tiers"] = {"gpu": {"num_blocks": 8, "max_num_blocks": 2**30}}
    assert error(big).startswith("tiers.gpu.max_num_blocks: 1,073,741,824 blocks of ")


def test_capacity_that_gives_too_many_blocks():
    # 4-byte blocks: 1 PiB would be 2**48 slots, past the int32 slot ids of the kernels
    cfg = CacheConfig.from_dict({"model": {"num_layers": 1, "num_kv_heads": 1, "head_dim": 1,
                                           "dtype": "float16"},
                                 "block_size": 1, "tiers": {"gpu": {"capacity": "1PiB"}}})
    assert cfg.block_bytes == 4
    with pytest.raises(ConfigError, match=r"^tiers\.gpu\.capacity: '1PiB' \(1,125,899,906,842,"
                                          r"624 bytes\) is 281,474,976,710,656 blocks of 4 bytes, "
                                          r"more than the 2,147,483,647 a tier may have"):
        sizing.tier_num_blocks(cfg, "gpu")


@pytest.mark.parametrize("text,expected", [
    ("4.35GB", 4_350_000_000),  # exact: float arithmetic gives 4,349,999,999
    ("0.1KB", 100),
    ("1PiB", 1024**5), ("1PB", 1000**5),
    ("0.0000000000009094947017729282379150390625TiB", 1),  # 2**-40 TiB: exactly one byte
    ("0" * 400 + "1KiB", 1024),  # leading zeros are not digits of magnitude
    (" 40GiB\t", 40 * 1024**3),
    (1e15, 10**15),
])
def test_parse_size_exact(text, expected):
    assert sizing.parse_size(text, "x") == ("bytes", expected)


@pytest.mark.parametrize("text", [
    "9" * 400 + "GiB", "1e400GiB", "1.5PiB", 10**400, 2.0**60, float("nan"), float("inf"),
    "40GiB\n", "\n40GiB", "\x1c40GiB", "٤٠GiB", "40\u00a0GiB", "70%\n", "٧٠%", "9" * 400 + "%",
    "1e3GiB", "40 G iB", b"40GiB", [40],
])
def test_parse_size_rejects_overflow_and_lookalikes(text):
    with pytest.raises(ConfigError, match=r"^tiers\.gpu\.capacity: expected a"):
        sizing.parse_size(text, "tiers.gpu.capacity")


@pytest.mark.parametrize("spec,message", [
    (":Foo", "expected 'pkg.module:Class'"),
    (".rel:Foo", "expected 'pkg.module:Class'"),
    ("pkg.:Foo", "expected 'pkg.module:Class'"),
    ("pkg:", "expected 'pkg.module:Class'"),
    ("a b:C", "expected 'pkg.module:Class'"),
    ("pkg:Foo.Bar", "expected 'pkg.module:Class'"),
    ("pkg:Foo:Bar", "expected 'pkg.module:Class'"),
    ("class.mod:Foo", "expected 'pkg.module:Class'"),
    ("tiered_cache.policies.lru:LRUPolicy\n", "expected 'pkg.module:Class'"),
    ("tiered_cache.policies.base:CachePolicy",
     "is abstract (it does not implement __len__, insert, remove, victims)"),
    ("tiered_cache.policies.base:PriorityPolicy", "is abstract (it does not implement priority)"),
    ("tiered_cache.policies:POLICIES", "is not a subclass of tiered_cache.policies.CachePolicy"),
    ("tiered_cache.policies.lru:NoSuchPolicy", "cannot load policy"),
    ("lru\n", "unknown policy 'lru\\n'"),
])
def test_malformed_policy_specs(spec, message):
    with pytest.raises(ConfigError) as info:
        CacheConfig.from_dict({"policy": spec})
    assert info.value.path == "policy"
    assert message in str(info.value)


def test_policy_module_that_fails_or_needs_other_arguments(tmp_path, monkeypatch):
    (tmp_path / "tc_user_policies.py").write_text(
        "from tiered_cache.policies import LRUPolicy\n"
        "class NeedsArgs(LRUPolicy):\n"
        "    def __init__(self, capacity_blocks, oracle, **kw):\n"
        "        super().__init__(capacity_blocks, **kw)\n"
        "class Fine(LRUPolicy):\n"
        "    pass\n")
    (tmp_path / "tc_broken_policies.py").write_text("raise RuntimeError('boom at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert CacheConfig.from_dict({"policy": "tc_user_policies:Fine"}).policy == (
        "tc_user_policies:Fine")
    assert "cannot be built as NeedsArgs(capacity_blocks, block_size=..., " \
           "cost_context_tokens=...)" in error({"policy": "tc_user_policies:NeedsArgs"})
    assert error({"policy": "tc_broken_policies:X"}) == (
        "policy: cannot load policy 'tc_broken_policies:X': importing 'tc_broken_policies' "
        "raised RuntimeError: boom at import")


@pytest.mark.parametrize("device", ["cpu\n", "auto\n", "cuda:0\n", " cpu", "CPU", "cuda:٣",
                                    "cuda:01", "cuda:1000", "cuda:", "cuda:-1", "cuda0", ""])
def test_bad_devices(device):
    with pytest.raises(ConfigError) as info:
        CacheConfig.from_dict({"tiers": {"gpu": {"device": device, "num_blocks": 4}}})
    assert info.value.path == "tiers.gpu.device"
    with pytest.raises(ConfigError):
        sizing.resolve_device(device)


def test_device_index_range_message():
    assert error({"tiers": {"gpu": {"device": "cuda:1000", "num_blocks": 4}}}) == (
        "tiers.gpu.device: expected one of 'auto', 'cpu', 'cuda' or 'cuda:N' with N in 0..999 "
        "and no leading zeros, got 'cuda:1000'")
    for ok in ("cuda:0", "cuda:7", "cuda:999", "cuda", "cpu", "auto"):
        assert CacheConfig.from_dict({"tiers": {"gpu": {"device": ok, "num_blocks": 4}}})


@pytest.mark.parametrize("key", ["adapter_id", "model.name"])
@pytest.mark.parametrize("value,message", [
    ("a\x00b", "expected printable characters"),
    ("lora\n", "expected printable characters"),
    ("a\tb", "expected printable characters"),
    ("zero\u200bwidth", "expected printable characters"),
    ("\ud800", "expected printable characters"),
    ("nb\u00a0sp", "expected printable characters"),
    (" lora", "expected no leading or trailing whitespace"),
    ("x" * 257, "expected at most 256 characters, got 257"),
    ("   ", "expected a non-empty string"),
    ("", "expected a non-empty string"),
    (b"lora", "expected a non-empty string"),
])
def test_namespace_ids_are_printable_and_bounded(key, value, message):
    data = {"adapter_id": value} if key == "adapter_id" else {"model": {"name": value}}
    with pytest.raises(ConfigError) as info:
        CacheConfig.from_dict(data)
    assert info.value.path == key
    assert message in str(info.value)


def test_namespace_ids_accepted():
    for value in ("my-lora/v1.2", "x" * 256, "日本語のアダプタ", "a b", "meta-llama/Llama-3-70B"):
        assert CacheConfig.from_dict({"adapter_id": value}).adapter_id == value
        assert CacheConfig.from_dict({"model": {"name": value}}).model.name == value


@pytest.mark.parametrize("addr", ["127.0.0.1", "0.0.0.0", "::", "::1", "fe80::1%eth0",
                                  "2001:db8::1", "localhost", "metrics.svc.cluster.local",
                                  "my-host", "a" * 63, "host1"])
def test_http_addr_accepted(addr):
    cfg = CacheConfig.from_dict({"metrics": {"http_port": 9400, "http_addr": addr}})
    assert cfg.metrics.http_addr == addr
    assert CacheConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize("addr", ["", "127.0.0.1\n", " localhost", "localhost ", "1.2.3",
                                  "999.1.1.1", "256.0.0.1", "-bad", "bad-", "a..b", ".a", "a.",
                                  "host_name", "[::1]", "http://localhost", "a" * 64,
                                  ".".join(["a" * 60] * 5), "exa mple", "ünïcode", None, 1,
                                  2130706433, ["127.0.0.1"]])
def test_http_addr_rejected(addr):
    with pytest.raises(ConfigError) as info:
        CacheConfig.from_dict({"metrics": {"http_addr": addr}})
    assert info.value.path == "metrics.http_addr"
    assert "expected an IP address ('127.0.0.1', '0.0.0.0', '::1') or a hostname" in str(
        info.value)


def test_http_addr_from_yaml():
    cfg = CacheConfig.from_dict(load_yaml("metrics:\n  http_port: 9400\n  http_addr: 0.0.0.0\n"))
    assert cfg.metrics.http_addr == "0.0.0.0"
    assert CacheConfig().metrics.http_addr == "127.0.0.1"


def test_unprintable_or_huge_keys_are_shown_short():
    assert error({10**5000: 1}).startswith(
        "<an integer of about 5001 digits>: unknown key; valid keys are ")
    assert error({"pol\ncy": "lru"}).startswith("'pol\\ncy': unknown key")
    msg = error({"x" * 1_000_000: 1})
    assert msg.startswith("'xxxx") and len(msg) < 400
    assert error({"": 1}).startswith("'': unknown key; valid keys are ")
    assert error({"tiers": {"gpu.num_blocks": 1}}).startswith("tiers.'gpu.num_blocks': unknown")
    msg = error({"policy": "x" * 5000 + ":A"})
    assert msg.startswith("policy: cannot load policy 'xxx") and len(msg) < 400
    msg = error({"model": {"name": ["y" * 1_000_000] * 1000}})
    assert msg.startswith("model.name: expected a non-empty string, got [") and len(msg) < 400


def test_self_referencing_values():
    loop: list = []
    loop.append(loop)
    assert error({"policy": loop}).startswith("policy: expected a policy name")
    data = load_yaml("a: &a [*a, *a]\n")
    assert data["a"][0] is data["a"]
    # reprlib stops at 3 levels, so a structure that contains itself prints finitely
    assert error({"model": {"name": data["a"]}}) == (
        "model.name: expected a non-empty string, got "
        "[[[[...], [...]], [[...], [...]]], [[[...], [...]], [[...], [...]]]]")


def test_from_yaml_bad_paths():
    with pytest.raises(ConfigError, match=r"^config: expected a file path, got None$"):
        CacheConfig.from_yaml(None)
    with pytest.raises(ConfigError, match="cannot read config file"):
        CacheConfig.from_yaml("con\0fig.yaml")


# -- YAML text ----------------------------------------------------------------------------------


def yaml_error(text) -> str:
    with pytest.raises(ConfigError) as info:
        load_yaml(text, "c.yaml")
    assert info.value.path == "c.yaml"
    return str(info.value)


@pytest.mark.parametrize("text,value", [
    ("1:30", "1:30"),           # YAML 1.1 sexagesimal would be 90
    ("010", 10),                # YAML 1.1 octal would be 8
    ("0o17", "0o17"),           # a string, as PyYAML's dumper writes it
    ("0x1F", 31),
    ("1_000", 1000),
    ("-5", -5),
    ("0b101", "0b101"),
    ("2024-01-01", "2024-01-01"),  # no timestamps: a date is a string
    ("2024-13-45", "2024-13-45"),  # PyYAML's timestamp constructor raises ValueError
    ("=", "="),
    ("<<", "<<"),
    ("1e400", float("inf")),
    ("yes", "yes"),
    ("~", None),
])
def test_yaml_scalars(text, value):
    assert load_yaml(f"a: {text}\n") == {"a": value}


@pytest.mark.parametrize("text,problem", [
    ("a: !!int abc", "line 1, column 4: expected an integer, got 'abc'"),
    ("a: !!int 1:30", "line 1, column 4: expected an integer, got '1:30'"),
    ("a: !!bool abc", "line 1, column 4: expected true or false, got 'abc'"),
    ("a: !!bool yes", "line 1, column 4: expected true or false, got 'yes'"),
    ("a: !!float x", "line 1, column 4: expected a number, got 'x'"),
    ("a: !!timestamp 2024-13-45", "line 1, column 4: !!timestamp is not a config value"),
    ("a: !!map x", "line 1, column 4: expected a mapping node, but found scalar"),
    ("a: !!set [1]", "line 1, column 4: expected a mapping node, but found sequence"),
    ("a: !!python/object:os.system x", "could not determine a constructor"),
    ("a: " + "1" * 5000, "line 1, column 4: integer of 5,000 digits (at most 4300)"),
    ("a: [" + "[" * 100 + "]" * 101, "nesting deeper than 64 levels"),
    ("a:\n" + "".join("  " * i + f"k{i}:\n" for i in range(1, 100)),
     "nesting deeper than 64 levels"),
    ("x: &x {a: 1}\ny:\n  <<: *x\n  b: 1\n  b: 2\n", "line 5, column 3: duplicate key 'b'"),
    ("y:\n  <<: {a: 1, a: 2}\n", "line 2, column 14: duplicate key 'a'"),
    ("a: 1\n1: 2\ntrue: 3\n", "line 3, column 1: duplicate key True"),
    ("a: *nowhere", "found undefined alias 'nowhere'"),
    ("a: 1\n---\nb: 2\n", "expected a single document"),
    ("a: \x00", "invalid YAML"),
    ("a: \ud800", "invalid YAML"),
    ("a: b: c", "invalid YAML at line 1, column 5"),
    (b"a: \xff\xfe\xfd", "invalid YAML"),
])
def test_yaml_errors_are_config_errors(text, problem):
    assert problem in yaml_error(text)


def test_yaml_merge_keys_and_float_tags():
    text = ("base: &gpu {device: cpu, num_blocks: 8}\n"
            "tiers:\n  gpu:\n    <<: *gpu\n    num_blocks: 16\n")
    assert load_yaml(text)["tiers"] == {"gpu": {"device": "cpu", "num_blocks": 16}}
    assert load_yaml("a: !!float 3\nb: !!float 1_0.5\nc: !!int 0x10\nd: !!str 3\n") == {
        "a": 3.0, "b": 10.5, "c": 16, "d": "3"}


def test_load_yaml_needs_text():
    with pytest.raises(ConfigError, match=r"^c\.yaml: expected YAML text, got NoneType$"):
        load_yaml(None, "c.yaml")


def test_yaml_deep_nesting_from_a_deep_stack():
    # 60 levels of YAML parse even when the caller is already deep in its own stack
    text = "a: " + "[" * 60 + "]" * 60

    def recurse(n):
        return recurse(n - 1) if n else load_yaml(text)

    limit = sys.getrecursionlimit()
    assert recurse(limit - 300)
    with pytest.raises(ConfigError):
        recurse(limit - 60)
