"""What the scheduler side tells the workers each step, and what they answer: plain data.

A `StepPlan` travels inside vLLM's connector metadata to every worker (pickled across
processes in the multiprocess engine), so it holds only ints, strings, lists and int32 numpy
arrays. Block numbers are tiered-cache blocks of the request (block j covers tokens
[j * block_size, (j + 1) * block_size)); `vllm_blocks[i]` is the vLLM block id holding the
request's vLLM block `first_vllm + i` (a vLLM block is `sub_blocks` of ours).

Workers keep each request's token ids (sent once, in `TokenUpdate`s, as they become needed)
and the chained keys of their own rank's part, so a step that saves one block sends one
block's tokens, not the prompt's. `forget` comes first in a plan: a request finished,
preempted or looked up again starts from nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class TokenUpdate:
    req_id: str
    offset: int                 # tokens the worker already holds for this request
    tokens: np.ndarray          # int32: the next ones


@dataclass
class LoadOp:
    """Copy blocks [start, start + count) of the request from the daemon into vLLM's blocks."""

    req_id: str
    salt: str | None
    adapter: str | None
    start: int
    count: int
    first_vllm: int
    vllm_blocks: list[int]
    is_async: bool = False


@dataclass
class SaveOp:
    """Publish blocks [start, start + count) of the request, computed into vLLM's blocks."""

    req_id: str
    salt: str | None
    adapter: str | None
    start: int
    count: int
    first_vllm: int
    vllm_blocks: list[int]


@dataclass
class StepPlan:
    forget: list[str] = field(default_factory=list)
    tokens: list[TokenUpdate] = field(default_factory=list)
    loads: list[LoadOp] = field(default_factory=list)
    saves: list[SaveOp] = field(default_factory=list)

    def empty(self) -> bool:
        return not (self.forget or self.tokens or self.loads or self.saves)


@dataclass
class WorkerReport:
    """A step's outcome on one worker; reports of the ranks add up (`merge`)."""

    loaded: dict[str, int] = field(default_factory=dict)        # req -> ranks done
    failed: dict[str, int] = field(default_factory=dict)        # req -> first block not loaded
    saved_blocks: int = 0
    unsaved: dict[str, int] = field(default_factory=dict)       # req -> first block not saved
    counters: dict[str, int] = field(default_factory=dict)

    def merge(self, other: WorkerReport) -> WorkerReport:
        out = WorkerReport(dict(self.loaded), dict(self.failed), self.saved_blocks
                           + other.saved_blocks, dict(self.unsaved), dict(self.counters))
        for r, n in other.loaded.items():
            out.loaded[r] = out.loaded.get(r, 0) + n
        for src, dst in ((other.failed, out.failed), (other.unsaved, out.unsaved)):
            for r, b in src.items():
                dst[r] = min(dst.get(r, b), b)
        for k, n in other.counters.items():
            out.counters[k] = out.counters.get(k, 0) + n
        return out

    def empty(self) -> bool:
        return not (self.loaded or self.failed or self.saved_blocks or self.unsaved
                    or self.counters)


def vllm_block_of(block: int, first_vllm: int, vllm_blocks: list[int],
                  sub_blocks: int) -> tuple[int, int]:
    """(vLLM block id, our sub-block inside it) of our block `block`."""
    v, sub = divmod(block, sub_blocks)
    return vllm_blocks[v - first_vllm], sub
