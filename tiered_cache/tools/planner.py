"""`tiered-cache plan`: how many blocks and tokens each tier of a config holds.

    tiered-cache plan --config configs/llama-70b-h200.yaml
    tiered-cache plan --config my.yaml --gpu-memory 80GiB --host-memory 512GiB --json

`--gpu-memory` / `--host-memory` set the free memory that a `"70%"` capacity applies to, so an
operator can plan for a machine they are not on. Sizes given in bytes or `num_blocks` don't
depend on the machine. No torch is imported unless a `"%"` GPU capacity must ask CUDA.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from tiered_cache import sizing
from tiered_cache.config import CacheConfig
from tiered_cache.errors import ConfigError, TierUnavailableError
from tiered_cache.tools import command

DESCRIPTION = """\
How many blocks, bytes and tokens each tier of a config holds, and the bytes per token and
per block of its model geometry. --gpu-memory / --host-memory set the free memory that a "70%"
capacity applies to, so you can plan for a machine you are not on.

examples:
  tiered-cache plan --config configs/llama-70b-h200.yaml
  tiered-cache plan --config my.yaml --gpu-memory 80GiB --host-memory 512GiB --json"""


class TierPlan(NamedTuple):
    name: str
    num_blocks: int
    bytes: int
    tokens: int


@dataclass
class Plan:
    bytes_per_token: int
    bytes_per_block: int
    block_size: int
    tiers: list[TierPlan]
    total_tokens: int
    """Sum of the token slots of every tier."""
    model: str = ""
    write_policy: str = "write_back"
    notes: list[str] = field(default_factory=list)

    @property
    def total_blocks(self) -> int:
        return sum(t.num_blocks for t in self.tiers)

    @property
    def total_bytes(self) -> int:
        return sum(t.bytes for t in self.tiers)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "block_size": self.block_size,
            "bytes_per_token": self.bytes_per_token,
            "bytes_per_block": self.bytes_per_block,
            "write_policy": self.write_policy,
            "tiers": [t._asdict() for t in self.tiers],
            "total_blocks": self.total_blocks,
            "total_bytes": self.total_bytes,
            "total_tokens": self.total_tokens,
            "notes": list(self.notes),
        }


def make_plan(config: CacheConfig, gpu_free: int | None = None,
              host_free: int | None = None, disk_free: int | None = None) -> Plan:
    """Blocks, bytes and tokens per tier. `gpu_free`/`host_free`/`disk_free` are the free bytes
    that a `"%"` capacity applies to (None: ask this machine)."""
    block = config.block_bytes
    tiers = []
    names = [("gpu", gpu_free), ("host", host_free)]
    if config.tiers.disk is not None:
        names.append(("disk", disk_free))
    for name, free in names:
        n = sizing.tier_num_blocks(config, name, free)
        # bytes where the tier lives: on disk a slot also takes its header and alignment
        tiers.append(TierPlan(name, n, n * sizing.tier_slot_bytes(config, name),
                              n * config.block_size))
    notes = []
    host = tiers[1]
    if host.num_blocks == 0:
        notes.append("no host tier: blocks evicted from the GPU are dropped")
    elif config.write_policy == "write_through":
        notes.append("write_through copies each full GPU block to host, so the tiers overlap: "
                     "the total counts slots, not distinct tokens")
    return Plan(
        bytes_per_token=config.bytes_per_token,
        bytes_per_block=block,
        block_size=config.block_size,
        tiers=tiers,
        total_tokens=sum(t.tokens for t in tiers),
        model=config.model.name,
        write_policy=config.write_policy,
        notes=notes,
    )


def _gib(n: int) -> str:
    return f"{n / sizing.GiB:,.2f}"


def format_plan(plan: Plan) -> str:
    """A readable table: thousands separators, bytes also in GiB."""
    lines = [
        f"model            {plan.model}",
        f"bytes per token  {plan.bytes_per_token:,} ({sizing.format_bytes(plan.bytes_per_token)})",
        f"block size       {plan.block_size:,} tokens",
        f"bytes per block  {plan.bytes_per_block:,} ({sizing.format_bytes(plan.bytes_per_block)})",
        "",
    ]
    header = ("tier", "blocks", "bytes", "GiB", "tokens")
    rows = [(t.name, f"{t.num_blocks:,}", f"{t.bytes:,}", _gib(t.bytes), f"{t.tokens:,}")
            for t in plan.tiers]
    rows.append(("total", f"{plan.total_blocks:,}", f"{plan.total_bytes:,}",
                 _gib(plan.total_bytes), f"{plan.total_tokens:,}"))
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def fmt(row: tuple[str, ...]) -> str:
        first = row[0].ljust(widths[0])
        rest = (cell.rjust(w) for cell, w in zip(row[1:], widths[1:], strict=True))
        return "  ".join([first, *rest])

    lines.append(fmt(header))
    lines.append("  ".join("-" * w for w in widths))
    lines.extend(fmt(r) for r in rows[:-1])
    lines.append("  ".join("-" * w for w in widths))
    lines.append(fmt(rows[-1]))
    lines.extend(f"note: {n}" for n in plan.notes)
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", default=None,
                        help="YAML config (default: the embedded default config)")
    parser.add_argument("--gpu-memory", metavar="SIZE", type=command.absolute_size,
                        default=None,
                        help="free GPU memory that a '%%' gpu capacity applies to, e.g. 80GiB "
                             "(default: ask this machine)")
    parser.add_argument("--host-memory", metavar="SIZE", type=command.absolute_size,
                        default=None,
                        help="free host memory that a '%%' host capacity applies to, e.g. 512GiB "
                             "(default: ask this machine)")
    parser.add_argument("--disk-space", metavar="SIZE", type=command.absolute_size,
                        default=None,
                        help="free disk space that a '%%' disk capacity applies to, e.g. 2TiB "
                             "(default: ask this machine, at tiers.disk.path)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _free_override(free: int | None, option: str, capacity: Any) -> int | None:
    """`free`, with a note on stderr when the tier's size does not depend on it."""
    if free is not None and (capacity is None
                             or sizing.parse_size(capacity, option)[0] != "fraction"):
        print(f"note: {option} is ignored: that tier's size is not a '%' capacity",
              file=sys.stderr)
    return free


def main(args: argparse.Namespace) -> int:
    """Print the plan (table, or JSON with --json). Bad input raises ConfigError naming the
    flag, or the config file and key."""
    config = command.load_config(args.config)
    source = args.config or "<default config>"
    try:
        with command.config_errors(source=source):
            gpu_free = _free_override(args.gpu_memory, "--gpu-memory",
                                      config.tiers.gpu.capacity)
            host_free = _free_override(args.host_memory, "--host-memory",
                                       config.tiers.host.capacity)
            disk = config.tiers.disk
            disk_free = _free_override(args.disk_space, "--disk-space",
                                       disk.capacity if disk is not None else None)
            plan = make_plan(config, gpu_free=gpu_free, host_free=host_free,
                             disk_free=disk_free)
    except TierUnavailableError as exc:
        raise ConfigError(source, f"{exc}; pass --gpu-memory SIZE to plan for a GPU this "
                                  "machine does not have") from None
    if args.json:
        print(json.dumps(plan.to_dict(), indent=2))
    else:
        print(format_plan(plan))
    return 0


if __name__ == "__main__":  # pragma: no cover
    from tiered_cache.tools.cli import main as cli_main

    sys.exit(cli_main(["plan", *sys.argv[1:]]))
