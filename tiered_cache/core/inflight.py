"""In-flight prefix sharing: `open()` attaches to blocks another open sequence is computing.

K requests that arrive together with the same new prefix would otherwise each compute and hold
their own copy of it. Instead, the full blocks of a prompt that `open` gives a sequence (its
*writer*) are registered by key while it computes them; a later `open` whose walk over the
published index stops where such a block continues its chain takes it, as vLLM v1 takes a block
whose hash it registered at allocation. The taker (a *waiter*):

- pins the blocks (`ref_count`), counts their tokens in `num_cached_tokens` (and in the device
  tier's hits and `counters.inflight_hit_tokens`), and gets slots only for the rest;
- gets a `LayerReadiness` per writer in `seq.pending` (not zero-copy: attention waits for it):
  layer l is ready once the writer has written layer l up to the last block taken. Writes only
  move forward, so a ready layer's KV is final, whatever the writer does next;
- never publishes those blocks: the writer does, once they are full in every layer. The waiter's
  own blocks after them wait (`seq.awaiting`) and publish under them when the writer has.

If the writer closes before it has written every layer of the blocks taken, the waiters'
readiness fails with PrefixAbortedError (a TransferError): wait/attention/gather of the missing
layers raise it, telling the engine to compute those tokens itself (close the sequence and open
it again: it then computes them, or takes them from whoever does). Layers that were ready stay
readable. The blocks are freed when the last waiter closes; nothing is ever published from them.

Verification is the published path's: the chained key, the parent (the block matched before),
the depth, the root (tenant/namespace/adapter) and the token ids, compared with the writer's.

NOTE: registration costs no extra hashing: the writer's keys are computed at open instead of at
publish (`seq.keys` runs ahead of `num_published`). One dict entry per registered block, removed
when it is published or its writer closes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tiered_cache.core.blocks import NO_BLOCK
from tiered_cache.core.readiness import LayerReadiness
from tiered_cache.core.sequence import Sequence
from tiered_cache.errors import PrefixAbortedError, SequenceClosedError

if TYPE_CHECKING:
    from tiered_cache.core.index import BlockIndex


class Waiter:
    """A waiter's hold on a writer: ready once `writer.written[l] >= needed` for each layer l."""

    __slots__ = ("seq", "needed", "readiness")

    def __init__(self, seq: Sequence, needed: int, readiness: LayerReadiness) -> None:
        self.seq = seq
        self.needed = needed
        self.readiness = readiness


