"""The CPU copies' shortcuts: `api._copy_on_cpu` (the common call, checked on arrays) does what
the full path does, for good and bad arguments alike, and `host_copy`'s cached routes follow a
pool whose tensor or storage changes."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tiered_cache.kernels import api, copy_blocks_to_gpu, copy_blocks_to_host

host_copy = pytest.importorskip("tiered_cache.kernels.host_copy")

L, S_GPU, S_HOST, BLOCK = 3, 6, 7, (4, 2, 8)


def _pools(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(L, 2, S_GPU, *BLOCK, generator=gen),
            torch.randn(S_HOST, L, 2, *BLOCK, generator=gen))


def _outcome(fn, gpu, host, gs, hs, layers, to_host: bool):
    """(exception type and message, or None; both pools after the call)."""
    try:
        if to_host:
            fn(gpu, gs, host, hs)
        else:
            fn(host, hs, gpu, gs, layers=layers)
        err = None
    except Exception as exc:            # the two paths must agree on what is wrong
        err = (type(exc), str(exc))
    return err, gpu.clone(), host.clone()


slot = st.one_of(st.integers(-2, 8), st.sampled_from([True, 0.5, 2**70]))
slots = st.one_of(st.lists(st.integers(0, 5), max_size=6),
                  st.lists(slot, max_size=6),
                  st.lists(st.integers(0, 5), max_size=6).map(np.asarray))
layer_lists = st.one_of(st.none(), st.lists(st.integers(-1, 3), max_size=4),
                        st.sampled_from([(0, 2), range(2), [0.5], "01"]))


@settings(max_examples=300, deadline=None)
@given(gs=slots, hs=slots, layers=layer_lists, to_host=st.booleans(), seed=st.integers(0, 3))
def test_the_shortcut_does_what_the_full_path_does(gs, hs, layers, to_host, seed):
    fn = copy_blocks_to_host if to_host else copy_blocks_to_gpu
    fast = _outcome(fn, *_pools(seed), gs, hs, layers, to_host)
    real = api._copy_on_cpu
    api._copy_on_cpu = lambda *a, **k: False
    try:
        full = _outcome(fn, *_pools(seed), gs, hs, layers, to_host)
    finally:
        api._copy_on_cpu = real
    assert fast[0] == full[0]
    assert torch.equal(fast[1], full[1]) and torch.equal(fast[2], full[2])


def test_the_shortcut_takes_the_common_call(monkeypatch):
    """(so the test above compares two paths, not one)"""
    taken = []
    real = api._copy_on_cpu
    monkeypatch.setattr(api, "_copy_on_cpu", lambda *a, **k: taken.append(real(*a, **k)) or
                        taken[-1])
    gpu, host = _pools(0)
    copy_blocks_to_host(gpu, [1, 4], host, [6, 0])
    copy_blocks_to_gpu(host, [6, 0], gpu, [2, 3], layers=[1])
    assert taken == [True, True]
    assert torch.equal(gpu[1, :, 2], gpu[1, :, 1]) and torch.equal(gpu[1, :, 3], gpu[1, :, 4])


def _key(gpu, host):
    return (id(gpu), id(host), (2, 0, 1), (0, 1, 2))       # (device -> host)


def test_a_route_follows_a_new_storage_and_goes_with_its_tensor():
    gpu, host = _pools(1)
    copy_blocks_to_host(gpu, [0, 1], host, [0, 1])
    assert torch.equal(host[0], gpu[:, :, 0])
    first = host_copy._routes[_key(gpu, host)]
    # the same tensor object over another storage (a pool laid over new memory)
    fresh = torch.zeros_like(host)
    host.set_(fresh.untyped_storage(), 0, fresh.shape, fresh.stride())
    copy_blocks_to_host(gpu, [2], host, [3])
    assert torch.equal(fresh[3], gpu[:, :, 2])          # written to the new storage
    assert not fresh[0].any()
    assert host_copy._routes[_key(gpu, host)] is not first
    # a view made afresh for each call (a permuted pool) finds its route again
    copy_blocks_to_host(gpu.permute(0, 1, 2, 3, 4, 5), [4], host, [5])
    again = host_copy._routes[_key(gpu, host)]
    copy_blocks_to_host(gpu.permute(0, 1, 2, 3, 4, 5), [5], host, [6])
    assert host_copy._routes[_key(gpu, host)] is again
    assert torch.equal(fresh[6], gpu[:, :, 5])
    # a pool tensor dropped (a pool resized gets new tensors): its routes go with it
    other = torch.zeros_like(host)
    copy_blocks_to_host(gpu, [1], other[:4], [2])
    assert torch.equal(other[2], gpu[:, :, 1])
    key = _key(gpu, other)
    assert key in host_copy._routes
    del other
    gc.collect()
    assert key not in host_copy._routes
