"""Where one page of SGLang's host KV pool lies: its pieces, as views, in flat-page order.

SGLang's host pools (`sglang.srt.mem_cache.pool_host`) lay pages out by `layout`:
`layer_first` keeps one run per layer and K|V (`[2, L, size, H, D]`), `page_first` and
`page_first_direct` one run per K|V (`[2, size, L, H, D]`, `[2, pages, L, page, H, D]`), an MLA
pool one run per layer or one per page. `get_data_page(index, flat=False)` returns the page as
a strided view of the pool; its flattening is the "flat data page" SGLang's generic (non-v1)
calls move. The pieces here are that view cut into its largest contiguous sub-blocks, in C
order, so the concatenation of the pieces is exactly the flat data page: pages stored through
`batch_set_v1` read back through `batch_get`, and the other way round.

No intermediate tensor: the pieces are views of the pool, and tiers write and read them where
they lie (pwritev/preadv on disk, one copy into or out of shared memory).
"""

from __future__ import annotations

import itertools

import torch

from tiered_cache.errors import ShapeError


def contiguous_runs(view: torch.Tensor) -> list[torch.Tensor]:
    """`view` cut along its leading dims into the fewest contiguous sub-blocks, in C order."""
    lead = 0
    while lead < view.dim() and not view[(0,) * lead].is_contiguous():
        lead += 1
    if lead == view.dim():
        lead = view.dim() - 1
    if lead == 0:
        return [view]
    return [view[idx] for idx in itertools.product(*(range(n) for n in view.shape[:lead]))]


class HostPages:
    """The pages of one SGLang host pool (anything with `get_data_page`, `page_size`,
    `layout`, `dtype`)."""

    def __init__(self, host_pool) -> None:
        self.pool = host_pool
        self.page_size = int(host_pool.page_size)
        probe = host_pool.get_data_page(0, flat=False)
        self.page_shape = tuple(probe.shape)
        self.dtype = probe.dtype
        self.page_bytes = probe.numel() * probe.element_size()
        runs = contiguous_runs(probe)
        # NOTE: zero copy only where the pool hands out views of itself whose sub-blocks are
        # contiguous; otherwise (a pool whose get_data_page copies, or strides that never
        # become contiguous) every page goes through its flat copy instead.
        self.zero_copy = (probe.device.type == "cpu" and all(r.is_contiguous() for r in runs)
                          and _shares_storage(probe, host_pool))
        self.pieces_per_page = len(runs)

    @property
    def layout(self) -> str:
        return str(getattr(self.pool, "layout", "unknown"))

    def page_index(self, host_indices: torch.Tensor, i: int) -> int:
        return int(host_indices[i * self.page_size])

    def check_indices(self, host_indices: torch.Tensor, n: int) -> None:
        if host_indices.numel() != n * self.page_size:
            raise ShapeError(f"host_indices: {host_indices.numel()} slots for {n} pages of "
                             f"{self.page_size} tokens")

    def pieces(self, index: int) -> list[torch.Tensor]:
        """The page at host slot `index` as views of the pool (zero_copy), in flat order."""
        return [p.reshape(-1) for p in contiguous_runs(self.pool.get_data_page(index,
                                                                               flat=False))]

    def flat(self, index: int) -> torch.Tensor:
        """A contiguous copy of the page (for pools that do not allow zero copy)."""
        return self.pool.get_data_page(index, flat=True).contiguous()

    def scratch(self) -> torch.Tensor:
        return torch.empty(self.page_shape, dtype=self.dtype).reshape(-1)

    def store_flat(self, index: int, data: torch.Tensor) -> None:
        self.pool.set_from_flat_data_page(index, data)


def _shares_storage(page: torch.Tensor, host_pool) -> bool:
    """Whether `page` is a view into the pool's own buffer(s)."""
    buffers = getattr(host_pool, "kv_buffer", None)
    if buffers is None:
        return False
    if not isinstance(buffers, (list, tuple)):
        buffers = [buffers]
    addr = page.untyped_storage().data_ptr()
    return any(isinstance(b, torch.Tensor) and b.untyped_storage().data_ptr() == addr
               for b in buffers)
