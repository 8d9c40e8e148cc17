"""The node daemon `tiered-cache serve`: the server above the data plane.

- `serve`: the command (config, signals, READY line, SIGTERM drain).
- `service`: NodeService, the op handlers over the tenants' partitions (clients, leases,
  handles, staging areas).
- `partition`: one tenant's tiers (a stack built by tiered_cache.tiers.build_stack).
- `leases`: client -> expiry, with a reaper that reports each ended lease exactly once.
- `observe`: /metrics and /health.
- `process`: a daemon as a child process (`tiered-cache run-shared`, tests, benchmarks).

The wire (protocol, transport, client, shared memory) is tiered_cache.wire, below the data
plane; nothing below this package imports it.
"""
