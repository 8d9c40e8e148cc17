"""What both ends of the daemon's page ops share (tiered_cache/daemon/pages.py serves them,
tiered_cache/pages/daemon.py is the client): their version, the bounds of an engine key and of
a part name, and the geometry of a page pool in shared memory."""

from __future__ import annotations

from dataclasses import dataclass

from tiered_cache.wire.shm import PAGE

VERSION = 1                 # of the page ops; `page_attach` names it
ENGINE_KEY_MAX = 124        # bytes of one engine key (SGLang's page hash, vLLM's offload key)
MAX_PART = 64               # bytes of a part name (a TP rank's, `replicated`)


@dataclass(frozen=True)
class PageGeometry:
    """A pool of `num_slots` whole pages of `page_bytes`, each slot starting on a page
    boundary (SharedPool needs only `num_slots`, `slot_stride` and `nbytes`)."""

    num_slots: int
    page_bytes: int

    def __post_init__(self) -> None:
        if self.num_slots < 1 or self.page_bytes < 1:
            raise ValueError(f"a page pool needs slots and bytes, got {self}")

    @property
    def slot_stride(self) -> int:
        return -(-self.page_bytes // PAGE) * PAGE

    @property
    def nbytes(self) -> int:
        return self.num_slots * self.slot_stride

    def slot(self, buf: memoryview, i: int) -> memoryview:
        at = i * self.slot_stride
        return buf[at:at + self.page_bytes]
