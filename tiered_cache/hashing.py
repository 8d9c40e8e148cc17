"""Block identity: 128-bit chained keys, stable across processes and restarts.

key(block i) = H(key(block i-1) || token ids of block i as int32 little-endian bytes), and
key(block -1) = H(namespace), where the namespace folds in the model id, the KV dtype, the cache
geometry, the adapter id and the tenant salt. Equal keys therefore mean "same tokens at the same
position after the same prefix, for the same model and tenant".

NOTE: never Python's `hash()` (salted per process). xxh3-128 is used for speed; the hash function
is injectable so tests can prove that a deliberately weak hash never returns another prompt's KV
(the cache compares stored tokens on every match when `verify_tokens` is on).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from tiered_cache.errors import TokenError
from tiered_cache.jit import LazyModule

HashFn = Callable[[bytes], bytes]
MAX_TOKEN_ID = 2**31 - 1
_VERSION = b"tiered-cache/block-key/v1"


# The C function itself, not a wrapper: it runs once per block on every open().
xxh3_128: HashFn = xxhash.xxh3_128_digest


@dataclass(frozen=True)
class Namespace:
    """Everything besides the tokens that makes two blocks' KV differ."""

    model: str
    kv_dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    adapter_id: str | None = None

    def encode(self, salt: str | bytes | None) -> bytes:
        fields = {
            "model": self.model, "kv_dtype": self.kv_dtype, "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim,
            "block_size": self.block_size, "adapter_id": self.adapter_id,
        }
        if isinstance(salt, bytes):
            salt_bytes = salt
        elif salt is None:
            salt_bytes = b""
        else:
            salt_bytes = salt.encode()
        body = json.dumps(fields, sort_keys=True).encode()
        # Length-prefix the salt so that no (namespace, salt) pair can alias another.
        return _VERSION + b"\0" + body + b"\0" + len(salt_bytes).to_bytes(4, "little") + salt_bytes


