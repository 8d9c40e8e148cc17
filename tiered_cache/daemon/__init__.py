"""The node daemon's foundations: one process per node owns the shared tiers, engines attach.

- `protocol`: the wire format (length-prefixed msgpack maps, a declarative schema per op).
- `transport`: the Unix-socket server (SO_PEERCRED allowlist, frame limits, graceful stop).
- `client`: the engine's connection (request/response, timeouts, reconnect) and its heartbeat.
- `peer`: a connection's identity from the kernel, and the allowlist.
- `leases`: client -> expiry, with a reaper that reports each ended lease exactly once.
- `shm`: the shared host pool's memory (a sealed memfd passed with SCM_RIGHTS) and its views.
- `errors`: the typed errors, and their names on the wire.
- `testing`: a reference daemon over all of these, run as a process by tests and benchmarks.

Submodules are imported on use: only `shm` needs torch.
"""
