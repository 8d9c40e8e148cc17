"""Public kernel functions: validate, pick a backend, call the Triton kernel or its torch twin.

Shapes (see ``reference.py`` for the conventions):

- q (decode) ``[B, Hq, D]``; q (prefill) ``[n, Hq, D]``; ``Hq = G * Hkv``.
- k_pools / v_pools: ``(gpu_layer_view, host_layer_view_or_None)``, each
  ``[num_slots, block_size, Hkv, D]``, any strides (host views are ``host_kv[:, l, 0]``).
- k_scales / v_scales (FP8 pools only): ``(gpu_scales [S], host_scales [S_h] or None)`` float32.
- block_tables / block_tiers ``[B, max_blocks]`` (tier 0 = GPU pool, nonzero = host pool),
  seq_lens ``[B]``; entries past ``cdiv(seq_len, block_size)`` are ignored.

Value checks that would need a device sync (slot ranges, lengths against the table width) run
only when the index tensors are on the CPU.
"""

from __future__ import annotations

import logging
import math
import operator
from collections.abc import Iterable

import numpy as np
import torch

from tiered_cache.errors import DTypeError, ShapeError

from . import _checks as c
from . import reference
from .dispatch import Backend, device_view, resolve_backend

KVPair = tuple[torch.Tensor, "torch.Tensor | None"]
ScalePair = "tuple[torch.Tensor, torch.Tensor | None] | None"


def _kernels_interpreted() -> bool:
    """Whether the Triton kernels were built by the interpreter (TRITON_INTERPRET=1 at import)."""
    from .decode import _decode_kernel

    return type(_decode_kernel).__name__ == "InterpretedFunction"


def _triton_ready(backend: str, device: torch.device) -> bool:
    """Resolve ``backend``; for CPU tensors also require interpreted kernels."""
    if resolve_backend(backend, device) == "torch":
        return False
    if device.type != "cuda" and not _kernels_interpreted():
        raise RuntimeError(
            "backend='triton' with CPU tensors: triton was imported before TRITON_INTERPRET=1 "
            "was set, so its kernels are compiled, not interpreted"
        )
    return True


def _visible(
    backend: str, device: torch.device, named: list[tuple[str, torch.Tensor | None]]
) -> list[torch.Tensor | None] | None:
    """Device views of host-side tensors for a Triton launch, or None (-> torch path) when one
    is not device-visible. A forced ``backend="triton"`` raises instead of falling back."""
    views = []
    for name, t in named:
        v = device_view(t, device)
        if t is not None and v is None:
            if backend == "triton":
                raise RuntimeError(
                    f"{name}: on {t.device}, not visible from {device}; the Triton path needs "
                    "the host pool in pinned memory (UVA). Use backend='auto' or 'torch'."
                )
            return None
        views.append(v)
    return views


def _check_tables(
    names: tuple[str, str, str],
    tables: torch.Tensor,
    tiers: torch.Tensor,
    lens: torch.Tensor,
    block_size: int,
    num_slots: tuple[int, int | None],
) -> None:
    """CPU-only value checks: lengths fit the table, used slots are in range for their tier."""
    if tables.device.type != "cpu" or tiers.device.type != "cpu" or lens.device.type != "cpu":
        return
    if lens.numel() == 0:
        return
    width = tables.shape[1]
    if int(lens.min()) < 0 or int(lens.max()) > width * block_size:
        raise ShapeError(
            f"{names[2]}: lengths must be in [0, {width * block_size}] (max_blocks={width} x "
            f"block_size={block_size}), got [{int(lens.min())}, {int(lens.max())}]"
        )
    used = torch.arange(width)[None, :] < ((lens.to(torch.int64) + block_size - 1) // block_size)[
        :, None
    ]
    on_host = used & (tiers != 0)
    checks = (("GPU", used & ~on_host, num_slots[0]), ("host", on_host, num_slots[1]))
    for tier_name, mask, n in checks:
        if not bool(mask.any()):
            continue
        if n is None:
            raise ShapeError(f"{names[1]}: names host-pool blocks but no host view was given")
        ids = tables[mask].to(torch.int64)
        if int(ids.min()) < 0 or int(ids.max()) >= n:
            raise ShapeError(
                f"{names[0]}: {tier_name} slot ids must be in [0, {n}), got "
                f"[{int(ids.min())}, {int(ids.max())}]"
            )


