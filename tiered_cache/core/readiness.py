"""Per-layer readiness of an in-flight promotion.

A promotion copies its blocks layer by layer. Readers wait for the one layer they are about to
use, so attention on layer l runs while layers after it are still copying.

On a GPU each layer's copy records a CUDA event on the copy stream; `wait` returns it and the
data plane makes the reader's stream wait on it (no host synchronisation). On CPU a condition
wake-up (core/wakeup.py: no lock held while waiting, safe against an interrupt at any line)
wakes the waiting thread as soon as its layer lands. No torch here: the event is opaque to the
control plane.
"""

from __future__ import annotations

import time

from tiered_cache.core.wakeup import Wakeup
from tiered_cache.errors import PrefixAbortedError, PromotionTimeout, TransferError


class LayerReadiness:
    def __init__(self, num_layers: int, blocks: int) -> None:
        self.num_layers = num_layers
        self.blocks = blocks
        self._ready = 0                       # layers [0, _ready) have landed
        self._events: list[object | None] = [None] * num_layers
        self._error: BaseException | None = None
        self._landed = Wakeup()
        self.created = time.perf_counter()
        self.zero_copy = True       # False: a block is staged from disk; readers must wait
        self.inflight = False       # True: waits on another sequence computing the blocks

    @property
    def ready_layers(self) -> int:
        return self._ready

    @property
    def done(self) -> bool:
        return self._ready >= self.num_layers or self._error is not None

    @property
    def error(self) -> BaseException | None:
        return self._error

    def layer_done(self, layer: int, event: object | None = None) -> None:
        """Layers land in order; `event` is a CUDA event recorded after that layer's copy."""
        self._events[layer] = event
        self._ready = layer + 1
        self._landed.notify_all()

    def layers_done(self, layers: range | tuple[int, ...], event: object | None = None) -> None:
        """`layer_done` of each of `layers` (consecutive, in order, one copy's), waking the
        waiters once."""
        events = self._events
        for layer in layers:
            events[layer] = event
        self._ready = layers[-1] + 1
        self._landed.notify_all()

    def fail(self, error: BaseException) -> None:
        self._error = error
        self._landed.notify_all()

    def wait(self, layer: int, timeout: float | None = None) -> object | None:
        """Block until `layer` has landed (or the promotion failed, or `timeout` passed).
        Returns the layer's device event (None on CPU) for the reader's stream to wait on.

        NOTE: a failed promotion raises for every layer, those that landed before the failure
        too: the commit of a failed promotion releases its device slots, so no layer of it
        can be read. Blocks shared in flight (`inflight`) are the exception: the waiter pins
        them and their writer only ever wrote forward, so the layers it finished stay readable
        after it gave up."""
        if self._ready > layer and (self._error is None or self.inflight):
            return self._events[layer]
        if not self._landed.wait_for(lambda: self._ready > layer or self._error is not None,
                                     timeout):
            raise PromotionTimeout(
                f"layer {layer} of a promotion of {self.blocks} blocks did not land "
                f"within {timeout:.3f} s ({self._ready} of {self.num_layers} layers "
                "ready); raise migrator.wait_timeout_s or check the migrator")
        if self._error is not None and not (self.inflight and self._ready > layer):
            if isinstance(self._error, PrefixAbortedError):
                raise PrefixAbortedError(str(self._error)) from self._error
            raise TransferError(f"promotion failed: {self._error}") from self._error
        return self._events[layer]
