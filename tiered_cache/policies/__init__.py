"""Eviction policies, by name, plus loading a user policy from `"pkg.module:Class"`."""

from __future__ import annotations

import importlib
import inspect
import keyword

from tiered_cache.errors import ConfigError
from tiered_cache.policies.adaptive import AdaptivePolicy
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
from tiered_cache.sizing import short_repr

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
    "adaptive": AdaptivePolicy,
}


def _short(exc: BaseException, limit: int = 200) -> str:
    """An exception's message cut to one line of an error: "No module named 'x...'" repeats
    the whole (possibly huge) module path."""
    text = " ".join(str(exc).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _is_dotted_name(text: str) -> bool:
    """`pkg.module` (absolute, each part a Python identifier, no keyword)."""
    return all(part.isidentifier() and not keyword.iskeyword(part) for part in text.split("."))


def resolve(spec: str, path: str = "policy") -> type[CachePolicy]:
    """Policy class for a registered name or a `"pkg.module:Class"` path.

    Every bad spec raises ConfigError(path, ...): not only an unknown name or a missing module,
    but a malformed path (`":Foo"`, `".rel:Foo"`, `"a b:C"`: importlib would raise ValueError
    or TypeError), a module whose own import fails with any exception, a name that is not a
    CachePolicy subclass, an abstract class (the base `CachePolicy` itself), and a class that
    cannot be called the way the cache builds a policy, `Class(capacity_blocks, block_size=...,
    cost_context_tokens=...)`. So a config that loads has a policy the cache can build.
    """
    if not isinstance(spec, str) or not spec:
        raise ConfigError(path, f"expected a policy name {sorted(POLICIES)} or 'pkg.module:Class', "
                                f"got {short_repr(spec)}")
    if ":" not in spec:
        try:
            return POLICIES[spec]
        except KeyError:
            raise ConfigError(path, f"unknown policy {short_repr(spec)}; expected one of "
                                    f"{sorted(POLICIES)} or 'pkg.module:Class'") from None
    module_name, _, attr = spec.partition(":")
    if not (_is_dotted_name(module_name) and attr.isidentifier()):
        raise ConfigError(path, f"expected 'pkg.module:Class' (an absolute dotted module path, "
                                f"':', a class name), got {short_repr(spec)}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(path, f"cannot load policy {short_repr(spec)}: "
                                f"{_short(exc)}") from None
    except Exception as exc:  # noqa: BLE001 - a user module's import code may raise anything
        raise ConfigError(path, f"cannot load policy {short_repr(spec)}: importing "
                                f"{short_repr(module_name)} raised {type(exc).__name__}: "
                                f"{_short(exc)}") from None
    try:
        cls = getattr(module, attr)
    except Exception as exc:  # noqa: BLE001 - AttributeError, or a module __getattr__'s own
        raise ConfigError(path, f"cannot load policy {short_repr(spec)}: "
                                f"{_short(exc)}") from None
    try:
        is_policy = isinstance(cls, type) and issubclass(cls, CachePolicy)
    except TypeError:  # a metaclass whose __subclasscheck__ refuses
        is_policy = False
    if not is_policy:
        raise ConfigError(path, f"{short_repr(spec)} is not a subclass of "
                                "tiered_cache.policies.CachePolicy")
    missing = ", ".join(sorted(getattr(cls, "__abstractmethods__", ())))
    if missing or inspect.isabstract(cls):
        raise ConfigError(path, f"{short_repr(spec)} is abstract (it does not implement "
                                f"{missing}); name a concrete subclass")
    try:
        signature = inspect.signature(cls)
    except (TypeError, ValueError):  # no introspectable signature: let the cache find out
        signature = None
    if signature is not None:
        try:
            signature.bind(1, block_size=16, cost_context_tokens=1.0)
        except TypeError as exc:
            raise ConfigError(path, f"{short_repr(spec)} cannot be built as "
                                    f"{attr}(capacity_blocks, block_size=..., "
                                    f"cost_context_tokens=...): {exc}") from None
    return cls


__all__ = ["CachePolicy", "PriorityPolicy", "POLICIES", "resolve", "LRUPolicy", "LFUPolicy",
           "CostAwarePolicy", "S3FIFOPolicy", "ARCPolicy", "BeladyPolicy",
           "ReuseCreditPolicy", "ClassCreditPolicy", "HitDensityPolicy", "AdaptivePolicy"]
