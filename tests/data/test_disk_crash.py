"""Crashes, for real: writer processes SIGKILLed in the middle of writing, at random moments and
at every I/O call (with the interrupted write torn part way), and a file size limit that makes
the kernel refuse writes. After each, a new DiskPool on the same path must recover every record
whose write() returned, with identical bytes, and never list a record that does not read back
exactly.

Writers are real processes, each a fresh interpreter (`python -m tests.data.test_disk_crash MODE`):
the files, syscalls and SIGKILL are real; the only thing a crash-point child changes is that its
k-th `os.pwritev` writes a prefix of its bytes with `os.pwrite` and then SIGKILLs its own
process.
"""

from __future__ import annotations

import json
import os
import random
import resource
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from tests.data.test_disk import make_record, open_pool
from tiered_cache import records
from tiered_cache.data.disk import DiskFullError, DiskPool
from tiered_cache.records import CorruptRecord

REPO = Path(__file__).resolve().parents[2]
PB = 128 * 1024 + 512          # payload areas of 132 KiB: torn writes land inside payloads
SLOTS = 48


def pool_at(path: Path, **kw) -> DiskPool:
    return open_pool(path, SLOTS, payload_bytes=PB, **kw)


def write(pool: DiskPool, slots: list[int], idents: list[str]) -> None:
    recs = [make_record(i, pb=PB) for i in idents]
    pool.write(slots, [h for h, _ in recs], [p for _, p in recs])


def recovered(pool: DiskPool, idents: set[str]) -> dict[int, tuple[str, int]]:
    """slot -> (ident, hits) of every record scan() lists. Strict: every listed record must
    read back without error and byte for byte (a SIGKILL loses nothing already written, so a
    visible header means a whole payload), and be one this test wrote."""
    by_key = {records.decode_header(make_record(i, pb=PB)[0]).key: i for i in idents}
    out = {}
    for slot, header in pool.scan():
        assert header.key in by_key, f"slot {slot}: a record nobody wrote"
        ident = by_key[header.key]
        buf = np.empty(PB, dtype=np.uint8)
        pool.read(slot, header, buf)            # raises CorruptRecord: the test fails
        assert np.array_equal(buf, make_record(ident, pb=PB)[1]), f"slot {slot}: wrong KV"
        out[slot] = (ident, header.hits)
    return out


# ----------------------------------------------------------------------------- random SIGKILLs
def writer_main(path: str, gen: int, seed: int) -> None:
    """Write and erase random batches forever, reporting each op before and after on stdout."""
    rng = random.Random(seed)
    pool = pool_at(Path(path))
    pool.scan()
    print(json.dumps({"ready": gen}), flush=True)
    for r in range(10**9):
        if rng.random() < 0.15:
            slots = rng.sample(range(SLOTS), rng.randint(1, 4))
            print(json.dumps({"begin": r, "op": "erase", "slots": slots}), flush=True)
            pool.erase(slots)
        else:
            start = rng.randrange(SLOTS)
            run = list(range(start, min(SLOTS, start + rng.randint(1, 10))))
            slots = sorted(set(run + rng.sample(range(SLOTS), rng.randint(0, 3))))
            idents = [f"g{gen}.r{r}.s{s}" for s in slots]
            print(json.dumps({"begin": r, "op": "write", "slots": slots, "idents": idents}),
                  flush=True)
            write(pool, slots, idents)
        print(json.dumps({"done": r}), flush=True)


@pytest.mark.slow
def test_sigkill_at_random_moments_recovers_every_completed_write(tmp_path):
    rng = random.Random(1234)
    committed: dict[int, str | None] = {}           # what the disk holds, as verified
    idents: set[str] = set()
    in_flight_kills = 0
    for gen in range(8):
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.data.test_disk_crash", "writer", str(tmp_path), str(gen),
             str(rng.randrange(2**32))],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        first = proc.stdout.readline()
        assert json.loads(first) == {"ready": gen}, proc.stderr.read()
        time.sleep(rng.uniform(0.02, 0.4))          # the kill lands wherever the writer is
        proc.send_signal(signal.SIGKILL)
        # NOTE: read(), not communicate(): readline() may have buffered the next lines already.
        rest = proc.stdout.read()
        proc.stdout.close()
        proc.stderr.close()
        assert proc.wait() == -signal.SIGKILL

        ops = {}
        last_begun = None
        for line in rest.splitlines():
            try:
                msg = json.loads(line)
            except json.JSONDecodeError:             # the line the kill cut short
                continue
            if "begin" in msg:
                ops[msg["begin"]] = msg
                last_begun = msg
                idents.update(msg.get("idents", []))
            elif "done" in msg:
                op = ops.pop(msg["done"])
                new = op.get("idents") or [None] * len(op["slots"])
                committed.update(zip(op["slots"], new))
        allowed: dict[int, set[str | None]] = {}
        if ops:                                      # the op the kill interrupted
            (op,) = ops.values()
            assert op is last_begun
            in_flight_kills += 1
            new = op.get("idents") or [None] * len(op["slots"])
            for s, ident in zip(op["slots"], new):
                allowed[s] = {committed.get(s), ident, None}

        with pool_at(tmp_path) as pool:
            got = {s: i for s, (i, _) in recovered(pool, idents).items()}
        for s in range(SLOTS):
            if s in allowed:
                assert got.get(s) in allowed[s], (gen, s, got.get(s), allowed[s])
            else:
                assert got.get(s) == committed.get(s), (gen, s, got.get(s), committed.get(s))
        committed = dict.fromkeys(range(SLOTS)) | got
    print(f"{in_flight_kills} of 8 kills landed inside an operation")
    assert in_flight_kills >= 1, "no kill landed inside an operation"


