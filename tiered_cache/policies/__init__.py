"""Eviction policies, by name, plus loading a user policy from `"pkg.module:Class"`."""

from __future__ import annotations

import importlib

from tiered_cache.errors import ConfigError
from tiered_cache.policies.arc import ARCPolicy
from tiered_cache.policies.base import CachePolicy, PriorityPolicy
from tiered_cache.policies.belady import BeladyPolicy
from tiered_cache.policies.class_credit import ClassCreditPolicy
from tiered_cache.policies.cost_aware import CostAwarePolicy
from tiered_cache.policies.hit_density import HitDensityPolicy
from tiered_cache.policies.lfu import LFUPolicy
from tiered_cache.policies.lru import LRUPolicy
from tiered_cache.policies.reuse_credit import ReuseCreditPolicy
from tiered_cache.policies.s3fifo import S3FIFOPolicy

POLICIES: dict[str, type[CachePolicy]] = {
    "lru": LRUPolicy,
    "lfu": LFUPolicy,
    "cost_aware": CostAwarePolicy,
    "s3fifo": S3FIFOPolicy,
    "arc": ARCPolicy,
    "belady": BeladyPolicy,
    "reuse_credit": ReuseCreditPolicy,
    "class_credit": ClassCreditPolicy,
    "hit_density": HitDensityPolicy,
}


def resolve(spec: str, path: str = "policy") -> type[CachePolicy]:
    """Policy class for a registered name or a `"pkg.module:Class"` path."""
    if not isinstance(spec, str) or not spec:
        raise ConfigError(path, f"expected a policy name {sorted(POLICIES)} or 'pkg.module:Class', "
                                f"got {spec!r}")
    if ":" not in spec:
        try:
            return POLICIES[spec]
        except KeyError:
            raise ConfigError(path, f"unknown policy {spec!r}; expected one of {sorted(POLICIES)} "
                                    "or 'pkg.module:Class'") from None
    module_name, _, attr = spec.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(path, f"cannot load policy {spec!r}: {exc}") from None
    if not (isinstance(cls, type) and issubclass(cls, CachePolicy)):
        raise ConfigError(path, f"{spec!r} is not a subclass of tiered_cache.policies.CachePolicy")
    return cls


__all__ = ["CachePolicy", "PriorityPolicy", "POLICIES", "resolve", "LRUPolicy", "LFUPolicy",
           "CostAwarePolicy", "S3FIFOPolicy", "ARCPolicy", "BeladyPolicy",
           "ReuseCreditPolicy", "ClassCreditPolicy", "HitDensityPolicy"]
