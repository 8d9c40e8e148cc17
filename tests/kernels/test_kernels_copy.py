"""Block copies between the layer-major GPU pool and the block-major host pool."""

import math
import os
import shutil

# Decide before anything imports triton: without a GPU driver, run Triton kernels interpreted.
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from tiered_cache.kernels import copy_blocks_to_gpu, copy_blocks_to_host  # noqa: E402
from tiered_cache.kernels.reference import as_bits, slot_runs  # noqa: E402
from tiered_cache.kernels.testing import backend_params, seed_for  # noqa: E402

L, S_GPU, S_HOST, BLOCK = 3, 10, 12, (4, 2, 8)
SENTINEL = 0x55  # bytes of untouched memory


def _pools(dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    gpu = torch.randn(L, 2, S_GPU, *BLOCK, generator=gen).to(dtype)
    host = torch.empty(S_HOST, L, 2, *BLOCK, dtype=dtype)
    host.view(torch.uint8).fill_(SENTINEL)
    return gpu, host


SLOTS = {
    "contiguous": ([2, 3, 4, 5], [6, 7, 8, 9]),
    "scattered": ([9, 0, 4, 7], [3, 11, 0, 5]),
    "mixed": ([1, 2, 3, 8, 5, 6], [0, 1, 2, 10, 4, 5]),  # runs of 3, 1 and 2
}


@pytest.mark.parametrize("backend", [*backend_params(), "auto"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("pattern", sorted(SLOTS))
def test_round_trip_gpu_host_gpu(backend, dtype, pattern):
    gpu, host = _pools(dtype, seed_for("copy", dtype, pattern))
    src, dst = SLOTS[pattern]
    copy_blocks_to_host(gpu, torch.tensor(src, dtype=torch.int32), host, dst, backend=backend)
    for s, d in zip(src, dst):
        assert torch.equal(as_bits(host[d]), as_bits(gpu[:, :, s]))
    untouched = [i for i in range(S_HOST) if i not in dst]
    assert (host[untouched].view(torch.uint8) == SENTINEL).all()

    back = torch.empty_like(gpu)
    back.view(torch.uint8).fill_(SENTINEL)
    new_slots = [S_GPU - 1 - i for i in range(len(src))]
    copy_blocks_to_gpu(host, dst, back, new_slots, backend=backend)
    for s, n in zip(src, new_slots):
        assert torch.equal(as_bits(back[:, :, n]), as_bits(gpu[:, :, s]))
    others = [i for i in range(S_GPU) if i not in new_slots]
    assert (back[:, :, others].view(torch.uint8) == SENTINEL).all()


@pytest.mark.parametrize("backend", [*backend_params(), "auto"])
@pytest.mark.parametrize("layers", [[1], [0, 2], [2, 0, 1]])
def test_copy_to_gpu_layer_subset(backend, layers):
    """Layer-wise promotion: only the named layers are written."""
    gpu, host = _pools(torch.float16, seed_for("layers", layers))
    host.copy_(torch.randn(host.shape).to(host.dtype))
    src, dst = [4, 5, 11, 0], [1, 2, 3, 7]
    copy_blocks_to_gpu(host, src, gpu_before := gpu.clone(), dst, layers=layers, backend=backend)
    for layer in range(L):
        for s, d in zip(src, dst):
            want = host[s, layer] if layer in layers else gpu[layer, :, d]
            assert torch.equal(gpu_before[layer, :, d], want)
    others = [i for i in range(S_GPU) if i not in dst]
    assert torch.equal(gpu_before[:, :, others], gpu[:, :, others])


@pytest.mark.parametrize("backend", [*backend_params(), "auto"])
def test_scales_travel_with_the_same_functions(backend):
    """FP8 scales gpu [L, 2, S] / host [S_h, L, 2] move as 1-element blocks."""
    gpu_scales = torch.rand(L, 2, S_GPU)
    host_scales = torch.zeros(S_HOST, L, 2)
    copy_blocks_to_host(gpu_scales[..., None], [3, 1], host_scales[..., None], [0, 5],
                        backend=backend)
    assert torch.equal(host_scales[0], gpu_scales[:, :, 3])
    assert torch.equal(host_scales[5], gpu_scales[:, :, 1])


@pytest.mark.parametrize("layers", [None, [1], [0, 2]])
def test_one_pass_cpu_copy_matches_the_torch_twin_on_strided_pool_views(layers):
    """auto on CPU takes the numba chunk copy; pools cut from a larger reservation (as resizable
    pools are: strides of max_slots, not of the shape) must come out as the torch twin's."""
    gen = torch.Generator().manual_seed(3)
    gpu_big = torch.randn(L, 2, 2 * S_GPU, *BLOCK, generator=gen).to(torch.bfloat16)
    gpu = gpu_big[:, :, :S_GPU]
    assert not gpu.is_contiguous()
    out = {}
    for backend in ("auto", "torch"):
        host = torch.zeros(2 * S_HOST, L, 2, *BLOCK, dtype=torch.bfloat16)[:S_HOST]
        copy_blocks_to_host(gpu, [9, 0, 4, 5, 6], host, [3, 11, 0, 1, 2], backend=backend)
        back = torch.zeros_like(gpu_big)[:, :, :S_GPU]
        copy_blocks_to_gpu(host, [3, 11, 0, 1, 2], back, [1, 2, 3, 7, 5], layers=layers,
                           backend=backend)
        out[backend] = (host.clone(), back.clone())
    assert torch.equal(out["auto"][0], out["torch"][0])
    assert torch.equal(out["auto"][1], out["torch"][1])
    assert torch.equal(out["auto"][0][11], gpu[:, :, 0])


def test_slot_runs_coalesce_adjacent_pairs():
    src = torch.tensor([3, 4, 5, 9, 1, 2])
    dst = torch.tensor([0, 1, 2, 3, 7, 8])
    assert slot_runs(src, dst) == [(3, 0, 3), (9, 3, 1), (1, 7, 2)]
    assert slot_runs(torch.tensor([5, 6]), torch.tensor([1, 0])) == [(5, 1, 1), (6, 0, 1)]
    assert slot_runs(torch.tensor([], dtype=torch.int64), torch.tensor([], dtype=torch.int64)) == []


def test_torch_twin_uses_one_slice_copy_per_run(monkeypatch):
    """A contiguous batch is one copy_ (not one per block), whatever the number of blocks."""
    gpu, host = _pools(torch.float32, 0)
    calls = []
    real = torch.Tensor.copy_
    monkeypatch.setattr(torch.Tensor, "copy_", lambda self, *a, **k: calls.append(1) or real(
        self, *a, **k))
    copy_blocks_to_host(gpu, range(0, 8), host, range(2, 10), backend="torch")
    assert len(calls) == 1


def test_copy_rejects_bad_inputs():
    gpu, host = _pools(torch.float32, 0)
    with pytest.raises(ValueError, match="equal lengths"):
        copy_blocks_to_host(gpu, [0, 1], host, [0])
    with pytest.raises(ValueError, match="distinct"):
        copy_blocks_to_host(gpu, [0, 1], host, [3, 3])
    with pytest.raises(ValueError, match="host_slots"):
        copy_blocks_to_host(gpu, [0], host, [S_HOST])
    with pytest.raises(ValueError, match="host_kv"):
        copy_blocks_to_host(gpu, [0], host[:, :2], [0])
    with pytest.raises(TypeError, match="host_kv"):
        copy_blocks_to_host(gpu, [0], host.double(), [0])
    with pytest.raises(ValueError, match="layers"):
        copy_blocks_to_gpu(host, [0], gpu, [0], layers=[L])
    with pytest.raises(TypeError, match="gpu_slots"):
        copy_blocks_to_gpu(host, [0], gpu, [0.5])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_copy_gpu_pinned_round_trip(backend):
    gpu_cpu, host = _pools(torch.bfloat16, 1)
    gpu = gpu_cpu.cuda()
    host = host.pin_memory()
    src, dst = [9, 0, 4, 7, 1, 2], [3, 11, 0, 5, 6, 7]
    copy_blocks_to_host(gpu, src, host, dst, backend=backend)
    torch.cuda.synchronize()
    for s, d in zip(src, dst):
        assert torch.equal(host[d], gpu_cpu[:, :, s])
    back = torch.zeros_like(gpu)
    copy_blocks_to_gpu(host, dst, back, src, layers=[0, 2], backend=backend)
    torch.cuda.synchronize()
    assert torch.equal(back[[0, 2]][:, :, src].cpu(), gpu_cpu[[0, 2]][:, :, src])
    assert (back[1] == 0).all()


@pytest.mark.parametrize("bad, match", [
    ([0.5], "float64 values"), ([1, 2.0], "float64 values"), (["1"], "<U1 values"),
    ([True], "bool values"), ([[1, 2]], r"flat sequence of ints, got shape \(1, 2\)"),
    ([2**70], "object values"), (5, "sequence of ints"),
])
def test_slot_lists_must_be_flat_ints(bad, match):
    gpu, host = _pools(torch.float32, 0)
    before = host.clone()
    with pytest.raises(TypeError, match=match):
        copy_blocks_to_host(gpu, bad, host, [0])
    assert torch.equal(host.view(torch.uint8), before.view(torch.uint8))


# ---------------------------------------------------------------- the CPU copier's paths
# kernels/host_copy.py picks one of three loops: streaming stores (big copies, 32-byte aligned
# destination chunks), 8-byte words (chunks and offsets on words), a memcpy per chunk (the
# rest). Each must give the torch twin's bytes; these pin which path each case takes.

def _spy_paths(monkeypatch):
    from tiered_cache.kernels import host_copy
    seen = []
    words, chunks = host_copy._copy_words, host_copy._copy_chunks
    monkeypatch.setattr(host_copy, "_copy_words",
                        lambda *a: seen.append("stream" if a[-1] else "words") or words(*a))
    monkeypatch.setattr(host_copy, "_copy_chunks",
                        lambda *a: seen.append("memcpy") or chunks(*a))
    return host_copy, seen


def _both_backends(gpu, gs, host_shape, hs, dtype, host_offset=0):
    """copy_blocks_to_host then back, with auto and with torch; the auto results."""
    out = {}
    for backend in ("auto", "torch"):
        flat = torch.zeros(host_offset + math.prod(host_shape), dtype=dtype)
        host = flat[host_offset:].view(host_shape)
        copy_blocks_to_host(gpu, gs, host, hs, backend=backend)
        back = torch.zeros_like(gpu)
        copy_blocks_to_gpu(host, hs, back, gs, backend=backend)
        out[backend] = (host.clone(), back.clone())
    assert torch.equal(out["auto"][0], out["torch"][0])
    assert torch.equal(out["auto"][1], out["torch"][1])
    return out["auto"]


@pytest.mark.parametrize("host_offset, chunk_elems, want", [
    (0, 64, ["stream", "stream"]),  # 256-byte chunks, aligned pools: streaming stores
    # host pool 8 bytes past an aligned address: no streaming into it (out of it, yes)
    (2, 64, ["words", "stream"]),
    (0, 2, ["words", "words"]),     # 8-byte chunks: words, not 32-byte vectors
    (0, 1, ["memcpy", "memcpy"]),   # 4-byte chunks (FP8 scales): a memcpy per chunk
])
def test_each_cpu_copy_path_gives_the_torch_twins_bytes(monkeypatch, host_offset, chunk_elems,
                                                        want):
    host_copy, seen = _spy_paths(monkeypatch)
    monkeypatch.setattr(host_copy.streaming, "STREAM_MIN_BYTES", 0)
    gen = torch.Generator().manual_seed(chunk_elems + host_offset)
    gpu = torch.randn(L, 2, S_GPU, chunk_elems, generator=gen)
    host, back = _both_backends(gpu, [9, 0, 4, 5], (S_HOST, L, 2, chunk_elems), [3, 11, 0, 1],
                                torch.float32, host_offset)
    if not host_copy.streaming.STREAMING:
        want = ["words" if w == "stream" else w for w in want]
    assert seen == want
    assert torch.equal(host[11], gpu[:, :, 0])
    assert torch.equal(back[:, :, [9, 0, 4, 5]], gpu[:, :, [9, 0, 4, 5]])


def test_copies_below_the_cache_size_do_not_stream(monkeypatch):
    host_copy, seen = _spy_paths(monkeypatch)
    monkeypatch.setattr(host_copy.streaming, "STREAM_MIN_BYTES", 1 << 30)
    gpu = torch.randn(L, 2, S_GPU, 64)
    _both_backends(gpu, [1, 2], (S_HOST, L, 2, 64), [0, 5], torch.float32)
    assert seen == ["words", "words"]


@pytest.mark.parametrize("caches, want", [
    # a 2-vCPU VM of a large Xeon: the host's 480 MiB L3, shared by the VM's two CPUs
    ([("48K", "0"), ("2048K", "0"), ("491520K", "0-1")], 16 << 20),
    ([("32K", "0"), ("1024K", "0-1"), ("16384K", "0-7")], 16 << 20),    # 2 MiB a CPU: as is
    ([("256M", None)], 8 << 20),        # nobody says who shares it: one CPU's worth
    ([("64M", "0-3,8,10-11")], 56 << 20),
    ([], 32 << 20),                     # unknown
])
def test_the_shared_cache_counts_at_most_8_mib_per_cpu_sharing_it(tmp_path, caches, want):
    """(A VM reporting its host's whole L3 kept every 32 MiB demotion batch on cached stores.)"""
    from tiered_cache.kernels import streaming

    for i, (size, shared) in enumerate(caches):
        d = tmp_path / f"index{i}"
        d.mkdir()
        (d / "size").write_text(size + "\n")
        if shared is not None:
            (d / "shared_cpu_list").write_text(shared + "\n")
    assert streaming._shared_cache_bytes(str(tmp_path)) == want


@pytest.mark.slow                       # copies more than the real threshold, interpreted
def test_a_copy_larger_than_the_cache_streams_with_the_real_threshold(monkeypatch):
    """24 MiB out and back at the real threshold (x86-64: streaming stores), byte for byte."""
    host_copy, seen = _spy_paths(monkeypatch)
    n = max(4, -(-host_copy.streaming.STREAM_MIN_BYTES // (L * 2 * 4 * 16384)))
    gpu = torch.randint(-2**31, 2**31 - 1, (L, 2, n, 16384), dtype=torch.int32)
    slots = list(range(n))[::-1]
    host, back = _both_backends(gpu, slots, (n, L, 2, 16384), list(range(n)), torch.int32)
    assert torch.equal(back, gpu)
    assert seen[0] == ("stream" if host_copy.streaming.STREAMING else "words")


@pytest.mark.parametrize("n", [5, 600, 5000])
def test_slot_checks_hold_for_short_and_long_lists(n):
    """Short slot lists are checked in Python, long ones in numpy: the same answers."""
    gpu = torch.zeros(1, 2, n + 1, 2)
    host = torch.zeros(n + 1, 1, 2, 2)
    ids = list(range(n))
    copy_blocks_to_host(gpu, ids, host, ids[::-1])
    with pytest.raises(ValueError, match="distinct"):
        copy_blocks_to_host(gpu, ids, host, ids[:-1] + [0])
    with pytest.raises(ValueError, match=r"host_slots: slot ids must be in \[0, "):
        copy_blocks_to_host(gpu, ids, host, ids[:-1] + [n + 1])
    with pytest.raises(ValueError, match=r"gpu_slots: .*got range \[-1, "):
        copy_blocks_to_host(gpu, [-1] + ids[1:], host, ids)
    copy_blocks_to_gpu(host, ids[:-1] + [0], gpu, ids)      # a source may repeat
    with pytest.raises(ValueError, match="distinct"):
        copy_blocks_to_gpu(host, ids, gpu, [1] + ids[1:])


def test_a_pool_on_an_unaligned_buffer_takes_the_memcpy_path(monkeypatch):
    """A pool over memory that is not 8-byte aligned (torch.frombuffer of an odd offset)
    cannot be seen as words: it must still copy, through the memcpy loop."""
    host_copy, seen = _spy_paths(monkeypatch)
    raw = bytearray(S_HOST * L * 2 * 64 + 3)
    flat = torch.frombuffer(memoryview(raw)[3:], dtype=torch.uint8)
    assert flat.untyped_storage().data_ptr() % 8 and flat.storage_offset() == 0
    host = flat.view(S_HOST, L, 2, 64)                      # uint8 chunks of 64 bytes
    gpu = torch.randint(0, 256, (L, 2, S_GPU, 64), dtype=torch.uint8)
    copy_blocks_to_host(gpu, [9, 0, 4], host, [3, 11, 0])
    assert torch.equal(host[11], gpu[:, :, 0]) and torch.equal(host[3], gpu[:, :, 9])
    back = torch.zeros_like(gpu)
    copy_blocks_to_gpu(host, [3, 11, 0], back, [9, 0, 4])
    assert torch.equal(back[:, :, [9, 0, 4]], gpu[:, :, [9, 0, 4]])
    assert seen == ["memcpy", "memcpy"]
