"""The connector's worker side: loads into and saves out of vLLM's paged KV, layer by layer,
through the node service's shared pool. No vLLM import (tests drive it with plain tensors).

Each step the scheduler side sends a `StepPlan` (plans.py). For a load the worker `fetch`es
the blocks itself, under its own handle (so nothing it copies can be evicted or reused under
the copy, whatever happens to the scheduler's connection), copies them out of its read-only
mapping of the pool one layer per job (`wait_for_layer_load` waits for that layer's job), and
`release`s the handle: a handle no longer held (its lease was reaped meanwhile) voids the copy.
For a save it copies each layer of the new blocks into its own staging area as attention
writes them (`save_kv_layer` queues the job and returns), and once every layer is written
(`wait_for_save`) `publish`es them; the daemon checks each block's chained key, parent and
tokens before it takes it.

Failures are never garbage KV: a block that could not be fetched, a copy that raised, a
handle found not held, a daemon gone mid-step are reported to vLLM as load errors (vLLM block
ids, `load_errors`), and vLLM recomputes from the first of them. The step's saves of such a
request are dropped (the tokens it computed attended to the KV that failed): with tensor
parallelism every rank drops them, since the attention outputs of all ranks are reduced
together (`agree` takes the union of the failed requests over the group).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from tiered_cache.hashing import BlockHasher, Namespace
from tiered_cache.integrations.vllm import layout as kvlayout
from tiered_cache.integrations.vllm.copier import Job, pipeline_for
from tiered_cache.integrations.vllm.identity import Geometry, rank_salt
from tiered_cache.integrations.vllm.link import DaemonLink
from tiered_cache.integrations.vllm.plans import LoadOp, SaveOp, StepPlan, WorkerReport

log = logging.getLogger(__name__)

Agree = Callable[[set[str]], set[str]]


def union_over(group=None) -> Agree:
    """An `agree` for a tensor-parallel group (a torch.distributed CPU group): the union of
    every rank's failed requests. Called by every rank in the same steps (those whose plan has
    sync loads: the plan is the same on every rank)."""
    def agree(failed: set[str]) -> set[str]:
        import torch.distributed as dist

        gathered: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, sorted(failed), group=group)
        return set().union(*(set(x) for x in gathered))
    return agree


def layer_order(names) -> list[str]:
    """Layer names in model order (numbers compared as numbers), the same in every process."""
    def natural(name: str):
        return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]
    return sorted(names, key=natural)


@dataclass
class _Req:
    tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    n: int = 0
    root: bytes | None = None
    keys: list[bytes] = field(default_factory=list)

    def extend(self, offset: int, tokens: np.ndarray) -> bool:
        if offset != self.n:
            return False
        need = self.n + len(tokens)
        if need > len(self.tokens):
            grown = np.zeros(max(need, 2 * len(self.tokens), 256), np.int32)
            grown[:self.n] = self.tokens[:self.n]
            self.tokens = grown
        self.tokens[self.n:need] = tokens
        self.n = need
        return True


@dataclass
class _Load:
    op: LoadOp
    handle: int = 0
    gen: int = 0
    got: int = 0                    # blocks fetched (whole vLLM blocks)
    slots: list[int] = field(default_factory=list)
    failed_at: int | None = None    # first block (ours) not loaded
    job: Job | None = None          # async loads: their one job


@dataclass
class _Save:
    op: SaveOp
    slots: list[int]
    keys: list[bytes]
    parent: bytes
    root: bytes


class WorkerSide:
    """One worker (one tensor-parallel rank) of the connector."""

    def __init__(self, geometry: Geometry, *, rank: int, resolve_link: Callable[[], DaemonLink],
                 attach_timeout_s: float, load_timeout_s: float,
                 agree: Agree | None = None) -> None:
        self.g = geometry
        self.rank = rank
        self._resolve = resolve_link
        self.link: DaemonLink | None = None
        self.attach_timeout_s = attach_timeout_s
        self.load_timeout_s = load_timeout_s
        self.agree = agree
        g = geometry
        self.hasher = BlockHasher(Namespace(g.model, g.dtype, g.num_layers, g.num_kv_heads,
                                            g.head_dim, g.block_size, None))
        self.layers: list[str] = []
        self.index: dict[str, int] = {}
        self.views: list[torch.Tensor] = []
        self.pipeline = None
        self.reqs: dict[str, _Req] = {}
        self._plan = StepPlan()
        self._loads: list[_Load] = []
        self._load_jobs: dict[int, Job] = {}
        self._async: list[_Load] = []
        self._saves: list[_Save] = []
        self._save_jobs: list[Job] = []
        self._saved_layers: set[int] = set()
        self._saves_prepared = False
        self._staging = None
        self._save_gen = -1
        self._keep: list[torch.Tensor] = []
        self._host_writes: list[tuple[torch.Tensor, int, torch.Tensor]] = []
        self._errors: set[int] = set()
        self._recved: set[str] = set()
        self._report = WorkerReport()
        self._ever_attached = False
        self.seconds = {"save_copy_wait": 0.0, "publish": 0.0}
        self.counters = {"loads": 0, "loaded_blocks": 0, "load_failures": 0,
                         "failed_blocks": 0, "fetch_misses": 0, "void_copies": 0,
                         "copy_errors": 0, "saved_blocks": 0, "taken_blocks": 0,
                         "dropped_saves": 0, "token_gaps": 0, "layers_missing": 0}

    # setup ------------------------------------------------------------------------------------

    def register(self, kv_caches: Mapping[str, torch.Tensor], backend: str, *,
                 num_blocks: int, dtype: torch.dtype) -> None:
        """Read vLLM's per-layer KV tensors; refuse a layout not understood (LayoutError)."""
        g = self.g
        names = layer_order(kv_caches)
        if len(names) != g.num_layers:
            raise kvlayout.LayoutError(f"{len(names)} KV cache layers, the model has "
                                       f"{g.num_layers} (hybrid or cross-layer caches are not "
                                       "supported)")
        views, device = [], None
        for name in names:
            kv = kv_caches[name]
            lay = kvlayout.describe(kv, backend, num_blocks=num_blocks,
                                    block_size=g.vllm_block_size, num_kv_heads=g.num_kv_heads,
                                    head_dim=g.head_dim, dtype=dtype, name=name)
            if device is not None and kv.device != device:
                raise kvlayout.LayoutError(f"layer {name!r} on {kv.device}, others on {device}")
            device = kv.device
            views.append(kvlayout.blocks_view(kv, lay, g.block_size))
        self.layers, self.views = names, views
        self.index = {n: i for i, n in enumerate(names)}
        self.device = device
        self.pipeline = pipeline_for(device)

    def close(self) -> None:
        if self.pipeline is not None:
            self.pipeline.close()
        if self.link is not None:
            self.link.close()
            self.link = None

    # the link ---------------------------------------------------------------------------------

    def _link(self, wait: bool) -> DaemonLink | None:
        """The attached link; waits (bounded) only until the first attach ever."""
        if self.link is None:
            self.link = self._resolve()
        if self.link.attached:
            self._ever_attached = True
            if self.device.type == "cuda":
                for p in (self.link.pool, self.link.staging):
                    if p is not None:
                        p.register_cuda()
            return self.link
        if wait and not self._ever_attached:
            if self.link.wait_attached(self.attach_timeout_s):
                return self._link(False)
        return None

    # a step -----------------------------------------------------------------------------------

    def bind(self, plan: StepPlan) -> None:
        """Take this step's plan (before the forward)."""
        self._plan = plan
        for r in plan.forget:
            self.reqs.pop(r, None)
        for t in plan.tokens:
            req = self.reqs.setdefault(t.req_id, _Req())
            if not req.extend(t.offset, t.tokens):
                # NOTE: the scheduler and this worker disagree on the request's tokens (a
                # bug): its blocks are neither loaded nor saved from here on.
                self.counters["token_gaps"] += 1
                log.error("request %s: tokens from %d sent, %d held; dropping it", t.req_id,
                          t.offset, req.n)
                self.reqs.pop(t.req_id, None)

    def _chain(self, req: _Req, root: bytes, upto: int) -> list[bytes]:
        """Keys of the request's blocks [0, upto) (as far as its tokens go)."""
        if req.root != root:
            req.root, req.keys = root, []
        bs = self.g.block_size
        have = len(req.keys)
        upto = min(upto, req.n // bs)
        if upto > have:
            parent = req.keys[-1] if req.keys else root
            req.keys.extend(self.hasher.chain(parent, req.tokens[have * bs:upto * bs]))
        return req.keys[:upto]

    def _root(self, link: DaemonLink, salt: str | None, adapter: str | None) -> bytes | None:
        root, _ = link.root(rank_salt(salt, self.rank, self.g.tp_size), adapter,
                            timeout_s=self.load_timeout_s)
        return root

    def start_load(self) -> None:
        """Fetch this step's loads and queue their copies (sync loads: one job per layer)."""
        plan = self._plan
        if not plan.loads:
            return
        link = self._link(wait=True)
        sync: list[_Load] = []
        for op in plan.loads:
            ld = _Load(op)
            self.counters["loads"] += 1
            try:
                self._fetch(link, ld)
            except Exception:            # noqa: BLE001 - a miss (reported), never a crash
                log.exception("request %s: fetching its load failed", op.req_id)
                self.counters["copy_errors"] += 1
                ld.failed_at = op.start
                if ld.handle:
                    self._release(link, ld)
                ld.got = 0
            if op.is_async:
                self._async.append(ld)
                if ld.got:
                    ld.job = self.pipeline.submit(lambda ld=ld, link=link: self._copy_in(
                        link, [ld], range(len(self.views))))
            else:
                sync.append(ld)
        self._loads = sync
        ready = [ld for ld in sync if ld.got]
        if ready:
            for layer in range(len(self.views)):
                self._load_jobs[layer] = self.pipeline.submit(
                    lambda layer=layer, link=link: self._copy_in(link, ready, (layer,)))

    def _fetch(self, link: DaemonLink | None, ld: _Load) -> None:
        op = ld.op
        bs, k = self.g.block_size, self.g.sub_blocks
        req = self.reqs.get(op.req_id)
        if link is None or req is None or req.n < (op.start + op.count) * bs:
            ld.failed_at = op.start
            return
        root = self._root(link, op.salt, op.adapter)
        if root is None:
            ld.failed_at = op.start
            return
        keys = self._chain(req, root, op.start)
        if len(keys) < op.start:
            ld.failed_at = op.start
            return
        parent = keys[-1] if op.start else root
        reply, gen = link.call("fetch", self.load_timeout_s, root=root, parent=parent,
                               tokens=req.tokens[op.start * bs:(op.start + op.count) * bs],
                               wait_ms=int(self.load_timeout_s * 1000 * 0.8))
        if reply is None or not reply["handle"]:
            self.counters["fetch_misses"] += 1
            ld.failed_at = op.start
            return
        slots = list(reply["slots"])
        got = len(slots) // k * k           # whole vLLM blocks only
        ld.handle, ld.gen, ld.slots, ld.got = reply["handle"], gen, slots[:got], got
        if got < op.count:
            ld.failed_at = op.start + got
        if got == 0:
            self._release(link, ld)

    def _copy_in(self, link: DaemonLink, loads: list[_Load], layers) -> None:
        pool = link.pool
        if pool is None:
            raise RuntimeError("the daemon's pool is no longer mapped")
        # NOTE: retained for the copy: the link closes the pool when the daemon is lost, on
        # its own thread, and an unmap under the copy is a SIGSEGV (RuntimeError once closed).
        with pool.retain():
            kv = pool.kv
            for ld in loads:
                if ld.gen != link.generation:
                    raise RuntimeError("the daemon connection was replaced during the load")
                vb, sub = self._targets(ld.op, ld.op.start, ld.got)
                slots = torch.tensor(ld.slots, dtype=torch.long)
                for layer in layers:
                    self.views[layer][vb, sub] = self._from_host(kv, slots, layer)

    def _from_host(self, kv: torch.Tensor, slots: torch.Tensor, layer: int) -> torch.Tensor:
        """`kv[slots, layer]` (the pool's blocks of one layer) on this worker's device."""
        if self.device.type == "cpu":
            return kv[slots, layer]
        # NOTE: gathered into page-locked memory so the upload is an asynchronous DMA on the
        # side stream; the buffer lives until the step ends (the copy reads it until then).
        buf = torch.empty((len(slots), *kv.shape[2:]), dtype=kv.dtype, pin_memory=True)
        torch.index_select(kv[:, layer], 0, slots, out=buf)
        self._keep.append(buf)
        return buf.to(self.device, non_blocking=True)

    def _targets(self, op: LoadOp | SaveOp, start: int, count: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """(vLLM block ids, sub-block numbers) of our blocks [start, start + count)."""
        k = self.g.sub_blocks
        blocks = np.arange(start, start + count)
        v = blocks // k - op.first_vllm
        ids = np.asarray(op.vllm_blocks, dtype=np.int64)[v]
        dev = self.device
        return (torch.from_numpy(ids).to(dev), torch.from_numpy(blocks % k).to(dev))

    def wait_layer(self, name: str) -> None:
        """Attention on `name` may read its KV (only this layer's copies are waited for)."""
        job = self._load_jobs.get(self.index.get(name, -1))
        if job is None:
            return
        try:
            job.wait_device()
        except BaseException:      # noqa: BLE001 - the loads fail; the forward carries on
            self.counters["copy_errors"] += 1
            for ld in self._loads:
                if ld.got and ld.failed_at is None:
                    ld.failed_at = ld.op.start

    def save_layer(self, name: str) -> None:
        """Queue the copy of this step's new blocks of layer `name` into the staging area."""
        layer = self.index.get(name)
        if layer is None:
            return
        if not self._saves_prepared and self._plan.saves:
            self._saves_prepared = True
            try:
                self._prepare_saves()
            except Exception:            # noqa: BLE001 - the step's saves are dropped
                log.exception("preparing the step's saves failed")
                self._saves = []
        if not self._saves:
            return
        self._saved_layers.add(layer)
        saves = self._saves
        self._save_jobs.append(self.pipeline.submit(
            lambda: self._copy_out(saves, layer)))

    def _prepare_saves(self) -> None:
        link = self._link(wait=False)
        plan = self._plan
        if link is None or link.staging is None:
            self.counters["dropped_saves"] += sum(s.count for s in plan.saves)
            for s in plan.saves:
                self._unsaved(s.req_id, s.start)
            return
        room = link.staging_slots
        used = 0
        for op in plan.saves:
            req = self.reqs.get(op.req_id)
            root = self._root(link, op.salt, op.adapter) if req is not None else None
            keys = self._chain(req, root, op.start + op.count) if root is not None else []
            if root is None or len(keys) < op.start + op.count or used + op.count > room:
                self.counters["dropped_saves"] += op.count
                self._unsaved(op.req_id, op.start)
                continue
            self._saves.append(_Save(op, list(range(used, used + op.count)),
                                     keys[op.start:op.start + op.count],
                                     keys[op.start - 1] if op.start else root, root))
            used += op.count
        self._staging = link.staging
        self._save_gen = link.generation

    def _copy_out(self, saves: list[_Save], layer: int) -> None:
        with self._staging.retain():        # NOTE: as in _copy_in (the link may close it)
            self._copy_out_retained(saves, layer)

    def _copy_out_retained(self, saves: list[_Save], layer: int) -> None:
        kv = self._staging.kv
        for s in saves:
            vb, sub = self._targets(s.op, s.op.start, s.op.count)
            src = self.views[layer][vb, sub]
            slots = torch.tensor(s.slots, dtype=torch.long)
            if self.device.type == "cpu":
                kv[slots, layer] = src
            else:
                # Downloaded asynchronously into page-locked memory; scattered into the
                # staging slots once the job's event has fired (`_publish`).
                buf = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
                buf.copy_(src, non_blocking=True)
                self._host_writes.append((slots, layer, buf))

    def _unsaved(self, req_id: str, block: int) -> None:
        u = self._report.unsaved
        u[req_id] = min(u.get(req_id, block), block)

    def end_step(self) -> None:
        """`wait_for_save`: finish the step's loads (release, check), then publish its saves."""
        link = self.link
        failed: set[str] = set()
        try:
            for ld in self._loads:
                if ld.got:
                    self._finish_load(link, ld, self._load_jobs.values())
                self._account(ld)
                if ld.failed_at is not None:
                    failed.add(ld.op.req_id)
            if self.agree is not None and self._loads:
                failed = self.agree(failed)
            try:
                self._publish(link, failed)
            except Exception:            # noqa: BLE001 - a miss later, never a crash now
                log.exception("publishing the step's saves failed")
                self.counters["dropped_saves"] += sum(s.op.count for s in self._saves)
        finally:
            self._loads, self._load_jobs = [], {}
            self._saves, self._save_jobs, self._saved_layers = [], [], set()
            self._saves_prepared = False
            self._keep, self._host_writes = [], []
            self._plan = StepPlan()

    def _finish_load(self, link: DaemonLink | None, ld: _Load, jobs) -> None:
        ok = True
        for job in list(jobs) if ld.job is None else [ld.job]:
            try:
                job.wait_host()
            except BaseException:      # noqa: BLE001 - counted; the load fails
                ok = False
        if not ok:
            self.counters["copy_errors"] += 1
        held = self._release(link, ld)
        if not ok or not held:
            if ok:
                self.counters["void_copies"] += 1
            ld.failed_at = ld.op.start

    def _release(self, link: DaemonLink | None, ld: _Load) -> bool:
        if not ld.handle or link is None:
            return False
        handle, ld.handle = ld.handle, 0
        if ld.gen != link.generation:
            return False                # the connection it was taken on is gone, and its pins
        reply, gen = link.call("release", self.load_timeout_s, handle=handle)
        return bool(reply and reply["held"] and gen == ld.gen)

    def _account(self, ld: _Load) -> None:
        op = ld.op
        r = self._report
        r.loaded[op.req_id] = r.loaded.get(op.req_id, 0) + 1
        if ld.failed_at is None:
            self.counters["loaded_blocks"] += op.count
            return
        k = self.g.sub_blocks
        first = ld.failed_at // k * k
        self.counters["load_failures"] += 1
        self.counters["failed_blocks"] += op.start + op.count - first
        r.failed[op.req_id] = min(r.failed.get(op.req_id, first), first)
        for v in range(first // k, (op.start + op.count + k - 1) // k):
            self._errors.add(op.vllm_blocks[v - op.first_vllm])

    def _publish(self, link: DaemonLink | None, failed: set[str]) -> None:
        saves = self._saves
        if not saves:
            return
        bad = False
        t0 = time.perf_counter()
        for job in self._save_jobs:
            try:
                job.wait_host()
            except BaseException:      # noqa: BLE001 - counted; nothing of the step is saved
                bad = True
        self.seconds["save_copy_wait"] += time.perf_counter() - t0
        if bad:
            self.counters["copy_errors"] += 1
        elif self._host_writes:
            try:
                with self._staging.retain():
                    kv = self._staging.kv
                    for slots, layer, buf in self._host_writes:
                        kv[slots, layer] = buf
            except RuntimeError:        # the link closed the staging area: nothing is saved
                bad = True
                self.counters["copy_errors"] += 1
        missing = len(self._saved_layers) < len(self.views)
        if missing:
            self.counters["layers_missing"] += 1
        keep = [] if bad or missing else [s for s in saves if s.op.req_id not in failed]
        for s in saves:
            if s not in keep:
                self.counters["dropped_saves"] += s.op.count
                self._unsaved(s.op.req_id, s.op.start)
        if not keep or link is None or link.generation != self._save_gen:
            for s in keep:
                self._unsaved(s.op.req_id, s.op.start)
            return
        bs = self.g.block_size
        by_root: dict[bytes, list[tuple[int, dict]]] = {}
        for s in keep:
            req = self.reqs.get(s.op.req_id)
            if req is None:                 # forgotten meanwhile (cannot happen in a step)
                self._unsaved(s.op.req_id, s.op.start)
                continue
            for i, (slot, key) in enumerate(zip(s.slots, s.keys)):
                depth = s.op.start + i
                parent = s.keys[i - 1] if i else s.parent
                data = req.tokens[depth * bs:(depth + 1) * bs]
                by_root.setdefault(s.root, []).append((depth, {
                    "slot": slot, "key": key, "parent": parent, "depth": depth,
                    "tokens": data.astype("<i4").tobytes(), "hits": 0}))
        t0 = time.perf_counter()
        for root, entries in by_root.items():
            entries.sort(key=lambda e: e[0])
            reply, gen = link.call("publish", self.load_timeout_s, root=root,
                                   entries=[e for _, e in entries])
            if reply is None or gen != self._save_gen:
                for s in keep:
                    if s.root == root:
                        self._unsaved(s.op.req_id, s.op.start)
                continue
            self.counters["saved_blocks"] += len(entries)
            self.counters["taken_blocks"] += sum(reply["taken"])
            self._report.saved_blocks += len(entries)
        self.seconds["publish"] += time.perf_counter() - t0

    # async loads and reports ------------------------------------------------------------------

    def finished(self) -> set[str]:
        """Async loads that completed (failed ones too: their blocks are in `load_errors`)."""
        done = [ld for ld in self._async if ld.job is None or ld.job.done.is_set()]
        if done:
            self._async = [ld for ld in self._async if ld not in done]
            for ld in done:
                if ld.got:
                    self._finish_load(self.link, ld, [])
                self._account(ld)
                self._recved.add(ld.op.req_id)
        out, self._recved = self._recved, set()
        return out

    def load_errors(self) -> set[int]:
        out, self._errors = self._errors, set()
        return out

    def take_report(self) -> WorkerReport:
        out, self._report = self._report, WorkerReport()
        return out

    def stats(self) -> dict:
        link = self.link.stats() if self.link is not None else {"attached": False}
        return {"rank": self.rank, **self.counters, "requests": len(self.reqs), "link": link,
                "seconds": dict(self.seconds)}