@dataclass(slots=True, eq=False, repr=False)
class InFlight:
    """The in-flight part of `BlockIndex` (`index.inflight`): the registry of blocks being
    computed and the waiters on their writers. Only the owner calls it, from `open`, the
    writes, publishing and `close`, with the lock held."""

    ix: BlockIndex                  # the owner: block state, `_pin`, `_publish_ready`
    enabled: bool = False           # config `share_inflight`: open() takes blocks being computed
    registry: dict[bytes, tuple[int, Sequence, int]] = field(default_factory=dict)
    """key -> (block, writer, depth): full blocks open sequences are computing (invariant 6)."""

    def match(self, seq: Sequence, matched: list[int]) -> list[int]:
        """The blocks being computed that continue `matched` (the published match) for `seq`."""
        ix = self.ix
        inflight = self.registry
        if not inflight:
            return []
        bs = ix.block_size
        nbytes = bs * 4
        tokens = seq.token_ids
        data = tokens.tobytes()
        h = ix.hasher.hash_fn
        key = seq.keys[-1] if matched else seq.root
        prev = matched[-1] if matched else NO_BLOCK
        shared: list[int] = []
        for i in range(len(matched), len(tokens) // bs):
            key = h(key + data[i * nbytes:(i + 1) * nbytes])
            entry = inflight.get(key)
            if entry is None:
                break
            b, writer, depth = entry
            wb = writer.blocks
            if (depth != i or writer.closed or writer.root_id != seq.root_id
                    or wb[depth] != b or (depth and wb[depth - 1] != prev)
                    or writer.token_ids[i * bs:(i + 1) * bs].tobytes()
                    != data[i * nbytes:(i + 1) * nbytes]):
                seq.collided = True
                break
            seq.keys.append(key)
            shared.append(b)
            prev = b
        return shared

    def take(self, seq: Sequence, shared: list[int], first: int) -> int:
        """Pin `shared` (blocks [first, first + len) of `seq`, being computed by others) for
        `seq` and wait on their writers. Returns their token count. Cannot fail."""
        if not shared:
            return 0
        ix = self.ix
        writers: dict[int, tuple[Sequence, int, int]] = {}     # id -> (writer, last, count)
        inflight = self.registry
        for i, b in enumerate(shared, first):
            ix._pin(b)
            _, writer, _ = inflight[seq.keys[i]]
            _, _, n = writers.get(writer.id, (writer, 0, 0))
            writers[writer.id] = (writer, i, n + 1)
        for writer, last, n in writers.values():
            r = LayerReadiness(ix.num_layers, n)
            r.zero_copy = False                 # no copy to read in place: wait for the writer
            r.inflight = True
            w = Waiter(seq, (last + 1) * ix.block_size, r)
            writer.waiters.append(w)
            _advance(writer, w)
            seq.pending.append(r)
        seq.awaiting = first + len(shared)
        tokens = len(shared) * ix.block_size
        ix.counters.inflight_hit_tokens += tokens
        return tokens

    def register(self, seq: Sequence) -> None:
        """Register the sequence's own full blocks (after `num_published`) as being computed,
        computing their keys now (publishing would)."""
        ix = self.ix
        bs = ix.block_size
        nbytes = bs * 4
        full = seq.num_tokens // bs
        keys = seq.keys
        if len(keys) >= full:
            return
        data = seq.token_ids.tobytes()
        h, prefix, inflight = ix.hasher.hash_fn, ix.prefix, self.registry
        key = keys[-1] if keys else seq.root
        blocks, mine = seq.blocks, seq.registered
        for i in range(len(keys), full):
            key = h(key + data[i * nbytes:(i + 1) * nbytes])
            keys.append(key)
            if key not in prefix and key not in inflight:
                inflight[key] = (blocks[i], seq, i)
                mine.append(key)

    def progress(self, writer: Sequence) -> None:
        """The writer wrote: advance its waiters' readiness."""
        if not writer.waiters:
            return
        for w in writer.waiters:
            _advance(writer, w)

    def published(self, writer: Sequence, first: int, ready: int) -> list[int]:
        """Blocks [first, ready) of `writer` were published (or tried): unregister them, and
        publish what waiters kept back under them. Returns the waiters' fresh blocks.

        NOTE: also a key another sequence registered, once it is published (by this sequence,
        which computed the same block meanwhile): the index then names the published block,
        and the registry only ever names blocks nothing else stands for (invariant 6)."""
        ix = self.ix
        inflight = self.registry
        if inflight:
            prefix = ix.prefix
            for key in writer.keys[first:ready]:
                entry = inflight.get(key)
                if entry is not None and (entry[1] is writer or key in prefix):
                    del inflight[key]
        fresh: list[int] = []
        waiters = writer.waiters
        if not waiters:
            return fresh
        for w in waiters:
            if not w.seq.closed and w.seq.awaiting == w.seq.num_published:
                fresh += ix._publish_ready(w.seq)
        # A waiter is done with its writer once the blocks it took are published.
        bs = ix.block_size
        writer.waiters = [w for w in waiters if not w.seq.closed
                          and writer.num_published * bs < w.needed]
        return fresh

    def close(self, writer: Sequence) -> None:
        """The writer closes: unregister what it did not publish; fail the waiters whose
        blocks it did not write in every layer."""
        ix = self.ix
        inflight = self.registry
        for key in writer.registered:
            entry = inflight.get(key)
            if entry is not None and entry[1] is writer:
                del inflight[key]
        writer.registered = []
        for w in writer.waiters:
            if not w.readiness.done:
                ix.counters.inflight_aborts += 1
                w.readiness.fail(PrefixAbortedError(
                    f"sequence {writer.id}, which was computing {w.readiness.blocks} block(s) "
                    f"that sequence {w.seq.id} shares, closed before writing them in every "
                    f"layer (layers ready: {w.readiness.ready_layers}); compute those tokens "
                    "yourself: close the sequence and open it again"))
        writer.waiters = []


def wake_closed(seq: Sequence) -> None:
    """`seq` closes while another thread may wait on the blocks it took in flight: fail its
    own readiness on them (each waiter has its own), so that the wait wakes now rather than
    when the writer writes. Lock held by the caller."""
    for r in seq.pending:
        if r.inflight and not r.done:
            r.fail(SequenceClosedError(f"sequence {seq.id} was closed while waiting for "
                                       "blocks another sequence computes"))


def _advance(writer: Sequence, w: Waiter) -> None:
    r, written, needed = w.readiness, writer.written, w.needed
    # NOTE: layers become ready in order (LayerReadiness), each once the writer covered it,
    # with the device event of the writer's last copy into that layer (None on CPU).
    while r.ready_layers < len(written) and written[r.ready_layers] >= needed:
        layer = r.ready_layers
        r.layer_done(layer, writer.write_events.get(layer))
