"""The connector's configuration (kv_connector_extra_config) and block identity: what is taken
from vLLM, what may be set, and the key path of every error."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

from tiered_cache.errors import ConfigError
from tiered_cache.integrations.vllm import embedded
from tiered_cache.integrations.vllm.identity import (
    Geometry,
    adapter_of,
    default_block_size,
    model_name,
    rank_salt,
)
from tiered_cache.integrations.vllm.settings import resolve

VLLM = Geometry("m", "float32", 4, 2, 64, 32, 32, 1)


def test_nothing_given_is_an_embedded_service_with_vllms_geometry():
    r = resolve({}, VLLM)
    assert r.embedded and r.socket is None
    assert r.geometry == VLLM
    assert r.cache.model.num_kv_heads == 2 and r.cache.block_size == 32
    assert r.cache.tiers.host.capacity == "4GiB"
    assert r.settings.lookup_deadline_ms == 5.0 and r.settings.load == "sync"


def test_inline_mapping_and_yaml_file_say_the_same(tmp_path):
    data = {"block_size": 16, "tiers": {"host": {"num_blocks": 100}},
            "vllm": {"lookup_deadline_ms": 3, "load": "async"}}
    path = tmp_path / "c.yaml"
    path.write_text("block_size: 16\ntiers: {host: {num_blocks: 100}}\n"
                    "vllm: {lookup_deadline_ms: 3, load: async}\n")
    a, b = resolve({"tiered_cache": data}, VLLM), resolve({"tiered_cache": str(path)}, VLLM)
    for r in (a, b):
        assert r.geometry.block_size == 16 and r.geometry.sub_blocks == 2
        assert r.cache.tiers.host.num_blocks == 100
        assert r.settings.load == "async" and r.settings.lookup_deadline_ms == 3.0


def test_an_external_daemon():
    r = resolve({"tiered_cache": {"tiers": {"daemon": {"socket": "/run/tc/d.sock"}}}}, VLLM)
    assert not r.embedded and r.socket == "/run/tc/d.sock"


def test_the_model_name_may_be_set_the_geometry_must_agree():
    r = resolve({"tiered_cache": {"model": {"name": "llama-3-8b", "num_kv_heads": 2}}}, VLLM)
    assert r.geometry.model == "llama-3-8b"
    with pytest.raises(ConfigError) as e:
        resolve({"tiered_cache": {"model": {"num_kv_heads": 8}}}, VLLM)
    assert e.value.path == "kv_connector_extra_config.tiered_cache.model.num_kv_heads"


@pytest.mark.parametrize("extra, path", [
    ({"other": 1}, "kv_connector_extra_config.other"),
    ({"tiered_cache": 5}, "kv_connector_extra_config.tiered_cache"),
    ({"tiered_cache": {"block_size": 12}}, "kv_connector_extra_config.tiered_cache.block_size"),
    ({"tiered_cache": {"block_size": 64}}, "kv_connector_extra_config.tiered_cache.block_size"),
    ({"tiered_cache": {"tiers": {"gpu": {"num_blocks": 4}}}},
     "kv_connector_extra_config.tiered_cache.tiers.gpu"),
    ({"tiered_cache": {"tiers": {"daemon": {"socket": "/x.sock"}, "host": {}}}},
     "kv_connector_extra_config.tiered_cache.tiers.host"),
    ({"tiered_cache": {"tiers": {"host": {"capacity": "lots"}}}},
     "kv_connector_extra_config.tiered_cache.tiers.host.capacity"),
    ({"tiered_cache": {"daemon": {"socket": "/x.sock"}}},
     "kv_connector_extra_config.tiered_cache.daemon.socket"),
    ({"tiered_cache": {"vllm": {"load": "lazy"}}},
     "kv_connector_extra_config.tiered_cache.vllm.load"),
    ({"tiered_cache": {"vllm": {"lookup_deadline_ms": 0}}},
     "kv_connector_extra_config.tiered_cache.vllm.lookup_deadline_ms"),
    ({"tiered_cache": {"vllm": {"deadline": 1}}},
     "kv_connector_extra_config.tiered_cache.vllm.deadline"),
    ({"tiered_cache": {"model": {"head_dim": 128}}},
     "kv_connector_extra_config.tiered_cache.model.head_dim"),
    ({"tiered_cache": {"model": {"rope": 1}}}, "kv_connector_extra_config.tiered_cache.model.rope"),
])
def test_errors_name_their_key(extra, path):
    with pytest.raises(ConfigError) as e:
        resolve(extra, VLLM)
    assert e.value.path == path, str(e.value)


def test_a_file_names_itself_in_its_errors(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("tiers: {host: {capacity: lots}}\n")
    with pytest.raises(ConfigError) as e:
        resolve({"tiered_cache": str(path)}, VLLM)
    assert e.value.path == f"{path}: tiers.host.capacity"
    with pytest.raises(ConfigError) as e:
        resolve({"tiered_cache": str(tmp_path / "missing.yaml")}, VLLM)
    assert "missing.yaml" in str(e.value)


def test_block_sizes_and_dtypes():
    assert default_block_size(32) == 32 and default_block_size(96) == 32
    assert default_block_size(16) == 16
    with pytest.raises(ConfigError):
        Geometry("m", "fp8_e4m3", 4, 2, 64, 32, 32)
    assert Geometry("m", "float32", 4, 2, 64, 32, 96).sub_blocks == 3
    with pytest.raises(ConfigError) as e:
        Geometry("m", "float32", 4, 2, 64, 64, 96)
    assert "does not divide vLLM's block size 96" in str(e.value)


def test_salts_ranks_and_adapters_are_distinct_and_stable():
    assert rank_salt(None, 0, 1) == b"" and rank_salt("t", 0, 1) == b"t"
    salts = {rank_salt(s, r, n) for s in (None, "t") for n in (2, 4) for r in range(n)}
    assert len(salts) == 12
    long = "x" * 5000
    assert rank_salt(long, 0, 1) == rank_salt(long, 0, 1) and len(rank_salt(long, 0, 1)) < 64
    assert adapter_of(None) is None and adapter_of("sql") == "sql"
    assert adapter_of("a" * 100) == adapter_of("a" * 100) != adapter_of("a" * 101)
    assert len(adapter_of("a" * 100)) <= 64
    assert model_name("/models/llama") == "/models/llama"
    assert model_name("x" * 300).startswith("vllm-model:")


def test_embedded_socket_paths_are_per_engine_private_and_short(tmp_path):
    short = tempfile.mkdtemp(prefix="tc-")
    try:
        a = embedded.socket_path("engine-a", short)
        b = embedded.socket_path("engine-b" * 40, short)
        assert a != b and a == embedded.socket_path("engine-a", short)
        assert len(a) == len(b)                      # the engine id is hashed
        base = os.path.join(short, f"tiered-cache-{os.geteuid()}")
        assert oct(os.stat(base).st_mode & 0o777) == "0o700"
        os.chmod(base, 0o777)
        with pytest.raises(ConfigError) as e:
            embedded.socket_path("engine-a", short)
        assert e.value.path.endswith("vllm.socket_dir")
    finally:
        shutil.rmtree(short)
    with pytest.raises(ConfigError) as e:
        embedded.socket_path("engine-a", str(tmp_path / ("d" * 60)))
    assert "too long" in str(e.value)


def test_socket_directories_of_dead_engines_are_swept(tmp_path):
    import fcntl

    base = tmp_path / "base"
    for name in ("vllm-dead", "vllm-alive", "vllm-mine", "other"):
        (base / name).mkdir(parents=True)
        (base / name / "daemon.sock.lock").write_text("1\n")
    alive = os.open(base / "vllm-alive" / "daemon.sock.lock", os.O_RDWR)
    fcntl.flock(alive, fcntl.LOCK_EX)            # a live service holds its lock
    try:
        assert embedded.sweep_stale(str(base), str(base / "vllm-mine")) == 1
    finally:
        os.close(alive)
    assert sorted(p.name for p in base.iterdir()) == ["other", "vllm-alive", "vllm-mine"]


def test_an_embedded_pool_the_machine_cannot_give_is_an_error_at_start(tmp_path):
    from tiered_cache.config import CacheConfig

    r = resolve({"tiered_cache": {"tiers": {"host": {"capacity": "64TiB"}}}}, VLLM)
    short = tempfile.mkdtemp(prefix="tc-")
    try:
        cfg = embedded.service_config(r.cache, embedded.socket_path("big", short), None)
        with pytest.raises(ConfigError) as e:
            embedded.EmbeddedNode("big", CacheConfig.from_dict(cfg.to_dict()))
        assert e.value.path.startswith("kv_connector_extra_config.tiered_cache.tiers.host")
        assert embedded.find("big") is None
        assert not os.path.exists(os.path.dirname(embedded.socket_path("big", short)))
    finally:
        shutil.rmtree(short)
