"""The message a second opener of a disk tier directory gets reads as one sentence that says
who holds it and what to do, in each case: this process, another live process, a dead one."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tiered_cache.data.dirlock import DirLock, LockHeldError

REPO = Path(__file__).resolve().parents[2]


def _sentences_ok(text: str) -> None:
    # NOTE: the old same-process text glued two clauses: "... has a disk pool open on it holds
    # the lock ...".
    assert "on it holds" not in text
    assert text.count(" holds ") <= 1
    assert re.search(r"tiers\.disk\.path", text)


def test_a_second_lock_in_this_process(tmp_path):
    first = DirLock(tmp_path)
    try:
        with pytest.raises(LockHeldError) as exc:
            DirLock(tmp_path)
        text = str(exc.value)
        _sentences_ok(text)
        assert text == (f"tiers.disk.path: {tmp_path} is already open in this process (pid "
                        f"{os.getpid()}): one disk tier directory serves one cache at a time; "
                        "shut the other cache down first, or give this one another "
                        "tiers.disk.path")
        assert exc.value.pid == os.getpid()
    finally:
        first.release()


@pytest.mark.slow
def test_a_lock_held_by_another_process(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""\
            import sys, time
            sys.path.insert(0, {str(REPO)!r})
            from pathlib import Path
            from tiered_cache.data.dirlock import DirLock
            lock = DirLock(Path({str(tmp_path)!r}))
            print("held", flush=True)
            sys.stdin.read()
            """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(LockHeldError) as exc:
            DirLock(tmp_path)
        text = str(exc.value)
        _sentences_ok(text)
        assert text == (f"tiers.disk.path: {tmp_path} is in use by process {holder.pid} (it "
                        f"holds {tmp_path / 'lock'}): one process owns a disk tier directory "
                        "at a time; stop that process, or give this cache another "
                        "tiers.disk.path")
    finally:
        holder.stdin.close()
        holder.wait(30)


def test_two_caches_on_one_disk_path_in_one_process(tmp_path):
    from tests.helpers import make_cache

    def build():
        return make_cache(gpu_blocks=8, host_blocks=8, migrator={"enabled": True},
                          extra={"tiers": {"disk": {"path": str(tmp_path), "num_blocks": 16}}})

    a = build()
    try:
        with pytest.raises(LockHeldError) as exc:
            build()
        _sentences_ok(str(exc.value))
        assert "is already open in this process" in str(exc.value)
    finally:
        a.shutdown()
    build().shutdown()              # and once the first is shut down, the path is free again
