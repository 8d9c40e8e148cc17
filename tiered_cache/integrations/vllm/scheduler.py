"""The connector's scheduler side: lookups under a deadline, the holds that keep what a lookup
found from being evicted until it is loaded, and each step's plan. No vLLM import: the
connector passes vLLM's `Request` objects through (`request_id`, `all_token_ids`,
`num_tokens`, `cache_salt`, `lora_request`), and tests pass plain objects.

A lookup asks the daemon for each rank's part of the request's blocks from the first one
(`fetch`: the daemon verifies each block's chained key and tokens and pins what it found under
a handle), so it learns both what it can load past vLLM's own prefix hit and what the daemon
lacks of the blocks vLLM had (those are saved again). A block is a hit only when every rank's
part is there: the hit is the shortest rank's. The whole lookup takes at most
`vllm.lookup_deadline_ms`; a daemon that is away, slow or dead costs at most that, and the
request is a miss.

The holds (one handle per rank) last until the workers report the load done (all ranks), or
the request ends: finished, aborted, preempted, looked up again, or its load failed. Every
exit releases them (`_drop`); a handle of a connection that has since been replaced is not
released (the daemon reaped it with the connection). Workers take their own handle for the
copy itself (worker.py), so a hold lost early costs at most a miss, never wrong KV.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from tiered_cache.integrations.vllm.identity import Geometry, adapter_of, rank_salt
from tiered_cache.integrations.vllm.link import DaemonLink
from tiered_cache.integrations.vllm.plans import (
    LoadOp,
    SaveOp,
    StepPlan,
    TokenUpdate,
    WorkerReport,
)
from tiered_cache.integrations.vllm.settings import ConnectorSettings

log = logging.getLogger(__name__)


class RequestLike(Protocol):
    request_id: str
    num_tokens: int
    cache_salt: str | None

    @property
    def all_token_ids(self) -> Any: ...


@dataclass
class Scheduled:
    """One request of a step: its computed tokens before the step, tokens scheduled in it."""

    req_id: str
    num_computed: int
    num_scheduled: int


@dataclass
class StepInput:
    scheduled: list[Scheduled] = field(default_factory=list)
    preempted: Iterable[str] = ()


@dataclass
class _State:
    request: Any
    salt: str | None
    adapter: str | None
    holds: list[tuple[int, int]] = field(default_factory=list)     # (handle, generation)
    num_computed: int = 0           # vLLM's own hit at the lookup
    hit: int = 0                    # tokens the lookup offered
    saved: int = 0                  # blocks (ours) the daemon has or is being sent
    sent: int = 0                   # tokens the workers hold
    loaded_ranks: int = 0
    loading: bool = False
    fresh: bool = True              # looked up in the current schedule pass


def reusable(request: Any) -> bool:
    """Whether the request's KV is a function of its token ids alone (and the namespace, salt
    and adapter). NOTE: multimodal placeholders and prompt embeddings are not: the same ids
    stand for other inputs, so such requests are neither looked up nor saved."""
    return not getattr(request, "mm_features", None) \
        and getattr(request, "prompt_embeds", None) is None


class SchedulerSide:
    def __init__(self, geometry: Geometry, settings: ConnectorSettings, link: DaemonLink, *,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.g = geometry
        self.settings = settings
        self.link = link
        self.clock = clock
        self.deadline_s = settings.lookup_deadline_ms / 1e3
        self.promote_wait_s = settings.promote_wait_ms / 1e3
        # NOTE: releases run on the scheduler's thread too; one that times out drops the
        # connection, and the daemon then reaps every hold of it at once, which is what a
        # release would have done.
        self.release_timeout_s = max(5 * self.deadline_s, 0.05)
        self._waiting: dict[str, float] = {}        # request -> first lookup that waited
        self.reqs: dict[str, _State] = {}
        self._loads: list[LoadOp] = []
        self._forget: list[str] = []
        self._tokens: list[TokenUpdate] = []
        self.lookup_seconds: list[float] = []
        self.counters = {"lookups": 0, "lookup_hits": 0, "query_tokens": 0,
                         "device_hit_tokens": 0, "hit_tokens": 0, "loaded_tokens": 0,
                         "failed_loads": 0, "failed_tokens": 0, "deadline_misses": 0,
                         "daemon_away": 0, "holds": 0, "released_holds": 0,
                         "lost_holds": 0, "saved_blocks": 0, "planned_saves": 0,
                         "unsaved_requests": 0, "not_reusable": 0, "promotion_waits": 0}

    # lookups ----------------------------------------------------------------------------------

    def lookup(self, request: RequestLike, num_computed: int) -> tuple[int | None, bool]:
        """`get_num_new_matched_tokens`: tokens past `num_computed` the daemon can load (None:
        ask again next step, blocks are being brought up from disk or the remote store)."""
        t0 = self.clock()
        c = self.counters
        c["lookups"] += 1
        rid = request.request_id
        old = self.reqs.pop(rid, None)
        if old is not None:
            self._drop(old)
            if old.sent:
                self._forget.append(rid)
        if not reusable(request):
            c["not_reusable"] += 1
            self._timed(t0)
            return 0, False
        lora = getattr(request, "lora_request", None)
        st = _State(request, request.cache_salt,
                    adapter_of(getattr(lora, "lora_name", None)) if lora is not None else None)
        self.reqs[rid] = st
        g = self.g
        bs, vbs = g.block_size, g.vllm_block_size
        st.num_computed = num_computed
        st.saved = num_computed // bs           # assumed there unless the lookup says not
        cap = (request.num_tokens - 1) // vbs * vbs
        c["query_tokens"] += max(0, request.num_tokens - num_computed)
        c["device_hit_tokens"] += num_computed
        if cap - num_computed < vbs:
            self._timed(t0)
            return 0, False
        tokens = np.asarray(request.all_token_ids[:cap], dtype=np.int32)
        found, pending = self._fetch_all(st, tokens, t0 + self.deadline_s)
        if pending:
            # The daemon holds blocks of this prompt in a slower tier (disk, remote) that it
            # could not bring up within the deadline; it goes on bringing them up. vLLM asks
            # again next step (None), for at most vllm.promote_wait_ms.
            first = self._waiting.setdefault(rid, t0)
            if t0 - first < self.promote_wait_s:
                c["promotion_waits"] += 1
                self._drop(st)
                self._timed(t0)
                return None, False
        self._waiting.pop(rid, None)
        if found is not None:
            st.saved = found
        hit = 0 if found is None else max(0, found * bs - num_computed) // vbs * vbs
        hit = min(hit, cap - num_computed)
        if hit <= 0:
            self._drop(st)
            self._timed(t0)
            return 0, False
        st.hit = hit
        c["lookup_hits"] += 1
        c["hit_tokens"] += hit
        self._timed(t0)
        return hit, self.settings.load == "async"

    def _fetch_all(self, st: _State, tokens: np.ndarray, deadline: float
                   ) -> tuple[int | None, bool]:
        """Pin every rank's leading blocks: (the shortest rank's count, None when unknown;
        whether some rank's blocks are still being brought up from a slower tier)."""
        found: int | None = None
        pending = False
        for rank in range(self.g.tp_size):
            left = deadline - self.clock()
            if left <= 0:
                self.counters["deadline_misses"] += 1
                return self._none(st), pending
            root, _ = self.link.root(rank_salt(st.salt, rank, self.g.tp_size), st.adapter,
                                     timeout_s=left)
            left = deadline - self.clock()
            if root is None or left <= 0:
                self.counters["daemon_away" if root is None else "deadline_misses"] += 1
                return self._none(st), pending
            reply, gen = self.link.call("fetch", left, root=root, parent=root, tokens=tokens,
                                        wait_ms=int(left * 800))
            if reply is None:
                self.counters["daemon_away"] += 1
                return self._none(st), pending
            n = len(reply["slots"])
            if reply["handle"]:
                st.holds.append((reply["handle"], gen))
                self.counters["holds"] += 1
            elif not pending:
                # NOTE: a fetch answers all or nothing when it has to wait for a slower tier
                # and runs out of time: nothing pinned, but the blocks may be there (`lookup`
                # counts them wherever they are, pinning nothing).
                left = deadline - self.clock()
                peek, _ = self.link.call("lookup", left, root=root, parent=root,
                                         tokens=tokens) if left > 0 else (None, 0)
                pending = bool(peek and peek["blocks"] > 0)
            found = n if found is None else min(found, n)
        return found, pending

    def _none(self, st: _State) -> None:
        self._drop(st)
        return None

    def _timed(self, t0: float) -> None:
        if len(self.lookup_seconds) < 100_000:
            self.lookup_seconds.append(self.clock() - t0)

    # allocation and plans ---------------------------------------------------------------------

    def after_alloc(self, request: RequestLike, block_ids: list[int], num_external: int) -> None:
        """`update_state_after_alloc`: a load of `num_external` tokens into `block_ids`."""
        st = self.reqs.get(request.request_id)
        if st is None:
            return
        if num_external <= 0:
            if not st.loading:
                self._drop(st)
            return
        g = self.g
        start = st.num_computed // g.block_size
        count = num_external // g.block_size
        k = g.sub_blocks
        first_v = start // k
        self._send(st, (start + count) * g.block_size)
        self._loads.append(LoadOp(request.request_id, st.salt, st.adapter, start, count,
                                  first_v, list(block_ids[first_v:(start + count) // k]),
                                  is_async=self.settings.load == "async"))
        st.loading = True
        st.loaded_ranks = 0
        st.saved = max(st.saved, start + count)

    def _send(self, st: _State, upto: int) -> None:
        """Make the workers hold the request's first `upto` tokens."""
        if upto > st.sent:
            toks = np.asarray(st.request.all_token_ids[st.sent:upto], dtype=np.int32)
            self._tokens.append(TokenUpdate(st.request.request_id, st.sent, toks))
            st.sent = upto

    def build_plan(self, step: StepInput, block_ids_of: Callable[[str], list[int]]
                   ) -> StepPlan:
        """`build_connector_meta`: this step's plan (and the state it implies)."""
        for rid in step.preempted:
            st = self.reqs.get(rid)
            if st is not None and not st.fresh:
                self._drop(st)
                del self.reqs[rid]
                if st.sent:
                    self._forget.append(rid)
        plan = StepPlan(forget=self._forget, loads=self._loads)
        self._forget, self._loads = [], []
        if self.settings.save:
            self._plan_saves(step, block_ids_of, plan)
        plan.tokens, self._tokens = self._tokens, []
        for st in self.reqs.values():
            st.fresh = False
        return plan

    def _plan_saves(self, step: StepInput, block_ids_of, plan: StepPlan) -> None:
        budget = self.link.staging_slots if self.link.attached else 0
        if budget <= 0:
            return
        g = self.g
        bs, k = g.block_size, g.sub_blocks
        for s in step.scheduled:
            st = self.reqs.get(s.req_id)
            if st is None:
                continue
            known = len(st.request.all_token_ids)
            upto = min(s.num_computed + s.num_scheduled, known) // bs
            n = min(upto - st.saved, budget)
            if n <= 0:
                continue
            start = st.saved
            first_v, end_v = start // k, (start + n - 1) // k + 1
            ids = block_ids_of(s.req_id)
            if len(ids) < end_v:
                continue
            self._send(st, (start + n) * bs)
            plan.saves.append(SaveOp(s.req_id, st.salt, st.adapter, start, n, first_v,
                                     list(ids[first_v:end_v])))
            st.saved += n
            budget -= n
            self.counters["planned_saves"] += n

    # feedback and exits -----------------------------------------------------------------------

    def on_report(self, report: WorkerReport) -> None:
        """What the workers did last step: loads done (release the holds once every rank is),
        loads failed (vLLM recomputes from there: so will the saves)."""
        c = self.counters
        for rid, n in report.loaded.items():
            st = self.reqs.get(rid)
            if st is None:
                continue
            st.loaded_ranks += n
            if st.loaded_ranks >= self.g.tp_size:
                st.loading = False
                if rid not in report.failed:
                    c["loaded_tokens"] += st.hit
                self._drop(st)
        for rid, block in report.failed.items():
            c["failed_loads"] += 1
            st = self.reqs.get(rid)
            if st is None:
                continue
            c["failed_tokens"] += max(0, st.num_computed + st.hit - block * self.g.block_size)
            st.saved = min(st.saved, block)
            self._drop(st)
        c["saved_blocks"] += report.saved_blocks
        c["unsaved_requests"] += len(report.unsaved)

    def finished(self, request: RequestLike) -> None:
        """`request_finished` (finished or aborted, waiting or running)."""
        self._waiting.pop(request.request_id, None)
        st = self.reqs.pop(request.request_id, None)
        if st is not None:
            self._drop(st)
            if st.sent:
                self._forget.append(request.request_id)

    def _drop(self, st: _State) -> None:
        holds, st.holds = st.holds, []
        for handle, gen in holds:
            if gen != self.link.generation:
                self.counters["lost_holds"] += 1
                continue
            self.link.call("release", self.release_timeout_s, handle=handle)
            self.counters["released_holds"] += 1

    def held(self) -> int:
        """Handles held now (every request, every rank)."""
        return sum(len(st.holds) for st in self.reqs.values())

    def close(self) -> None:
        for st in list(self.reqs.values()):
            self._drop(st)
        self.reqs.clear()

    def stats(self) -> dict[str, Any]:
        xs = np.asarray(self.lookup_seconds) if self.lookup_seconds else np.zeros(1)
        return {**self.counters, "open_requests": len(self.reqs), "holds_now": self.held(),
                "lookup_p50_ms": float(np.percentile(xs, 50) * 1e3),
                "lookup_p99_ms": float(np.percentile(xs, 99) * 1e3),
                "link": self.link.stats()}
