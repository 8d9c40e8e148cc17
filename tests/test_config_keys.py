"""Config values the loader used to accept and then ignore or hand to a client library: each
is a ConfigError naming its key now (issue 23, items 6 and 8).

- an unknown tier section suggests the kind it is a synonym of (`tiers.redis` -> `remote`);
- `daemon.tenants` keys that no peer can ever match (`uid:0001`, ids past 2**32-1);
- `tiers.remote` URLs redis-py would refuse at connect time (port, IPv6 literal, options, db)
  and `ttl_s` below one second;
- a `daemon:` section (the node daemon's settings) in an engine's config without
  `tiers.daemon`: the engine would run alone.
"""

from __future__ import annotations

import pytest

from tests.helpers import config_dict, make_config
from tiered_cache.config import CacheConfig
from tiered_cache.errors import ConfigError


@pytest.mark.parametrize("typed, kind", [
    ("redis", "remote"), ("valkey", "remote"), ("ssd", "disk"), ("nvme", "disk"),
    ("cpu", "host"), ("dram", "host"), ("cuda", "gpu"), ("hbm", "gpu"),
])
def test_a_synonym_of_a_tier_kind_suggests_that_kind(typed, kind):
    with pytest.raises(ConfigError) as exc:
        CacheConfig.from_dict({"tiers": {typed: {}}})
    assert exc.value.path == f"tiers.{typed}"
    assert f"did you mean {kind!r}" in str(exc.value)


def test_a_typo_of_a_tier_kind_still_suggests_the_closest_kind():
    with pytest.raises(ConfigError, match="did you mean 'remote'"):
        CacheConfig.from_dict({"tiers": {"remot": {}}})


def _daemon(**daemon):
    return CacheConfig.from_dict(config_dict(extra={"daemon": daemon}))


@pytest.mark.parametrize("who", ["uid:0001", "gid:007", "uid:4294967296", "gid:99999999999",
                                 "uid:-1", "uid:+5", "uid: 5"])
def test_a_tenant_key_no_peer_can_match_is_refused(who):
    with pytest.raises(ConfigError) as exc:
        _daemon(tenants={who: "a"})
    assert exc.value.path.startswith("daemon.tenants")
    assert repr(who) in str(exc.value) or who in str(exc.value)


@pytest.mark.parametrize("who", ["uid:0", "uid:1000", "gid:4294967295"])
def test_canonical_tenant_keys_are_accepted(who):
    assert _daemon(tenants={who: "a"}).daemon.tenants == {who: "a"}


def _remote(**remote):
    return CacheConfig.from_dict(config_dict(extra={"tiers": {"remote": remote}}))


@pytest.mark.parametrize("url, key", [
    ("redis://127.0.0.1:70000/0", "port"),
    ("redis://127.0.0.1:0/0", "port"),
    ("redis://127.0.0.1:abc/0", "port"),
    ("redis://[::1:6379/0", "IPv6"),
    ("redis://[::zz]:6379/0", "IPv6"),
    ("redis://127.0.0.1:6379/0?foo=1", "option"),
    ("redis://127.0.0.1:6379/0?socket_timeout=1", "option"),
    ("redis://127.0.0.1:6379/x", "database"),
    ("redis://127.0.0.1:6379/0/1", "database"),
    ("redis://:6379/0", "host"),
    ("redis://127.0.0.1:6379/0#frag", "fragment"),
])
def test_a_remote_url_the_client_library_would_refuse_is_a_config_error(url, key):
    with pytest.raises(ConfigError) as exc:
        _remote(url=url)
    assert exc.value.path == "tiers.remote.url"
    assert key.lower() in str(exc.value).lower()


@pytest.mark.parametrize("url", ["redis://127.0.0.1:6379/0", "redis://[::1]:6379/2",
                                 "rediss://cache.internal:6380", "valkey://user:pw@h:1/0",
                                 "redis://h"])
def test_remote_urls_the_client_accepts_still_load(url):
    assert _remote(url=url).tiers.remote.url == url


def test_a_cluster_url_must_name_database_0():
    with pytest.raises(ConfigError) as exc:
        _remote(url="redis://127.0.0.1:6379/3", cluster=True)
    assert exc.value.path == "tiers.remote.url" and "cluster" in str(exc.value)


@pytest.mark.parametrize("ttl", [0.5, 0.001, 1e-9])
def test_a_ttl_below_one_second_is_a_config_error(ttl):
    with pytest.raises(ConfigError) as exc:
        _remote(url="redis://127.0.0.1:6379/0", ttl_s=ttl)
    assert exc.value.path == "tiers.remote.ttl_s"


def test_a_daemon_section_in_an_engine_config_without_tiers_daemon_is_refused():
    """`daemon:` configures `tiered-cache serve`; an engine attaches with tiers.daemon.socket.
    An engine config with only the former used to run alone, silently."""
    from tiered_cache import TieredKVCache

    config = make_config(extra={"daemon": {"socket": "/run/x/daemon.sock"}})
    with pytest.raises(ConfigError) as exc:
        TieredKVCache(config)
    assert exc.value.path == "daemon"
    assert "tiers.daemon.socket" in str(exc.value) and "/run/x/daemon.sock" in str(exc.value)


def test_the_default_daemon_section_does_not_bother_an_engine():
    from tiered_cache import TieredKVCache

    TieredKVCache(make_config()).shutdown()
    # what to_dict() writes back (the default daemon section) round-trips too
    TieredKVCache(CacheConfig.from_dict(make_config().to_dict())).shutdown()
