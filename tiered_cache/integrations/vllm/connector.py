"""`TieredCacheConnector`: vLLM's KV connector API (v1) over the scheduler and worker sides.

    LLM(model=..., kv_transfer_config=KVTransferConfig(
        kv_connector="TieredCacheConnector",
        kv_connector_module_path="tiered_cache.integrations.vllm",
        kv_role="kv_both",
        kv_connector_extra_config={"tiered_cache": "/etc/tiered-cache/vllm.yaml"}))

The only module that imports vLLM: it reads the geometry and layout from vLLM's config and
tensors, and translates vLLM's objects (SchedulerOutput, KVCacheBlocks, ModelRunnerOutput)
to and from the plain ones of scheduler.py, worker.py and plans.py.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from tiered_cache.errors import ConfigError
from tiered_cache.integrations.vllm import embedded, settings
from tiered_cache.integrations.vllm.identity import (
    Geometry,
    default_block_size,
    model_name,
)
from tiered_cache.integrations.vllm.link import DaemonLink, LocalTransport, SocketTransport
from tiered_cache.integrations.vllm.plans import StepPlan, WorkerReport
from tiered_cache.integrations.vllm.scheduler import Scheduled, SchedulerSide, StepInput
from tiered_cache.integrations.vllm.worker import WorkerSide, union_over

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("tiered_cache.integrations.vllm")

_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def _timed(fn):
    """Add the call's wall time to the connector's `seconds[name]` (what the connector costs
    the scheduler's and the forward's threads, waits included; benchmarks read it)."""
    name = fn.__name__

    def wrapper(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(self, *args, **kwargs)
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0
    wrapper.__name__ = name
    wrapper.__doc__ = fn.__doc__
    return wrapper


@dataclass
class TieredConnectorMetadata(KVConnectorMetadata):
    plan: StepPlan = field(default_factory=StepPlan)


@dataclass
class TieredWorkerMetadata(KVConnectorWorkerMetadata):
    report: WorkerReport = field(default_factory=WorkerReport)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, TieredWorkerMetadata)
        return TieredWorkerMetadata(self.report.merge(other.report))


@dataclass
class TieredConnectorStats(KVConnectorStats):
    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        out = dict(self.data)
        for k, v in other.data.items():
            if isinstance(v, (int, float)) and isinstance(out.get(k, 0), (int, float)):
                out[k] = out.get(k, 0) + v
            else:
                out[k] = v
        return TieredConnectorStats(data=out)

    def reduce(self) -> dict[str, int | float]:
        return {k: v for k, v in self.data.items() if isinstance(v, (int, float))}

    def is_empty(self) -> bool:
        return not self.data


def geometry_of(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> Geometry:
    """What vLLM says about the KV: one group of full attention, per-rank heads, dtype."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    where = "kv_transfer_config"
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ConfigError(where, f"the connector needs one KV cache group (full attention), "
                                 f"this model has {len(groups)}")
    spec = groups[0].kv_cache_spec
    if not isinstance(spec, FullAttentionSpec) or isinstance(spec, MLAAttentionSpec) \
            or spec.sliding_window is not None or spec.attention_chunk_size is not None:
        raise ConfigError(where, f"the connector stores full attention KV; got "
                                 f"{type(spec).__name__}")
    if spec.head_size_v != spec.head_size or spec.num_head_slots is not None \
            or spec.state_content_bytes is not None or spec.page_size_padded is not None:
        raise ConfigError(where, "packed, padded or asymmetric K/V pages are not supported")
    if vllm_config.cache_config.cache_dtype not in ("auto", None) and \
            spec.dtype not in _DTYPES:
        raise ConfigError(where, f"KV cache dtype {vllm_config.cache_config.cache_dtype!r} "
                                 "is not supported (FP8 KV has per-block scales)")
    dtype = _DTYPES.get(spec.dtype)
    if dtype is None:
        raise ConfigError(where, f"KV dtype {spec.dtype} is not supported")
    par = vllm_config.parallel_config
    if par.pipeline_parallel_size != 1 or par.decode_context_parallel_size != 1:
        raise ConfigError(where, "pipeline and decode-context parallelism are not supported "
                                 "by the connector yet (tensor parallelism is)")
    mc = vllm_config.model_config
    served = mc.served_model_name
    name = served[0] if isinstance(served, (list, tuple)) and served else (served or mc.model)
    bs = spec.block_size
    return Geometry(model_name(str(name)), dtype, len(groups[0].layer_names), spec.num_kv_heads,
                    spec.head_size, default_block_size(bs), bs, par.tensor_parallel_size)


