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
SHIPPED = ["default.yaml", "llama-70b-h200.yaml", "daemon.yaml"]


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
        "lru", "write_back", True, "tensors")
    assert cfg.metrics.http_port is None
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
    daemon.metrics.http_port = None
    assert daemon == cfg


def test_to_dict_is_plain_and_block_size_resolved(monkeypatch):
    monkeypatch.setattr(sizing, "l2_cache_bytes", lambda device: 64 * 1024)
    cfg = CacheConfig.from_dict({"block_size": "auto", "model": {"num_kv_heads": 2}})
    d = cfg.to_dict()
    assert d["block_size"] == 64
    assert isinstance(d["tiers"]["gpu"], dict) and isinstance(d["model"], dict)
    assert CacheConfig.from_dict(d) == cfg


def test_import_does_not_pull_torch():
    code = ("import sys; import tiered_cache.config, tiered_cache.sizing, tiered_cache.planner; "
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
    assert error({"tiers": {"disk": {}}}) == (
        "tiers.disk: unknown key; valid keys are 'gpu', 'host'")


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
