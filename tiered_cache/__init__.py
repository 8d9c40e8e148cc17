"""tiered-cache: a CPU-GPU tiered KV-cache runtime for long-context LLM serving.

NOTE: the public names are loaded on first use (PEP 562), so that importing a part of the
library (`tiered_cache.core`, `tiered_cache.config`) loads neither the facade nor torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tiered_cache.cache import TieredKVCache
    from tiered_cache.config import CacheConfig
    from tiered_cache.core.sequence import Sequence

__all__ = ["TieredKVCache", "CacheConfig", "Sequence"]
__version__ = "0.1.0"

_PUBLIC = {"TieredKVCache": "tiered_cache.cache", "CacheConfig": "tiered_cache.config",
           "Sequence": "tiered_cache.core.sequence"}


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})
