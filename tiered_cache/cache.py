"""`TieredKVCache`: the public facade. It validates input, orchestrates (lock -> index -> unlock ->
data plane) and owns the lifecycle; the block state is the `BlockIndex`'s (core/index.py, which
lists the invariants), the bytes are the pools' (data/pools.py), copies are the executor's
(data/executor.py), background moves the migrator's.

NOTE: exception safety. Every public call validates its input before any state changes. The
parts that change state and hand something back (a pinned sequence, a layer being written, a
sequence being read) run inside one commit section (core/atomic.py) together with the code that
releases them in `try/finally`, so a KeyboardInterrupt can neither cut a mutation in half nor
land between an acquisition and its release; it is raised when the section ends. Waits
(promotions, readers, transient capacity) run outside sections and stay interruptible.
"""

from __future__ import annotations

import atexit
import functools
import logging
import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

from tiered_cache import assembly, shared_tiers
from tiered_cache.config import CacheConfig
from tiered_cache.core import moves
from tiered_cache.core import resize as resizing
from tiered_cache.core.atomic import atomic, install, interrupt_pending
from tiered_cache.core.index import DEVICE, BlockIndex
from tiered_cache.core.readiness import LayerReadiness
from tiered_cache.core.sequence import Sequence
from tiered_cache.core.tier import TierSpec, TierState
from tiered_cache.core.transfer import Transfer
from tiered_cache.errors import (
    ArgumentError,
    CacheClosedError,
    CapacityError,
    ConfigError,
    DTypeError,
    KVValueError,
    LayerError,
    PrefixAbortedError,
    ShapeError,
    StorageDisabledError,
    TierUnavailableError,
    TokenError,
    TransferError,
)
from tiered_cache.hashing import BlockHasher, HashFn, Namespace, as_token_array, xxh3_128
from tiered_cache.sizing import resolve_device, tier_num_blocks

log = logging.getLogger("tiered_cache.cache")


