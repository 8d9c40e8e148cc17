"""The control plane: the one owner of block state, moves, resize and invariants. No torch.

`BlockIndex` (index.py) owns the blocks (`BlockTable`, blocks.py), the prefix index, every
tier's state, pins, the clock, the counters and the lock (declared in state.py); everything that
changes block state is one of its methods or of its parts' (`index.copies`, `index.space`,
`index.keyed`, `index.persist`, `index.inflight`). Nothing here imports the facade
(`tiered_cache.cache`) or the data plane.
"""
