"""Backend selection and device views shared by the public kernel functions.

Every public function takes ``backend: "auto" | "triton" | "torch"``:

- ``"torch"``: the pure-torch twin (the CPU path and the test oracle).
- ``"triton"``: the Triton kernel. On CUDA tensors it is compiled; on CPU tensors it only runs
  when ``TRITON_INTERPRET=1`` was set before triton was first imported (tests use this).
- ``"auto"``: Triton when the tensors are on CUDA and triton imports, torch otherwise.

Triton is imported lazily (only when a Triton path is taken), so ``import tiered_cache.kernels``
works without triton and does not freeze the ``TRITON_INTERPRET`` decision at import time.
"""

from __future__ import annotations

import functools
import os
from typing import Literal

import torch

Backend = Literal["auto", "triton", "torch"]
Resolved = Literal["triton", "torch"]

_BACKENDS = ("auto", "triton", "torch")
_TRUE = ("1", "true", "on", "yes")


def interpret_requested() -> bool:
    """Whether ``TRITON_INTERPRET`` is set to a true value in the environment."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in _TRUE


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    """Whether triton imports (cached; it never changes within a process)."""
    try:
        import triton  # noqa: F401
    except Exception:  # pragma: no cover - depends on the install
        return False
    return True


def resolve_backend(backend: str, device: torch.device) -> Resolved:
    """Turn ``backend`` into the path to take for tensors on ``device``.

    Raises ValueError for an unknown name, RuntimeError when ``"triton"`` is forced where it
    cannot run (triton missing, or CPU tensors without ``TRITON_INTERPRET=1``).
    """
    if backend not in _BACKENDS:
        raise ValueError(f"backend: expected one of {_BACKENDS}, got {backend!r}")
    if backend == "torch":
        return "torch"
    on_cuda = device.type == "cuda"
    if backend == "auto":
        return "triton" if on_cuda and triton_available() else "torch"
    if not triton_available():
        raise RuntimeError("backend='triton': triton is not installed")
    if not on_cuda and not interpret_requested():
        raise RuntimeError(
            "backend='triton' with CPU tensors needs TRITON_INTERPRET=1 in the environment "
            "before triton is first imported"
        )
    return "triton"


class _CudaArrayInterface:
    """Exposes a raw device-visible byte range through ``__cuda_array_interface__`` (v3).

    Holds a reference to the owning host tensor so the memory outlives the CUDA alias.
    """

    def __init__(self, owner: torch.Tensor, ptr: int, nbytes: int):
        self._owner = owner
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "strides": None,
            "version": 3,
        }


def device_view(t: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    """A tensor aliasing ``t`` that kernels on ``device`` can read and write, or None.

    - ``t`` already on ``device``: returned as is.
    - ``t`` in pinned host memory and ``device`` is CUDA: a CUDA tensor with the same shape,
      strides and dtype over the same bytes (zero copy).
    - anything else (pageable host memory, another device): None; callers fall back to the
      torch path, which copies.

    NOTE: the alias relies on UVA (unified virtual addressing, every 64-bit CUDA platform):
    pinned memory from ``cudaHostAlloc``/``cudaHostRegister`` (what ``pin_memory()`` uses) is
    mapped into the device address space at the same address, so the host pointer is a valid
    device pointer. Kernels then read it over PCIe/NVLink-C2C at the interconnect's bandwidth.
    fp8/bf16 have no ``typestr``, so the bytes are wrapped as uint8 and re-viewed as ``t.dtype``.
    """
    if t is None:
        return None
    if t.device == device:
        return t
    if t.device.type != "cpu" or device.type != "cuda" or not t.is_pinned():
        return None
    storage = t.untyped_storage()
    try:
        raw = torch.as_tensor(
            _CudaArrayInterface(t, storage.data_ptr(), storage.nbytes()), device=device
        )
    except Exception:  # pragma: no cover - needs CUDA; a driver without UVA lands here
        return None
    return raw.view(t.dtype).as_strided(t.shape, t.stride(), t.storage_offset())


def next_pow2(n: int) -> int:
    """Smallest power of two >= max(n, 1)."""
    return 1 << max(int(n) - 1, 0).bit_length()


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints."""
    return -(-a // b)
