"""The migrator: background promotion, demotion and write-through copies.

- Promotions (blocks an open() matched in a slower tier) run on worker threads, layer by layer,
  each layer signalled as soon as it lands (core/readiness.py). Jobs are served in open() order,
  so earlier sequences and earlier layers come first. One job per block: open() reuses a block's
  pending promotion instead of copying it again.
- Demotion runs on its own thread: above `high_watermark` of the device tier it demotes policy
  victims down to `low_watermark`, so allocation on the hot path almost never evicts
  synchronously. A promotion never waits behind a demotion batch.
- write_through copies run on the workers too.

Copies run outside the control-plane lock (plan / copy / commit, see tiered_cache.core.moves).
On a GPU each worker has its own CUDA stream (never the default stream) and records an event
per layer; on CPU the copies are torch ops that release the GIL.

Faults: a failed copy is retried up to `max_retries` times, then given up with a logged reason;
the block stays valid in its source tier and the failure is counted
(`tiered_cache_transfer_failures_total`). A demotion batch given up pauses demotion out of
its tier for a moment (`_RETRY_PAUSE_S`): requests then evict synchronously and, the copy
path still failing, drop their victims. An unexpected exception anywhere in a thread is
logged, counted (`ThreadHealth`), its plan committed as failed, and the thread carries on.
"""

from __future__ import annotations

import collections
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial

from tiered_cache.config import MigratorConfig
from tiered_cache.core import moves
from tiered_cache.core.index import BlockIndex
from tiered_cache.core.readiness import LayerReadiness
from tiered_cache.core.tier import DEVICE
from tiered_cache.core.transfer import GroupedPlan, Transfer
from tiered_cache.errors import (
    CacheBrokenError,
    CapacityError,
    TierUnavailableError,
    TransferError,
)
from tiered_cache.migrator.health import ThreadHealth

log = logging.getLogger("tiered_cache.migrator")
FaultHook = Callable[[str, int], None]


@dataclass(order=True)
class _Job:
    priority: int
    order: int
    kind: str = field(compare=False)
    plan: list[Transfer] = field(compare=False)
    readiness: LayerReadiness | None = field(compare=False, default=None)
    tier: int = field(compare=False, default=-1)            # "put": the keyed tier


