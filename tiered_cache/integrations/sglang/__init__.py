"""SGLang: a HiCache storage backend (`--hicache-storage-backend dynamic`) over the page store.

    module_path: tiered_cache.integrations.sglang     class_name: TieredCacheStorage

docs/sglang.md has the launch flags. Importing this package imports SGLang.
"""

from tiered_cache.integrations.sglang.backend import TieredCacheStorage

__all__ = ["TieredCacheStorage"]
