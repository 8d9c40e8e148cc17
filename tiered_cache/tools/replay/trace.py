"""Request traces: the JSONL record schema of Mooncake/Alibaba-shaped traces, read and checked.

A record is a JSON object with `hash_ids`, a list of ints in [0, 2**31): the trace's block ids,
already prefix-chained (equal ids at the same position mean the same tokens after the same
prefix). `timestamp`, `input_length` and `output_length` are carried along but not needed by
the replay. Every record is checked when it is read, so a bad line fails with its file and line
number before the replay starts instead of as a KeyError in the middle of it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tiered_cache.errors import TieredCacheError

MAX_ID = 2**31 - 1
"""Largest trace id: ids become int32 token ids (every token of block j equals hash_ids[j])."""


class TraceError(TieredCacheError, ValueError):
    """A trace line is not a request of the expected shape."""


def check_request(rec: Any, where: str) -> dict[str, Any]:
    """`rec` itself if it is a request record; TraceError naming `where` otherwise."""
    if not isinstance(rec, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(rec).__name__}")
    ids = rec.get("hash_ids")
    if not isinstance(ids, list):
        raise TraceError(f"{where}: 'hash_ids' must be a list of ints, got {ids!r:.60}")
    for x in ids:
        if not isinstance(x, int) or isinstance(x, bool) or not 0 <= x <= MAX_ID:
            raise TraceError(f"{where}: hash_ids: expected ints in [0, 2**31), got {x!r}")
    return rec


def load_trace(path: str | os.PathLike, limit: int | None = None) -> list[dict[str, Any]]:
    """Read a JSONL trace: at most `limit` records (None: all). Blank lines are skipped. Raises
    TraceError naming the line."""
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool)
                              or limit < 0):
        raise TraceError(f"limit: expected a non-negative int or None, got {limit!r}")
    p = Path(path)
    try:
        f = p.open(encoding="utf-8")
    except OSError as exc:
        raise TraceError(f"{p}: cannot read trace: {exc.strerror or exc}") from None
    out: list[dict[str, Any]] = []
    with f:
        try:
            for n, line in enumerate(f, 1):
                if limit is not None and len(out) >= limit:
                    break
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise TraceError(f"{p}:{n}: not JSON: {exc.msg}") from None
                out.append(check_request(rec, f"{p}:{n}"))
        except UnicodeDecodeError as exc:
            raise TraceError(f"{p}: not UTF-8 text: {exc.reason}") from None
    return out


def requests_from(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Validate in-memory records (e.g. from tiered_cache.tools.workloads) like trace lines."""
    return [check_request(r, f"request {i}") for i, r in enumerate(records)]
