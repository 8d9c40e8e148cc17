"""`tiered-cache plan`: the 70B-on-H200 arithmetic, written out."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest

from tiered_cache import TieredKVCache
from tiered_cache.config import CacheConfig
from tiered_cache.tools import cli, planner

ROOT = Path(__file__).resolve().parents[2]
CONFIG_70B = ROOT / "configs" / "llama-70b-h200.yaml"
GiB = 1024**3

# Llama-3-70B, bf16 KV: 80 layers * (K and V) * 8 KV heads * 128 dims * 2 bytes
BYTES_PER_TOKEN = 80 * 2 * 8 * 128 * 2
BYTES_PER_BLOCK = 16 * BYTES_PER_TOKEN
GPU_BLOCKS = 40 * GiB // BYTES_PER_BLOCK
HOST_512_BLOCKS = 512 * GiB // BYTES_PER_BLOCK
HOST_480_BLOCKS = 480 * GiB // BYTES_PER_BLOCK


def test_the_arithmetic():
    assert BYTES_PER_TOKEN == 327_680
    assert BYTES_PER_BLOCK == 5_242_880 == 5 * 1024**2
    assert GPU_BLOCKS == 8_192 and GPU_BLOCKS * 16 == 131_072
    assert HOST_512_BLOCKS == 104_857 and HOST_512_BLOCKS * 16 == 1_677_712  # 104,857.6 floored
    assert HOST_480_BLOCKS == 98_304 and HOST_480_BLOCKS * 16 == 1_572_864


def config_70b(host_capacity: str) -> CacheConfig:
    d = CacheConfig.from_yaml(CONFIG_70B).to_dict()
    d["tiers"]["host"]["capacity"] = host_capacity
    return CacheConfig.from_dict(d)


def test_plan_70b_with_512gib_host_all_of_it():
    plan = planner.make_plan(config_70b("100%"), host_free=512 * GiB)
    assert plan.bytes_per_token == 327_680
    assert plan.bytes_per_block == 5_242_880
    assert plan.block_size == 16
    assert plan.tiers == [
        ("gpu", 8_192, 8_192 * 5_242_880, 131_072),
        ("host", 104_857, 104_857 * 5_242_880, 1_677_712),
    ]
    assert plan.tiers[0].bytes == 40 * GiB
    assert plan.total_tokens == 131_072 + 1_677_712 == 1_808_784
    assert plan.total_blocks == 8_192 + 104_857 == 113_049


def test_plan_shipped_70b_config():
    plan = planner.make_plan(CacheConfig.from_yaml(CONFIG_70B))  # no "%": machine-independent
    assert plan.tiers == [
        ("gpu", 8_192, 40 * GiB, 131_072),
        ("host", 98_304, 480 * GiB, 1_572_864),
    ]
    assert plan.total_tokens == 131_072 + 1_572_864 == 1_703_936
    assert plan.total_bytes == 520 * GiB


def test_gpu_percentage_uses_given_free_memory():
    d = CacheConfig.from_yaml(CONFIG_70B).to_dict()
    d["tiers"]["gpu"]["capacity"] = "50%"
    plan = planner.make_plan(CacheConfig.from_dict(d), gpu_free=80 * GiB)
    assert plan.tiers[0].num_blocks == 40 * GiB // 5_242_880 == 8_192


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    rc = cli.main(["plan", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture
def config_100pct(tmp_path) -> Path:
    text = CONFIG_70B.read_text().replace("capacity: 480GiB", 'capacity: "100%"')
    assert '"100%"' in text
    f = tmp_path / "70b-all-host.yaml"
    f.write_text(text)
    return f


def test_cli_table(config_100pct, capsys):
    rc, out, err = run_cli(["--config", str(config_100pct), "--host-memory", "512GiB"], capsys)
    assert rc == 0, err
    assert "llama-3-70b" in out
    assert "327,680" in out and "5,242,880" in out and "5.00 MiB" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.strip()}
    assert rows["gpu"][1:] == ["8,192", "42,949,672,960", "40.00", "131,072"]
    assert rows["host"][1:] == ["104,857", f"{104_857 * 5_242_880:,}", "512.00", "1,677,712"]
    assert rows["total"][1] == "113,049" and rows["total"][-1] == "1,808,784"
    assert "note: write_through" in out


def test_cli_json(config_100pct, capsys):
    rc, out, err = run_cli(["--config", str(config_100pct), "--host-memory", "512GiB", "--json"],
                           capsys)
    assert rc == 0, err
    data = json.loads(out)
    assert data["bytes_per_token"] == 327_680
    assert data["bytes_per_block"] == 5_242_880
    assert data["block_size"] == 16
    assert data["tiers"] == [
        {"name": "gpu", "num_blocks": 8_192, "bytes": 40 * GiB, "tokens": 131_072},
        {"name": "host", "num_blocks": 104_857, "bytes": 104_857 * 5_242_880,
         "tokens": 1_677_712},
    ]
    assert data["total_tokens"] == 1_808_784


def test_cli_shipped_config_and_ignored_override(capsys):
    rc, out, err = run_cli(["--config", str(CONFIG_70B), "--host-memory", "512GiB", "--json"],
                           capsys)
    assert rc == 0
    assert json.loads(out)["tiers"][1]["num_blocks"] == 98_304
    assert "--host-memory is ignored" in err


def test_cli_default_config(capsys):
    rc, out, _ = run_cli([], capsys)
    assert rc == 0
    assert "tiny-llama" in out and "1,280" in out  # 256 + 1024 blocks


def test_cli_errors(tmp_path, capsys):
    missing = tmp_path / "missing.yaml"
    rc, out, err = run_cli(["--config", str(missing)], capsys)
    assert rc == 2 and out == ""
    assert err == f"tiered-cache plan: error: {missing}: no such config file\n"
    rc, _, err = run_cli(["--config", str(CONFIG_70B), "--gpu-memory", "50%"], capsys)
    assert rc == 2
    assert "error: --gpu-memory: expected an absolute size like '512GiB', got '50%'" in err
    bad = tmp_path / "bad.yaml"
    bad.write_text("tiers:\n  gpu:\n    capacity: 1KiB\n")
    rc, _, err = run_cli(["--config", str(bad)], capsys)
    assert rc == 2
    # Computed from the file's values after loading: still names the file, then the key.
    assert (f"error: {bad}: tiers.gpu.capacity: '1KiB' (1,024 bytes) holds no block of 65,536 "
            "bytes") in err
    assert len(err.splitlines()) == 1


@pytest.mark.parametrize("text,key", [
    ("model:\n  num_layers: 0\n", "model.num_layers"),
    ('policy: ":Foo"\n', "policy"),                  # once a ValueError and a traceback
    ('policy: ".rel:Foo"\n', "policy"),              # once a TypeError and a traceback
    ("tiers:\n  gpu:\n    capacity: \"1" + "0" * 400 + "GiB\"\n", "tiers.gpu.capacity"),
])
def test_config_file_errors_name_the_file_and_the_key(tmp_path, capsys, text, key):
    f = tmp_path / "my.yaml"
    f.write_text(text)
    rc, out, err = run_cli(["--config", str(f)], capsys)
    assert rc == 2 and out == ""
    assert err.startswith(f"tiered-cache plan: error: {f}: {key}: "), err
    assert "Traceback" not in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("argv", [
    ["--gpu-memory", "1" + "0" * 400 + "GiB"],        # once an OverflowError and a traceback
    ["--host-memory", "lots"],
])
def test_plan_flag_errors_are_one_line_exit_2(capsys, argv):
    rc, out, err = run_cli(argv, capsys)
    assert rc == 2 and out == ""
    assert err.startswith(f"tiered-cache plan: error: {argv[0]}: expected an absolute size")
    assert len(err.splitlines()) == 1


def test_format_plan_is_aligned():
    text = planner.format_plan(planner.make_plan(CacheConfig.from_yaml(CONFIG_70B)))
    table = [line for line in text.splitlines()
             if line.split() and line.split()[0] in ("tier", "gpu", "host", "total")]
    assert len({len(line) for line in table}) == 1


# -- what the plan says happens to an evicted block (issue 23, item 7) ------------------------

ENGINE_DAEMON = ROOT / "configs" / "engine-daemon.yaml"
DAEMON_CONFIG = ROOT / "configs" / "daemon.yaml"


def test_engine_attached_to_the_daemon_does_not_drop_evicted_blocks():
    """configs/engine-daemon.yaml: host is replaced by the daemon's pool (no host row), the
    daemon is listed beneath, and the note says where an evicted block is found again (every
    computed block is published with write: on_compute), not that it is dropped."""
    plan = planner.make_plan(CacheConfig.from_yaml(ENGINE_DAEMON))
    assert [t.name for t in plan.tiers] == ["gpu"]
    assert [(k.name, k.write) for k in plan.beneath] == [("daemon", "on_compute")]
    assert "/run/tiered-cache/daemon.sock" in plan.beneath[0].where
    text = " ".join(plan.notes)
    assert "dropped" not in text
    assert "published to the node daemon" in text and "open() finds it there" in text
    assert "the daemon's config" in text
    data = plan.to_dict()
    assert data["beneath"][0]["name"] == "daemon"
    out = planner.format_plan(plan)
    assert "beneath: daemon: the node daemon at /run/tiered-cache/daemon.sock" in out


def test_a_read_only_daemon_tier_drops_evicted_blocks_here():
    d = CacheConfig.from_yaml(ENGINE_DAEMON).to_dict()
    d["tiers"]["daemon"]["write"] = "off"
    plan = planner.make_plan(CacheConfig.from_dict(d))
    assert any("evicted from the GPU are dropped" in n for n in plan.notes)
    assert any("tiers.daemon.write: off" in n and "only read" in n for n in plan.notes)


def test_no_host_and_no_keyed_tier_drops_evicted_blocks():
    d = CacheConfig.from_yaml(CONFIG_70B).to_dict()
    d["tiers"]["host"] = {"num_blocks": 0}
    plan = planner.make_plan(CacheConfig.from_dict(d))
    assert plan.beneath == []
    assert plan.notes == ["no host tier: blocks evicted from the GPU are dropped"]


@pytest.mark.parametrize("write, says", [("on_compute", "every computed block is also put"),
                                         ("on_host", "blocks that reach the host tier"),
                                         ("off", "only read from")])
def test_a_remote_tier_is_listed_beneath_with_what_it_is_given(write, says):
    d = CacheConfig.from_yaml(CONFIG_70B).to_dict()
    d["tiers"]["remote"] = {"url": "redis://user:secret@10.0.0.5:6379/0", "write": write}
    plan = planner.make_plan(CacheConfig.from_dict(d))
    assert [t.name for t in plan.tiers] == ["gpu", "host"]
    (remote,) = plan.beneath
    assert remote.name == "remote" and "secret" not in remote.where
    assert any(says in n for n in plan.notes), plan.notes
    assert any("maxmemory" in n for n in plan.notes)


def test_the_daemons_own_config_says_gpu_is_not_built():
    plan = planner.make_plan(CacheConfig.from_yaml(DAEMON_CONFIG))
    assert any("tiered-cache serve" in n and "tiers.gpu is not built" in n for n in plan.notes)


@pytest.mark.parametrize("tiers", [
    {"host": {"num_blocks": 16}},
    {"host": {"num_blocks": 0}},
    {"host": {"num_blocks": 0}, "daemon": {"socket": "@SOCK@"}},
    {"host": {"num_blocks": 16}, "disk": {"num_blocks": 8, "path": "@DISK@"}},
])
def test_the_plan_names_the_tiers_the_cache_builds(tiers, tmp_path):
    """The planner chooses kinds as the stack builder does: the same slot tiers (with slots)
    and keyed tiers as a real cache built from the same config."""
    short = tempfile.mkdtemp(prefix="tc-plan-", dir="/tmp" if Path("/tmp").is_dir() else None)
    try:
        text = json.dumps(tiers).replace("@SOCK@", f"{short}/none.sock").replace(
            "@DISK@", str(tmp_path / "disk"))
        config = CacheConfig.from_dict({
            "model": {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "dtype": "float16"},
            "block_size": 4, "tiers": {"gpu": {"device": "cpu", "num_blocks": 8},
                                       **json.loads(text)}})
        plan = planner.make_plan(config)
        with TieredKVCache(config) as cache:
            built = [t.name for t in cache.index.tiers]
            keyed = [k.name for k in cache.index.keyed.tiers]
        assert [t.name for t in plan.tiers if t.num_blocks] == built
        assert [k.name for k in plan.beneath] == keyed
    finally:
        shutil.rmtree(short, ignore_errors=True)