def _attention_inputs(
    q: object, q_doc: str, k_pools: object, v_pools: object, k_scales: object, v_scales: object
) -> tuple[torch.Tensor, KVPair, KVPair, ScalePair, ScalePair, c.PoolGeometry]:
    q = c.tensor("q", q)
    c.ndim("q", q, 3, q_doc)
    c.dtype_in("q", q, c.Q_DTYPES)
    kg, kh = c.pools("k_pools", k_pools)
    vg, vh = c.pools("v_pools", v_pools)
    geom = c.pool_geometry(
        [("k_pools[0]", kg), ("k_pools[1]", kh), ("v_pools[0]", vg), ("v_pools[1]", vh)]
    )
    if (kh is None) != (vh is None):
        raise ShapeError("k_pools/v_pools: give a host view for both K and V, or for neither")
    if vg.shape[0] != kg.shape[0] or (kh is not None and vh.shape[0] != kh.shape[0]):
        raise ShapeError("v_pools: expected as many slots as the matching k_pools view")
    if q.shape[2] != geom.head_dim:
        raise ShapeError(f"q: head_dim {q.shape[2]} != the pools' head_dim {geom.head_dim}")
    if q.shape[1] % geom.num_kv_heads != 0:
        raise ShapeError(
            f"q: num_q_heads={q.shape[1]} must be a multiple of num_kv_heads={geom.num_kv_heads}"
        )
    ks = c.scales("k_scales", k_scales, geom.dtype, kg, kh)
    vs = c.scales("v_scales", v_scales, geom.dtype, vg, vh)
    c.same_device(q.device, [("k_pools[0]", kg), ("v_pools[0]", vg)])
    if ks is not None:
        c.same_device(q.device, [("k_scales[0]", ks[0]), ("v_scales[0]", vs[0])])
    return q, (kg, kh), (vg, vh), ks, vs, geom


def _scale(scale: float | None, head_dim: int) -> float:
    if scale is None:
        return head_dim**-0.5
    if not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise DTypeError(f"scale: expected a finite float, got {scale!r}")
    return float(scale)


def _check_out(out: object, q: torch.Tensor) -> None:
    if out is None:
        return
    c.tensor("out", out)
    if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
        raise ShapeError(
            f"out: expected shape {tuple(q.shape)}, dtype {q.dtype} on {q.device} like q, got "
            f"{tuple(out.shape)}, {out.dtype} on {out.device}"
        )


def _check_rest(names: tuple[str, str, str], bt: torch.Tensor, tiers: torch.Tensor,
                lens: torch.Tensor, geom, q: torch.Tensor, kp: KVPair, vp: KVPair, ks, vs,
                scale: float | None, out: torch.Tensor | None, backend: str):
    """What decode and prefill check alike once their tables have a batch dimension: table
    entries against the pools, the scale, `out`. Returns the scale and the Triton inputs (None:
    the torch twin runs)."""
    _check_tables(names, bt, tiers, lens, geom.block_size,
                  (kp[0].shape[0], None if kp[1] is None else kp[1].shape[0]))
    sc = _scale(scale, geom.head_dim)
    _check_out(out, q)
    return sc, _triton_inputs(backend, q, kp, vp, ks, vs)


def _tiers(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.int8) if t.dtype == torch.bool else t


