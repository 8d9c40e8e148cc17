"""`tiered-cache` itself: --version, help with descriptions and defaults, one-line errors with
exit codes, and the library importing none of the tools' optional packages."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

import tiered_cache
from tiered_cache.errors import CapacityError, ConfigError, install_hint
from tiered_cache.tools import cli, command, extras

SCRIPT = Path(sys.executable).parent / "tiered-cache"


def python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)


# --- the library does not import the tools' extra ------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("module", ["tiered_cache", "tiered_cache.cache"])
def test_library_imports_neither_matplotlib_nor_tqdm(module):
    proc = python(f"import sys, {module}; print(sorted(m for m in ('matplotlib', 'tqdm') "
                  "if m in sys.modules))")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


@pytest.mark.slow
def test_building_the_command_line_imports_neither():
    proc = python("import sys; from tiered_cache.tools import cli; cli.build_parser(); "
                  "print(sorted(m for m in ('matplotlib', 'tqdm') if m in sys.modules))")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_missing_extra_names_the_install_line_and_the_way_around_it():
    with pytest.raises(extras.MissingExtraError) as exc:
        extras.require("tiered_cache_no_such_module", "the widget", instead="--no-widget")
    assert str(exc.value) == ("the widget needs tiered_cache_no_such_module, which is not "
                              f"installed: {install_hint('tools')}, or pass --no-widget")
    assert extras.available("json") and not extras.available("tiered_cache_no_such_module")


# --- entry point and --version -------------------------------------------------------------------


def test_script_entry_point_is_the_tools_cli():
    (ep,) = entry_points(group="console_scripts", name="tiered-cache")
    assert ep.value == "tiered_cache.cli:main"
    assert ep.load() is cli.main


def test_version(capsys):
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out == f"tiered-cache {tiered_cache.__version__}\n"


@pytest.mark.slow
@pytest.mark.skipif(not SCRIPT.exists(), reason="console script not installed next to python")
def test_version_from_the_installed_script():
    proc = subprocess.run([str(SCRIPT), "--version"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and proc.stdout == f"tiered-cache {tiered_cache.__version__}\n"


# --- help ----------------------------------------------------------------------------------------


def subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = cli.build_parser()
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def test_every_subcommand_is_listed_and_has_a_description(capsys):
    assert cli.main(["--help"]) == 0
    top = capsys.readouterr().out
    subs = subparsers()
    assert set(subs) == set(cli.COMMANDS)
    for name, parser in subs.items():
        assert name in top
        assert parser.description and len(parser.description) > 40, name
        assert cli.main([name, "--help"]) == 0
        text = capsys.readouterr().out
        assert parser.description.splitlines()[0] in text


@pytest.mark.parametrize("name", sorted(cli.COMMANDS))
def test_help_shows_every_default(name):
    parser = subparsers()[name]
    text = "".join(parser.format_help().split())           # undo the line wrapping
    shown = 0
    for action in parser._actions:
        if not action.option_strings or action.default in (None, False, argparse.SUPPRESS):
            continue
        default = action.default
        if isinstance(default, float) and "%(default)" in (action.help or ""):
            default = f"{default:.3g}"
        assert f"(default:{default})".replace(" ", "") in text, (name, action.option_strings)
        shown += 1
    if name not in ("plan", "serve"):   # their options default to "ask", "off" or the config
        assert shown >= 3


# --- errors and exit codes -----------------------------------------------------------------------


def test_flag_error_is_one_line_naming_the_flag(capsys):
    rc = cli.main(["replay", "--workload", "chat", "--gpu-blocks", "0"])
    err = capsys.readouterr().err
    assert rc == 2
    assert err == ("tiered-cache replay: error: --gpu-blocks: expected a positive integer, got "
                   "0 (see tiered-cache replay --help)\n")


def test_unknown_subcommand_exits_2(capsys):
    assert cli.main(["serve-nothing"]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "invalid choice: 'serve-nothing'" in err


@pytest.mark.parametrize("parse,text,message", [
    (command.positive_int, "0", "expected a positive integer, got 0"),
    (command.positive_int, "1.5", "expected a positive integer, got 1.5"),
    (command.positive_int, "x", "expected a positive integer, got 'x'"),
    (command.non_negative_int, "-1", "expected a non-negative integer, got -1"),
    (command.positive_float, "inf", "expected a positive number, got inf"),
    (command.positive_float, "nan", "expected a positive number, got nan"),
    (command.fraction, "1.5", "expected a number in (0, 1], got 1.5"),
    (command.absolute_size, "50%", "expected an absolute size like '512GiB', got '50%'"),
    (command.absolute_size, "9" * 400 + "GiB", "expected an absolute size like '512GiB'"),
    (command.positive_int_list, "1,0", "expected comma-separated positive integers, got '1,0'"),
    (command.name_list, " , ", "expected comma-separated names, got ' , '"),
])
def test_flag_types_reject_with_a_message(parse, text, message):
    with pytest.raises(argparse.ArgumentTypeError) as exc:
        parse(text)
    assert str(exc.value).startswith(message)


def test_flag_types_accept():
    assert command.positive_int("3") == 3 and command.non_negative_int("0") == 0
    assert command.fraction("1") == 1.0 and command.positive_float("70.6e9") == 70.6e9
    assert command.absolute_size("1KiB") == 1024
    assert command.positive_int_list("500, 1000") == [500, 1000]
    assert command.name_list("lru,arc") == ["lru", "arc"]


def test_config_errors_name_the_flag_or_the_file():
    flags = {"tiers.gpu.num_blocks": "--gpu-blocks"}
    with pytest.raises(ConfigError) as exc:
        with command.config_errors(flags=flags, source="my.yaml"):
            raise ConfigError("tiers.gpu.num_blocks", "expected a positive integer, got 0")
    assert str(exc.value) == "--gpu-blocks: expected a positive integer, got 0"
    with pytest.raises(ConfigError) as exc:
        with command.config_errors(flags=flags, source="my.yaml"):
            raise ConfigError("tiers.host.capacity", "too small")
    assert str(exc.value) == "my.yaml: tiers.host.capacity: too small"
    with pytest.raises(ConfigError) as exc:     # already names the file: unchanged
        with command.config_errors(source="my.yaml"):
            raise ConfigError("my.yaml", "no such config file")
    assert str(exc.value) == "my.yaml: no such config file"
    with pytest.raises(ConfigError) as exc:     # a plain ValueError from config code
        with command.config_errors(source="my.yaml"):
            raise ValueError("Empty module name")
    assert str(exc.value) == "my.yaml: cannot use this value: ValueError: Empty module name"


@pytest.mark.parametrize("error,code", [
    (ConfigError("--x", "bad"), 2),
    (command.UsageError("give a TRACE"), 2),
    (CapacityError("full"), 1),
    (extras.MissingExtraError("needs tqdm"), 1),
    (KeyboardInterrupt(), 130),
])
def test_run_maps_errors_to_one_line_and_an_exit_code(capsys, error, code):
    def body() -> int:
        raise error

    assert command.run(body, "tiered-cache x") == code
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith("tiered-cache x: ")


def test_run_lets_bugs_through():
    def body() -> int:
        raise ZeroDivisionError("a bug keeps its traceback")

    with pytest.raises(ZeroDivisionError):
        command.run(body, "tiered-cache x")


@pytest.mark.slow
def test_closed_stdout_ends_quietly():
    """`tiered-cache replay ... --json | head -c 0`: the reader is gone when the report is
    written; the command ends without a BrokenPipeError traceback (exit code 1)."""
    r, w = os.pipe()
    os.close(r)                     # no reader at all: the first write fails, every time
    code = ("import sys; from tiered_cache.tools.cli import main; "
            "sys.exit(main(['replay', '--workload', 'chat', '--requests', '50', "
            "'--block-size', '16', '--gpu-blocks', '4000', '--json']))")
    try:
        proc = subprocess.run([sys.executable, "-c", code], stdout=w, stderr=subprocess.PIPE,
                              timeout=120)
    finally:
        os.close(w)
    assert proc.returncode == 1
    assert proc.stderr.decode() == ""
