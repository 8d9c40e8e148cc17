"""What a replay prints and draws: the one-replay report, the sweep table and the sweep plot.

The plot has two rows per tier layout: the token hit rate against capacity, and the same runs
divided by LRU's hit rate. The second row is the one to read: the online policies differ by
5-17%, which in the first row is lines drawn on top of each other, and in the second is the
distance from the 1.0 line. Belady (the offline optimum, often 1.5x or more) stays in the first
row only: on the ratio axis it would squash the differences the row is there to show.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from tiered_cache.tools import extras
from tiered_cache.tools.replay.driver import BASELINE_POLICY, DEFAULT_POLICY

GiB = 1024**3
OFFLINE_POLICY = "belady"
"""The offline optimum: a reference line in the hit-rate row, left out of the ratio row."""


def format_report(r: dict[str, Any]) -> str:
    """The report of one `replay()` as aligned lines of text."""
    tiers = list(r["hit_rate_by_tier"])
    lines = [
        f"trace {r.get('trace', '?')}: {r['requests']} requests, {r['requested_blocks']} blocks "
        f"of {r['block_size']} tokens; policy {r['policy']}; gpu {r['gpu_blocks']} + host "
        f"{r['host_blocks']}" + (f" + disk {r['disk_blocks']}" if r.get("disk_blocks") else "")
        + f" blocks ({r['block_bytes'] / 2**20:.0f} MiB each)",
        f"token hit rate      {r['token_hit_rate']:.4f}  (" + ", ".join(
            f"{t} {r['hit_rate_by_tier'][t]:.4f}" for t in tiers) + ")",
        "evictions           " + ", ".join(f"{t} {r['evictions'][t]}" for t in tiers)
        + f"  (dropped {r['dropped_blocks']})",
        f"promotions          {r['promotions']['blocks']} blocks, "
        f"{r['promotions']['bytes'] / GiB:.1f} GiB",
        f"demotions           {r['demotions']['blocks']} blocks, "
        f"{r['demotions']['bytes'] / GiB:.1f} GiB",
        f"bytes moved         {r['bytes_moved'] / GiB:.1f} GiB (incl. write-through "
        f"{r['write_through']['bytes'] / GiB:.1f} GiB)",
        f"prefill saved       {r['prefill_seconds_saved']:.1f} s "
        f"(compute {r['prefill_compute_seconds_saved']:.1f} s - host transfers "
        f"{r['host_transfer_seconds']:.1f} s; {r['cost_model']['peak_tflops']:g} TFLOP/s x MFU "
        f"{r['cost_model']['mfu']:g}, PCIe {r['cost_model']['pcie_gbps']:g} GB/s)",
    ]
    if r["oversized_requests"]:
        lines.append(f"oversized           {r['oversized_requests']} requests larger than the "
                     "device tier (counted as misses)")
    lines.append(f"replay speed        {r['block_ops_per_s']:,.0f} block ops/s "
                 f"({r['block_ops']} ops in {r['replay_seconds']:.2f} s)")
    return "\n".join(lines)


def sweep_table(result: dict[str, Any]) -> str:
    """Text table: one line per (tiers, capacity), hit rate per policy (and x LRU)."""
    pols = result["policies"]
    lines = []
    head = f"{'tiers':6} {'capacity':>8} {'gpu+host':>13}  " + "  ".join(
        f"{p:>15}" for p in pols)
    lines.append(head)
    lines.append("-" * len(head))
    idx = {(r["tiers"], r["capacity"], r["policy"]): r for r in result["rows"]}
    for mode in result["tiers"]:
        for cap in result["capacities"]:
            any_row = next((idx[(mode, cap, p)] for p in pols if (mode, cap, p) in idx), None)
            if any_row is None:
                continue
            split = f"{any_row['gpu_blocks']}+{any_row['host_blocks']}"
            cells = []
            for p in pols:
                r = idx.get((mode, cap, p))
                if r is None:
                    cells.append(f"{'':>15}")
                    continue
                v = r["vs_lru"]
                cells.append(f"{r['token_hit_rate']:.3f} ({v:.2f}x)".rjust(15) if v else
                             f"{r['token_hit_rate']:.3f}".rjust(15))
            lines.append(f"{mode:6} {cap:>8} {split:>13}  " + "  ".join(cells))
    return "\n".join(lines)


def _style(policy: str) -> dict[str, Any]:
    if policy == OFFLINE_POLICY:            # a reference, not a contender
        return {"linestyle": "--", "color": "black"}
    if policy == DEFAULT_POLICY:
        return {"linewidth": 2.5}
    if policy == BASELINE_POLICY:
        return {"color": "grey"}
    return {}


def _points(result: dict[str, Any], mode: str, policy: str, key: str) -> list[tuple[int, float]]:
    return sorted((r["capacity"], r[key]) for r in result["rows"]
                  if r["tiers"] == mode and r["policy"] == policy and r[key] is not None)


def sweep_figure(result: dict[str, Any], title: str = "") -> Any:
    """The sweep as a matplotlib Figure: one column per tier layout; the top row is the token
    hit rate against total capacity, one line per policy; the bottom row (when the sweep ran
    LRU) is each online policy's hit rate divided by LRU's at the same capacity."""
    plt = extras.pyplot()
    modes = result["tiers"]
    ratios = any(r.get("vs_lru") is not None for r in result["rows"])
    nrows = 2 if ratios else 1
    fig, axes = plt.subplots(nrows, len(modes), figsize=(6.5 * len(modes), 4.6 * nrows),
                             squeeze=False, sharex="col")
    for col, mode in enumerate(modes):
        ax = axes[0][col]
        for pol in result["policies"]:
            pts = _points(result, mode, pol, "token_hit_rate")
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3,
                        label=pol, **_style(pol))
        ax.set_xscale("log")
        ax.set_ylabel("token hit rate")
        sub = ("device tier only" if mode == "single" else
               f"device {result['gpu_fraction']:.0%} + host (device >= largest request)")
        ax.set_title(f"{title} - {sub}" if title else sub, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        if ratios:
            ax = axes[1][col]
            ax.axhline(1.0, color="grey", linewidth=1)
            for pol in result["policies"]:
                pts = _points(result, mode, pol, "vs_lru")
                if pts and pol not in (BASELINE_POLICY, OFFLINE_POLICY):
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                            markersize=3, label=pol, **_style(pol))
            ax.set_xscale("log")
            ax.set_ylabel(f"token hit rate / {BASELINE_POLICY}'s")
            ax.set_title(f"ratio to {BASELINE_POLICY}, online policies ({sub})", fontsize=10)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
        axes[-1][col].set_xlabel(f"capacity (blocks of {result['block_size']} tokens)")
    fig.tight_layout()
    return fig


def plot_sweep(result: dict[str, Any], path: str | os.PathLike, title: str = "") -> Path:
    """Write `sweep_figure(result, title)` as a PNG; returns its path."""
    return extras.save_figure(sweep_figure(result, title), path, dpi=110)