def paged_decode_attention(
    q: torch.Tensor,
    k_pools: KVPair,
    v_pools: KVPair,
    block_tables: torch.Tensor,
    block_tiers: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float | None = None,
    k_scales: ScalePair = None,
    v_scales: ScalePair = None,
    backend: Backend = "auto",
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Paged decode attention, one query token per sequence.

    q ``[B, Hq, D]``; pools as in the module doc; block_tables/block_tiers ``[B, max_blocks]``
    int; seq_lens ``[B]`` int (tokens, the last block may be partial; 0 gives zeros).
    ``scale`` defaults to ``D ** -0.5``. ``num_splits``: split-K factor (None: the kernel picks
    from the device size; the torch twin chunks by ~1K tokens). Returns ``[B, Hq, D]`` in q's
    dtype, written into ``out`` when given (same shape/dtype/device as q). On CUDA with a host
    view in pageable memory, ``"auto"`` falls back to the torch path.
    """
    q, kp, vp, ks, vs, geom = _attention_inputs(
        q, "[batch, num_q_heads, head_dim]", k_pools, v_pools, k_scales, v_scales
    )
    b = q.shape[0]
    bt = c.index_tensor("block_tables", block_tables, 2, "[batch, max_blocks]")
    tiers = c.index_tensor("block_tiers", block_tiers, 2, "[batch, max_blocks]")
    lens = c.index_tensor("seq_lens", seq_lens, 1, "[batch]")
    if bt.shape[0] != b or tiers.shape != bt.shape or lens.shape[0] != b:
        raise ShapeError(
            f"block_tables {tuple(bt.shape)}, block_tiers {tuple(tiers.shape)}, seq_lens "
            f"{tuple(lens.shape)}: expected [{b}, max_blocks], [{b}, max_blocks], [{b}]"
        )
    c.same_device(q.device, [("block_tables", bt), ("block_tiers", tiers), ("seq_lens", lens)])
    if num_splits is not None and (not isinstance(num_splits, int) or num_splits < 1):
        raise ShapeError(f"num_splits: expected None or an int >= 1, got {num_splits!r}")
    sc, triton_inputs = _check_rest(
        ("block_tables", "block_tiers", "seq_lens"), bt, tiers, lens, geom, q, kp, vp, ks, vs,
        scale, out, backend,
    )
    if triton_inputs is not None:
        from .decode import paged_decode_triton

        k2, v2, ks2, vs2 = triton_inputs
        return paged_decode_triton(
            q, k2, v2, bt, _tiers(tiers), lens, scale=sc, k_scales=ks2, v_scales=vs2,
            num_splits=num_splits, interpreted=_kernels_interpreted(), out=out,
        )
    res = reference.paged_decode(
        q, kp, vp, bt, tiers, lens, scale=sc, k_scales=ks, v_scales=vs, num_splits=num_splits
    )
    return res if out is None else out.copy_(res)


def prefill_attention(
    q: torch.Tensor,
    k_pools: KVPair,
    v_pools: KVPair,
    block_table: torch.Tensor,
    block_tier: torch.Tensor,
    seq_len: int,
    *,
    scale: float | None = None,
    k_scales: ScalePair = None,
    v_scales: ScalePair = None,
    backend: Backend = "auto",
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of ``n`` new tokens over a cached prefix plus themselves (one sequence).

    q ``[n, Hq, D]`` holds positions ``seq_len - n .. seq_len - 1``, whose K/V are already in
    the pool; block_table/block_tier ``[max_blocks]``; seq_len: total tokens (int). Causal among
    the new tokens, full over the prefix. Returns ``[n, Hq, D]`` in q's dtype, written into
    ``out`` when given (same shape/dtype/device as q).
    """
    q, kp, vp, ks, vs, geom = _attention_inputs(
        q, "[num_new_tokens, num_q_heads, head_dim]", k_pools, v_pools, k_scales, v_scales
    )
    bt = c.index_tensor("block_table", block_table, 1, "[max_blocks]")
    tier = c.index_tensor("block_tier", block_tier, 1, "[max_blocks]")
    if tier.shape != bt.shape:
        raise ShapeError(f"block_tier: expected shape {tuple(bt.shape)}, got {tuple(tier.shape)}")
    c.same_device(q.device, [("block_table", bt), ("block_tier", tier)])
    if isinstance(seq_len, torch.Tensor) and seq_len.numel() == 1:
        seq_len = int(seq_len)
    if isinstance(seq_len, bool) or not isinstance(seq_len, int):
        raise DTypeError(f"seq_len: expected an int, got {type(seq_len).__name__}")
    n = q.shape[0]
    if not n <= seq_len <= bt.shape[0] * geom.block_size:
        raise ShapeError(
            f"seq_len: expected {n} (new tokens) <= seq_len <= {bt.shape[0] * geom.block_size} "
            f"(max_blocks x block_size), got {seq_len}"
        )
    sc, triton_inputs = _check_rest(
        ("block_table", "block_tier", "seq_len"), bt[None], tier[None], torch.tensor([seq_len]),
        geom, q, kp, vp, ks, vs, scale, out, backend,
    )
    if triton_inputs is not None:
        from .prefill import prefill_triton

        k2, v2, ks2, vs2 = triton_inputs
        return prefill_triton(
            q, k2, v2, bt, _tiers(tier), seq_len, scale=sc, k_scales=ks2, v_scales=vs2,
            interpreted=_kernels_interpreted(), out=out,
        )
    res = reference.prefill(q, kp, vp, bt, tier, seq_len, scale=sc, k_scales=ks, v_scales=vs)
    return res if out is None else out.copy_(res)


def _triton_inputs(backend, q, kp, vp, ks, vs):
    """(k_pools, v_pools, k_scales, v_scales) with host parts as device-visible views, or None
    when the Triton path does not apply (torch backend, float64, host memory not visible)."""
    if not (_triton_ready(backend, q.device) and q.dtype != torch.float64):
        return None
    views = _visible(backend, q.device, [
        ("k_pools[1]", kp[1]), ("v_pools[1]", vp[1]),
        ("k_scales[1]", ks[1] if ks else None), ("v_scales[1]", vs[1] if vs else None),
    ])
    if views is None:
        return None
    return ((kp[0], views[0]), (vp[0], views[1]),
            (ks[0], views[2]) if ks else None, (vs[0], views[3]) if vs else None)


def merge_attention_states(
    o1: torch.Tensor,
    lse1: torch.Tensor,
    o2: torch.Tensor,
    lse2: torch.Tensor,
    *,
    backend: Backend = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two attention states over disjoint key sets into the state over their union.

    o1, o2 ``[..., H, D]`` (same shape and device); lse1, lse2 ``[..., H]``: natural-log
    log-sum-exp of the *scaled* scores (``log sum_j exp(scale * q.k_j)``). Returns
    ``(o [..., H, D] in o1's dtype, lse [..., H] in lse1's dtype)``. A part over no keys
    (``lse = -inf``) is a no-op, whatever its o holds; two empty parts give ``(0, -inf)``.
    """
    for name, t in (("o1", o1), ("lse1", lse1), ("o2", o2), ("lse2", lse2)):
        c.tensor(name, t)
        c.dtype_in(name, t, c.Q_DTYPES)
    if o1.dim() < 2 or o2.shape != o1.shape:
        raise ShapeError(
            f"o1/o2: expected equal shapes [..., H, D], got {tuple(o1.shape)} and {tuple(o2.shape)}"
        )
    if lse1.shape != o1.shape[:-1] or lse2.shape != o1.shape[:-1]:
        raise ShapeError(
            f"lse1/lse2: expected shape {tuple(o1.shape[:-1])} (o without D), got "
            f"{tuple(lse1.shape)} and {tuple(lse2.shape)}"
        )
    c.same_device(o1.device, [("lse1", lse1), ("o2", o2), ("lse2", lse2)])
    use_triton = _triton_ready(backend, o1.device) and torch.float64 not in (
        o1.dtype, o2.dtype, lse1.dtype, lse2.dtype
    )
    if use_triton:
        from .merge import merge_two_triton

        return merge_two_triton(o1, lse1, o2, lse2)
    return reference.merge_states(o1, lse1, o2, lse2)


# ---------------------------------------------------------------------------------------------
# block copies
# ---------------------------------------------------------------------------------------------


def _copy_inputs(
    gpu_kv: object, host_kv: object, gpu_slots: object, host_slots: object, to_host: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gpu_kv = c.tensor("gpu_kv", gpu_kv)
    host_kv = c.tensor("host_kv", host_kv)
    if gpu_kv.dim() < 3 or gpu_kv.shape[1] != 2:
        raise ShapeError(
            f"gpu_kv: expected [num_layers, 2, num_gpu_slots, *block], got {tuple(gpu_kv.shape)}"
        )
    want = (gpu_kv.shape[0], 2, *gpu_kv.shape[3:])
    if host_kv.dim() != gpu_kv.dim() or tuple(host_kv.shape[1:]) != want:
        raise ShapeError(
            f"host_kv: expected [num_host_slots, {', '.join(map(str, want))}] to match gpu_kv, "
            f"got {tuple(host_kv.shape)}"
        )
    if host_kv.dtype != gpu_kv.dtype:
        raise DTypeError(f"host_kv: expected dtype {gpu_kv.dtype} like gpu_kv, got {host_kv.dtype}")
    gs = c.slots("gpu_slots", gpu_slots)
    hs = c.slots("host_slots", host_slots)
    if gs.numel() != hs.numel():
        raise ShapeError(
            f"gpu_slots/host_slots: expected equal lengths, got {gs.numel()} and {hs.numel()}"
        )
    c.slot_range("gpu_slots", gs, gpu_kv.shape[2], distinct=not to_host)
    c.slot_range("host_slots", hs, host_kv.shape[0], distinct=to_host)
    return gpu_kv, host_kv, gs, hs


def _chunks_contiguous(t: torch.Tensor, block_dims: int) -> bool:
    """Whether each (slot, layer, kv) chunk (the trailing ``block_dims`` dims) is contiguous."""
    expected = 1
    for size, stride in zip(reversed(t.shape[-block_dims:]), reversed(t.stride()[-block_dims:])):
        if size > 1 and stride != expected:
            return False
        expected *= size
    return True


def _copy_triton_views(
    backend: str, gpu_kv: torch.Tensor, host_kv: torch.Tensor
) -> torch.Tensor | None:
    """Host pool view for the Triton copy kernel, or None for the torch path."""
    if not _triton_ready(backend, gpu_kv.device):
        return None
    nd = gpu_kv.dim() - 3
    if nd and not (_chunks_contiguous(gpu_kv, nd) and _chunks_contiguous(host_kv, nd)):
        if backend == "triton":
            raise ShapeError("gpu_kv/host_kv: the Triton copy needs each block chunk contiguous")
        return None
    views = _visible(backend, gpu_kv.device, [("host_kv", host_kv)])
    return None if views is None else views[0]


def _host_copy(backend: str, gpu_kv: torch.Tensor, host_kv: torch.Tensor):
    """The numba one-pass copy module when it applies (backend auto, both pools in CPU memory,
    chunks contiguous, numba importable), else None for the torch twin."""
    if backend != "auto" or gpu_kv.device.type != "cpu" or host_kv.device.type != "cpu":
        return None
    nd = gpu_kv.dim() - 3
    if not (_chunks_contiguous(gpu_kv, nd) and _chunks_contiguous(host_kv, nd)):
        return None
    try:
        from . import host_copy
    except ImportError:                 # numba missing: the torch twin does the copy
        return None
    except Exception:                   # NOTE: never every copy failing for the copier's sake
        _log_copier_failure()
        return None
    return host_copy


_SMALL_DISTINCT = 512
"""Destination lists up to this long are checked for repeats as a Python set."""


def _copy_on_cpu(gpu_kv: object, host_kv: object, gpu_slots: object, host_slots: object,
                 layers: object, backend: str, to_host: bool) -> bool:
    """The common call, done at once: both pools in CPU memory with the numba copier, slots
    as lists (or 1-D numpy arrays) of ints, every argument valid. Returns False, having done
    nothing, for anything else; the full path then copies or says what is wrong.

    NOTE: the migrator's and the node daemon's copies are a few MiB, and the full path's
    argument handling (tensors made of the slot lists, then arrays again) cost ~40 us a call,
    a tenth of a 16-block promotion's layer group. The checks here are the same, on arrays."""
    if not (isinstance(gpu_kv, torch.Tensor) and isinstance(host_kv, torch.Tensor)
            and isinstance(gpu_slots, (list, np.ndarray))
            and isinstance(host_slots, (list, np.ndarray))):
        return False
    n = len(gpu_slots)
    if (not n or len(host_slots) != n or gpu_kv.dim() < 3 or gpu_kv.shape[1] != 2
            or host_kv.dtype != gpu_kv.dtype
            or tuple(host_kv.shape[1:]) != (gpu_kv.shape[0], 2, *gpu_kv.shape[3:])):
        return False
    fast = _host_copy(backend, gpu_kv, host_kv)
    if fast is None:
        return False
    gs, hs = np.asarray(gpu_slots), np.asarray(host_slots)
    if gs.ndim != 1 or hs.ndim != 1 or gs.dtype.kind not in "iu" or hs.dtype.kind not in "iu":
        return False
    if (_min(gs) < 0 or _max(gs) >= gpu_kv.shape[2] or _min(hs) < 0
            or _max(hs) >= host_kv.shape[0]):
        return False
    dst = hs if to_host else gs
    if n <= _SMALL_DISTINCT:
        if len(set(dst.tolist())) != n:
            return False
    elif np.unique(dst).size != n:
        return False
    num_layers = gpu_kv.shape[0]
    if layers is None:
        ls = np.arange(num_layers)
    else:
        if not isinstance(layers, (list, tuple, range)):
            return False
        try:
            ls = np.asarray(sorted({operator.index(x) for x in layers}), dtype=np.int64)
        except TypeError:
            return False
        if not len(ls) or ls[0] < 0 or ls[-1] >= num_layers:
            return False
    gs, hs = gs.astype(np.int64, copy=False), hs.astype(np.int64, copy=False)
    if to_host:
        fast.copy_blocks(gpu_kv, (2, 0, 1), gs, host_kv, (0, 1, 2), hs, ls)
    else:
        fast.copy_blocks(host_kv, (0, 1, 2), hs, gpu_kv, (2, 0, 1), gs, ls)
    return True


_min, _max = np.minimum.reduce, np.maximum.reduce

_copier_failed = False


def _log_copier_failure() -> None:
    global _copier_failed
    if not _copier_failed:
        _copier_failed = True
        logging.getLogger(__name__).exception("the CPU block copier (numba) failed to load; "
                                              "copies use the torch twin")


def copy_blocks_to_host(
    gpu_kv: torch.Tensor,
    gpu_slots: Iterable[int] | torch.Tensor,
    host_kv: torch.Tensor,
    host_slots: Iterable[int] | torch.Tensor,
    *,
    backend: Backend = "auto",
    non_blocking: bool = False,
) -> None:
    """Copy blocks, all layers, from the layer-major GPU pool to the block-major host pool:
    ``host_kv[host_slots[i]] = gpu_kv[:, :, gpu_slots[i]]``.

    gpu_kv ``[L, 2, S, *block]``, host_kv ``[S_h, L, 2, *block]`` (``*block`` is usually
    ``block_size, H, D``; pass ``gpu_scales[..., None]`` / ``host_scales[..., None]`` to move
    FP8 scales the same way). Slots: lists or 1-D int tensors of equal length, destination ids
    distinct. ``non_blocking`` is passed to the torch copies (the caller then syncs).

    On CUDA the Triton path (pinned host pool, written through UVA) is asynchronous on the
    current stream: synchronize or wait on an event before the CPU reads ``host_kv``.
    """
    if _copy_on_cpu(gpu_kv, host_kv, gpu_slots, host_slots, None, backend, to_host=True):
        return
    gpu_kv, host_kv, gs, hs = _copy_inputs(gpu_kv, host_kv, gpu_slots, host_slots, to_host=True)
    if gs.numel() == 0:
        return
    host_view = _copy_triton_views(backend, gpu_kv, host_kv)
    if host_view is not None:
        from .copy import copy_to_host_triton

        dev = gpu_kv.device
        copy_to_host_triton(gpu_kv, gs.to(dev), host_view, hs.to(dev))
        return
    fast = _host_copy(backend, gpu_kv, host_kv)
    if fast is not None:
        fast.copy_blocks(gpu_kv, (2, 0, 1), gs.numpy(), host_kv, (0, 1, 2), hs.numpy(),
                         np.arange(gpu_kv.shape[0]))
        return
    reference.copy_to_host(gpu_kv, gs, host_kv, hs, non_blocking=non_blocking)


def copy_blocks_to_gpu(
    host_kv: torch.Tensor,
    host_slots: Iterable[int] | torch.Tensor,
    gpu_kv: torch.Tensor,
    gpu_slots: Iterable[int] | torch.Tensor,
    *,
    layers: Iterable[int] | None = None,
    backend: Backend = "auto",
    non_blocking: bool = False,
) -> None:
    """Copy blocks from the block-major host pool into the layer-major GPU pool:
    ``gpu_kv[l, :, gpu_slots[i]] = host_kv[host_slots[i], l]`` for each l in ``layers``
    (default: all; a subset gives layer-wise promotion). Shapes as ``copy_blocks_to_host``.
    """
    if _copy_on_cpu(gpu_kv, host_kv, gpu_slots, host_slots, layers, backend, to_host=False):
        return
    gpu_kv, host_kv, gs, hs = _copy_inputs(gpu_kv, host_kv, gpu_slots, host_slots, to_host=False)
    num_layers = gpu_kv.shape[0]
    if layers is None:
        layer_list = None
    else:
        try:
            layer_list = sorted({operator.index(x) for x in layers})
        except (TypeError, ValueError) as e:
            raise DTypeError("layers: expected an iterable of ints") from e
        if layer_list and (layer_list[0] < 0 or layer_list[-1] >= num_layers):
            raise ShapeError(f"layers: expected ids in [0, {num_layers}), got {layer_list}")
    if gs.numel() == 0 or layer_list == []:
        return
    host_view = _copy_triton_views(backend, gpu_kv, host_kv)
    if host_view is not None:
        from .copy import copy_to_gpu_triton

        dev = gpu_kv.device
        ls = torch.tensor(
            layer_list if layer_list is not None else range(num_layers), dtype=torch.int32
        )
        copy_to_gpu_triton(host_view, hs.to(dev), gpu_kv, gs.to(dev), ls.to(dev))
        return
    fast = _host_copy(backend, gpu_kv, host_kv)
    if fast is not None:
        fast.copy_blocks(host_kv, (0, 1, 2), hs.numpy(), gpu_kv, (2, 0, 1), gs.numpy(),
                         np.arange(num_layers) if layer_list is None else np.array(layer_list))
        return
    reference.copy_to_gpu(
        host_kv, hs, gpu_kv, gs, layers=layer_list, non_blocking=non_blocking
    )


# ---------------------------------------------------------------------------------------------
# fp8
# ---------------------------------------------------------------------------------------------


def quantize_fp8(
    x: torch.Tensor, *, backend: Backend = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block e4m3 quantization. x ``[N, ...]`` (N blocks; e.g. ``[N, block_size, H, D]``),
    float16/bfloat16/float32 -> ``(x_fp8 [N, ...] float8_e4m3fn, scale [N] float32)`` with
    ``scale = amax(|x[i]|) / 448`` (1.0 for an all-zero block), so ``x ~= scale * x_fp8``
    (relative error <= 2**-4 per element, from e4m3's 3 mantissa bits). Non-finite inputs give
    non-finite scales: check before quantizing if the source can overflow."""
    x = c.tensor("x", x)
    if x.dim() < 1:
        raise ShapeError("x: expected [num_blocks, ...] (at least 1-D)")
    c.dtype_in("x", x, (torch.float16, torch.bfloat16, torch.float32))
    if _triton_ready(backend, x.device):
        from .fp8 import quantize_fp8_triton

        return quantize_fp8_triton(x)
    return reference.quantize_fp8(x)


def dequantize_fp8(
    x_fp8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Inverse of ``quantize_fp8``: x_fp8 ``[N, ...]`` float8_e4m3fn, scale ``[N]`` float32 ->
    ``scale[i] * x_fp8[i]`` as ``dtype``."""
    c.tensor("x_fp8", x_fp8)
    c.tensor("scale", scale)
    c.dtype_in("x_fp8", x_fp8, (c.FP8_DTYPE,))
    if x_fp8.dim() < 1 or scale.shape != (x_fp8.shape[0],):
        raise ShapeError(
            f"scale: expected shape ({x_fp8.shape[0] if x_fp8.dim() else '?'},) (one per block), "
            f"got {tuple(scale.shape)}"
        )
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise DTypeError(f"dtype: expected a floating torch.dtype, got {dtype!r}")
    return reference.dequantize_fp8(x_fp8, scale, dtype)
