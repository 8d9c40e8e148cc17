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
import logging
import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import numpy as np

from tiered_cache.config import CacheConfig, check_identifier
from tiered_cache.core import resize as resizing
from tiered_cache.core.atomic import atomic, install, interrupt_pending
from tiered_cache.core.readiness import LayerReadiness
from tiered_cache.core.sequence import Sequence
from tiered_cache.core.tier import DEVICE, TierState
from tiered_cache.core.transfer import Transfer
from tiered_cache.errors import (
    ArgumentError,
    CacheBrokenError,
    CacheClosedError,
    CapacityError,
    ConfigError,
    DTypeError,
    KVValueError,
    LayerError,
    PrefixAbortedError,
    SequenceClosedError,
    ShapeError,
    StorageDisabledError,
    TieredCacheError,
    TierUnavailableError,
    TokenError,
    TransferError,
)
from tiered_cache.hashing import BlockHasher, HashFn, Namespace, as_token_array, xxh3_128
from tiered_cache.tiers.base import ENGINE
from tiered_cache.tiers.stack import build_stack

if TYPE_CHECKING:
    import torch

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
        self.block_bytes = config.block_bytes
        self.allow_non_finite = config.allow_non_finite_kv
        self.hasher = BlockHasher(
            Namespace(model.name, model.dtype, model.num_layers, model.num_kv_heads,
                      model.head_dim, self.block_size, config.adapter_id), hash_fn)
        self._closed = False
        self._resize_lock = threading.Lock()    # one resize at a time
        self.stack = stack = build_stack(config, ENGINE, hasher=self.hasher)
        self.index, self.executor, self.costs = stack.index, stack.executor, stack.costs
        self.pools, self.stores = stack.pools, stack.stores
        self.migrator, self.compactor, self.health = (stack.migrator, stack.compactor,
                                                      stack.health)
        self._metrics_server = None
        try:
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
            stack.start()                   # the keyed tiers' links; first copies compile here
        except BaseException:
            stack.stop_workers()
            stack.close()
            raise
        install()                       # defer SIGINT inside commit sections (main thread)
        if self.migrator or self.compactor:
            # Stop threads at interpreter exit even if the user never closes the cache.
            atexit.register(_shutdown_if_alive, weakref.ref(self))

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
        self.stack.stop_workers()
        if self.index.broken is None:
            self._close_sequences()
            # What only memory holds goes to the disk tier (tiers.disk.drain_on_shutdown).
            written = self.stack.drain()
            if written:
                log.info("shutdown: %d blocks written to the persistent tier", written)
        # NOTE: after a torn section (core/atomic.py) no sequence is closed, and the tiers'
        # close writes nothing down from a state that may be half changed (tiers/disk.py).
        self.stack.close()
        if self._metrics_server is not None:
            server, thread = self._metrics_server
            server.shutdown()
            server.server_close()
            thread.join(timeout=5)
            self._metrics_server = None

    def _close_sequences(self) -> None:
        """Writes and reads running outside the lock finish first (up to 30 s); then every
        open sequence is closed (one still busy is left open)."""
        deadline = time.monotonic() + 30.0
        while any(s.writing or s.readers for s in self.index.open_sequences()) and \
                time.monotonic() < deadline:
            time.sleep(0.001)
        for seq in self.index.open_sequences():
            if seq.writing or seq.readers:
                continue
            self.index.close(seq)

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
            since = self.index.space.ended
            try:
                with atomic():
                    seq = self.index.open(tokens, salt=salt, adapter_id=adapter_id,
                                          reserve_last=reserve_last, promote=self._promote)
                    if self.stores and not interrupt_pending():
                        self.stack.load_keyed(seq)
                return seq
            except BaseException as exc:
                # NOTE: whatever is raised once the index handed `seq` over (an interrupt
                # deferred anywhere in the section and raised at its end, the SystemExit of a
                # deferred SIGTERM handler, an error of a shared tier's load) reaches a caller
                # who never gets `seq`: give it back first, in a section of its own so that a
                # second interrupt cannot cut the close.
                if seq is not None:
                    with atomic():
                        if not seq.closed:
                            self.index.close(seq)
                    raise
                self._wait_for_room(exc, since, deadline)

    def _wait_for_room(self, exc: BaseException, since: int, deadline: float) -> None:
        """After a failed open/append: re-raise unless it was a transient shortage (copies under
        way hold the room) and `migrator.wait_timeout_s` has not passed; then wait, outside
        the lock and interruptibly, until a copy ends (core/eviction.py `wait_for_copies`)."""
        if not (isinstance(exc, CapacityError) and exc.transient):
            raise exc
        left = deadline - time.monotonic()
        if left <= 0:
            raise CapacityError(f"{exc} (still short after waiting "
                                f"{self.config.migrator.wait_timeout_s:g} s, "
                                "migrator.wait_timeout_s, for copies under way)") from exc
        self.index.space.wait_for_copies(since, left)
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
            since = self.index.space.ended
            try:
                self.index.append(seq, tokens)
                return
            except CapacityError as exc:
                self._wait_for_room(exc, since, deadline)

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
                    with atomic(), idx.lock:
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
            self.stack.copy_down(self.index.mark_computed(seq))

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
        try:
            for readiness in pending:
                event = readiness.wait(layer, timeout)
                if event is not None:
                    import torch

                    torch.cuda.current_stream().wait_event(event)
        except TieredCacheError as exc:
            if seq.closed:
                raise SequenceClosedError(f"wait: sequence {seq.id} was closed (by another "
                                          "thread) while this one waited") from exc
            raise
        if seq.closed:
            # NOTE: closed by another thread meanwhile (close wakes waits on in-flight blocks;
            # a promotion ends by itself): its blocks may already serve another prompt.
            raise SequenceClosedError(f"wait: sequence {seq.id} was closed (by another thread) "
                                      "while this one waited")
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
        if self.stores:
            root, _ = self.index.register_root(salt, adapter_id)
            n += self.stack.invalidate_keyed(root, tokens)
        return n

    def stats(self) -> dict:
        out = self.index.stats()
        out["closed"] = self._closed
        return self.stack.stats(out)

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
        self.stack.run(plan)

    def _promote(self, plan: list[Transfer], readiness: LayerReadiness) -> None:
        self.stack.promote(plan, readiness)

    def _published(self, fresh: list[int]) -> None:
        """Blocks just published: a copy below them (write_through), and puts to the keyed
        tiers written as blocks are computed."""
        self.stack.published(fresh)

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
        if self.index.broken is not None:
            raise CacheBrokenError(f"a commit section was cut by {self.index.broken}, which "
                                   "could not be deferred (core/atomic.py): the state may be "
                                   "half changed, so this cache refuses every call; build a "
                                   "new TieredKVCache")

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

    def _q_expect(self) -> tuple[tuple[torch.dtype, ...], torch.device]:
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


def _shutdown_if_alive(ref: weakref.ref[TieredKVCache]) -> None:
    cache = ref()
    if cache is not None:
        cache.shutdown()


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
    try:
        check_identifier("adapter_id", adapter_id)
    except ConfigError as exc:
        raise TokenError(str(exc)) from None