class TieredCacheConnector(KVConnectorBase_V1):
    """tiered-cache's tiers (host, disk, remote, the node daemon) beneath vLLM's GPU blocks."""

    _cache_hit_source = CacheHitSource.HOST

    @property
    def requires_kv_delivery(self) -> bool:
        return False        # a best-effort cache: a dropped save is a later miss

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        # wait_for_layer_load / save_kv_layer run between layers: a full CUDA graph would
        # replay past them (vLLM then uses piecewise graphs, Python between the pieces).
        return True

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = self._kv_transfer_config
        self.resolved = settings.resolve(ktc.kv_connector_extra_config,
                                         geometry_of(vllm_config, kv_cache_config))
        self.geometry = g = self.resolved.geometry
        self.engine_id = str(ktc.engine_id)
        s = self.resolved.settings
        self.node: embedded.EmbeddedNode | None = None
        self.scheduler: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        self._sources = CacheHitSource.HOST
        self._daemon_stats: dict[str, Any] = {}
        self._daemon_stats_at = 0.0
        self.seconds: dict[str, float] = {}
        if role == KVConnectorRole.SCHEDULER:
            if getattr(ktc, "kv_load_failure_policy", "recompute") != "recompute":
                # NOTE: a cache's failed load is a miss: vLLM recomputes the blocks (its default,
                # "fail", would fail the user's request over a cache problem). The scheduler
                # reads the policy right after building its connector.
                log.info("tiered-cache connector: kv_load_failure_policy set to 'recompute' "
                         "(a failed load from the cache is recomputed, never an error)")
                ktc.kv_load_failure_policy = "recompute"
            if self.resolved.embedded:
                self.node = self._start_node(vllm_config)
                service = self.node.service
                connect = lambda: LocalTransport(service, "embedded service")  # noqa: E731
                if self.resolved.cache.tiers.disk or self.resolved.cache.tiers.remote:
                    self._sources = CacheHitSource.EXTERNAL_UNSPECIFIED
            else:
                path, timeout = self.resolved.socket, s.lookup_deadline_ms / 1e3
                connect = lambda: SocketTransport(path, max(timeout, 1.0))  # noqa: E731
                self._sources = CacheHitSource.EXTERNAL_UNSPECIFIED
            link = DaemonLink(connect, g, attach=False, timeout_s=max(1.0, s.load_timeout_s),
                              name="vllm-scheduler").start(wait_s=2.0)
            self.scheduler = SchedulerSide(g, s, link)
            log.info("tiered-cache connector (scheduler): %s, block size %d (vLLM %d), "
                     "tp %d, load %s", "embedded service" if self.node else self.resolved.socket,
                     g.block_size, g.vllm_block_size, g.tp_size, s.load)
        else:
            self.worker = WorkerSide(g, rank=0, resolve_link=self._worker_link,
                                     attach_timeout_s=s.attach_timeout_s,
                                     load_timeout_s=s.load_timeout_s,
                                     agree=self._agree if g.tp_size > 1 else None)
            self._union = None

    # the node ---------------------------------------------------------------------------------

    def _start_node(self, vllm_config: VllmConfig) -> embedded.EmbeddedNode:
        r = self.resolved
        g = self.geometry
        sched = vllm_config.scheduler_config
        per_step = sched.max_num_batched_tokens // g.block_size + sched.max_num_seqs
        staging = None if r.staging_given else min(4096, max(64, 2 * per_step))
        sock = embedded.socket_path(self.engine_id, r.settings.socket_dir)
        node = embedded.EmbeddedNode(self.engine_id,
                                     embedded.service_config(r.cache, sock, staging))
        if r.cache.metrics.http_port is not None:
            from tiered_cache.daemon.observe import serve_http

            self._http = serve_http(node.service, r.cache.metrics.http_addr,
                                    r.cache.metrics.http_port)
        return node

    def _worker_link(self) -> DaemonLink:
        r, s, g = self.resolved, self.resolved.settings, self.geometry
        if r.embedded:
            node = embedded.find(self.engine_id)
            if node is not None:
                service = node.service
                connect = lambda: LocalTransport(service, "embedded service")  # noqa: E731
            else:
                path = embedded.socket_path(self.engine_id, s.socket_dir)
                connect = lambda: SocketTransport(path, s.load_timeout_s)  # noqa: E731
        else:
            path = r.socket
            connect = lambda: SocketTransport(path, s.load_timeout_s)  # noqa: E731
        return DaemonLink(connect, g, attach=True, timeout_s=s.load_timeout_s,
                          name=f"vllm-worker-{self.worker.rank}").start()

    def _agree(self, failed: set[str]) -> set[str]:
        """The union over the tensor-parallel group of the requests whose load failed."""
        if self._union is None:
            from vllm.distributed.parallel_state import get_tp_group

            self._union = union_over(get_tp_group().cpu_group)
        return self._union(failed)

    # worker side ------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        assert self.worker is not None
        if self.geometry.tp_size > 1:
            self.worker.rank = get_tensor_model_parallel_rank()
        ctx = self._vllm_config.compilation_config.static_forward_context
        backends = {type(getattr(ctx.get(n), "attn_backend", None)).__name__ for n in kv_caches}
        names = set()
        for n in kv_caches:
            backend = getattr(ctx.get(n), "attn_backend", None)
            names.add(backend.get_name() if backend is not None else f"unknown ({backends})")
        if len(names) != 1:
            raise ConfigError("kv_transfer_config", f"layers use attention backends {names}")
        spec = self._kv_cache_config.kv_cache_groups[0].kv_cache_spec
        self.worker.register(kv_caches, names.pop(), num_blocks=self._kv_cache_config.num_blocks,
                             dtype=spec.dtype)

    @_timed
    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self.worker is not None and isinstance(connector_metadata, TieredConnectorMetadata):
            self.worker.bind(connector_metadata.plan)

    @_timed
    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self.worker.start_load()

    @_timed
    def wait_for_layer_load(self, layer_name: str) -> None:
        self.worker.wait_layer(layer_name)

    @_timed
    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        self.worker.save_layer(layer_name)

    @_timed
    def wait_for_save(self) -> None:
        self.worker.end_step()

    @_timed
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None,
                                                                 set[str] | None]:
        done = self.worker.finished() if self.worker is not None else set()
        return None, (done or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.load_errors() if self.worker is not None else set()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if self.worker is None:
            return None
        report = self.worker.take_report()
        return None if report.empty() else TieredWorkerMetadata(report)

    # scheduler side ---------------------------------------------------------------------------

    @_timed
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        return self.scheduler.lookup(request, num_computed_tokens)

    @_timed
    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        ids = blocks.get_block_ids()[0] if num_external_tokens > 0 else []
        self.scheduler.after_alloc(request, ids, num_external_tokens)

    @_timed
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        so = scheduler_output
        scheduled = [Scheduled(r.req_id, r.num_computed_tokens,
                               so.num_scheduled_tokens.get(r.req_id, 0))
                     for r in so.scheduled_new_reqs]
        cached = so.scheduled_cached_reqs
        scheduled += [Scheduled(rid, cached.num_computed_tokens[i],
                                so.num_scheduled_tokens.get(rid, 0))
                      for i, rid in enumerate(cached.req_ids)]
        manager = self._kv_cache_manager
        plan = self.scheduler.build_plan(
            StepInput(scheduled, so.preempted_req_ids or ()),
            lambda rid: manager.get_block_ids(rid)[0] if manager is not None else [])
        return TieredConnectorMetadata(plan)

    @_timed
    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, TieredWorkerMetadata):
            self.scheduler.on_report(meta.report)

    @_timed
    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        self.scheduler.finished(request)
        return False, None

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int
                                       ) -> dict[CacheHitSource, int]:
        return {self._sources: num_external_tokens} if num_external_tokens else {}

    @_timed
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        # NOTE: vLLM asks every step; the counters are cheap but the daemon's partition stats
        # are not (a JSON of every tier, under its lock), so the snapshot is at most 1 Hz.
        if self.scheduler is None:
            return None
        now = time.monotonic()
        if now - self._daemon_stats_at < 1.0:
            return None
        self._daemon_stats_at = now
        reply, _ = self.scheduler.link.call("stats", self.scheduler.release_timeout_s)
        if reply is not None:
            part = json.loads(reply["json"]).get("partition", {})
            self._daemon_stats = {f"daemon_hit_tokens_{t}": n for t, n in
                                  part.get("hit_tokens_by_tier", {}).items()}
        data = {k: v for k, v in self.scheduler.stats().items() if k != "link"}
        return TieredConnectorStats(data={**data, **self._daemon_stats})

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None
                                 ) -> KVConnectorStats | None:
        return TieredConnectorStats(data=dict(data or {}))

    def reset_cache(self) -> bool | None:
        log.info("reset_connector: the connector's tiers are kept (they may be shared with "
                 "other engines); nothing reset")
        return False

    def stats(self) -> dict[str, Any]:
        """Everything this side counts (tests and benchmarks read it)."""
        out: dict[str, Any] = {"pid": os.getpid(), "seconds": dict(self.seconds)}
        if self.scheduler is not None:
            out["scheduler"] = self.scheduler.stats()
        if self.worker is not None:
            out["worker"] = self.worker.stats()
        if self.node is not None:
            out["service"] = self.node.stats()
        return out

    def shutdown(self) -> None:
        if self.scheduler is not None:
            self.scheduler.close()
            self.scheduler.link.close()
        if self.worker is not None:
            self.worker.close()
        if self.node is not None:
            http = getattr(self, "_http", None)
            if http is not None:
                http[0].shutdown()
                http[0].server_close()
            self.node.stop()
