"""The compactor: moves live blocks from high slots to low free ones, in the background.

Fragmentation of a tier = free slots below its highest used slot / used slots. Past
`threshold`, each step plans up to `max_moves_per_step` moves (highest movable block -> lowest
free slot), copies them without the lock, and remaps under the lock. It never moves a pinned or
in-flight block, and a block that gets pinned while its copy runs is left where it was. No
stop-the-world pause: each lock hold covers one plan or one commit of a bounded step.
"""

from __future__ import annotations

import logging
import threading

from tiered_cache.config import CompactorConfig
from tiered_cache.core import moves
from tiered_cache.core.index import BlockIndex
from tiered_cache.errors import CacheBrokenError
from tiered_cache.migrator.health import ThreadHealth

log = logging.getLogger("tiered_cache.compactor")


class Compactor:
    def __init__(self, index: BlockIndex, executor, config: CompactorConfig,
                 start: bool = True, health: ThreadHealth | None = None) -> None:
        self.index = index
        self.executor = executor
        self.config = config
        self.health = health if health is not None else ThreadHealth()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="tc-compactor", daemon=True)
        self.health.watch(self._thread)
        if start:
            self._thread.start()

    def step(self, tier: int) -> int:
        """One bounded compaction step on a tier; returns the number of blocks moved."""
        idx = self.index
        with idx.locked():
            if idx.tiers[tier].allocator.fragmentation() <= self.config.threshold:
                return 0
            plan = moves.plan_compaction(idx, tier, self.config.max_moves_per_step)
        if not plan:
            return 0
        ok = False
        try:
            self.executor.run(plan)
            ok = True
        except Exception:  # noqa: BLE001 - a failed move just leaves the block where it was
            log.exception("compaction copy failed; blocks stay where they were")
        finally:
            moved = moves.commit_compaction(idx, plan, ok)
        return moved

    def compact(self, tier: int, max_steps: int = 1_000_000) -> int:
        """Run steps until the tier is under the threshold or nothing can move."""
        total = 0
        for _ in range(max_steps):
            moved = self.step(tier)
            if moved == 0:
                break
            total += moved
        return total

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)

    def _loop(self) -> None:
        while not self._stop.wait(self.config.interval_s):
            for t in range(len(self.index.tiers)):
                try:
                    while not self._stop.is_set() and self.step(t):
                        pass
                except CacheBrokenError:    # a torn commit section: nothing more is moved
                    self.health.record(log, "compaction step (stopped)")
                    return
                except Exception:  # noqa: BLE001 - keep the thread alive
                    self.health.record(log, "compaction step")
