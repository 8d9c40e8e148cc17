"""One tensor-parallel rank of the vLLM connector's worker side in its own process (for
tests/integrations/test_vllm_tp.py): a WorkerSide attached to a node service over its socket,
the ranks joined in a gloo group (what vLLM's TP group is on CPU), driven step by step over a
multiprocessing connection.

    python tests/vllm_rank.py ADDRESS RANK TP SOCKET GLOO_STORE
"""

from __future__ import annotations

import os
import signal
import sys
from multiprocessing.connection import Client
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from tests.vllm_harness import VllmKV, geometry, socket_link  # noqa: E402
from tiered_cache.integrations.vllm.worker import WorkerSide, union_over  # noqa: E402

AUTHKEY = b"tiered-cache-tests"

NUM_BLOCKS = 64


def rank_main(rank: int, tp: int, sock: str, store: str, conn) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=tp)
    g = geometry(tp=tp)
    link = socket_link(sock, g, attach=True, timeout_s=10.0)
    worker = WorkerSide(g, rank=rank, resolve_link=lambda: link, attach_timeout_s=10,
                        load_timeout_s=10, agree=union_over())
    kv = VllmKV(NUM_BLOCKS, g.vllm_block_size)
    worker.register(kv.layers, "CPU_ATTN", num_blocks=NUM_BLOCKS, dtype=torch.float32)
    conn.send(("ready", rank))
    while True:
        msg = conn.recv()
        if msg is None:
            break
        plan, compute, check, die_after_layer = msg
        worker.bind(plan)
        worker.start_load()
        for layer, name in enumerate(worker.layers):
            worker.wait_layer(name)
            if compute is not None:
                ids, toks, start, end = compute
                kv.write(ids, toks, start, end, layer, rank)
            worker.save_layer(name)
            if die_after_layer == layer:
                os.kill(os.getpid(), signal.SIGKILL)
        worker.end_step()
        worker.finished()
        errors = worker.load_errors()
        ok = kv.check(*check, rank=rank) if check is not None else None
        conn.send((worker.take_report(), errors, ok))
    worker.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    address, rank, tp, sock, store = sys.argv[1:6]
    rank_main(int(rank), int(tp), sock, store, Client(address, authkey=AUTHKEY))