class BlockHasher:
    def __init__(self, namespace: Namespace, hash_fn: HashFn = xxh3_128, *,
                 tenant: bytes = b"") -> None:
        self.namespace = namespace
        self.hash_fn = hash_fn
        self.tenant = tenant
        self._roots: dict[tuple[str | bytes | None, str | None], tuple[bytes, int]] = {}
        self._root_ids: dict[bytes, int] = {}
        self._by_key: dict[bytes, list[int]] = {}     # root key -> ids of its preimages
        self._record_ids: dict[bytes, int] = {}       # root key -> id of its records
        self._ambiguous: set[int] = set()             # record ids no preimage may adopt
        self._next_id = itertools.count()
        self._compiled: bool | None = None            # `keys` in one compiled call?

    def root(self, salt: str | bytes | None = None,
             adapter_id: str | None = None) -> tuple[bytes, int]:
        """Key of the empty prefix for this tenant salt (and adapter, overriding the config's),
        and a small id of its exact preimage.

        NOTE: depth-0 blocks store the root id and a match compares it, so tenant isolation holds
        even if the hash collides (the same way token verification guards every other block).
        """
        cache_key = (salt, adapter_id)
        found = self._roots.get(cache_key)
        if found is None:
            ns = self.namespace
            if adapter_id is not None:
                ns = Namespace(ns.model, ns.kv_dtype, ns.num_layers, ns.num_kv_heads,
                               ns.head_dim, ns.block_size, adapter_id)
            preimage = ns.encode(tenant_salt(self.tenant, salt))
            key = self.hash_fn(preimage)
            root_id = self._root_ids.get(preimage)
            if root_id is None:
                root_id = self._adopt(key)
                self._root_ids[preimage] = root_id
                self._by_key.setdefault(key, []).append(root_id)
            found = (key, root_id)
            self._roots[cache_key] = found
        return found

    def set_tenant(self, tenant: bytes) -> None:
        """Key every root from now on under `tenant` (the salt the node daemon assigned this
        client, see `tenant_salt`). Roots already handed out keep their keys and ids: blocks
        cached under them stay valid where they are, and are simply not found by new opens.
        Lock of the index held by the caller."""
        if tenant != self.tenant:
            self.tenant = tenant
            self._roots.clear()

    def _adopt(self, key: bytes) -> int:
        """An id for a new preimage: the id of records under its key (a restart, another
        process) if those records can only be this root's, else a fresh one."""
        rid = self._record_ids.get(key)
        if rid is not None and key not in self._by_key and rid not in self._ambiguous:
            return rid
        return next(self._next_id)

    def root_id_for_key(self, key: bytes) -> int:
        """The id of a root known only by its key (from a persisted record).

        NOTE: a record names its tenant by the root key alone (the salt is never written
        down), so a restart matches recovered depth-0 blocks by root key, a 128-bit hash. Two
        preimages with one key (a broken hash function) make the key ambiguous: its records get
        an id no tenant will ever have, so a collision can only cost misses, never another
        tenant's KV. The chained keys, parents and token ids of every block are still checked
        as for any other block."""
        rid = self._record_ids.get(key)
        if rid is None:
            ids = self._by_key.get(key, [])
            rid = ids[0] if len(ids) == 1 else next(self._next_id)
            if len(ids) > 1:
                self._ambiguous.add(rid)
            self._record_ids[key] = rid
        return rid

    def namespace_digest(self) -> bytes:
        """16 bytes naming the model, KV dtype, geometry and block size (not the adapter or
        tenant, which the root key carries): persisted records of another namespace are
        never read. Always xxh3-128, whatever hash function keys blocks."""
        ns = self.namespace
        body = json.dumps({"model": ns.model, "kv_dtype": ns.kv_dtype,
                           "num_layers": ns.num_layers, "num_kv_heads": ns.num_kv_heads,
                           "head_dim": ns.head_dim, "block_size": ns.block_size},
                          sort_keys=True).encode()
        return xxhash.xxh3_128_digest(_VERSION + b"\0namespace\0" + body)

    def key(self, parent: bytes, token_bytes: bytes) -> bytes:
        return self.hash_fn(parent + token_bytes)

    def warm_up(self) -> None:
        """Compile (or load from numba's disk cache) the chained-key kernel now, if `keys` will
        use it: a fresh daemon's first lookup paid for it (about 200 ms here), four times a
        50 ms lookup deadline."""
        self.compiled  # noqa: B018 - the property compiles on first read

    @property
    def compiled(self) -> bool:
        """Whether `keys` computes chained keys in one compiled call (the default hash
        function and a block size tiered_cache.xxh3 handles) rather than block by block."""
        fast = self._compiled
        if fast is None:
            fast = self.hash_fn is xxh3_128 and _xxh3().fits(self.namespace.block_size)
            if fast:
                _xxh3().warm_up()
            self._compiled = fast
        return fast

    def keys(self, parent: bytes, tokens: np.ndarray, first: int, n: int) -> bytes:
        """The chained keys of blocks first .. first + n - 1 of `tokens` (int32) after the
        block keyed `parent`, joined (16 bytes each): what `key` gives block by block."""
        bs = self.namespace.block_size
        if self.compiled:
            return _xxh3().chain_keys(parent, tokens[first * bs:(first + n) * bs], bs, n)
        data = tokens[first * bs:(first + n) * bs].tobytes()
        h, key, nbytes, out = self.hash_fn, parent, 4 * bs, []
        for off in range(0, n * nbytes, nbytes):
            key = h(key + data[off:off + nbytes])
            out.append(key)
        return b"".join(out)

    def chain(self, parent: bytes, tokens: np.ndarray) -> list[bytes]:
        """Chained keys of the whole blocks of `tokens` (token ids) after the block keyed
        `parent` (a root key: from the start of a prompt)."""
        data = np.ascontiguousarray(tokens, dtype=np.int32).tobytes()
        nbytes = 4 * self.namespace.block_size
        h, key, keys = self.hash_fn, parent, []
        for off in range(0, len(data) - nbytes + 1, nbytes):
            key = h(key + data[off:off + nbytes])
            keys.append(key)
        return keys


_xxh3_module = LazyModule("tiered_cache.xxh3")


