"""The copy executor: runs transfer plans on the tier pools, through handlers registered per
(source kind, destination kind) — the role of vLLM's `OffloadingWorker.register_handler`.

A plan is plain data (core/transfer.py); the executor groups it into runs of slots per tier
pair and calls the handler of the pair's pool kinds. Every handler is registered by a tier kind
(tiered_cache.tiers: the kind declares which pairs it brings); the memory tiers' handlers are
here, the others beside their pools. `NullExecutor` stands in for `storage: none`.

On a GPU the handlers enqueue on the current CUDA stream (the migrator sets its copy stream);
pinned host <-> device copies are asynchronous.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from tiered_cache.core.transfer import Transfer, group
from tiered_cache.errors import TransferError

# handler(src_pool, dst_pool, transfers sorted by source slot, layers, non_blocking)
Handler = Callable[[Any, Any, list[Transfer], "tuple[int, ...] | None", bool], None]


class Executor:
    """Executes plans on `pools` (index = tier index; `kinds[i]` names pool i's kind)."""

    def __init__(self, pools: Sequence[Any], kinds: Sequence[str]) -> None:
        self.pools = list(pools)
        self.kinds = list(kinds)
        self.handlers: dict[tuple[str, str], Handler] = {}

    def register(self, src_kind: str, dst_kind: str, handler: Handler) -> None:
        self.handlers[(src_kind, dst_kind)] = handler

    def run(self, plan: list[Transfer], layers: tuple[int, ...] | None = None) -> None:
        """Copy every transfer of the plan; `layers` overrides the transfers' own (the
        migrator promotes a few layers at a time). Any failure raises TransferError; what was
        copied before it is simply not used (the plan's commit decides)."""
        if not plan:
            return
        try:
            nb = bool(self.pools[0].kv.is_cuda)
            for (src, dst, own), transfers in group(plan).items():
                handler = self.handlers.get((self.kinds[src], self.kinds[dst]))
                if handler is None:
                    raise TransferError(f"no copy handler from a {self.kinds[src]!r} tier to "
                                        f"a {self.kinds[dst]!r} tier")
                handler(self.pools[src], self.pools[dst], transfers,
                        own if layers is None else layers, nb)
        except TransferError:
            raise
        except Exception as exc:
            raise TransferError(f"copy of {len(plan)} blocks failed: {exc}") from exc


class NullExecutor:
    """Metadata-only caches (`storage: none`): nothing to copy."""

    pools: list = []

    def register(self, src_kind: str, dst_kind: str, handler: Handler) -> None:
        pass

    def run(self, plan: list[Transfer], layers: tuple[int, ...] | None = None) -> None:
        pass


# ---------------------------------------------------------------- handlers
def _slots(transfers: list[Transfer]) -> tuple[list[int], list[int]]:
    return [t.src_slot for t in transfers], [t.dst_slot for t in transfers]


def gpu_to_host(src, dst, transfers, layers, nb) -> None:
    from tiered_cache import kernels

    src_slots, dst_slots = _slots(transfers)
    kernels.copy_blocks_to_host(src.kv, src_slots, dst.kv, dst_slots, non_blocking=nb)
    if src.scales is not None:
        # FP8 per-block scales travel with their blocks (gpu: [L, 2, S], host: [S, L, 2]).
        si = torch.as_tensor(src_slots, device=src.scales.device)
        di = torch.as_tensor(dst_slots, device=dst.scales.device)
        dst.scales[di] = src.scales[:, :, si].permute(2, 0, 1).to(dst.scales.device,
                                                                   non_blocking=True)


def host_to_gpu(src, dst, transfers, layers, nb) -> None:
    from tiered_cache import kernels

    src_slots, dst_slots = _slots(transfers)
    kernels.copy_blocks_to_gpu(src.kv, src_slots, dst.kv, dst_slots, layers=layers,
                               non_blocking=nb)
    if src.scales is not None:
        si = torch.as_tensor(src_slots, device=src.scales.device)
        di = torch.as_tensor(dst_slots, device=dst.scales.device)
        for layer in (range(src.scales.shape[1]) if layers is None else layers):
            dst.scales[layer][:, di] = src.scales[si, layer].t().to(dst.scales.device,
                                                                   non_blocking=True)


def within_pool(src, dst, transfers, layers, nb) -> None:
    """Slots to other slots of the same pool (compaction, shrink)."""
    src_slots, dst_slots = _slots(transfers)
    # NOTE: advanced indexing on a uint8 view: CPU torch has no index ops for fp8.
    pool = src.kv.view(torch.uint8)
    if src.layout == "layer_major":
        pool[:, :, dst_slots] = pool[:, :, src_slots]
    else:
        pool[dst_slots] = pool[src_slots]
    if src.scales is not None:
        a = src.scales
        si = torch.as_tensor(src_slots, device=a.device)
        di = torch.as_tensor(dst_slots, device=a.device)
        if src.layout == "layer_major":
            a[:, :, di] = a[:, :, si]
        else:
            a[di] = a[si]
