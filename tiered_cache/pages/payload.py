"""A page's bytes where the engine keeps them: one buffer, or pieces taken back to back.

An engine's host pool rarely holds a page in one run of memory: SGLang's `page_first` layout
keeps a page's K and V apart, `layer_first` one piece per layer and K|V. A page is therefore
given as a *payload*: a buffer, or a list/tuple of buffers (CPU tensors, numpy arrays,
memoryviews) whose concatenation is the page. Tiers write and read the pieces where they lie
(pwritev/preadv on disk, one copy into or out of shared memory), so no tier makes a gathered
copy of the page except where its medium needs one value (a Redis SET).
"""

from __future__ import annotations

from collections.abc import Sequence

from tiered_cache.data.fileio import byte_view
from tiered_cache.pages.identity import PageSizeError

Payload = object            # a buffer, or a list/tuple of buffers


def views(payload: Payload, page_bytes: int, what: str, *,
          writable: bool = False) -> tuple[memoryview, ...]:
    """The payload as byte views (one per piece), checked to hold exactly `page_bytes`."""
    try:
        if isinstance(payload, (list, tuple)):
            out = tuple(byte_view(p) for p in payload)
        else:
            out = (byte_view(payload),)
    except (TypeError, ValueError) as exc:
        raise PageSizeError(f"{what}: not a page buffer: {exc}") from None
    nbytes = sum(v.nbytes for v in out)
    if nbytes != page_bytes:
        raise PageSizeError(f"{what}: {nbytes:,} bytes, a page of this store holds "
                            f"{page_bytes:,}")
    if writable and any(v.readonly for v in out):
        raise PageSizeError(f"{what}: the buffer is read-only")
    return out


def as_payload(pieces: tuple[memoryview, ...]) -> object:
    """What DiskPool and records take: the buffer itself when there is one piece."""
    return pieces[0] if len(pieces) == 1 else list(pieces)


def fill(pieces: Sequence[memoryview], src: memoryview) -> None:
    """Copy `src` (a page's bytes) into the pieces, back to back."""
    at = 0
    for piece in pieces:
        n = piece.nbytes
        piece[:] = src[at:at + n]
        at += n


def gather_into(dst: memoryview, pieces: Sequence[memoryview]) -> None:
    """Copy the pieces, back to back, into `dst` (one page's bytes)."""
    at = 0
    for piece in pieces:
        n = piece.nbytes
        dst[at:at + n] = piece
        at += n


def gather(pieces: Sequence[memoryview]) -> bytes:
    return pieces[0].tobytes() if len(pieces) == 1 else b"".join(pieces)
