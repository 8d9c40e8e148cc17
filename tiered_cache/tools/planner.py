"""`tiered-cache plan`: how many blocks and tokens each tier of a config holds.

    tiered-cache plan --config configs/llama-70b-h200.yaml
    tiered-cache plan --config my.yaml --gpu-memory 80GiB --host-memory 512GiB --json

`--gpu-memory` / `--host-memory` set the free memory that a `"70%"` capacity applies to, so an
operator can plan for a machine they are not on. Sizes given in bytes or `num_blocks` don't
depend on the machine. No torch is imported unless a `"%"` GPU capacity must ask CUDA.

The tiers are those an engine builds from the config (the registered tier kinds, without the
ones another replaces: an engine attached to the node daemon builds no host tier); the keyed
tiers beneath them (remote, daemon) hold no slots of this process and are listed below the
table, with where a block the GPU evicts goes.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from tiered_cache import sizing
from tiered_cache.config import CacheConfig, DaemonConfig
from tiered_cache.errors import ConfigError, TierUnavailableError
from tiered_cache.tiers.base import ENGINE, KEYED, TierKind, kinds
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


class KeyedPlan(NamedTuple):
    """A keyed tier beneath the slot tiers: no slots of this process; sized elsewhere."""

    name: str
    where: str
    """What holds its blocks ("the node daemon at /run/...", "redis://host:6379/0")."""
    write: str
    """Its `write` key: which blocks this engine puts there (`off`: read only)."""
    sized_by: str
    """What sets its size."""


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
    beneath: list[KeyedPlan] = field(default_factory=list)
    """The keyed tiers (remote, daemon), in the order open() consults them."""

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
            "beneath": [k._asdict() for k in self.beneath],
            "notes": list(self.notes),
        }


def engine_kinds(config: CacheConfig) -> list[TierKind]:
    """The tier kinds an engine builds from `config`, in order: configured in the engine
    role, without those another configured kind replaces (as the stack builder chooses)."""
    configured = [kind for kind in kinds().values()
                  if ENGINE in kind.roles and getattr(config.tiers, kind.name) is not None]
    replaced = {name for kind in configured for name in kind.needs.replaces}
    return [kind for kind in configured if kind.name not in replaced]


def _keyed(config: CacheConfig, kind: TierKind) -> KeyedPlan:
    section = getattr(config.tiers, kind.name)
    where, bound = kind.where(section)
    return KeyedPlan(kind.name, where, str(getattr(section, "write", "off")), bound)


def _where_evictions_go(slots: list[TierPlan], beneath: list[KeyedPlan]) -> list[str]:
    """Notes: what happens to a block the device tier evicts, and what each keyed tier gets."""
    notes = []
    below = next((t for t in slots[1:] if t.num_blocks > 0), None)
    device = slots[0].name
    written = [k for k in beneath if k.write == "on_compute"]
    if below is None and written:
        names = ", ".join(k.where for k in written)
        notes.append(f"no host tier in this process: every block it computes is also "
                     f"published to {names} (write: on_compute), so a block the "
                     f"{device.upper()} evicts is not lost: open() finds it there (until "
                     f"that tier evicts it in turn), as the other engines do")
    elif below is None:
        notes.append(f"no host tier: blocks evicted from the {device.upper()} are dropped")
    for k in beneath:
        if k.write == "off":
            notes.append(f"tiers.{k.name}.write: off: {k.where} is only read from")
        elif k.write == "on_host":
            notes.append(f"tiers.{k.name}.write: on_host: blocks that reach the host tier are "
                         f"put to {k.where}")
        elif below is not None:
            notes.append(f"tiers.{k.name}.write: on_compute: every computed block is also "
                         f"put to {k.where}")
        notes.append(f"tiers.{k.name}: its capacity is set by {k.sized_by}, not here")
    return notes


def make_plan(config: CacheConfig, gpu_free: int | None = None,
              host_free: int | None = None, disk_free: int | None = None) -> Plan:
    """Blocks, bytes and tokens per tier. `gpu_free`/`host_free`/`disk_free` are the free bytes
    that a `"%"` capacity applies to (None: ask this machine)."""
    block = config.block_bytes
    tiers = []
    free_of = {"gpu": gpu_free, "host": host_free, "disk": disk_free}
    chosen = engine_kinds(config)
    for kind in (k for k in chosen if k.shape != KEYED):
        n = sizing.tier_num_blocks(config, kind.name, free_of.get(kind.name))
        # bytes where the tier lives: on disk a slot also takes its header and alignment
        tiers.append(TierPlan(kind.name, n, n * sizing.tier_slot_bytes(config, kind.name),
                              n * config.block_size))
    beneath = [_keyed(config, kind) for kind in chosen if kind.shape == KEYED]
    notes = _where_evictions_go(tiers, beneath)
    if config.write_policy == "write_through" and any(t.num_blocks for t in tiers[1:]):
        notes.append("write_through copies each full GPU block to host, so the tiers overlap: "
                     "the total counts slots, not distinct tokens")
    if config.daemon != DaemonConfig():
        notes.append("this config has a daemon: section (the node daemon's): under "
                     "`tiered-cache serve` tiers.gpu is not built, and the host and disk tiers "
                     "above are what each tenant partition gets")
    return Plan(
        bytes_per_token=config.bytes_per_token,
        bytes_per_block=block,
        block_size=config.block_size,
        tiers=tiers,
        total_tokens=sum(t.tokens for t in tiers),
        model=config.model.name,
        write_policy=config.write_policy,
        notes=notes,
        beneath=beneath,
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
    lines.extend(f"beneath: {k.name}: {k.where} (write: {k.write})" for k in plan.beneath)
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
