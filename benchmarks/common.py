"""Small helpers shared by the benchmarks: timing, table printing, JSON results.

Every benchmark compares against a baseline measured in the same run (these machines are noisy),
prints a table and writes JSON under ``results/``.
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "results"
if str(REPO) not in sys.path:
    # NOTE: the reference daemon (tests/daemon_reference.py) is not in the wheel: benchmarks
    # that run it import `tests.daemon_reference` from the repository.
    sys.path.insert(0, str(REPO))


def time_it(fn: Callable[[], Any], *, warmup: int = 1, repeats: int = 5,
            sync: Callable[[], Any] | None = None,
            setup: Callable[[], Any] | None = None) -> dict[str, float]:
    """Run ``fn`` ``warmup`` times untimed, then ``repeats`` times timed.

    ``sync`` (e.g. ``torch.cuda.synchronize``) runs before the clock starts and before it stops,
    so asynchronous device work is inside the measurement. ``setup`` runs untimed before every
    call. Returns ``{"median_s", "min_s", "max_s", "repeats"}``.
    """
    for _ in range(warmup):
        if setup is not None:
            setup()
        fn()
    if sync is not None:
        sync()
    times = []
    for _ in range(max(1, repeats)):
        if setup is not None:
            setup()
        if sync is not None:
            sync()
        t0 = time.perf_counter()
        fn()
        if sync is not None:
            sync()
        times.append(time.perf_counter() - t0)
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times),
            "repeats": len(times)}


def quantile(values: Sequence[float], q: float) -> float:
    """Nearest-rank quantile of ``values`` (0.0 for an empty list)."""
    if not values:
        return 0.0
    s = sorted(values)
    k = min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))
    return s[k]


def gbps(nbytes: int | float, seconds: float) -> float:
    """Decimal GB/s (1e9 bytes per second)."""
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def fmt(value: Any, digits: int = 3) -> str:
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            return str(value)
        if value == 0:
            return "0"
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        return f"{value:.{digits}g}" if abs(value) < 1 else f"{value:.{digits}f}".rstrip(
            "0").rstrip(".")
    return str(value)


def print_table(rows: Iterable[dict[str, Any]], columns: Sequence[str] | None = None,
                title: str | None = None, file=None) -> str:
    """Print ``rows`` (dicts) as an aligned text table; returns the text. Missing cells are
    blank; numbers are right-aligned."""
    rows = list(rows)
    if columns is None:
        columns = []
        for r in rows:
            columns.extend(k for k in r if k not in columns)
    cells = [[fmt(r.get(c, "")) if r.get(c, "") != "" else "" for c in columns] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    numeric = [all(isinstance(r.get(c), (int, float)) or r.get(c) in ("", None) for r in rows)
               for c in columns]

    def line(values: Sequence[str]) -> str:
        return "  ".join(v.rjust(w) if num else v.ljust(w)
                         for v, w, num in zip(values, widths, numeric)).rstrip()

    out = []
    if title:
        out.append(title)
    out.append(line(columns))
    out.append("  ".join("-" * w for w in widths))
    out.extend(line(row) for row in cells)
    text = "\n".join(out)
    print(text, file=file or sys.stdout, flush=True)
    return text


def environment() -> dict[str, Any]:
    """Where the numbers come from (quoted with every result)."""
    info: dict[str, Any] = {"python": platform.python_version(), "machine": platform.machine(),
                            "cpus": os.cpu_count()}
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
        info["cuda"] = torch.cuda.is_available()
        if info["cuda"]:
            info["gpu"] = torch.cuda.get_device_name()
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    return info


def write_json(path: str | os.PathLike, payload: dict[str, Any]) -> Path:
    """Write ``payload`` as JSON (parent folders created); relative paths are taken from the
    current directory. Returns the path written."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(payload, indent=2, sort_keys=False, default=_json_default) + "\n")
    print(f"wrote {p}", flush=True)
    return p


def trim_heap() -> None:
    """Give the C heap's free pages back to the system (glibc's `malloc_trim`; nothing
    elsewhere), before the first reading of a resident-set measurement.

    NOTE: what a fill adds to the RSS depends on how much freed memory the heap holds when it
    starts: a warm-up that compiled the numba kernels (an empty kernel cache, or another
    checkout's overwriting it) left ~7 MB free that the fill then reused, so 10^5 blocks read
    ~290 bytes a block with the compile and ~360 without. Trimming gives back glibc's part
    (~310 with the compile); Python's own arenas keep the rest, so measure with the kernels
    cached, as an installed process runs (control_plane_peers.py fills each checkout's kernel
    cache first)."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        trim = libc.malloc_trim
    except (OSError, AttributeError, TypeError):
        return
    trim(0)


def import_checkout(root: str | os.PathLike) -> None:
    """Import tiered_cache from the checkout at `root`, installed or not (e.g. a git worktree of
    an older commit, for a before/after in the same sitting).

    NOTE: checkouts before the move of kernels/ and migrator/ under tiered_cache/ keep them
    as top-level folders that their editable install mapped into the package (pyproject's
    package-dir); a bare checkout on sys.path has no such mapping, so for those it is made
    here, for the checkout named and nothing else. Call it before anything imports
    tiered_cache."""
    import importlib.util

    root = str(Path(root).resolve())
    sys.path.insert(0, root)
    import tiered_cache

    if not Path(tiered_cache.__file__).resolve().is_relative_to(root):
        raise SystemExit(f"tiered_cache imported from {tiered_cache.__file__}, not {root}")
    for sub in ("kernels", "migrator"):
        name = f"tiered_cache.{sub}"
        if name in sys.modules or not os.path.isdir(os.path.join(root, sub)):
            continue
        spec = importlib.util.spec_from_file_location(
            name, os.path.join(root, sub, "__init__.py"),
            submodule_search_locations=[os.path.join(root, sub)])
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
        setattr(tiered_cache, sub, mod)


def checkout_child(script: str | os.PathLike, args: Sequence[str], *,
                   python: str = sys.executable, env: dict | None = None,
                   cwd: str | None = None, timeout: float = 3600) -> Any:
    """Run `python script *args` (a benchmark's child mode, typically measuring another
    checkout through `import_checkout`) and return the JSON on the last line it printed.
    A child that fails stops the benchmark with the end of its stderr."""
    import subprocess

    proc = subprocess.run([python, str(script), *args], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=timeout)
    if proc.returncode != 0:
        raise SystemExit(f"child {python} {script} {' '.join(args)} failed:\n"
                         f"{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def best_by_checkout(script: str | os.PathLike, checkouts: Sequence[tuple[str, str]],
                     args: Sequence[str], rounds: int, key: str,
                     value: str) -> dict[tuple[str, Any], float]:
    """Run `script --child-root ROOT *args` for each (label, ROOT) of `checkouts`, `rounds`
    times, alternating, each in a fresh child without PYTHONPATH (`checkout_child`; the child
    prints a JSON list of rows); returns the least `value` per (label, row[key])."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    best: dict[tuple[str, Any], float] = {}
    for _ in range(rounds):
        for label, root in checkouts:
            for r in checkout_child(script, ["--child-root", root, *args], env=env,
                                    timeout=1800):
                k = (label, r[key])
                best[k] = min(best.get(k, float("inf")), r[value])
    return best


def default_out(name: str) -> str:
    """``results/<name>.json`` under the repository root."""
    return str(RESULTS / f"{name}.json")


def _json_default(o: Any) -> Any:
    if hasattr(o, "item"):
        return o.item()
    if isinstance(o, (set, tuple)):
        return list(o)
    return str(o)
