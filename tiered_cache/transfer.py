"""Transfer plans: the control plane's decisions about copies, as data.

The control plane never copies; it emits `Transfer`s. The data plane (here synchronously, in the
migrator asynchronously) executes them, so the same plan could drive every rank of a
tensor-parallel group.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

from tiered_cache.block import Block


@dataclass(frozen=True, slots=True)
class Transfer:
    block: Block
    src_tier: int
    src_slot: int
    dst_tier: int
    dst_slot: int
    layers: tuple[int, ...] | None = None      # None: every layer


def group(transfers: Iterable[Transfer]) -> dict[tuple[int, int, tuple[int, ...] | None],
                                                  tuple[list[int], list[int]]]:
    """Group by (src tier, dst tier, layers) into parallel slot lists, sorted by source slot so
    that adjacent slots coalesce into one large copy downstream."""
    out: dict = defaultdict(lambda: ([], []))
    for t in sorted(transfers, key=lambda t: (t.src_tier, t.dst_tier, t.src_slot)):
        src, dst = out[(t.src_tier, t.dst_tier, t.layers)]
        src.append(t.src_slot)
        dst.append(t.dst_slot)
    return dict(out)


def execute(transfers: list[Transfer], pools: list,
            layers: tuple[int, ...] | None = None) -> None:
    """Run a plan on the tier pools (index = tier index; 0 is the device pool), on the current
    CUDA stream when the pools are on a GPU. `layers` overrides every transfer's layers (the
    migrator promotes one layer at a time)."""
    if not transfers or pools[0] is None:
        return
    from tiered_cache import kernels

    # Pinned host <-> device copies are asynchronous on the caller's (copy) stream.
    nb = bool(pools[0].kv.is_cuda)
    import torch

    for (src, dst, own_layers), (src_slots, dst_slots) in group(transfers).items():
        layers = own_layers if layers is None else layers
        if src == 0 and dst == 1:
            kernels.copy_blocks_to_host(pools[0].kv, src_slots, pools[1].kv, dst_slots,
                                        non_blocking=nb)
        elif src == 1 and dst == 0:
            kernels.copy_blocks_to_gpu(pools[1].kv, src_slots, pools[0].kv, dst_slots,
                                       layers=layers, non_blocking=nb)
        elif src == dst:
            # NOTE: advanced indexing on a uint8 view: CPU torch has no index ops for fp8.
            pool = pools[src].kv.view(torch.uint8)
            if pools[src].layout == "layer_major":
                pool[:, :, dst_slots] = pool[:, :, src_slots]
            else:
                pool[dst_slots] = pool[src_slots]
        else:
            raise ValueError(f"no copy path from tier {src} to tier {dst}")
        if pools[src].scales is not None:
            _copy_scales(pools, src, dst, src_slots, dst_slots, layers)


def _copy_scales(pools, src: int, dst: int, src_slots, dst_slots, layers) -> None:
    """FP8 per-block scales travel with their blocks (gpu: [L, 2, S], host: [S, L, 2])."""
    import torch

    a, b = pools[src].scales, pools[dst].scales
    si = torch.as_tensor(src_slots, device=a.device)
    di = torch.as_tensor(dst_slots, device=b.device)
    if src == 0 and dst == 1:
        b[di] = a[:, :, si].permute(2, 0, 1).to(b.device, non_blocking=True)
    elif src == 1 and dst == 0:
        for layer in (range(a.shape[1]) if layers is None else layers):
            b[layer][:, di] = a[si, layer].t().to(b.device, non_blocking=True)
    elif pools[src].layout == "layer_major":
        a[:, :, di] = a[:, :, si]
    else:
        a[di] = a[si]
