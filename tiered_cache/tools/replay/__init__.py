"""`tiered-cache replay`: replay a request trace through the real control plane.

One concept per module:

- `trace`: the JSONL record schema, reading and checking traces (`load_trace`, `TraceError`);
- `costs`: the prefill time a hit saves (`CostModel`, the default 70B geometry);
- `driver`: the replay and the sweep over a storage-free `TieredKVCache` (`replay`, `sweep`);
- `report`: the text report, the sweep table and the sweep plot;
- `cli`: the command line (`add_arguments`, `main`).

This package re-exports the names that tests, benchmarks and notebooks use.
"""

from tiered_cache.tools.replay.cli import DESCRIPTION, add_arguments, main
from tiered_cache.tools.replay.costs import MODEL_70B, CostModel
from tiered_cache.tools.replay.driver import (
    DEFAULT_CAPACITIES,
    DEFAULT_POLICY,
    DEFAULT_SWEEP_POLICIES,
    SweepSpec,
    attach_oracle,
    build_cache,
    replay,
    replay_config,
    split_capacity,
    sweep,
)
from tiered_cache.tools.replay.report import format_report, plot_sweep, sweep_figure, sweep_table
from tiered_cache.tools.replay.trace import (
    MAX_ID,
    TraceError,
    check_request,
    load_trace,
    requests_from,
)

__all__ = [
    "DESCRIPTION", "add_arguments", "main",
    "MODEL_70B", "CostModel",
    "DEFAULT_CAPACITIES", "DEFAULT_POLICY", "DEFAULT_SWEEP_POLICIES", "SweepSpec",
    "attach_oracle", "build_cache", "replay", "replay_config", "split_capacity", "sweep",
    "format_report", "plot_sweep", "sweep_figure", "sweep_table",
    "MAX_ID", "TraceError", "check_request", "load_trace", "requests_from",
]
