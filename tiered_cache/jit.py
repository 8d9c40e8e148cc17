"""numba's `njit` with a disk cache that may be missing: what the kernels compile with.

`njit(..., cache=True)` asks numba to cache the compiled function on disk, and numba looks for
a writable place (NUMBA_CACHE_DIR, the source's `__pycache__`, the user's cache directory).
Where there is none (a read-only install run by a service user without a home), numba raises
RuntimeError("cannot cache function ...") as the function is decorated, that is, as its module
is imported: the import of the CPU block copier failed inside the migrator's warm-up (the
thread died) and inside every gpu<->host copy, and the default policy's kernels failed the
import of the config.

Here such a function is compiled without the disk cache instead: the same machine code, only
compiled again by every process (seconds at start). It is logged (once per module) and counted
(`uncached()`).

NOTE: no fallback to a cache directory in /tmp: numba loads cached code by unpickling it, so a
directory another user could write first would let them run code in this process.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

_lock = threading.Lock()
_uncached: list[str] = []
_logged: set[str] = set()


def njit(*args: Any, cache: bool = False, **kwargs: Any) -> Callable[[Callable], Any]:
    """`numba.njit(*args, cache=cache, **kwargs)` as a decorator, compiled without the disk
    cache (logged, counted) where numba has nowhere to write it."""
    from numba import njit as numba_njit

    def decorate(fn: Callable) -> Any:
        if cache:
            try:
                return numba_njit(*args, cache=True, **kwargs)(fn)
            except RuntimeError as exc:
                if "cannot cache" not in str(exc):
                    raise
                _count(fn, exc)
        return numba_njit(*args, **kwargs)(fn)

    return decorate


def _count(fn: Callable, exc: RuntimeError) -> None:
    name = f"{fn.__module__}.{fn.__qualname__}"
    with _lock:
        _uncached.append(name)
        first = fn.__module__ not in _logged
        _logged.add(fn.__module__)
    if first:
        log.warning("%s: compiling without numba's disk cache (%s); set NUMBA_CACHE_DIR to a "
                    "directory this user can write to compile once per installation instead",
                    fn.__module__, exc)


class LazyModule:
    """A module imported at the first use of one of its names; then its names are this
    object's own attributes (a plain attribute lookup, no `__getattr__`, from then on).

    NOTE: the modules of compiled kernels are imported this way by the control plane and the
    policies, so `import tiered_cache.core` (or the config, which imports the policies) loads
    neither numba nor llvmlite: vLLM's CPU platform scans every loaded module's objects when a
    worker starts (vllm.triton_utils.dispatcher) and fails on llvmlite's ffi object, and the
    vLLM connector imports the config before vLLM's workers start."""

    def __init__(self, name: str) -> None:
        self.__dict__["_lazy_name"] = name

    def __getattr__(self, attr: str) -> Any:
        import importlib

        module = importlib.import_module(self.__dict__["_lazy_name"])
        self.__dict__.update(vars(module))
        return getattr(module, attr)


def uncached() -> list[str]:
    """The functions compiled without the disk cache in this process, by qualified name."""
    with _lock:
        return list(_uncached)
