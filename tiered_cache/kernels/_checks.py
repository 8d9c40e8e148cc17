"""Input validation for the public kernel functions.

Errors are the typed ones from ``tiered_cache.errors``: ``ShapeError`` (a ValueError) and
``DTypeError`` (a TypeError). Messages name the argument and what was expected. Checks never
synchronize a CUDA device: value checks (slot ranges, lengths) run only on CPU tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tiered_cache.errors import DTypeError, ShapeError

FP8_DTYPE = torch.float8_e4m3fn
KV_DTYPES = (torch.float16, torch.bfloat16, torch.float32, FP8_DTYPE)
Q_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INDEX_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool)


def tensor(name: str, x: object) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise DTypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    return x


def ndim(name: str, x: torch.Tensor, n: int, shape_doc: str) -> None:
    if x.dim() != n:
        raise ShapeError(f"{name}: expected {shape_doc} ({n}-D), got shape {tuple(x.shape)}")


def dtype_in(name: str, x: torch.Tensor, allowed: Sequence[torch.dtype]) -> None:
    if x.dtype not in allowed:
        names = ", ".join(str(d).replace("torch.", "") for d in allowed)
        raise DTypeError(f"{name}: expected dtype in ({names}), got {x.dtype}")


def index_tensor(name: str, x: object, n: int, shape_doc: str) -> torch.Tensor:
    x = tensor(name, x)
    ndim(name, x, n, shape_doc)
    dtype_in(name, x, INDEX_DTYPES)
    return x


@dataclass(frozen=True)
class PoolGeometry:
    """What every KV pool view of one attention call shares."""

    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype


def pools(
    name: str, pair: object
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Normalize ``(gpu_view, host_view_or_None)`` (a bare tensor means no host pool)."""
    if isinstance(pair, torch.Tensor):
        pair = (pair, None)
    if not isinstance(pair, (tuple, list)) or len(pair) != 2:
        raise DTypeError(
            f"{name}: expected a tuple (gpu_view [S, block_size, H, D], host_view or None)"
        )
    gpu, host = pair
    tensor(f"{name}[0]", gpu)
    if host is not None:
        tensor(f"{name}[1]", host)
    return gpu, host


def pool_geometry(named: Sequence[tuple[str, torch.Tensor | None]]) -> PoolGeometry:
    """Check that every pool view is [S, block_size, H, D] with one geometry and dtype."""
    geom: PoolGeometry | None = None
    for name, t in named:
        if t is None:
            continue
        ndim(name, t, 4, "[num_slots, block_size, num_kv_heads, head_dim]")
        dtype_in(name, t, KV_DTYPES)
        g = PoolGeometry(t.shape[1], t.shape[2], t.shape[3], t.dtype)
        if geom is None:
            geom = g
        elif g != geom:
            raise ShapeError(
                f"{name}: expected block_size={geom.block_size}, num_kv_heads="
                f"{geom.num_kv_heads}, head_dim={geom.head_dim}, dtype={geom.dtype} like the "
                f"first pool, got shape {tuple(t.shape)} dtype {t.dtype}"
            )
    assert geom is not None  # the gpu views are never None
    return geom


def scales(
    name: str,
    pair: object,
    kv_dtype: torch.dtype,
    gpu_pool: torch.Tensor,
    host_pool: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """FP8 scale vectors: required iff the pools are FP8; 1-D float32, one per slot."""
    if kv_dtype != FP8_DTYPE:
        if pair is not None:
            raise DTypeError(f"{name}: scales are only for float8_e4m3fn pools, got {kv_dtype}")
        return None
    if pair is None:
        raise DTypeError(f"{name}: float8_e4m3fn pools need per-block scales (gpu, host)")
    if isinstance(pair, torch.Tensor):
        pair = (pair, None)
    if not isinstance(pair, (tuple, list)) or len(pair) != 2:
        raise DTypeError(f"{name}: expected a tuple (gpu_scales [S], host_scales [S_h] or None)")
    out = []
    for i, (s, pool) in enumerate(zip(pair, (gpu_pool, host_pool))):
        if pool is None:
            out.append(None)
            continue
        if s is None:
            raise DTypeError(f"{name}[{i}]: the pool is float8_e4m3fn, its scales are missing")
        tensor(f"{name}[{i}]", s)
        ndim(f"{name}[{i}]", s, 1, f"[{pool.shape[0]}] (one scale per slot)")
        dtype_in(f"{name}[{i}]", s, (torch.float32,))
        if s.shape[0] != pool.shape[0]:
            raise ShapeError(
                f"{name}[{i}]: expected {pool.shape[0]} scales (one per slot), got {s.shape[0]}"
            )
        out.append(s)
    return out[0], out[1]


def same_device(device: torch.device, named: Sequence[tuple[str, torch.Tensor | None]]) -> None:
    for name, t in named:
        if t is not None and t.device != device:
            raise DTypeError(f"{name}: expected a tensor on {device}, got one on {t.device}")


def slots(name: str, x: object) -> torch.Tensor:
    """Slot lists: a Python sequence of ints or a 1-D integer tensor -> int64 CPU tensor."""
    if isinstance(x, torch.Tensor):
        if x.dim() != 1 or x.dtype not in INDEX_DTYPES or x.dtype == torch.bool:
            raise DTypeError(
                f"{name}: expected a 1-D integer tensor, got {x.dtype} {tuple(x.shape)}"
            )
        return x.detach().to("cpu", torch.int64)
    # NOTE: through numpy, not int() per element: a migration batch passes thousands of slots
    # per call, once per layer group, and a per-element loop cost a quarter of a 64 MiB copy.
    try:
        arr = np.asarray(x if isinstance(x, (list, tuple, range, np.ndarray)) else list(x))
    except (TypeError, ValueError) as e:
        raise DTypeError(f"{name}: expected a sequence of ints or a 1-D int tensor") from e
    if arr.size == 0:
        return torch.zeros(0, dtype=torch.int64)
    if arr.ndim != 1:
        raise DTypeError(f"{name}: expected a flat sequence of ints, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise DTypeError(f"{name}: expected a sequence of ints or a 1-D int tensor, got "
                         f"{arr.dtype} values")
    return torch.from_numpy(arr.astype(np.int64, copy=False))


_SMALL = 512
"""Slot lists up to this long are checked in Python (below)."""


def slot_range(name: str, s: torch.Tensor, num_slots: int, *, distinct: bool) -> None:
    """Slot ids in ``[0, num_slots)``; destination lists must not repeat a slot.

    NOTE: ``s`` is a CPU tensor (see ``slots``). A short list is checked as Python ints, a long
    one in numpy: right after a copy has swept the caches, ``torch.unique`` of a few dozen
    slots cost ~160 us and numpy's min/max/sort ~80 us (a sixth of a 16 MiB copy), Python's
    min/max/set ~20 us; for thousands of slots numpy wins."""
    n = s.numel()
    if not n:
        return
    if n <= _SMALL:
        ids = s.tolist()
        lo, hi = min(ids), max(ids)
        repeats = distinct and len(set(ids)) != n
    else:
        a = s.numpy()
        lo, hi = int(a.min()), int(a.max())
        if distinct:
            a = np.sort(a)
            repeats = bool(np.count_nonzero(a[1:] == a[:-1]))
        else:
            repeats = False
    if lo < 0 or hi >= num_slots:
        raise ShapeError(f"{name}: slot ids must be in [0, {num_slots}), got range [{lo}, {hi}]")
    if repeats:
        raise ShapeError(f"{name}: slot ids must be distinct")
