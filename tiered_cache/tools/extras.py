"""The `tools` extra: matplotlib and tqdm, reached only through this module.

The library never needs them, so they are an optional dependency (installed from the source
tree: `tiered_cache.errors.install_hint`); `check` also covers transformers (the `hf` extra),
which `tiered-cache run` builds its model with. Every use goes through the functions here,
which import on first use and, where a package is missing, raise `MissingExtraError` naming
the extra (and the flag that does without it), instead of a bare ImportError halfway through
a long run. Commands call `check` before they start working, so a missing package fails them
at once.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from tiered_cache.errors import install_hint

EXTRA = "tools"
INSTALL = install_hint(EXTRA)


class MissingExtraError(ImportError):
    """A package of an optional extra is not installed; the message says how to install it."""


def _missing(module: str, purpose: str, instead: str | None,
             extra: str = EXTRA) -> MissingExtraError:
    alternative = f", or pass {instead}" if instead else ""
    return MissingExtraError(f"{purpose} needs {module}, which is not installed: "
                             f"{install_hint(extra)}{alternative}")


def require(module: str, purpose: str, *, instead: str | None = None) -> ModuleType:
    """Import `module` of the extra, or raise MissingExtraError saying what needed it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise _missing(module, purpose, instead) from None


def available(module: str) -> bool:
    """Whether `module` can be imported (looked up, not imported)."""
    if module in sys.modules:               # None there means "blocked": import raises
        return sys.modules[module] is not None
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def check(*, plot: bool = False, progress: bool = False, model: bool = False) -> None:
    """Fail now, before any work, if a package the command will use later is missing: the
    plot (matplotlib), the progress bar (tqdm), a transformers model (the `hf` extra).

    Looks the packages up without importing them (matplotlib takes a while to import).
    """
    if model and not available("transformers"):
        raise _missing("transformers", "the model", None, extra="hf")
    if plot and not available("matplotlib"):
        raise _missing("matplotlib", "the plot", "--no-plot")
    if progress and not available("tqdm"):
        raise _missing("tqdm", "the progress bar", "--no-progress")


# --------------------------------------------------------------------------------- figures

def pyplot() -> Any:
    """`matplotlib.pyplot` on the Agg backend: figures are written to files, never shown, so a
    tool behaves the same on a headless server as on a laptop."""
    mpl = require("matplotlib", "the plot", instead="--no-plot")
    mpl.use("Agg")
    return importlib.import_module("matplotlib.pyplot")


def save_figure(fig: Any, path: str | Path, *, dpi: int = 110) -> Path:
    """Write `fig` as a PNG (creating the folder) and free it: pyplot keeps every open figure
    alive until it is closed, which a sweep of many plots would notice."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p, dpi=dpi)
    pyplot().close(fig)
    return p


# --------------------------------------------------------------------------------- progress

class NoProgress:
    """The progress-bar interface the tools use, doing nothing (bar disabled)."""

    def __init__(self, total: int = 0) -> None:
        self.total = total
        self.n = 0

    def update(self, n: int = 1) -> None:
        self.n += n

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> NoProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def progress_bar(total: int, desc: str, *, unit: str = "it", enabled: bool = True,
                 leave: bool = False) -> Any:
    """A tqdm bar on stderr (stdout stays clean for tables and JSON), or a `NoProgress`."""
    if not enabled:
        return NoProgress(total)
    tqdm = require("tqdm", "the progress bar", instead="--no-progress").tqdm
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, leave=leave,
                dynamic_ncols=True)
