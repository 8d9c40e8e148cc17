"""`tiered-cache` command line: `plan`, `run`, `run-shared`, `run-vllm`, `replay`, `serve`.

Each subcommand is a module with `DESCRIPTION`, `add_arguments(parser)` and `main(args) -> int`;
this file only dispatches. Exit codes and error lines: tiered_cache.tools.command.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from tiered_cache.tools import command

PROG = "tiered-cache"

# subcommand -> (module with DESCRIPTION, add_arguments(parser) and main(args) -> int, help)
COMMANDS = {
    "plan": ("tiered_cache.tools.planner", "how many tokens fit in each tier for a config"),
    "run": ("tiered_cache.tools.mainjob",
            "serve a multi-turn workload through the cache, three ways"),
    "run-shared": ("tiered_cache.tools.sharedjob",
                   "two engine processes sharing one node daemon: reuse across processes"),
    "run-vllm": ("tiered_cache.tools.vllmjob",
                 "the main workload through a real vLLM engine, with and without the connector"),
    "replay": ("tiered_cache.tools.replay", "replay a request trace through the control plane"),
    "serve": ("tiered_cache.daemon.serve", "run the node daemon engines on this node share"),
}


def _version() -> str:
    from tiered_cache import __version__

    return __version__


def build_parser() -> argparse.ArgumentParser:
    parser = command.ArgumentParser(
        prog=PROG, description="A CPU-GPU tiered KV-cache runtime: plan a config, run the "
        "main job, replay a request trace, serve the node daemon.")
    parser.add_argument("--version", action="version", version=f"{PROG} {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        try:
            mod = importlib.import_module(module)
        except ImportError:
            sub.add_parser(name, help=f"{help_text} (not available in this build)")
            continue
        p = sub.add_parser(name, help=help_text, description=mod.DESCRIPTION)
        mod.add_arguments(p)
        p.set_defaults(_main=mod.main)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse `argv` (default: sys.argv[1:]) and run the subcommand; returns the exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:              # --help, --version, usage errors (already printed)
        return exc.code if isinstance(exc.code, int) else command.EXIT_USAGE
    prog = f"{PROG} {args.command}"
    if not hasattr(args, "_main"):
        print(f"{prog}: not available in this build", file=sys.stderr)
        return command.EXIT_USAGE
    return command.run(lambda: args._main(args), prog)


if __name__ == "__main__":
    sys.exit(main())
