"""The shared host pool: a sealed memfd (mode 0600, no name on any filesystem) handed over the
socket with SCM_RIGHTS; two processes see each other's writes byte for byte; read-only clients
cannot write; a SIGKILLed daemon leaves nothing for its successor to trip over."""

from __future__ import annotations

import fcntl
import mmap
import os
import select
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
import torch

from tests.daemon_reference import ServerProcess, make_protocol
from tiered_cache.wire.client import Client
from tiered_cache.wire.shm import PAGE, PoolGeometry, SharedPool

PROTO = make_protocol()
GEOMETRY = PoolGeometry(8, 2, 16, 2, 64, "bfloat16")         # 16 KiB slots: 4 pages each
POOL_ARG = "8,2,16,2,64,bfloat16"

ROOT = Path(__file__).resolve().parents[2]
"""The repository: child processes run there, so that `tests.daemon_reference` imports."""


OTHER_TESTS_SHM = ("tc-disk-", "tc-odirect-")
"""Files test_disk.py makes in /dev/shm (a filesystem without O_DIRECT), maybe at the same time
on another xdist worker: not this module's daemons'."""


def shm_names() -> set[str]:
    names = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    return {n for n in names if not n.startswith(OTHER_TESTS_SHM)}


def attach(c: Client, writable: bool = True) -> SharedPool:
    reply = c.request("attach", {"writable": writable})
    (fd,) = reply.fds
    return SharedPool.attach(fd, PoolGeometry.from_fields(reply.fields), writable=writable)


def pattern(seed: int, slots: int) -> torch.Tensor:
    """Deterministic bytes for `slots` slots, regenerated identically in any process."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (slots, GEOMETRY.slot_bytes), generator=g, dtype=torch.uint8)


def as_bytes(kv: torch.Tensor) -> torch.Tensor:
    return kv.contiguous().view(torch.uint8).reshape(kv.shape[0], -1)


@pytest.fixture(scope="module")
def daemon():
    d = Path(tempfile.mkdtemp(prefix="tc-shm-"))
    before = shm_names()
    proc = ServerProcess(d / "d.sock", "--pool", POOL_ARG).start()
    yield proc
    try:
        assert proc.stop() == 0, proc.log()
        assert shm_names() == before
    finally:
        shutil.rmtree(d, ignore_errors=True)


# --- geometry and the memfd (in process) -------------------------------------------------------


def test_geometry_is_block_major_with_page_aligned_slots():
    g = GEOMETRY
    assert g.shape == (8, 2, 2, 16, 2, 64)
    assert g.slot_bytes == 2 * 2 * 16 * 2 * 64 * 2 == g.slot_stride == 4 * PAGE
    odd = PoolGeometry(3, 1, 4, 1, 10, "float32")           # 320-byte slots (80 floats)
    assert odd.slot_stride == PAGE and odd.nbytes == 3 * PAGE
    with SharedPool.create(odd) as pool:
        assert pool.kv.shape == odd.shape and pool.kv.dtype == torch.float32
        assert pool.kv.stride()[0] * 4 == PAGE                 # padded: each slot on its page
        pool.kv[1].fill_(7.0)
        assert pool.kv[0].sum() == 0 and pool.kv[2].sum() == 0
        assert pool.kv[1].sum() == 7.0 * 80
    with pytest.raises(ValueError, match="dtype"):
        PoolGeometry(1, 1, 1, 1, 1, "int8")
    with pytest.raises(ValueError, match="slot stride"):
        PoolGeometry.from_fields({**GEOMETRY.fields(), "slot_stride": 3 * PAGE})
    fp8 = SharedPool.create(PoolGeometry(2, 1, 16, 1, 8, "fp8_e4m3"))
    assert fp8.kv.dtype == torch.float8_e4m3fn
    fp8.close()


def test_the_memfd_is_0600_sealed_nameless_and_close_on_exec():
    before = shm_names()
    with SharedPool.create(GEOMETRY) as pool:
        st = os.fstat(pool.fd)
        assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
        assert st.st_size == GEOMETRY.nbytes
        assert fcntl.fcntl(pool.fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC
        seals = fcntl.fcntl(pool.fd, fcntl.F_GET_SEALS)
        want = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
        assert seals & want == want
        assert os.readlink(f"/proc/self/fd/{pool.fd}").startswith("/memfd:tiered-cache-pool")
        assert shm_names() == before                # nothing in /dev/shm
        fd = pool.client_fd()
        try:
            with pytest.raises(PermissionError):
                os.ftruncate(fd, 0)                 # no one can cut the pool under the others
            with pytest.raises(PermissionError):
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)
        finally:
            os.close(fd)


def test_attach_checks_the_fd_before_mapping_it():
    with SharedPool.create(GEOMETRY) as pool:
        bigger = PoolGeometry(9, *GEOMETRY.shape[1:2], 16, 2, 64, "bfloat16")
        with pytest.raises(ValueError, match="bytes, its geometry says"):
            SharedPool.attach(pool.client_fd(), bigger)
    unsealed = os.memfd_create("unsealed", os.MFD_CLOEXEC)
    os.ftruncate(unsealed, GEOMETRY.nbytes)
    with pytest.raises(ValueError, match="not size-sealed"):
        SharedPool.attach(unsealed, GEOMETRY)
    r, w = os.pipe()
    os.close(w)
    with pytest.raises(ValueError, match="not a regular file"):
        SharedPool.attach(r, GEOMETRY)


def test_register_cuda_is_a_no_op_without_cuda():
    with SharedPool.create(GEOMETRY) as pool:
        if torch.cuda.is_available():
            pytest.skip("covered by the GPU test")
        assert pool.register_cuda() is False and not pool.cuda_registered
        pool.unregister_cuda()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_registered_pool_copies_to_and_from_the_gpu():
    with SharedPool.create(GEOMETRY) as pool:
        src = pattern(3, GEOMETRY.num_slots).view(torch.bfloat16).view(GEOMETRY.shape)
        pool.kv.copy_(src)
        assert pool.register_cuda() and pool.cuda_registered
        dev = pool.kv.to("cuda", non_blocking=True)
        back = torch.empty_like(dev)
        back.copy_(dev)
        pool.kv.zero_()
        pool.kv.copy_(back, non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(as_bytes(pool.kv), as_bytes(src))
        pool.unregister_cuda()


# --- across processes --------------------------------------------------------------------------

CHILD = """
    import sys, torch
    from tiered_cache.wire.client import Client
    from tiered_cache.wire.shm import PoolGeometry, SharedPool
    from tests.daemon_reference import make_protocol
    with Client(sys.argv[1], make_protocol()) as c:
        reply = c.request("attach", {"writable": True})
        pool = SharedPool.attach(reply.fds[0], PoolGeometry.from_fields(reply.fields))
    g = pool.geometry
    def pattern(seed, slots):
        gen = torch.Generator().manual_seed(seed)
        return torch.randint(0, 256, (slots, g.slot_bytes), generator=gen, dtype=torch.uint8)
    mine = pool.kv[0:4].contiguous().view(torch.uint8).reshape(4, -1)
    print("same" if torch.equal(mine, pattern(1, 4)) else "DIFFERENT", flush=True)
    pool.kv[4:8].copy_(pattern(2, 4).view(g.torch_dtype).view(4, *g.slot_shape))
    print("written", flush=True)
    pool.close()