class Migrator:
    def __init__(self, index: BlockIndex, executor, config: MigratorConfig,
                 health: ThreadHealth | None = None, *, put_tiers: list[int] = (),
                 on_copy: Callable[[int, int, int, float], None] | None = None) -> None:
        self.index = index
        self.put_tiers = list(put_tiers)        # keyed tiers blocks reaching host are put to
        self.on_copy = on_copy
        self.executor = executor
        self.config = config
        self.health = health if health is not None else ThreadHealth()
        self.fault_hook: FaultHook | None = None       # tests inject copy failures here
        self._jobs: queue.PriorityQueue[_Job] = queue.PriorityQueue()
        self._order = itertools.count()
        self._busy = 0
        self._idle = threading.Condition()
        self._stop = threading.Event()
        self._wakes = [threading.Event() for _ in index.tiers]      # one per demoter
        gpu = executor.pools[0] if executor.pools else None
        self._cuda = gpu is not None and gpu.kv.is_cuda
        self._threads = [threading.Thread(target=self._work, name=f"tc-migrator-{i}",
                                          daemon=True) for i in range(config.num_workers)]
        # One demoter per tier with a tier below it (device -> host, host -> disk): a slow
        # disk write never holds up the device tier's demotion.
        self._lowering = [False] * len(index.tiers)
        self._paused = [0.0] * len(index.tiers)     # demotion out of tier i waits until then
        self._copies: dict[tuple[int, int], list] = {}      # (src, dst) -> [blocks, seconds]
        self._whole_sources = {t.index for t in [*index.tiers, *index.keyed.tiers]
                               if t.whole_records}
        for src in range(len(index.tiers) - 1):
            name = "tc-demoter" if src == 0 else f"tc-demoter-{index.tiers[src].name}"
            self._threads.append(threading.Thread(target=self._watch, args=(src,), name=name,
                                                  daemon=True))
        if any(t.persistent for t in index.tiers):
            self._threads.append(threading.Thread(target=self._erase, name="tc-eraser",
                                                  daemon=True))
        for t in self._threads:
            self.health.watch(t)
            t.start()

    # ------------------------------------------------------------ called under the index lock
    def promote(self, plan: list[Transfer], readiness: LayerReadiness) -> None:
        """Queue a promotion planned by `BlockIndex.open`."""
        self._submit(_Job(0, next(self._order), "promotion", plan, readiness))

    def copy_down(self, blocks: list[int]) -> None:
        if len(self.index.tiers) < 2:
            return
        try:
            plan = moves.plan_copy_down(self.index, blocks, DEVICE, DEVICE + 1)
        except CapacityError:
            # NOTE: as in the migrator-less path (`copy_down` below): the write has committed;
            # no room below (copies under way hold it) skips the extra copy, never an error.
            return
        if plan:
            self._submit(_Job(1, next(self._order), "write_through", plan))

    def _account(self, src: int, dst: int, blocks: int, seconds: float) -> None:
        """Blocks and seconds of finished copies, by tier pair (`copy_stats`)."""
        with self._idle:
            entry = self._copies.setdefault((src, dst), [0, 0.0])
            entry[0] += blocks
            entry[1] += seconds
        if self.on_copy is not None:
            try:
                self.on_copy(src, dst, blocks, seconds)
            except Exception:  # noqa: BLE001 - accounting never fails a copy
                self.health.record(log, "copy accounting")

    def copy_stats(self) -> dict[str, dict[str, float]]:
        """Per tier pair ("gpu->host", ...): blocks, bytes and seconds spent copying them (on
        the copy threads, retries and device syncs included): the data path's own rate."""
        names = [t.name for t in self.index.tiers] + [k.name for k in self.index.keyed.tiers]
        bb = self.index.block_bytes
        with self._idle:
            return {f"{names[s]}->{names[d]}": {"blocks": n, "bytes": n * bb, "seconds": sec}
                    for (s, d), (n, sec) in sorted(self._copies.items())}

    def poke(self) -> None:
        """Ask the demotion threads to look at their watermarks now."""
        for wake in self._wakes:
            wake.set()

    # ------------------------------------------------------------ lifecycle
    def drain(self, timeout: float = 30.0) -> bool:
        """Wait until no job is queued or running (tests, shutdown)."""
        with self._idle:
            return self._idle.wait_for(lambda: self._busy == 0 and self._jobs.empty(), timeout)

    def settle(self, timeout: float = 30.0) -> bool:
        """Wait until no copy is queued or running, no demoter is lowering a tier and no
        record waits to be erased (tests, benchmarks, shutdown). True if it settled."""
        deadline = time.monotonic() + timeout
        idx = self.index
        calm = 0
        while time.monotonic() < deadline:
            self.poke()
            if not self.drain(max(0.0, deadline - time.monotonic())):
                return False
            time.sleep(0.01)
            with idx.locked():
                quiet = (not any(self._lowering) and self._busy == 0
                         and not any(t.erasing for t in idx.tiers)
                         and all(t.reserved == 0 and t.busy == 0 for t in idx.tiers))
            calm = calm + 1 if quiet else 0
            if calm >= 3:
                return True
        return False

    def stop(self) -> None:
        """Finish the queued copies, then stop every thread. Idempotent."""
        if self._stop.is_set():
            return
        # NOTE: a torn index (core/atomic.py) commits nothing: no point waiting for its jobs
        # long (and a job counted but never queued would keep the drain waiting).
        self.drain(30.0 if self.index.broken is None else 1.0)
        self._stop.set()
        self.poke()
        for _ in range(self.config.num_workers):
            self._jobs.put(_Job(99, next(self._order), "stop", []))
        for t in self._threads:
            t.join(timeout=30)

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    # ------------------------------------------------------------ threads
    def _submit(self, job: _Job) -> None:
        with self._idle:
            self._busy += 1
        self._jobs.put(job)

    def _work(self) -> None:
        stream = self._new_stream()
        if not self._cuda:
            try:
                _warm_up_host_copy()
            except Exception:               # the copies fall back to the torch twin
                self.health.record(log, "migrator warm-up of the CPU block copier")
        while True:
            job = self._jobs.get()
            if job.kind == "stop":
                return
            jobs = [job]
            try:
                if job.kind == "promotion":
                    jobs += self._more_promotions()
                    self._promote(jobs, stream)
                elif job.kind == "put":
                    self._put(job, stream)
                else:
                    self._copy_down(job, stream)
            except Exception:               # never let a worker die: log, count, go on
                self.health.record(log, f"migrator {job.kind} job")
            finally:
                with self._idle:
                    self._busy -= len(jobs)
                    self._idle.notify_all()

    def _more_promotions(self) -> list[_Job]:
        """Promotion jobs queued right behind the one just taken, up to `_BATCH_BYTES` in all:
        copied together, they cost one call per layer group instead of one per job."""
        budget = self._BATCH_BYTES // max(1, self.index.block_bytes)
        out: list[_Job] = []
        while budget > 0:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job.kind != "promotion":
                self._jobs.put(job)         # its (priority, order) keeps its place
                break
            out.append(job)
            budget -= len(job.plan)
        return out

    _BATCH_BYTES = 256 << 20

    def _promote(self, jobs: list[_Job], stream) -> None:
        idx = self.index
        plan = [t for job in jobs for t in job.plan]
        # Records on disk are first read, whole and verified, into host staging slots; then
        # every block is copied to the device layer by layer (core/tree.py, _plan_promotion).
        # NOTE: a copy out of a record source (disk, a store, the node daemon) moves whole
        # verified blocks: it runs first, once, and only memory-to-memory copies go layer by
        # layer.
        error: BaseException | None = None
        # NOTE: from here on anything that raises still fails the waiters and commits every
        # plan (the finally below): a job lost here would leave its blocks in flight for good
        # and its readers waiting out their timeout.
        try:
            whole = self._whole_sources
            staged = [t for t in plan if t.dst_tier != 0 or t.src_tier in whole]
            to_device = GroupedPlan(t for t in plan
                                    if t.dst_tier == 0 and t.src_tier not in whole)
            num_layers = idx.num_layers
            # NOTE: layers are copied in groups of about `promotion_chunk_bytes`, each group
            # signalled as soon as it lands: small promotions would otherwise pay the per-call
            # overhead once per layer, large ones still land layer by layer.
            per_layer = max(1, len(to_device) * idx.block_bytes // num_layers)
            group = max(1, -(-self.config.promotion_chunk_bytes // per_layer))
            t0 = time.perf_counter()
            if staged:
                error = self._attempt("promotion", partial(self.executor.run, staged), stream)
                if error is None:
                    t1 = time.perf_counter()
                    self._account(staged[0].src_tier, staged[0].dst_tier, len(staged), t1 - t0)
                    t0 = t1
            for first in range(0, num_layers, group) if error is None else ():
                layers = tuple(range(first, min(num_layers, first + group)))
                error = self._attempt("promotion", partial(self.executor.run, to_device, layers),
                                      stream)
                if error is not None:
                    break
                event = self._event(stream)
                for job in jobs:
                    job.readiness.layers_done(layers, event)
            if error is None and not to_device:
                for job in jobs:            # nothing layered: every layer landed with stage 1
                    job.readiness.layers_done(range(num_layers))
            self._sync(stream)
            if error is None and to_device:
                self._account(to_device[0].src_tier, 0, len(to_device), time.perf_counter() - t0)
        except BaseException as exc:
            error = exc
            raise
        finally:
            # Whatever happened above, every waiter is told and every plan committed once.
            # NOTE: waiters learn of a failure before the commit frees the device slots, so a
            # reader that checks under the lock never reads a slot the commit released.
            failed = frozenset(getattr(error, "blocks", ()) or ())
            for job in jobs:
                try:
                    if error is not None:
                        job.readiness.fail(error)
                finally:
                    idx.commit_promotion(job.plan, error is None, failed)

    def _copy_down(self, job: _Job, stream) -> None:
        """A write-through copy job."""

        def attempt(plan: list[Transfer]) -> BaseException | None:
            error = self._attempt(job.kind, partial(self.executor.run, plan), stream)
            self._sync(stream)
            return error

        if _write_through(self.index, job.plan, attempt):
            self.put_remote([t.block for t in job.plan])

    def put_remote(self, blocks: list[int]) -> None:
        """Blocks that now have a host copy go to the keyed tiers written on_host."""
        for k in self.put_tiers:
            plan = self.index.keyed.plan_puts(blocks, k)
            if plan:
                self._submit(_Job(2, next(self._order), "put", plan, tier=k))

    def _put(self, job: _Job, stream) -> None:
        error: BaseException | None = None
        try:
            error = self._attempt("put", partial(self.executor.run, job.plan), stream)
        except BaseException as exc:
            error = exc
            raise
        finally:
            self.index.keyed.commit_puts(job.plan, job.tier, error is None)

    def _watch(self, src: int) -> None:
        """Demote tier `src` above the high watermark down to the low one, batch by batch,
        into the tier below it.

        NOTE: pipelined two deep: while batch k copies on the copier thread, batch k + 1 is
        planned (from the chain parents batch k leaves behind, see moves.plan_demotion) and
        queued behind it, so the copier goes from k to k + 1 without waiting for this
        thread; this thread commits k as soon as it lands, then plans k + 2 while k + 1
        copies. One batch copies at a time; the blocks of the batches in flight still hold
        slots, so they are subtracted from the excess (`_plan_demotion`).
        """
        copier = ThreadPoolExecutor(max_workers=1,
                                    thread_name_prefix=f"{threading.current_thread().name}-copy")
        stream = self._new_stream()

        def copy(plan):
            t0 = time.perf_counter()
            error = self._attempt("demotion", partial(self.executor.run, plan), stream)
            self._sync(stream)
            if error is None:
                self._account(src, src + 1, len(plan), time.perf_counter() - t0)
            if _unavailable(error):
                # NOTE: a full (or failing) disk degrades to "no more demotion into it" for a
                # while; the tier above drops its victims meanwhile, requests never see it.
                log.warning("demotion into tier %d paused for %.0f s: %s", src + 1,
                            _PAUSE_S, error)
                self._paused[src] = time.monotonic() + _PAUSE_S
            elif error is not None:
                # NOTE: any other failure backs off too. Re-planning at once would keep the
                # tier's candidates in flight batch after batch, so a request evicting
                # synchronously would find none and wait for room until it timed out; paused,
                # its eviction drops the victims (degraded_evictions) and it is served.
                self._paused[src] = max(self._paused[src], time.monotonic() + _RETRY_PAUSE_S)
            return error

        try:
            wake = self._wakes[src]
            while not self._stop.is_set():
                wake.wait(0.005)
                wake.clear()
                try:
                    self._demote_round(src, copier, copy)
                except CacheBrokenError:
                    # NOTE: a torn commit section (core/atomic.py): nothing more is moved.
                    self.health.record(log, f"watermark demotion of tier {src} (stopped)")
                    return
                except Exception:
                    self.health.record(log, f"watermark demotion of tier {src}")
                    time.sleep(0.05)        # back off; the state is consistent (see below)
        finally:
            copier.shutdown(wait=True)

    _DEPTH = 2      # demotion batches in flight at once: one copying, one queued behind it

    def _demote_round(self, src: int, copier: ThreadPoolExecutor, copy) -> None:
        idx = self.index
        pending: collections.deque[tuple[list[Transfer], Future]] = collections.deque()
        try:
            while True:
                if len(pending) < self._DEPTH and not self._stop.is_set():
                    plan = self._plan_demotion(src, [p for p, _ in pending])
                    if plan:
                        pending.append((plan, copier.submit(copy, plan)))
                        continue
                if not pending:
                    break
                # Parents of the batch committed here may be candidates now: the loop plans
                # again before it stops.
                batch, fut = pending[0]
                error = fut.result()
                pending.popleft()
                moves.commit_demotion(idx, batch, error is None)
                if error is None and src == 0:
                    self.put_remote([t.block for t in batch])
        finally:
            # NOTE: an exception above must not strand a batch in flight: wait for each copy
            # and commit it, in order, so its blocks and reserved slots come back.
            while pending:
                batch, fut = pending.popleft()
                failed = fut.exception() is not None or fut.result() is not None
                moves.commit_demotion(idx, batch, not failed)

    def _plan_demotion(self, src: int, pending: list[list[Transfer]]) -> list[Transfer] | None:
        """The next demotion batch of tier `src`, or None when its watermark is met (the
        blocks of the `pending` batches, not committed yet, are already on their way; the
        newest one's chain parents come first)."""
        cfg = self.config
        idx = self.index
        if self._paused[src] > time.monotonic():
            return None
        with idx.locked():
            if idx.space.waiting:
                # NOTE: a request waits for copies under way to end (core/eviction.py): start
                # no new batch until it got its room (it evicts synchronously if it must),
                # or a batch of the very blocks it is about to pin would keep it waiting.
                return None
            tier = idx.tiers[src]
            cap = tier.capacity_blocks
            in_flight = sum(map(len, pending))
            used = tier.used_blocks - in_flight
            floor = int(cfg.low_watermark * cap)
            due = used > cfg.high_watermark * cap
            if src == DEVICE:
                floor, short = _headroom(cap, floor, used, idx.space.demand, cfg.batch_blocks)
                due = due or short
            excess = used - floor
            if not due and not self._lowering[src]:
                return None
            if excess <= 0:
                self._lowering[src] = False
                return None
            self._lowering[src] = True
            plan = moves.plan_demotion(idx, src, src + 1, min(excess, cfg.batch_blocks),
                                       pending[-1] if pending else None)
            if not plan and not in_flight:
                self._lowering[src] = False     # everything left is pinned: nothing to demote
            return plan

    def _erase(self) -> None:
        """Erase the records of slots persistent tiers gave back, then free the slots."""
        idx = self.index
        tiers = [t.index for t in idx.tiers if t.persistent]
        while not self._stop.wait(0.01):
            for t in tiers:
                try:
                    slots = idx.space.take_erasures(t)
                except CacheBrokenError:    # a torn commit section: nothing more is erased
                    self.health.record(log, f"erasing records of tier {t} (stopped)")
                    return
                if not slots:
                    continue
                try:
                    self.executor.pools[t].erase(slots)
                except Exception:
                    self.health.record(log, f"erasing {len(slots)} record(s) of tier {t}")
                    idx.space.erased(t, slots, ok=False)
                    time.sleep(0.05)
                else:
                    idx.space.erased(t, slots)

    def _attempt(self, kind: str, copy: Callable[[], None], stream) -> Exception | None:
        """Run a copy with retries; returns the last error, or None on success."""
        error: Exception | None = None
        for attempt in range(self.config.max_retries + 1):
            try:
                if self.fault_hook is not None:
                    self.fault_hook(kind, attempt)
                if stream is not None:
                    import torch

                    stream.wait_stream(torch.cuda.default_stream(stream.device))
                    with torch.cuda.stream(stream):
                        copy()
                else:
                    copy()
                return None
            except Exception as exc:  # noqa: BLE001 - any copy failure is handled the same way
                error = exc
                if getattr(exc, "blocks", None) or _unavailable(exc):
                    break                   # a corrupt record, a full disk: retrying cannot help
                if attempt < self.config.max_retries:
                    self.index.count("transfer_retries")
        self.index.count("transfer_failures")
        log.warning("%s copy given up after %d tries: %s", kind, self.config.max_retries + 1,
                    error)
        return error

    # ------------------------------------------------------------ CUDA helpers
    def _new_stream(self):
        if not self._cuda:
            return None
        import torch

        return torch.cuda.Stream(device=self.executor.pools[0].kv.device)

    @staticmethod
    def _event(stream):
        if stream is None:
            return None
        import torch

        event = torch.cuda.Event()
        event.record(stream)
        return event

    @staticmethod
    def _sync(stream) -> None:
        if stream is not None:
            stream.synchronize()


def _headroom(cap: int, floor: int, used: int, demand: int, batch: int) -> tuple[int, bool]:
    """(the device tier's demotion floor, whether it is short of room now) given `demand`,
    the blocks one request has recently allocated there (core/eviction.py).

    NOTE: the watermarks alone leave `cap - low_watermark * cap` blocks free after a round;
    in a small tier that is less than two requests' worth (8 blocks, 0.9/0.8: the demoter
    starts only once the tier is full and frees 2), so every request that comes before the
    round ends evicts synchronously under the lock. There the demoter keeps two requests'
    worth free (at most one batch more than the low watermark) and starts as soon as less is
    free. Where one request is a large part of the tier (more than a quarter) no headroom
    helps, and the watermarks stand."""
    want = 2 * demand
    gap = cap - floor
    if not 0 < want <= cap // 2 or want <= gap:
        return floor, False
    want = min(want, gap + batch)
    return cap - want, cap - used < want


def promote(index: BlockIndex, executor, migrator: Migrator | None, plan: list[Transfer],
            readiness: LayerReadiness) -> None:
    """Called by `BlockIndex.open` (lock held): hand a promotion to the migrator, or, with no
    migrator running, make it now. A failed copy made now is committed as failed and raises
    TransferError."""
    if migrator is not None and not migrator.stopped:
        migrator.promote(plan, readiness)
        return
    try:
        executor.run(plan)
    except TransferError as exc:
        index.count("transfer_failures")
        index.commit_promotion(plan, False)
        readiness.fail(exc)
        raise
    index.commit_promotion(plan, True)
    readiness.layers_done(range(index.num_layers))


def copy_down(index: BlockIndex, executor, migrator: Migrator | None,
              blocks: list[int]) -> None:
    """`write_through`: a copy of just-published blocks in the tier below the device, so that
    evicting them later costs no copy. The migrator's job when it runs; made now otherwise
    (`migrator.enabled: false`, or stopped), by the same plan and commit (`_write_through`)
    on the calling thread, without retries."""
    if not (blocks and index.write_through and len(index.tiers) > 1):
        return
    if migrator is not None and not migrator.stopped:
        migrator.copy_down(blocks)
        return
    try:
        plan = moves.plan_copy_down(index, blocks, DEVICE, DEVICE + 1)
    except CapacityError:
        # NOTE: the write this copy follows has already committed: a copy that finds no room
        # below is skipped (the blocks just have no lower copy), never an error.
        return

    def attempt(plan: list[Transfer]) -> BaseException | None:
        try:
            executor.run(plan)
            return None
        except TransferError as exc:
            index.count("transfer_failures")     # the block just has no lower copy
            return exc

    _write_through(index, plan, attempt)


def _write_through(index: BlockIndex, plan: list[Transfer],
                   attempt: Callable[[list[Transfer]], BaseException | None]) -> bool:
    """Copy a planned write-through plan (`attempt` returns its error, or None) and commit it,
    whatever happens: the copies land, or their reserved slots are freed. True if it landed."""
    if not plan:
        return False
    error: BaseException | None = None
    try:
        error = attempt(plan)
    except BaseException as exc:
        error = exc
        raise
    finally:
        moves.commit_copy_down(index, plan, error is None)
    return error is None


_PAUSE_S = 10.0
"""How long demotion into a tier waits after the tier reported itself full or failing."""

_RETRY_PAUSE_S = 0.2
"""How long demotion out of a tier waits after a batch's copy failed for another reason."""


def _unavailable(error: BaseException | None) -> bool:
    """The copy failed because the destination tier cannot take data (a full disk)."""
    while error is not None:
        if isinstance(error, TierUnavailableError):
            return True
        error = error.__cause__
    return False


def _warm_up_host_copy() -> None:
    """Compile the CPU block copier (kernels/host_copy.py, ~0.3 s) and start its thread pool
    on a worker thread when the cache starts, not on the first demotion."""
    try:
        from tiered_cache.kernels import host_copy
    except ImportError:                 # numba missing: copies use the torch twin
        return
    host_copy.warm_up()
