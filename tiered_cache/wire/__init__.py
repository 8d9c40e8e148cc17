"""The node daemon's wire layer: what both ends of its socket share, below the data plane.

- `protocol`: the wire format (length-prefixed msgpack maps, a declarative schema per op);
  `framing`: frames over a stream socket; `ops`: the node daemon's ops (protocol v1).
- `transport`: the Unix-socket server (SO_PEERCRED allowlist, frame limits, graceful stop);
  `peer`: a connection's identity from the kernel, and the allowlist.
- `client`: the engine's connection (request/response, timeouts, reconnect) and its heartbeat.
- `shm`: the shared host pool's memory (a sealed memfd passed with SCM_RIGHTS) and its views.
- `errors`: the typed errors, and their names on the wire.

Nothing here imports the data plane, the control plane or the server (tiered_cache.daemon);
the data plane's daemon tier (data/daemon_tier.py) is built on it. Submodules are imported on
use: only `shm` needs torch (for tensor views, on demand).
"""
