"""`tiered-cache` command line: `plan`, `run`, `replay`."""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module with add_arguments(parser) and main(args) -> int, help)
COMMANDS = {
    "plan": ("tiered_cache.planner", "how many tokens fit in each tier for a config"),
    "run": ("tiered_cache.mainjob", "serve a multi-turn workload through the cache, three ways"),
    "replay": ("tiered_cache.replay", "replay a request trace through the control plane"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tiered-cache", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        try:
            mod = importlib.import_module(module)
        except ImportError:
            continue
        mod.add_arguments(p)
        p.set_defaults(_main=mod.main)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not hasattr(args, "_main"):
        print(f"tiered-cache {args.command}: not available in this build", file=sys.stderr)
        return 2
    from tiered_cache.errors import TieredCacheError

    try:
        return int(args._main(args) or 0)
    except TieredCacheError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
