"""Background data plane: the migrator (promotion, demotion, write-through) and the compactor."""

from tiered_cache.migrator.compactor import Compactor
from tiered_cache.migrator.health import ThreadHealth
from tiered_cache.migrator.worker import Migrator

__all__ = ["Compactor", "Migrator", "ThreadHealth"]
