"""A stand-in for vLLM's engine loop around the connector's scheduler and worker sides (no vLLM).

`MiniEngine` keeps vLLM's KV the way vLLM's CPU backend does (per layer `[B, H, N, 2D]`, each
block and head holding K's N rows then V's), allocates blocks, and runs a request the way the
v1 scheduler does: `lookup` (get_num_new_matched_tokens) -> `after_alloc` -> `build_plan`
(build_connector_meta) -> on the worker `bind` -> `start_load` -> per layer `wait_layer`,
"attention", `save_layer` -> `end_step` -> `finished` / `load_errors` / `take_report` ->
`on_report` (update_connector_output). "Attention" writes each computed token's KV as a fixed
function of the token ids so far, its position, layer and head (`expected_kv`), so a test
knows what every loaded byte must be.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from tiered_cache.integrations.vllm.identity import Geometry
from tiered_cache.integrations.vllm.link import DaemonLink, LocalTransport, SocketTransport
from tiered_cache.integrations.vllm.plans import StepPlan
from tiered_cache.integrations.vllm.scheduler import Scheduled, SchedulerSide, StepInput
from tiered_cache.integrations.vllm.settings import ConnectorSettings
from tiered_cache.integrations.vllm.worker import WorkerSide

LAYERS, HEADS, DIM = 2, 2, 8


@dataclass
class FakeRequest:
    request_id: str
    all_token_ids: list[int]
    cache_salt: str | None = None
    lora_request: object | None = None
    mm_features: list | None = None
    prompt_embeds: object | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


@dataclass
class FakeLora:
    lora_name: str


def geometry(block_size: int = 16, vllm_block_size: int = 32, tp: int = 1,
             heads: int = HEADS) -> Geometry:
    return Geometry("tiny-vllm", "float32", LAYERS, heads, DIM, block_size, vllm_block_size, tp)


def node_config(tmp, g: Geometry, host_blocks: int = 64, **extra) -> dict:
    """A daemon config for geometry `g` (a socket under `tmp`)."""
    return {"model": g.model_section(), "block_size": g.block_size,
            "tiers": {"host": {"num_blocks": host_blocks}},
            "daemon": {"socket": str(tmp / "s" / "d.sock"), "staging_blocks": 64,
                       "lease_s": 5.0}, **extra}


def expected_kv(tokens: list[int], pos: int, layer: int, rank: int = 0,
                heads: int = HEADS) -> torch.Tensor:
    """[2, H, D] K and V of the token at `pos`: a function of every token id up to it."""
    h = float(hash(tuple(tokens[:pos + 1])) % 9973)
    head = torch.arange(heads, dtype=torch.float64).view(heads, 1) + rank * heads
    d = torch.arange(DIM, dtype=torch.float64).view(1, DIM)
    k = torch.sin(h * 1e-3 + pos * 1e-2 + layer * 0.3 + head * 0.1 + d * 0.01)
    v = torch.cos(h * 7e-4 - pos * 3e-3 + layer * 0.2 - head * 0.2 + d * 0.03)
    return torch.stack([k, v]).float()


class VllmKV:
    """vLLM's CPU-backend KV for a few blocks: per layer [B, H, N, 2D]."""

    def __init__(self, num_blocks: int, block_size: int, heads: int = HEADS) -> None:
        self.num_blocks, self.block_size, self.heads = num_blocks, block_size, heads
        self.layers = {f"model.layers.{i}.self_attn.attn":
                       torch.zeros(num_blocks, heads, block_size, 2 * DIM)
                       for i in range(LAYERS)}
        self.free = list(range(1, num_blocks))      # block 0 stays unused, as vLLM's null block

    def names(self) -> list[str]:
        return list(self.layers)

    def planes(self, layer: int) -> torch.Tensor:
        """[B, H, 2, N, D]: the CPU backend's reading of the layer."""
        t = self.layers[f"model.layers.{layer}.self_attn.attn"]
        return t.view(self.num_blocks, self.heads, 2, self.block_size, DIM)

    def write(self, block_ids: list[int], tokens: list[int], start: int, end: int,
              layer: int, rank: int = 0) -> None:
        """'Attention' of tokens [start, end) of layer `layer`."""
        p = self.planes(layer)
        n = self.block_size
        for pos in range(start, end):
            kv = expected_kv(tokens, pos, layer, rank, self.heads)     # [2, H, D]
            p[block_ids[pos // n], :, :, pos % n, :] = kv.permute(1, 0, 2)

    def check(self, block_ids: list[int], tokens: list[int], start: int, end: int,
              rank: int = 0) -> bool:
        n = self.block_size
        for layer in range(LAYERS):
            p = self.planes(layer)
            for pos in range(start, end):
                got = p[block_ids[pos // n], :, :, pos % n, :].permute(1, 0, 2)
                if not torch.equal(got, expected_kv(tokens, pos, layer, rank, self.heads)):
                    return False
        return True

    def allocate(self, n: int) -> list[int]:
        ids, self.free = self.free[:n], self.free[n:]
        return ids

    def release(self, ids: list[int]) -> None:
        self.free.extend(ids)


@dataclass
class Served:
    matched: int
    loaded_ok: bool
    errors: set[int]
    blocks: list[int] = field(default_factory=list)


def local_link(service, g: Geometry, attach: bool) -> DaemonLink:
    return DaemonLink(lambda: LocalTransport(service), g, attach=attach, timeout_s=5.0,
                      name="test").start()


def socket_link(path: str, g: Geometry, attach: bool, timeout_s: float = 5.0,
                wait_s: float = 5.0) -> DaemonLink:
    """A link over the daemon's socket, started; `wait_s`: how long to wait for it to attach
    (0 where the test expects it not to: its first attempt runs in `start` anyway)."""
    return DaemonLink(lambda: SocketTransport(path, timeout_s), g, attach=attach,
                      timeout_s=timeout_s, name="test").start(wait_s=wait_s)


class MiniEngine:
    """The connector's two sides around one VllmKV, one request per step."""

    def __init__(self, g: Geometry, sched_link: DaemonLink, worker_link: DaemonLink, *,
                 settings: ConnectorSettings | None = None, num_blocks: int = 64) -> None:
        self.g = g
        self.settings = settings or ConnectorSettings()
        self.sched = SchedulerSide(g, self.settings, sched_link)
        self.worker = WorkerSide(g, rank=0, resolve_link=lambda: worker_link,
                                 attach_timeout_s=5.0, load_timeout_s=5.0)
        self.kv = VllmKV(num_blocks, g.vllm_block_size, g.num_kv_heads)
        self.worker.register(self.kv.layers, "CPU_ATTN", num_blocks=num_blocks,
                             dtype=torch.float32)
        self.blocks: dict[str, list[int]] = {}

    def step(self, scheduled: list[Scheduled], preempted=(), *, compute=None,
             hook=None) -> StepPlan:
        """One engine step: plan, worker (loads, 'attention' via `compute(layer)`, saves),
        reports back to the scheduler side. `hook(worker)` runs after start_load."""
        plan = self.sched.build_plan(StepInput(scheduled, preempted),
                                     lambda rid: self.blocks.get(rid, []))
        w = self.worker
        w.bind(plan)
        w.start_load()
        if hook is not None:
            hook(w)
        for layer, name in enumerate(w.layers):
            w.wait_layer(name)
            if compute is not None:
                compute(layer)
            w.save_layer(name)
        w.end_step()
        w.finished()
        self.last_errors = w.load_errors()
        self.sched.on_report(w.take_report())
        return plan

    def serve(self, req: FakeRequest, *, local_hit: int = 0, finish: bool = True,
              hook=None) -> Served:
        """Prefill the whole prompt in one step (vLLM's own cache holds `local_hit` tokens)."""
        bs = self.g.vllm_block_size
        matched, _ = self.sched.lookup(req, local_hit)
        n_blocks = -(-req.num_tokens // bs)
        ids = self.kv.allocate(n_blocks)
        self.blocks[req.request_id] = ids
        computed = local_hit + matched
        if local_hit:
            for layer in range(LAYERS):
                self.kv.write(ids, req.all_token_ids, 0, local_hit, layer)
        self.sched.after_alloc(req, ids, matched)

        def compute(layer: int) -> None:
            self.kv.write(ids, req.all_token_ids, computed, req.num_tokens, layer)

        self.step([Scheduled(req.request_id, computed, req.num_tokens - computed)],
                  compute=compute, hook=hook)
        errors = self.last_errors
        ok = self.kv.check(ids, req.all_token_ids, local_hit, computed) if matched else True
        if finish:
            self.finish(req)
        return Served(matched, ok, errors, ids)

    def finish(self, req: FakeRequest) -> None:
        self.sched.finished(req)
        self.kv.release(self.blocks.pop(req.request_id, []))

    def close(self) -> None:
        self.sched.close()
        self.worker.close()


def tokens(n: int, seed: int = 0) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(1, 30000, n)]