"""


def read_line(proc: subprocess.Popen, timeout: float = 120.0) -> str:
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, "the child said nothing"
    return proc.stdout.readline().strip()


@pytest.mark.slow
def test_two_processes_see_each_others_writes_byte_for_byte(daemon):
    with Client(daemon.socket_path, PROTO) as c:
        pool = attach(c)
    g = pool.geometry
    assert pool.kv.shape == g.shape and pool.kv.is_contiguous()
    pool.kv[0:4].copy_(pattern(1, 4).view(g.torch_dtype).view(4, *g.slot_shape))
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(CHILD), daemon.socket_path],
                             cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert read_line(child) == "same"
        assert read_line(child) == "written"
        assert child.wait(60) == 0
        assert torch.equal(as_bytes(pool.kv[4:8]), pattern(2, 4))
        assert torch.equal(as_bytes(pool.kv[0:4]), pattern(1, 4))
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        pool.kv[:].zero_()
        pool.close()


@pytest.mark.slow
def test_a_read_only_client_reads_but_cannot_map_writable(daemon):
    with Client(daemon.socket_path, PROTO) as c:
        writer = attach(c)
        writer.kv[3].fill_(1.5)
        reply = c.request("attach", {"writable": False})
        (fd,) = reply.fds
    try:
        assert os.fstat(fd).st_mode & 0o777 == 0o600
        assert fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY
        with pytest.raises(PermissionError):
            mmap.mmap(fd, GEOMETRY.nbytes, flags=mmap.MAP_SHARED,
                      prot=mmap.PROT_READ | mmap.PROT_WRITE)
        reader = SharedPool.attach(os.dup(fd), GEOMETRY, writable=False)
        assert not reader.writable
        assert torch.equal(reader.kv[3], writer.kv[3]) and float(reader.kv[3].max()) == 1.5
        writer.kv[3].fill_(2.5)                     # shared, not a snapshot
        assert float(reader.kv[3].min()) == 2.5
        reader.close()
    finally:
        os.close(fd)
        writer.kv[3].zero_()
        writer.close()


@pytest.mark.slow
def test_a_sigkilled_daemon_leaves_nothing_behind():
    d = Path(tempfile.mkdtemp(prefix="tc-shmk-"))
    before = shm_names()
    try:
        first = ServerProcess(d / "d.sock", "--pool", POOL_ARG).start()
        with Client(first.socket_path, PROTO) as c:
            pool = attach(c)
        pool.kv.fill_(3.0)
        first.kill()                                # SIGKILL: no cleanup code runs
        # the mapping stays valid while this process holds it (no SIGBUS, no lost bytes) ...
        assert float(pool.kv.min()) == 3.0
        pool.close()
        assert shm_names() == before                # ... and nothing has a name anywhere
        with ServerProcess(d / "d.sock", "--pool", POOL_ARG) as second:
            with Client(second.socket_path, PROTO) as c:
                fresh = attach(c)
            # a new daemon's pool is a new memfd: none of the old KV can leak into it
            assert float(fresh.kv.abs().max()) == 0.0
            fresh.close()
        assert shm_names() == before
    finally:
        shutil.rmtree(d, ignore_errors=True)
