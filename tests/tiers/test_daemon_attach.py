"""An engine's `tiers.daemon` where the daemon is missing or serves another model (issue 23,
item 6: misconfiguration that degrades silently), against a real `tiered-cache serve`:

- `tiers.daemon.required: true`: no daemon at the socket is a DaemonUnavailableError (a
  TierUnavailableError) at start, naming the key and the socket, and leaves no thread behind;
  without it the engine serves alone (one warning) and attaches when the daemon comes;
- a daemon of another model, KV dtype, geometry or block size is a ConfigError at start naming
  the engine's key that differs (it used to be a warning, and "no daemon yet" for ever).
"""

from __future__ import annotations

import textwrap
import threading

import pytest

from tiered_cache import CacheConfig, TieredKVCache
from tiered_cache.daemon.process import NodeProcess
from tiered_cache.errors import ConfigError, TierUnavailableError
from tiered_cache.wire.errors import DaemonUnavailableError

MODEL = {"name": "tiny", "num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "num_q_heads": 4,
         "dtype": "float32"}


def engine_config(sock: str, *, block_size: int = 4, **daemon) -> dict:
    return {"model": dict(MODEL), "block_size": block_size,
            "tiers": {"gpu": {"num_blocks": 16, "device": "cpu"},
                      "daemon": {"socket": sock, "timeout_s": 10.0, **daemon}}}


def links() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name == "tc-daemon-link"]


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("daemon")
    sock = str(tmp / "s" / "d.sock")
    cfg = tmp / "daemon.yaml"
    cfg.write_text(textwrap.dedent(f"""\
        model: {{name: tiny, num_layers: 2, num_kv_heads: 2, head_dim: 8, num_q_heads: 4,
                dtype: float32}}
        block_size: 4
        tiers:
          host: {{num_blocks: 64}}
        daemon: {{socket: {sock}}}
        """))
    proc = NodeProcess(cfg, sock, log_path=tmp / "daemon.log").start()
    yield proc
    proc.stop()


def test_a_required_daemon_that_is_not_there_is_an_error_at_start(tmp_path):
    sock = str(tmp_path / "nobody.sock")
    before = len(links())
    with pytest.raises(DaemonUnavailableError) as exc:
        TieredKVCache(CacheConfig.from_dict(engine_config(sock, required=True)))
    assert isinstance(exc.value, TierUnavailableError)
    assert "tiers.daemon.required" in str(exc.value) and sock in str(exc.value)
    assert len(links()) == before, "a link thread outlived the failed start"


def test_without_required_the_engine_serves_alone_and_attaches_later(tmp_path):
    sock = str(tmp_path / "s" / "d.sock")
    cache = TieredKVCache(CacheConfig.from_dict(engine_config(sock)))
    try:
        assert not cache.stores[0].available
        seq = cache.open(list(range(16)))
        cache.close(seq)
    finally:
        cache.shutdown()


@pytest.mark.slow
def test_a_required_daemon_that_is_there_attaches(node):
    cache = TieredKVCache(CacheConfig.from_dict(engine_config(node.socket_path, required=True)))
    try:
        assert cache.stores[0].available
    finally:
        cache.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("key, change", [
    ("model.num_layers", {"num_layers": 3}),
    ("model.num_kv_heads", {"num_kv_heads": 4}),
    ("model.head_dim", {"head_dim": 16}),
    ("model.dtype", {"dtype": "float16"}),
    ("model.name", {"name": "another-model"}),
    ("block_size", None),
])
def test_a_daemon_of_another_model_is_a_config_error_naming_the_key(node, key, change):
    cfg = engine_config(node.socket_path, block_size=8 if change is None else 4)
    cfg["model"].update(change or {})
    with pytest.raises(ConfigError) as exc:
        TieredKVCache(CacheConfig.from_dict(cfg))
    assert exc.value.path == key, exc.value
    assert node.socket_path in str(exc.value)
    assert "not yet" not in str(exc.value)