class TieredKVCache:
    """A KV cache whose blocks live in a device tier and slower tiers, shared across requests.

    ```
    with TieredKVCache(CacheConfig.from_yaml("configs/default.yaml")) as cache:
        seq = cache.open(prompt_ids)          # longest cached prefix, pinned
        for layer in range(L):                # KV of the uncached tokens only
            cache.write(seq, layer, k, v)
        k, v = cache.gather(seq, layer)
        cache.close(seq)                      # full blocks stay cached and evictable
    ```
    """

    def __init__(self, config: CacheConfig | None = None, *, registry=None,
                 hash_fn: HashFn = xxh3_128) -> None:
        self.config = config = config if config is not None else CacheConfig.default()
        if not isinstance(config, CacheConfig):
            raise ConfigError("", f"config: expected a CacheConfig, got {type(config).__name__}")
        model = config.model
        self.block_size: int = int(config.block_size)
        self.num_layers = model.num_layers
        self.num_kv_heads = model.num_kv_heads
        self.num_q_heads = config.num_q_heads
        self.head_dim = model.head_dim
        self.has_storage = config.storage == "tensors"
        self.device = resolve_device(config.tiers.gpu.device) if self.has_storage else "cpu"
        self.block_bytes = config.block_bytes
        self.allow_non_finite = config.allow_non_finite_kv
        self.hasher = BlockHasher(
            Namespace(model.name, model.dtype, model.num_layers, model.num_kv_heads,
                      model.head_dim, self.block_size, config.adapter_id), hash_fn)
        self._closed = False
        self._resize_lock = threading.Lock()    # one resize at a time
        self.migrator = self.compactor = None
        specs, self.pools = self._build_tiers(config)
        policy = assembly.policy_factory(config)
        self.costs = self._cost_model(config, specs)
        keyed_specs, self.stores = shared_tiers.build(self, config, specs)
        self.index = BlockIndex(specs, policy=policy, block_size=self.block_size,
                                num_layers=self.num_layers, hasher=self.hasher,
                                block_bytes=self.block_bytes,
                                verify_tokens=config.verify_tokens,
                                share_inflight=config.share_inflight,
                                write_through=config.write_policy == "write_through",
                                run=self._run, on_pressure=self._poke,
                                high_watermark=config.migrator.high_watermark,
                                keyed=keyed_specs,
                                worth=self._worth if self.costs is not None else None)
        from tiered_cache.data.executor import Executor, NullExecutor

        self.executor = (Executor(self.pools + self.stores,
                                  [s.kind for s in specs + keyed_specs])
                         if self.has_storage else NullExecutor())
        if any(s.persistent for s in specs):
            from tiered_cache.data import disk_tier

            for (src, dst), handler in disk_tier.HANDLERS.items():
                self.executor.register(src, dst, handler)
            assembly.recover(self.index, self.pools)
        if self.stores:
            from tiered_cache.data import daemon_tier, remote_tier

            for (src, dst), handler in (*remote_tier.HANDLERS.items(),
                                        *daemon_tier.HANDLERS.items()):
                self.executor.register(src, dst, handler)
        from tiered_cache.migrator import Compactor, Migrator, ThreadHealth

        self.health = ThreadHealth()
        self._metrics_server = None
        if registry is None and config.metrics.http_port is not None:
            from prometheus_client import CollectorRegistry
            registry = CollectorRegistry()
        self.registry = registry
        if registry is not None:
            from tiered_cache.metrics import CacheCollector
            registry.register(CacheCollector(self.stats, self.index))
        if config.metrics.http_port is not None:
            from tiered_cache.metrics import serve_metrics
            self._metrics_server = serve_metrics(
                registry, config.metrics.http_port, config.metrics.http_addr)
        # Background data plane: only meaningful when there is data to move.
        if self.has_storage and config.migrator.enabled:
            # Keyed tiers written as blocks get a copy in the tier they are put from.
            puts = [k for k, keyed in enumerate(self.index.keyed.tiers)
                    if keyed.put_from is not None]
            self.migrator = Migrator(self.index, self.executor, config.migrator, self.health,
                                     put_tiers=puts, on_copy=self._observe)
            if puts:
                migrator = self.migrator
                self.index.space.on_copied = lambda tier, blocks: (
                    migrator.put_remote(blocks) if tier == 1 else None)
        if config.tiers.daemon is not None:
            self.stores[0].start(on_attach=functools.partial(
                _attached, self.index, self.migrator if config.tiers.daemon.write ==
                "on_compute" else None))
        if self.has_storage and config.compactor.enabled:
            self.compactor = Compactor(self.index, self.executor, config.compactor,
                                       health=self.health)
        if self.has_storage:
            _warm_up(self.pools)        # first copies compile/import here, not under the lock
        install()                       # defer SIGINT inside commit sections (main thread)
        if self.migrator or self.compactor:
            # Stop threads at interpreter exit even if the user never closes the cache.
            ref = weakref.ref(self)
            atexit.register(lambda: (c := ref()) is not None and c.shutdown())

    def _build_tiers(self, config: CacheConfig) -> tuple[list[TierSpec], list]:
        from tiered_cache.data.pools import make_pool

        model = config.model
        geometry = dict(num_layers=model.num_layers, block_size=self.block_size,
                        num_kv_heads=model.num_kv_heads, head_dim=model.head_dim,
                        dtype=model.dtype)
        specs, pools = [], []
        for name in ("gpu", "host"):
            n = tier_num_blocks(config, name)
            if name == "host" and (n == 0 or config.tiers.daemon is not None):
                # `num_blocks: 0`: a device-only cache. Attached to the node daemon, the
                # daemon's shared host tier takes the place of this process's own.
                continue
            tcfg = getattr(config.tiers, name)
            pool = None
            if self.has_storage:
                pool = make_pool(name, n, device=self.device, memory=config.tiers.host.memory,
                                 max_slots=tcfg.max_num_blocks,
                                 segment_slots=tcfg.segment_blocks,
                                 resizable=getattr(tcfg, "resizable", False), **geometry)
            specs.append(TierSpec(name, name, n))
            pools.append(pool)
        disk = config.tiers.disk
        n = tier_num_blocks(config, "disk")
        if disk is not None and n > 0:
            specs.append(TierSpec("disk", "disk", n, persistent=self.has_storage,
                                  sync_target=not self.has_storage,
                                  admit_min_hits=disk.admit_min_hits))
            pools.append(self._disk_pool(config, n, pools, specs) if self.has_storage else None)
        return specs, pools

    def _disk_pool(self, config: CacheConfig, n: int, pools: list, specs: list):
        """The disk tier's pool (tensor storage): checks what it needs, opens its directory."""
        from tiered_cache.data.disk_tier import DiskTier

        disk = config.tiers.disk
        if disk.path is None:
            raise ConfigError("tiers.disk.path", "required with storage: tensors (the "
                                                 "directory the tier's records live in)")
        if len(specs) < 3 or specs[1].kind != "host":
            raise ConfigError("tiers.disk", "needs a host tier above it (tiers.host with "
                                            "num_blocks > 0): disk records are read through it")
        if not config.migrator.enabled:
            raise ConfigError("tiers.disk", "needs the migrator (migrator.enabled: true): only "
                                            "its background threads write and read the disk")
        host = pools[1]
        return DiskTier(disk.path, n, host_kv=host.kv, host_scales=host.scales,
                        num_tokens=self.block_size, namespace=self.hasher.namespace_digest(),
                        o_direct=disk.o_direct, max_slots=disk.max_num_blocks)

    def _cost_model(self, config: CacheConfig, specs: list[TierSpec]):
        """Load-vs-recompute estimates (tiered_cache.costs), when the model's size is known
        (`model.num_params`): without it there is no prefill cost to compare with."""
        from tiered_cache import costs

        return costs.from_config(config, [s.kind for s in specs]) if self.has_storage else None

    def _observe(self, src: int, dst: int, blocks: int, seconds: float) -> None:
        """A finished copy out of a slow slot tier (disk) feeds its cost estimates. (The remote
        store feeds its own: each lookup's latency and each get's bandwidth.)"""
        if self.costs is None or src >= len(self.index.tiers):
            return
        cost = self.costs.tiers.get(self.index.tiers[src].name)
        if cost is not None and dst == 1:
            cost.observe(blocks * self.block_bytes, seconds, blocks)

    def _worth(self, tier: int, nblocks: int, context_blocks: int) -> bool:
        """Whether loading `nblocks` from tier `tier` beats recomputing them (BlockIndex asks
        for disk-only blocks; open() for keyed tiers)."""
        return self.costs.worth_blocks(self.index.tier_name(tier), nblocks, context_blocks,
                                       block_bytes=self.block_bytes, block_size=self.block_size)

    # ------------------------------------------------------------------ context manager
    def __enter__(self) -> TieredKVCache:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        """Finish in-flight copies, stop background threads, close every open sequence (their
        full blocks stay cached). Idempotent; every later call raises CacheClosedError."""
        if self._closed:
            return
        self._closed = True
        for worker in (self.compactor, self.migrator):
            if worker is not None:
                worker.stop()
        # Writes and reads running outside the lock finish first.
        deadline = time.monotonic() + 30.0
        while any(s.writing or s.readers for s in self.index.open_sequences()) and \
                time.monotonic() < deadline:
            time.sleep(0.001)
        for seq in self.index.open_sequences():
            if seq.writing or seq.readers:      # still busy after 30 s: leave it open
                continue
            self.index.close(seq)
        assembly.close_persistent(self.index, self.pools)
        for store in self.stores:
            store.flush(5.0)
            store.close()
        if self._metrics_server is not None:
            server, thread = self._metrics_server
            server.shutdown()
            server.server_close()
            thread.join(timeout=5)
            self._metrics_server = None

    @property
    def closed(self) -> bool:
        return self._closed

    # ------------------------------------------------------------------ public API
    def open(self, token_ids, *, salt: str | bytes | None = None, adapter_id: str | None = None,
             reserve_last: bool = False) -> Sequence:
        """Start a sequence over `token_ids`, reusing the longest cached prefix from any tier.

        The matched blocks are pinned and made resident in the device tier; slots for the rest
        of the tokens are reserved. `reserve_last=True` never counts the final token as cached
        (an engine that needs the last position's logits must compute at least one token).
        Raises CapacityError (cache unchanged) when the device tier cannot hold the sequence.
        """
        self._check_alive()
        tokens = as_token_array(token_ids)
        _check_salt(salt)
        _check_adapter(adapter_id)
        if not isinstance(reserve_last, bool):
            raise ArgumentError(f"reserve_last: expected a bool, got "
                                f"{type(reserve_last).__name__}")
        deadline = time.monotonic() + self.config.migrator.wait_timeout_s
        while True:
            seq = None
            try:
                with atomic():
                    seq = self.index.open(tokens, salt=salt, adapter_id=adapter_id,
                                          reserve_last=reserve_last, promote=self._promote)
                    if self.stores and not interrupt_pending():
                        shared_tiers.note_open(self, seq)
                        shared_tiers.load(self, seq)
                return seq
            except KeyboardInterrupt:
                # NOTE: an interrupt deferred anywhere in the section (or landing after it)
                # is raised before the caller has `seq`: give it back first, in a section of
                # its own so that a second interrupt cannot cut the close.
                if seq is not None:
                    with atomic():
                        if not seq.closed:
                            self.index.close(seq)
                raise
            except CapacityError as exc:
                # Room is short only because background copies still hold slots they are
                # about to free: wait for them outside the lock and try again.
                if not exc.transient or time.monotonic() > deadline:
                    raise
            time.sleep(0.0005)
            self._check_alive()

    def can_open(self, num_tokens: int) -> bool:
        """Whether a sequence of `num_tokens` uncached tokens fits in the device tier now."""
        self._check_alive()
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, (int, np.integer)) \
                or num_tokens < 0:
            raise ArgumentError(f"can_open: num_tokens must be an int >= 0, got {num_tokens!r}")
        return self.index.can_open(int(num_tokens))

    def append(self, seq: Sequence, token_ids) -> None:
        """Declare the next tokens of a sequence (decode steps, the next turn of a chat)."""
        self._check_alive()
        self._check_seq(seq)
        tokens = as_token_array(token_ids)
        deadline = time.monotonic() + self.config.migrator.wait_timeout_s
        while True:
            try:
                self.index.append(seq, tokens)
                return
            except CapacityError as exc:
                if not exc.transient or time.monotonic() > deadline:
                    raise
            time.sleep(0.0005)

    def write(self, seq: Sequence, layer: int, key, value) -> None:
        """Write the KV of the next `n` unwritten tokens of `layer` (`key`/`value`: `[n, H, D]`).

        A block is published to the prefix index once every layer has written all its tokens.
        KV that requires grad is stored detached (the pools never join an autograd graph).
        """
        self._check_alive()
        self._check_seq(seq)
        self._check_layer(layer)
        n = self._check_kv(key, value)
        idx = self.index
        event = None
        with atomic():
            start = idx.begin_write(seq, layer, n)
            ok = False
            try:
                if self.has_storage and n:
                    # NOTE: the copy runs without the lock. The slots belong to this sequence's
                    # own blocks past its cached prefix: pinned (never moved, evicted or
                    # compacted), private until every layer is written, and close() refuses
                    # while `writing` is set, so no other thread reads or reuses them meanwhile.
                    # Writes to different layers may run in parallel.
                    with idx.lock:
                        flat = self._flat_index(seq, start, start + n)
                    pool = self.pools[DEVICE]
                    dev = pool.kv.device
                    pool.write_tokens(layer, flat, key.detach().to(dev), value.detach().to(dev))
                    if idx.inflight.enabled and dev.type == "cuda":
                        # Sequences sharing these blocks (core/inflight.py), now or once they
                        # take them, read them from their own streams: order their reads after
                        # this copy.
                        import torch

                        event = torch.cuda.Event()
                        event.record()
                ok = True
            finally:
                fresh = idx.end_write(seq, layer, start, n, ok, event)
            self._published(fresh)

    def mark_computed(self, seq: Sequence) -> None:
        """Metadata-only mode (`storage: none`): treat every declared token as written in every
        layer and publish the full blocks. Used by simulation and trace replay."""
        self._check_alive()
        self._check_seq(seq)
        if self.has_storage:
            raise StorageDisabledError("mark_computed is only for `storage: none`; with tensor "
                                       "storage, write the KV with write()")
        with atomic():
            self._copy_down(self.index.mark_computed(seq))

    def wait(self, seq: Sequence, layer: int, timeout: float | None = None) -> None:
        """Block until every block this sequence reads has `layer` in the device tier.

        Promotions land layer by layer, so layer l can be used while later layers still copy.
        Raises PromotionTimeout after `timeout` (default `migrator.wait_timeout_s`) and
        TransferError if a promotion failed (the engine should compute those tokens itself).
        """
        self._check_alive()
        self._check_seq(seq)
        self._check_layer(layer)
        _check_timeout("wait", timeout, zero=True)
        pending = seq.pending
        if not pending:
            return
        timeout = self.config.migrator.wait_timeout_s if timeout is None else timeout
        # NOTE: a promotion (or writer) that already failed for this layer ends the wait now:
        # waiting out the others first would only delay the same error (and a writer that a
        # single-threaded engine has not run yet would never finish).
        _check_landed(seq, layer)
        for readiness in pending:
            event = readiness.wait(layer, timeout)
            if event is not None:
                import torch

                torch.cuda.current_stream().wait_event(event)
        if all(r.done and r.error is None for r in pending):
            seq.pending = []

    def gather(self, seq: Sequence, layer: int):
        """Contiguous `(key, value)`, each `[written, H, D]`, of everything written so far."""
        self._check_alive()
        self._check_seq(seq)
        self._check_layer(layer)
        self._need_storage("gather")
        self.wait(seq, layer)
        idx = self.index
        with atomic(), idx.lock:
            idx.check_open(seq)
            _check_landed(seq, layer)
            flat = self._flat_index(seq, 0, seq.written[layer])
            return self.pools[DEVICE].read_tokens(layer, flat)

    def attention(self, q, seqs: list[Sequence], layer: int, *, scale: float | None = None):
        """Paged decode attention: `q` `[len(seqs), num_q_heads, head_dim]`, one query per
        sequence, over every token written for `layer` (the newest included). Returns the same
        shape. Blocks still being promoted are read from host (`kernels.missing_blocks`)."""
        from tiered_cache.data import attention

        self._check_alive()
        self._need_storage("attention")
        seqs = self._check_seqs(seqs)
        self._check_layer(layer)
        attention.check_q(q, len(seqs), self.num_q_heads, self.head_dim, *self._q_expect(),
                          "[len(seqs), num_q_heads, head_dim]")
        return self._read(seqs, layer, lambda rows: attention.decode(
            q, self.pools, rows, layer, scale, self.config.kernels.attention_backend))

    def prefill_attention(self, q, seq: Sequence, layer: int, *, scale: float | None = None):
        """Attention of the last `n` written tokens (`q` `[n, num_q_heads, head_dim]`): causal
        among them, full over everything before (chunked prefill over a cached prefix)."""
        from tiered_cache.data import attention

        self._check_alive()
        self._need_storage("prefill_attention")
        self._check_seq(seq)
        self._check_layer(layer)
        import torch

        if not isinstance(q, torch.Tensor) or q.dim() != 3:
            raise ShapeError("q: expected a tensor [n, num_q_heads, head_dim] for the last n "
                             f"written tokens, got {getattr(q, 'shape', type(q).__name__)}")
        n = q.shape[0]
        if not 1 <= n <= seq.written[layer]:
            raise ShapeError(f"q: {n} queries, but layer {layer} has {seq.written[layer]} "
                             "tokens written (queries are the last n written tokens)")
        attention.check_q(q, n, self.num_q_heads, self.head_dim, *self._q_expect(),
                          "[n, num_q_heads, head_dim]")
        return self._read([seq], layer, lambda rows: attention.prefill(
            q, self.pools, rows, layer, scale, self.config.kernels.attention_backend))

    def _read(self, seqs: list[Sequence], layer: int, kernel):
        """Run `kernel(rows)` over block tables built under the lock; the blocks it reads stay
        held (and the sequences open) until it returns."""
        wait_all = self.config.kernels.missing_blocks == "wait"
        for seq in seqs:
            if wait_all:
                self.wait(seq, layer)
            elif any(not r.zero_copy for r in seq.pending):
                # NOTE: blocks staged from disk have no copy to read in place until their
                # host stage lands: wait for this layer of those promotions only.
                _check_landed(seq, layer)               # (a failed one: no wait, as in wait)
                timeout = self.config.migrator.wait_timeout_s
                for r in seq.pending:
                    if not r.zero_copy:
                        event = r.wait(layer, timeout)
                        if event is not None:
                            import torch

                            torch.cuda.current_stream().wait_event(event)
        idx = self.index
        with atomic():
            rows, held = idx.begin_read(seqs, layer)
            try:
                return kernel(rows)
            finally:
                idx.end_read(seqs, held)

    def close(self, seq: Sequence, *, timeout: float | None = None) -> None:
        """Release a sequence: its published blocks stay cached (and become evictable), its
        private blocks (partial, or never fully written) are freed. An attention call still
        reading it is waited for (up to `timeout`, default `migrator.wait_timeout_s`, then
        BusySequenceError); a write still copying raises BusySequenceError at once."""
        self._check_alive()
        self._check_seq(seq)
        _check_timeout("close", timeout, zero=True)
        timeout = self.config.migrator.wait_timeout_s if timeout is None else timeout
        self.index.close(seq, timeout)

    def invalidate(self, token_ids, *, salt: str | bytes | None = None,
                   adapter_id: str | None = None) -> int:
        """Drop the cached blocks of this prefix and everything cached under them, from every
        tier. Returns the number of blocks dropped.

        NOTE: keys chain, so once a block is gone nothing below it is reachable; dropping the
        prefix's first block therefore drops every cached continuation of it. Blocks that open
        sequences still read leave the index at once and are freed when the last one closes.
        """
        self._check_alive()
        tokens = as_token_array(token_ids)
        _check_salt(salt)
        _check_adapter(adapter_id)
        n = self.index.invalidate(tokens, salt=salt, adapter_id=adapter_id)
        if self.config.tiers.daemon is not None:
            root, _ = self.index.register_root(salt, adapter_id)
            n += self.stores[0].invalidate(root, tokens)
        elif self.config.tiers.remote is not None:
            root, _ = self.index.register_root(salt, adapter_id)
            self.stores[0].delete(root, self.hasher.chain(root, tokens))
        return n

    def stats(self) -> dict:
        out = self.index.stats()
        out["threads"] = self.health.summary()
        out["closed"] = self._closed
        out["copies"] = self.migrator.copy_stats() if self.migrator is not None else {}
        for tier in self.index.tiers:
            if tier.persistent and not self._closed:
                out["tiers"][tier.name]["pool"] = self.pools[tier.index].stats()
        for keyed, store in zip(self.index.keyed.tiers, self.stores):
            out["tiers"][keyed.name]["store"] = store.stats()
        if self.config.tiers.daemon is not None and not self._closed:
            shared_tiers.daemon_stats(self.stores[0], out)
        if self.costs is not None:
            out["cost_model"] = {name: c.snapshot() for name, c in self.costs.tiers.items()}
        return out

    def resize(self, tier: str, num_blocks: int, *, timeout: float | None = 30.0) -> int:
        """Grow or shrink a tier to `num_blocks` slots while the cache serves; returns the new
        size. Growing backs new memory segments (CapacityError when the machine lacks the
        memory or `max_num_blocks` is passed); shrinking moves the blocks above the new size
        down, evicts by policy when they do not fit, and frees the emptied segments. Pinned
        blocks are waited for up to `timeout` seconds; on timeout the tier keeps its size and
        no block is lost. See `tiered_cache.core.resize`."""
        self._check_alive()
        t, n = self._check_resize(tier, num_blocks, timeout)
        state = self.index.tiers[t]
        pool = self.pools[t]
        with self._resize_lock:
            old = state.allocator.num_slots
            if pool is not None:
                pool.check_resize(n)    # fixed pool, max_num_blocks, memory: nothing changed
            else:
                cfg = getattr(self.config.tiers, state.name)
                if cfg.max_num_blocks is not None and n > cfg.max_num_blocks:
                    raise CapacityError(f"tiers.{state.name}: {n:,} blocks exceed "
                                        f"max_num_blocks {cfg.max_num_blocks:,}")
            if n > old:
                resizing.grow(self.index, t, n, pool)
            elif n < old:
                resizing.shrink(self.index, t, n, timeout, backing=pool, run=self._run,
                                poke=self.migrator.poke if self.migrator else None)
            return n

    def _check_resize(self, tier: str, num_blocks, timeout) -> tuple[int, int]:
        names = [t.name for t in self.index.tiers]
        if not isinstance(tier, str) or tier not in names:
            raise TierUnavailableError(f"resize: no tier named {tier!r} in this cache; tiers: "
                                       f"{names}")
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, (int, np.integer)):
            raise ArgumentError(f"resize: num_blocks must be an int, got {num_blocks!r}")
        n = int(num_blocks)
        if not 1 <= n <= 1 << 40:
            raise ArgumentError(f"resize: cannot resize tier {tier!r} to {n} blocks: at least "
                                "1 and at most 2**40")
        _check_timeout("resize", timeout, zero=False)
        return names.index(tier), n

    @property
    def tiers(self) -> list[TierState]:
        return self.index.tiers

    def tier(self, name: str) -> TierState:
        try:
            return self.index.tier(name)
        except KeyError:
            raise KeyError(f"no tier named {name!r}; tiers: "
                           f"{[t.name for t in self.index.tiers]}") from None

    # ------------------------------------------------------------------ data plane hooks
    def _run(self, plan: list[Transfer]) -> None:
        """Copy a plan now (synchronous eviction, shrink moves). Raises TransferError."""
        self.executor.run(plan)

    def _poke(self) -> None:
        if self.migrator is not None:
            self.migrator.poke()

    def _promote(self, plan: list[Transfer], readiness: LayerReadiness) -> None:
        assembly.promote(self.index, self.executor, self.migrator, plan, readiness)

    def _published(self, fresh: list[int]) -> None:
        """Blocks just published: a copy below them (write_through), and to the daemon."""
        self._copy_down(fresh)
        if fresh and self.migrator is not None and self.config.tiers.daemon is not None:
            self.migrator.put_remote(fresh)

    def _copy_down(self, fresh: list[int]) -> None:
        """write_through: a copy in the next tier now, so evicting the block later costs no
        copy (in the background when the migrator runs)."""
        if not (fresh and self.index.write_through and len(self.index.tiers) > 1):
            return
        if self.migrator is not None and not self.migrator.stopped:
            self.migrator.copy_down(fresh)
            return
        try:
            plan = moves.plan_copy_down(self.index, fresh, DEVICE, DEVICE + 1)
        except CapacityError:
            # NOTE: the write this copy follows has already committed: a copy that finds no
            # room below is skipped (the blocks just have no lower copy), never an error.
            return
        ok = False
        try:
            self.executor.run(plan)
            ok = True
        except TransferError:
            self.index.count("transfer_failures")     # the block just has no lower copy
        finally:
            moves.commit_copy_down(self.index, plan, ok)

    def _flat_index(self, seq: Sequence, start: int, end: int):
        import torch

        bs = self.block_size
        first, last = start // bs, (end - 1) // bs if end > start else start // bs
        slots = np.asarray(self.index.device_slots(seq, first, last), dtype=np.int64)
        if (slots < 0).any():
            raise TransferError(f"a block of sequence {seq.id} has no device copy (its "
                                "promotion failed)")
        pos = np.arange(start, end, dtype=np.int64)
        flat = slots[pos // bs - first] * bs + pos % bs
        return torch.from_numpy(flat).to(self.pools[DEVICE].kv.device)

    # ------------------------------------------------------------------ validation
    def _check_alive(self) -> None:
        if self._closed:
            raise CacheClosedError("the cache was shut down; build a new TieredKVCache")

    def _need_storage(self, what: str) -> None:
        if not self.has_storage:
            raise StorageDisabledError(f"{what} needs tensor storage; this cache has "
                                       "storage: none")

    def _check_seqs(self, seqs) -> list[Sequence]:
        if isinstance(seqs, Sequence) or not isinstance(seqs, (list, tuple)):
            raise ArgumentError(f"seqs: expected a list of Sequences, got "
                                f"{type(seqs).__name__}")
        if not seqs:
            raise ShapeError("seqs: expected at least one sequence")
        for s in seqs:
            self._check_seq(s)
        if len({s.id for s in seqs}) != len(seqs):
            raise ShapeError("seqs: the same sequence appears twice")
        return list(seqs)

    def _check_seq(self, seq: Sequence) -> None:
        if not isinstance(seq, Sequence):
            raise ArgumentError(f"expected a Sequence from TieredKVCache.open, got "
                                f"{type(seq).__name__}")
        self.index.check_open(seq)

    def _check_layer(self, layer: int) -> None:
        if not isinstance(layer, (int, np.integer)) or isinstance(layer, bool):
            raise LayerError(f"layer: expected an int, got {type(layer).__name__}")
        if not 0 <= layer < self.num_layers:
            raise LayerError(f"layer: expected 0 <= layer < {self.num_layers}, got {layer}")

    def _compute_dtypes(self):
        """Dtypes the model may hand KV (and queries) in: the storage dtype, or, for FP8
        storage, the wider types it quantizes from."""
        import torch

        from tiered_cache.data.pools import TORCH_DTYPES

        dtype = TORCH_DTYPES[self.config.model.dtype]
        if dtype == torch.float8_e4m3fn:
            return (torch.float16, torch.bfloat16, torch.float32)
        return (dtype,)

    def _q_expect(self):
        import torch

        dtypes = self._compute_dtypes()
        device = self.pools[DEVICE].kv.device if self.has_storage else torch.device("cpu")
        return dtypes, device

    def _check_kv(self, key, value) -> int:
        import torch

        dtypes = self._compute_dtypes()
        for name, x in (("key", key), ("value", value)):
            if not isinstance(x, torch.Tensor):
                raise DTypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
            if x.is_nested or x.layout != torch.strided:
                raise DTypeError(f"{name}: expected a dense (strided) tensor, got "
                                 f"{'a nested tensor' if x.is_nested else x.layout}")
            want = (self.num_kv_heads, self.head_dim)
            if x.dim() != 3 or tuple(x.shape[1:]) != want:
                raise ShapeError(f"{name}: expected shape [n, {want[0]}, {want[1]}] "
                                 f"(tokens, kv heads, head_dim), got {list(x.shape)}")
            if x.device.type not in ("cpu", "cuda"):
                raise DTypeError(f"{name}: expected a CPU or CUDA tensor, got one on "
                                 f"{x.device} (it has no data to store)")
            if not self.has_storage:
                continue
            if x.dtype not in dtypes:
                if len(dtypes) > 1:
                    # FP8 storage quantizes on write; the model computes in a wider type.
                    raise DTypeError(f"{name}: fp8_e4m3 storage takes float16, bfloat16 or "
                                     f"float32 KV to quantize, got {x.dtype}")
                raise DTypeError(f"{name}: expected dtype {dtypes[0]} (model.dtype), "
                                 f"got {x.dtype}")
            if x.numel() and (len(dtypes) > 1 or not self.allow_non_finite):
                # NOTE: a NaN or inf would be published and reused by later requests. Costs a
                # pass over the KV (a sync on a GPU); `allow_non_finite_kv: true` skips it,
                # except for FP8 storage, where one would poison the whole block's scale.
                if not bool(torch.isfinite(x.detach()).all()):
                    hint = ("fp8_e4m3 storage needs finite values" if len(dtypes) > 1 else
                            "set allow_non_finite_kv: true to store it anyway")
                    raise KVValueError(f"{name}: contains NaN or inf; refusing to cache it "
                                       f"({hint})")
        if key.shape != value.shape:
            raise ShapeError(f"key and value shapes differ: {list(key.shape)} vs "
                             f"{list(value.shape)}")
        return int(key.shape[0])

    # ------------------------------------------------------------------ introspection
    @contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the control-plane lock (tests read a consistent state)."""
        with self.index.locked():
            yield

    def open_sequences(self) -> list[Sequence]:
        return self.index.open_sequences()


def _check_landed(seq: Sequence, layer: int) -> None:
    for r in seq.pending:
        if r.inflight:
            if r.error is not None and r.ready_layers <= layer:
                raise PrefixAbortedError(str(r.error))
            continue                # its ready layers stay readable after an abort
        if r.error is not None:
            raise TransferError(f"promotion of a block of sequence {seq.id} failed: {r.error}")


def _check_timeout(what: str, timeout: object, *, zero: bool) -> None:
    """None, or a finite number of seconds > 0 (>= 0 with `zero`: do not wait at all)."""
    if timeout is None:
        return
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float, np.integer,
                                                             np.floating)) \
            or not (0 <= timeout if zero else 0 < timeout) or not timeout < float("inf"):
        bound = ">= 0" if zero else "> 0"
        raise ArgumentError(f"{what}: timeout must be {bound} seconds (finite) or None, got "
                            f"{timeout!r}")


def _check_salt(salt: object) -> None:
    if salt is not None and not isinstance(salt, (str, bytes)):
        raise TokenError(f"salt: expected a str, bytes or None, got {type(salt).__name__}")


def _check_adapter(adapter_id: object) -> None:
    """A per-request adapter id goes into the hash namespace: the same rules as the config's."""
    if adapter_id is None:
        return
    from tiered_cache.config import check_identifier

    try:
        check_identifier("adapter_id", adapter_id)
    except ConfigError as exc:
        raise TokenError(str(exc)) from None


def _attached(index: BlockIndex, migrator, tenant_salt: bytes) -> None:
    """The node daemon tier (re)attached (on its thread): key roots under the tenant it
    assigned, and publish what the device tier holds.

    NOTE: a new daemon may have lost everything (a restart without a disk tier), and blocks
    computed while it was away were never published: every published device block is put
    again (blocks whose root the daemon keys differently are skipped by the put, and a block
    the daemon already has is answered "not taken" and costs no copy there)."""
    index.set_tenant(tenant_salt)
    index.keyed.forget_puts(0)
    if migrator is not None and not migrator.stopped:
        migrator.put_remote(index.persist.blocks_in(DEVICE))


def _warm_up(pools: list) -> None:
    """Run each copy path once on slot 0 so its first real use (an eviction under the lock)
    does not pay for imports and kernel compilation (seconds, once per process)."""
    from tiered_cache.data.executor import Executor

    real = [p for p in pools if p is not None]
    if len(real) < 2 or real[0].num_slots < 1 or real[1].num_slots < 1:
        return
    ex = Executor(real[:2], ["gpu", "host"])
    try:
        import torch

        with torch.no_grad():
            # Copies slot 0 onto slot 0 of the other pool and back: both are unused (fresh
            # pools), so nothing observable changes.
            ex.run([Transfer(0, 0, 0, 1, 0)])
            ex.run([Transfer(0, 1, 0, 0, 0)])
    except TransferError:
        pass