# ----------------------------------------------------------------------------- crash points
def in_child(*args: str) -> tuple[int, str]:
    """Run `python -m tests.data.test_disk_crash *args` (one of CHILDREN) in a fresh interpreter;
    returns its exit code (-9: SIGKILLed) and what it reported on stdout (its JSON result, or
    a traceback).

    NOTE: not os.fork(): a fork of the test process must commit as much memory as that process
    has mapped, which a long pytest run (torch, pools) can push past what the kernel's
    overcommit check allows (ENOMEM in CI). subprocess starts children with vfork/exec."""
    # A hang guard, not a timing assertion.
    proc = subprocess.run([sys.executable, "-m", "tests.data.test_disk_crash", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    return proc.returncode, proc.stdout + proc.stderr


def crash_at(k: int, cut: str) -> None:
    """Make this process's k-th os.pwritev write a prefix of its bytes, then SIGKILL it."""
    real = os.pwritev
    calls = 0

    def pwritev(fd, bufs, offset, *flags):
        nonlocal calls
        calls += 1
        if calls == k:
            data = b"".join(bytes(b) for b in bufs)
            n = {"none": 0, "half": len(data) // 2 + 777, "all_but_one": len(data) - 1}[cut]
            os.pwrite(fd, data[:min(n, len(data))], offset)
            os.kill(os.getpid(), signal.SIGKILL)
        return real(fd, bufs, offset, *flags)

    os.pwritev = pwritev


OLD = [0, 1, 2, 3, 4, 5, 6, 7]
BATCH = [2, 3, 4, 6, 10, 11, 13]                     # reused run, reused single, fresh ones
GONE = [0, 1, 5]


def _populate(path: Path) -> set[str]:
    with pool_at(path) as pool:
        write(pool, OLD, [f"old{s}" for s in OLD])
    return {f"old{s}" for s in OLD} | {f"new{s}" for s in BATCH}


OPS: dict[str, Callable[[DiskPool], None]] = {
    "write": lambda pool: write(pool, BATCH, [f"new{s}" for s in BATCH]),
    "erase": lambda pool: pool.erase(GONE),
    "hits": lambda pool: pool.update_hits([1, 2], [9, 9]),
}


def crash_child(path: str, k: str, cut: str, op: str) -> str:
    """The crash-point child: OPS[op] on the pool at `path`, its k-th pwritev torn + SIGKILL."""
    pool = pool_at(Path(path))
    crash_at(int(k), cut)
    OPS[op](pool)
    pool.close()
    return "completed"


def _run_crash_points(path: Path, cut: str, op: str,
                      check: Callable[[dict[int, tuple[str, int]]], None]) -> int:
    """Crash OPS[op] at its 1st, 2nd, ... pwritev until it completes; check each outcome.
    Returns the number of crash points."""
    idents = _populate(path)
    base = path.with_name(path.name + "-base")
    os.rename(path, base)
    for k in range(1, 64):
        subprocess.run(["cp", "-a", str(base), str(path)], check=True)
        code, report = in_child("crash", str(path), str(k), cut, op)
        with pool_at(path) as pool:
            got = recovered(pool, idents)
        check(got, completed=(code == 0))
        subprocess.run(["rm", "-rf", str(path)], check=True)
        if code == 0:
            assert report.strip() == '"completed"', report
            return k - 1
        assert code == -signal.SIGKILL, report
    raise AssertionError("the operation never completed")


@pytest.mark.slow
@pytest.mark.parametrize("cut", ["none", "half", "all_but_one"])
def test_write_killed_at_every_io_call(tmp_path, cut):
    def check(got, completed):
        for s in range(SLOTS):
            now = got.get(s, (None, 0))[0]
            old = f"old{s}" if s in OLD else None
            if completed and s in BATCH:
                assert now == f"new{s}", (s, now)
            elif s in BATCH:
                assert now in {old, f"new{s}", None}, (s, now)
            else:
                assert now == old, (s, now)              # untouched slots keep their record

    points = _run_crash_points(tmp_path / "pool", cut, "write", check)
    assert points >= 9      # tombstones (2 runs), payloads (4 runs), headers (4 runs)


@pytest.mark.slow
@pytest.mark.parametrize("cut", ["none", "half"])
def test_erase_killed_at_every_io_call(tmp_path, cut):
    def check(got, completed):
        for s in range(SLOTS):
            now = got.get(s, (None, 0))[0]
            old = f"old{s}" if s in OLD else None
            if s in GONE:
                assert now in ({None} if completed else {old, None}), (s, now)
            else:
                assert now == old, (s, now)

    assert _run_crash_points(tmp_path / "pool", cut, "erase", check) >= 2


@pytest.mark.slow
@pytest.mark.parametrize("cut", ["none", "half"])
def test_hits_update_killed_at_every_io_call(tmp_path, cut):
    def check(got, completed):
        for s in range(SLOTS):
            now = got.get(s)
            if s in (1, 2):
                allowed = {(f"old{s}", 9)} if completed else {(f"old{s}", 0), (f"old{s}", 9),
                                                              None}
                assert now in allowed, (s, now)
            else:
                assert now == ((f"old{s}", 0) if s in OLD else None), (s, now)

    assert _run_crash_points(tmp_path / "pool", cut, "hits", check) >= 1


# ----------------------------------------------------------------------------- a full disk
def fsize_child(path: str, limit: str, o_direct: str) -> dict:
    """The full-disk child: writes under RLIMIT_FSIZE = limit."""
    pool = pool_at(Path(path), o_direct=bool(int(o_direct)))
    pool.scan()
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # (Python's default too) -> EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (int(limit), int(limit)))
    out = {}
    try:
        write(pool, [7, 8, 9], ["b7", "b8", "b9"])
    except DiskFullError as exc:
        out["write"] = [type(exc).__name__, exc.errno, str(exc)]
    write(pool, [4, 5], ["c4", "c5"])              # below the limit: still works
    try:
        pool.resize(4 * SLOTS)
    except DiskFullError as exc:
        out["resize"] = [type(exc).__name__, str(exc)]
    out["num_slots"] = pool.num_slots
    pool.close()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("o_direct", [False, True])
@pytest.mark.parametrize("limit_at", [3 * 4096, 3 * 4096 + 100])
def test_file_size_limit_makes_write_raise_disk_full_and_keeps_records(tmp_path, o_direct,
                                                                       limit_at):
    """RLIMIT_FSIZE (a real kernel limit: writes at or past it fail with EFBIG, one that
    crosses it is cut short, or refused with EINVAL under O_DIRECT when the cut is unaligned)
    stands in for a full filesystem (a tiny one would need a mount of its own)."""
    stride = 132 * 1024
    with pool_at(tmp_path, o_direct=o_direct) as pool:
        write(pool, [0, 1, 2, 3], ["a0", "a1", "a2", "a3"])
    limit = 8 * stride + limit_at                    # inside slot 8's payload area

    code, report = in_child("fsize", str(tmp_path), str(limit), str(int(o_direct)))
    assert code == 0, report
    out = json.loads(report)
    name, err, msg = out["write"]
    assert name == "DiskFullError" and err == 27 and "no more demotion to disk" in msg  # EFBIG
    assert out["resize"][0] == "DiskFullError" and out["num_slots"] == SLOTS
    with pool_at(tmp_path, o_direct=o_direct) as pool:
        got = recovered(pool, {"a0", "a1", "a2", "a3", "b7", "b8", "b9", "c4", "c5"})
        assert {s: i for s, (i, _) in got.items()} == {0: "a0", 1: "a1", 2: "a2", 3: "a3",
                                                       4: "c4", 5: "c5"}
        assert pool.stats()["bytes_reserved"] == SLOTS * (4096 + stride)


def test_corrupt_record_is_never_returned_by_read(tmp_path):
    """The counterpart of `recovered`'s strictness: a torn payload under an intact header (what
    a crash could leave without the write ordering) is CorruptRecord, not data."""
    with pool_at(tmp_path) as pool:
        write(pool, [0], ["t0"])
    with open(tmp_path / records.decode_header(make_record("t0", pb=PB)[0]).namespace.hex()
              / "payloads", "r+b") as f:
        f.seek(PB // 2)
        f.write(bytes(PB // 2))
    with pool_at(tmp_path) as pool, pytest.raises(CorruptRecord, match="payload hash"):
        (slot, header), = pool.scan()
        pool.read(slot, header, np.empty(PB, np.uint8))


if __name__ == "__main__":
    mode, *args = sys.argv[1:]
    if mode == "writer":
        writer_main(args[0], int(args[1]), int(args[2]))
    else:
        child = {"crash": crash_child, "fsize": fsize_child}[mode]
        try:
            result = child(*args)
        except BaseException:
            traceback.print_exc(file=sys.stdout)
            sys.exit(1)
        print(json.dumps(result), flush=True)
