"""tiered-cache: a CPU-GPU tiered KV-cache runtime for long-context LLM serving."""

from tiered_cache.cache import TieredKVCache
from tiered_cache.config import CacheConfig
from tiered_cache.core.sequence import Sequence

__all__ = ["TieredKVCache", "CacheConfig", "Sequence"]
__version__ = "0.1.0"