def _xxh3():
    """tiered_cache.xxh3 (numba), imported on first use (tiered_cache/jit.py LazyModule; an
    import statement per call cost the daemon's `adopt` ~0.5 us): `import
    tiered_cache.hashing` stays light."""
    return _xxh3_module


def tenant_salt(tenant: bytes, salt: str | bytes | None) -> str | bytes | None:
    """The salt a root is keyed by when a node daemon assigned the tenant `tenant`: the
    tenant, length-prefixed, then the request's own salt. The daemon derives it from the
    client's socket credentials, so no salt a client chooses can name another tenant's root.
    Without a tenant the request's salt is used as is."""
    if not tenant:
        return salt
    own = salt if isinstance(salt, bytes) else (salt or "").encode()
    return b"tenant\0" + len(tenant).to_bytes(4, "little") + tenant + own


def _out_of_range(arr: np.ndarray) -> bool:
    """Whether a non-empty integer array holds an id outside [0, MAX_TOKEN_ID].

    NOTE: one reduction where possible (the check runs on every open): a signed type of at
    most 4 bytes cannot exceed MAX_TOKEN_ID (2**31 - 1), and an unsigned one cannot be < 0."""
    if arr.dtype.kind == "i":
        return bool(_min(arr) < 0) or (arr.dtype.itemsize > 4 and bool(_max(arr) > MAX_TOKEN_ID))
    return arr.dtype.itemsize >= 4 and bool(_max(arr) > MAX_TOKEN_ID)


# (the ufuncs' reductions directly: `arr.min()` adds a Python wrapper, a third of its cost)
_min, _max = np.minimum.reduce, np.maximum.reduce


def as_token_array(token_ids: object, what: str = "token_ids") -> np.ndarray:
    """Validate token ids and return them as a 1-D int32 array.

    Accepts a list/tuple of ints, a 1-D integer numpy array or a 1-D integer torch tensor. Raises
    TokenError naming the first bad element.
    """
    if isinstance(token_ids, np.ndarray):
        arr = token_ids
    elif hasattr(token_ids, "detach") and hasattr(token_ids, "cpu"):   # torch.Tensor, no import
        dtype = str(token_ids.dtype)
        if token_ids.is_floating_point() or token_ids.is_complex() or "bool" in dtype:
            raise TokenError(f"{what}: expected integer token ids, "
                             f"got a tensor of {token_ids.dtype}")
        kind = ("meta" if token_ids.is_meta else "nested" if token_ids.is_nested else
                None if str(token_ids.layout) == "torch.strided" else str(token_ids.layout))
        if kind is not None:
            raise TokenError(f"{what}: expected a dense tensor with data, got a {kind} tensor")
        arr = token_ids.detach().cpu().numpy()
    elif isinstance(token_ids, (list, tuple, range)):
        for i, t in enumerate(token_ids):
            # bool is an int subclass; a True in a prompt is a bug, not token 1.
            if not isinstance(t, (int, np.integer)) or isinstance(t, bool):
                raise TokenError(f"{what}[{i}]: expected a non-negative int, got {t!r}")
            if not 0 <= t <= MAX_TOKEN_ID:
                raise TokenError(f"{what}[{i}]: expected a token id in [0, 2**31), got {t}")
        arr = np.asarray(token_ids, dtype=np.int64) if len(token_ids) else np.zeros(0, np.int64)
    else:
        raise TokenError(f"{what}: expected a list, numpy array or tensor of ints, "
                         f"got {type(token_ids).__name__}")
    if arr.ndim != 1:
        raise TokenError(f"{what}: expected a 1-D sequence, got shape {tuple(arr.shape)}")
    if arr.dtype.kind not in "iu":
        raise TokenError(f"{what}: expected integer token ids, got dtype {arr.dtype}")
    if arr.size and _out_of_range(arr):
        bad = np.flatnonzero((arr < 0) | (arr > MAX_TOKEN_ID))
        if bad.size:
            i = int(bad[0])
            raise TokenError(f"{what}[{i}]: expected a token id in [0, 2**31), got {int(arr[i])}")
    return np.ascontiguousarray(arr, dtype=np.int32)


__all__: Sequence[str] = ["BlockHasher", "Namespace", "as_token_array", "xxh3_128"]
