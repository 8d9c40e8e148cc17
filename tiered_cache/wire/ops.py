"""The node daemon's operations (protocol version 1): what an engine process may ask.

Every request and reply is a flat msgpack map checked field by field (wire/protocol.py); the
schemas below are the documentation of the wire format (docs/daemon.md renders them).

A session::

    hello                      -> client id, lease, tenant salt, namespace, staging size
    attach                     -> two fds (SCM_RIGHTS): the tenant's pool (read-only) and this
                                  client's staging area (read-write), with their geometry
    root   {salt, adapter}     -> the root key of that salt and adapter in the client's tenant
    fetch  {root, parent, tokens, wait_ms}
                               -> a handle pinning the leading blocks found, and their slots
    release {handle}           -> whether the handle was still held (if not, what was copied
                                  under it is void: the lease had expired)
    publish {root, entries}    -> which staged blocks the daemon took into the pool
    lookup {root, parent, tokens} -> how many leading blocks are cached (no pin)
    invalidate {root, tokens}  -> blocks dropped
    heartbeat                  -> renews the lease
    stats                      -> the daemon's tiers and counters (JSON)

NOTE: a client names a root only by a key the daemon derived for it (`root`): the tenant part
of the salt comes from the client's socket credentials, so no salt a client sends can reach
another tenant's blocks; and each tenant's pool is its own memfd, so no mapping can either.
"""

from __future__ import annotations

from tiered_cache.wire.protocol import (
    MAX_ID,
    Bool,
    Bytes,
    Float,
    Int,
    IntArray,
    IntList,
    ListOf,
    Op,
    Protocol,
    Str,
    Struct,
    key,
)
from tiered_cache.wire.shm import GEOMETRY_FIELDS

MAX_BLOCKS = 4096           # blocks in one fetch, lookup or publish
MAX_TOKENS = 1 << 20        # token ids in one request (4 MiB)
MAX_SALT = 1024
_ID = Int(0, MAX_ID)
_SLOT = Int(0, 2**31 - 1)
_ROOT_FIELDS = {"salt": Bytes(MAX_SALT, optional=True), "adapter": Str(64, optional=True)}
_RANGE = {"root": key(), "parent": key(), "tokens": IntArray(0, 2**31 - 1, MAX_TOKENS)}

ENTRY = Struct({
    "slot": _SLOT,                          # staging slot the client copied the block into
    "key": key(), "parent": key(),          # chained key, and the parent's (root at depth 0)
    "depth": Int(0, 2**31 - 1),
    "tokens": Bytes(4 << 16),               # int32 token ids of the block
    "hits": Int(0, 2**31 - 1),
})

OPS = [
    Op("hello", reply={
        "client": _ID, "lease_s": Float(0.0, 1e6), "tenant": Str(64, 1),
        "salt": Bytes(MAX_SALT, 1), "namespace": Bytes(16, 16), "staging_slots": _SLOT,
        "pid": Int(0, 2**31 - 1)},
        doc="grants a lease; names the client's tenant (from its credentials) and its salt"),
    Op("attach", reply={**GEOMETRY_FIELDS, "staging_slots": _SLOT},
       doc="fds: the tenant's pool (read-only), then this client's staging area"),
    Op("heartbeat", reply={"expires_in_s": Float(-1e6, 1e6)}),
    Op("root", _ROOT_FIELDS, {"root": key()}),
    Op("fetch", {**_RANGE, "wait_ms": Int(0, 60_000)},
       {"handle": _ID, "slots": IntList(0, 2**31 - 1, MAX_BLOCKS)},
       doc="pin the leading cached blocks of `tokens` (whole blocks) after `parent`; handle 0 "
           "and no slots when none is cached"),
    Op("release", {"handle": _ID}, {"held": Bool()}),
    Op("publish", {"root": key(), "entries": ListOf(ENTRY, MAX_BLOCKS, 1)},
       {"taken": IntList(0, 1, MAX_BLOCKS)}),
    Op("lookup", _RANGE, {"blocks": Int(0, MAX_BLOCKS * 64)}),
    Op("invalidate", {"root": key(), "tokens": IntArray(0, 2**31 - 1, MAX_TOKENS)},
       {"blocks": Int(0, 2**63 - 1)}),
    Op("stats", reply={"json": Str(1 << 20)}),
]


def make_protocol(max_frame: int = 8 << 20) -> Protocol:
    return Protocol(OPS, max_frame=max_frame)
