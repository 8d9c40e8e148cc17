"""What every tiered-cache command shares at its edges: help that shows defaults, one-line
errors that name what the user typed, and exit codes.

- Errors name the flag (`--gpu-blocks: expected a positive integer, got 0`) or the config file
  and key (`my.yaml: tiers.gpu.capacity: ...`), never a config key the user did not write: flag
  values are checked at parse time by the `type=` functions here, and `config_errors` renames
  the ConfigErrors raised by values that flags put into a config.
- Exit codes: 0 done; 2 bad input (a usage error, a ConfigError, or any other library error that
  is also a ValueError: a bad trace, bad tokens); 1 anything else that failed (a library error
  at run time, a missing optional package, stdout closed by the reader); 130 interrupted. Each
  is one line on stderr, without a traceback.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, NoReturn

from tiered_cache.errors import ConfigError, TieredCacheError

if TYPE_CHECKING:
    from tiered_cache.config import CacheConfig

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


class UsageError(TieredCacheError, ValueError):
    """A command line that cannot run as given: an argument missing, or two that conflict."""


# --------------------------------------------------------------------------------- parsers

class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Descriptions keep their line breaks; every option with a real default shows it.

    Options whose default is None or False say in their help what leaving them out means (None
    is rarely what the user gets: it stands for "from the config" or "computed")."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (action.default is None or action.default is False
                or action.default is argparse.SUPPRESS or "%(default)" in text):
            return text
        return super()._get_help_string(action)


class ArgumentParser(argparse.ArgumentParser):
    """An argparse parser whose errors are one line naming the flag, exit code 2."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        # argparse says "argument --gpu-blocks: ..."; the flag alone reads like the rest.
        message = message.removeprefix("argument ")
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _shown(text: str) -> str:
    """The rejected value as typed: numbers bare, anything else quoted."""
    try:
        float(text)
    except ValueError:
        return repr(text)
    return text.strip()


def _number(text: str, kind: type, expected: str) -> int | float:
    try:
        value = kind(text)
    except (ValueError, OverflowError):
        raise argparse.ArgumentTypeError(f"expected {expected}, got {_shown(text)}") from None
    if isinstance(value, float) and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected {expected}, got {_shown(text)}")
    return value


def positive_int(text: str) -> int:
    """`type=` for a count that must be at least 1."""
    value = _number(text, int, "a positive integer")
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {_shown(text)}")
    return int(value)


def non_negative_int(text: str) -> int:
    """`type=` for a count that may be 0."""
    value = _number(text, int, "a non-negative integer")
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {_shown(text)}")
    return int(value)


def positive_float(text: str) -> float:
    """`type=` for a finite number above 0 (a rate, a parameter count)."""
    value = _number(text, float, "a positive number")
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {_shown(text)}")
    return float(value)


def fraction(text: str) -> float:
    """`type=` for a share in (0, 1]."""
    value = _number(text, float, "a number in (0, 1]")
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {_shown(text)}")
    return float(value)


def absolute_size(text: str) -> int:
    """`type=` for an amount of memory like `80GiB` (bytes; not a percentage)."""
    from tiered_cache import sizing

    try:
        kind, value = sizing.parse_size(text, "")
    except (ConfigError, ArithmeticError):
        kind, value = "invalid", 0
    if kind != "bytes":
        raise argparse.ArgumentTypeError(
            f"expected an absolute size like '512GiB', got {text!r}")
    return int(value)


def positive_int_list(text: str) -> list[int]:
    """`type=` for comma-separated positive integers (`500,1000,2000`)."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    try:
        values = [int(p) for p in parts]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated positive integers, got {text!r}")
    return values


def name_list(text: str) -> list[str]:
    """`type=` for a comma-separated list of names (`lru,arc`)."""
    names = [p.strip() for p in text.split(",") if p.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"expected comma-separated names, got {text!r}")
    return names


# --------------------------------------------------------------------------------- config errors

def _message(exc: ConfigError) -> str:
    """The error's message without its leading `path: `."""
    text = str(exc.args[0]) if exc.args else ""
    prefix = f"{exc.path}: "
    return text[len(prefix):] if exc.path and text.startswith(prefix) else text


@contextmanager
def config_errors(*, flags: Mapping[str, str] | None = None,
                  source: str | None = None) -> Iterator[None]:
    """Re-raise ConfigErrors so they name what the user typed.

    `flags` maps config keys to the flags that set them (`{"tiers.gpu.num_blocks":
    "--gpu-blocks"}`): an error on such a key names the flag. Any other config key came from the
    config file `source`, which is put in front (`my.yaml: tiers.gpu.capacity: ...`). Errors
    that already name a flag or the file pass unchanged.

    NOTE: an input that the config code rejects with a plain ValueError, TypeError or
    ArithmeticError (a bug there: it should be a ConfigError naming the key) becomes a
    ConfigError naming `source`, so a command never answers bad input with a traceback.
    """
    flags = flags or {}
    try:
        yield
    except ConfigError as exc:
        path = exc.path or ""
        if path in flags:
            raise ConfigError(flags[path], _message(exc)) from None
        if path.startswith("-") or source is None or path.startswith(source):
            raise
        raise ConfigError(f"{source}: {path}" if path else source, _message(exc)) from None
    except TieredCacheError:
        raise
    except (ValueError, TypeError, ArithmeticError) as exc:
        raise ConfigError(source or "config",
                          f"cannot use this value: {type(exc).__name__}: {exc}") from None


def load_config(path: str | None) -> CacheConfig:
    """The config of `--config FILE`, or the embedded default; errors name the file."""
    from tiered_cache.config import CacheConfig

    with config_errors(source=path or "<default config>"):
        return CacheConfig.from_yaml(path) if path else CacheConfig.default()


# --------------------------------------------------------------------------------- running

def _quiet_stdout() -> None:
    """Point stdout at /dev/null: Python flushes it again at exit, and a flush into a pipe
    whose reader has gone raises once more, as "Exception ignored" noise."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):   # replaced or captured stdout (tests)
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


def exit_code(exc: BaseException) -> int:
    """The exit code for an error a command ends with (see the module docstring)."""
    if isinstance(exc, ConfigError) or (isinstance(exc, TieredCacheError)
                                        and isinstance(exc, ValueError)):
        return EXIT_USAGE
    return EXIT_FAILED


def run(body: Callable[[], int | None], prog: str) -> int:
    """Run a command's body and turn how it ended into an exit code and at most one line.

    A reader that closes the pipe early (`... | head`) ends the command quietly: there is nobody
    left to tell."""
    from tiered_cache.tools.extras import MissingExtraError

    try:
        rc = int(body() or 0)
        sys.stdout.flush()          # inside the try: the last write may be the one that fails
        return rc
    except BrokenPipeError:
        _quiet_stdout()
        return EXIT_FAILED
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except (TieredCacheError, MissingExtraError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return exit_code(exc)
