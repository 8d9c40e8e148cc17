"""PageRemote: pages named by engine keys in the remote store (Redis/Valkey).

One value per page: the page's record (`identity`: header with its engine key, then the page's
bytes) under `<prefix>:v1:<format digest>:<root>:<page key>`, through `stores.redis.RedisStore`,
which bounds every call (lookup deadline, socket timeouts, circuit breaker) and verifies every
value it reads against the format digest, the page key and the root. On top of that a page read
compares the stored engine key with the one asked for. A value that fails either check is a
miss and is deleted (`delete_corrupt`), so the next put of that page writes it again.

Puts are synchronous (one pipeline per batch): the callers (SGLang's backup thread, the vLLM
secondary tier's store worker) are background threads already, and a True then means the
server took the page.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from tiered_cache import records
from tiered_cache.pages import identity
from tiered_cache.pages.config import REMOTE
from tiered_cache.pages.identity import PageFormat
from tiered_cache.pages.payload import fill, gather
from tiered_cache.stores.base import KeyedStore

log = logging.getLogger(__name__)


class PageRemote:
    name = REMOTE
    shared = True               # other processes and nodes see what it holds

    def __init__(self, store: KeyedStore, format: PageFormat,
                 get_deadline_s: float | None = None) -> None:
        self.store = store
        self.format = format
        self.digest = format.digest()
        if store.namespace != self.digest:
            raise ValueError("the store is bound to another namespace than this page format")
        self.get_deadline_s = get_deadline_s
        self.mismatched = 0

    def exists(self, root: bytes, engine_keys: Sequence[bytes], deadline_s: float) -> list[bool]:
        keys = [identity.page_key(root, k) for k in engine_keys]
        return self.store.exists(root, keys, deadline_s)

    def get(self, root: bytes, engine_keys: Sequence[bytes],
            outs: Sequence[tuple[memoryview, ...]]) -> list[bool]:
        keys = [identity.page_key(root, k) for k in engine_keys]
        values = self.store.get(root, keys, self.get_deadline_s)
        ok = [False] * len(keys)
        wrong: list[bytes] = []
        for i, value in enumerate(values):
            if value is None:
                continue
            # NOTE: the store verified the record (format, page key, root, both hashes); the
            # engine key it names must be the one asked for (a page-key collision otherwise).
            header = records.decode_header(value)
            if not identity.matches(header, root, engine_keys[i]):
                wrong.append(keys[i])
                continue
            fill(outs[i], memoryview(value)[header.header_len:])
            ok[i] = True
        if wrong:
            self.mismatched += len(wrong)
            log.warning("remote pages: %d value(s) under another engine key: dropped",
                        len(wrong))
            self.store.delete(root, wrong)
        return ok

    def put(self, root: bytes, engine_keys: Sequence[bytes],
            payloads: Sequence[tuple[memoryview, ...]]) -> list[bool]:
        items = []
        for k, pieces in zip(engine_keys, payloads):
            body = gather(pieces)
            head = identity.encode_header(self.digest, root, k, body)
            items.append((identity.page_key(root, k), head + body))
        if not items:
            return []
        stored = self.store.put(root, items)
        # NOTE: put returns a count; a batch that failed part way is rare (one pipeline) and
        # counted by the store. Only an all-or-nothing answer is trusted as per-page truth.
        return [stored == len(items)] * len(items)

    def delete(self, root: bytes, engine_keys: Sequence[bytes]) -> int:
        return self.store.delete(root, [identity.page_key(root, k) for k in engine_keys])

    def stats(self) -> dict:
        return {**self.store.stats(), "mismatched": self.mismatched}

    def close(self) -> None:
        self.store.close()
