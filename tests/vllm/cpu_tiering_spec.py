"""A test-only TieringOffloadingSpec that runs on vLLM's CPU build.

vLLM's CPU offloading worker moves GPU <-> CPU blocks with CUDA/XPU copies and refuses to
start elsewhere ("only supported on CUDA-alike and XPU GPUs"). The engine's "GPU" blocks are in
CPU memory on the CPU build, so this spec's worker copies them synchronously, block for block,
between the engine's KV cache tensors and the very shared region the scheduler's primary tier
(and so the secondary tiers' memoryview) maps: everything above the worker (the tiering
manager, the primary pool, the secondary tiers, the scheduler) is vLLM's own.

    kv_connector_extra_config = {"spec_name": "CPUTestTieringSpec",
                                 "spec_module_path": "tests.vllm.cpu_tiering_spec", ...}
"""

from __future__ import annotations

import time

import torch
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec


class SyncCPUWorker(OffloadingWorker):
    def __init__(self, spec: TieringOffloadingSpec, kv_caches: CanonicalKVCaches) -> None:
        if spec.blocks_per_chunk != 1:
            raise ValueError("this test worker copies one engine block per offloaded chunk")
        if len(kv_caches.group_data_refs) != 1:
            raise ValueError("this test worker handles one KV cache group")
        rank = 0 if spec.replicated_layout else spec.config.parallel.rank
        self.region = SharedOffloadRegion(
            engine_id=spec.config.engine_id, num_chunks=spec.num_chunks, rank=rank,
            kv_bytes_per_chunk=spec.kv_bytes_per_chunk,
            cpu_page_size=spec.cpu_page_size_per_worker)
        self.engine: list[torch.Tensor] = []
        self.cpu: list[torch.Tensor] = []
        for t in kv_caches.tensors:
            self.engine.append(t.tensor.view(torch.int8).view(-1, t.page_size_bytes))
            self.cpu.append(self.region.create_next_worker_view(t.page_size_bytes))
        self.finished: list[TransferResult] = []

    def _copy(self, job_id: int, src: BlockIDsLoadStoreSpec, dst: BlockIDsLoadStoreSpec,
              to_cpu: bool) -> bool:
        t0 = time.perf_counter()
        src_ids, dst_ids = src.block_ids.tolist(), dst.block_ids.tolist()
        assert len(src_ids) == len(dst_ids), (len(src_ids), len(dst_ids))
        nbytes = 0
        for engine, cpu in zip(self.engine, self.cpu):
            for s, d in zip(src_ids, dst_ids):
                if to_cpu:
                    cpu[d].copy_(engine[s])
                else:
                    engine[d].copy_(cpu[s])
                nbytes += engine.shape[1]
        self.finished.append(TransferResult(job_id, True, nbytes, time.perf_counter() - t0))
        return True

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec,
                     dst_spec: BlockIDsLoadStoreSpec) -> bool:
        return self._copy(job_id, src_spec, dst_spec, to_cpu=True)

    def submit_load(self, job_id: int, src_spec: BlockIDsLoadStoreSpec,
                    dst_spec: GPULoadStoreSpec) -> bool:
        return self._copy(job_id, src_spec, dst_spec, to_cpu=False)

    def get_finished(self) -> list[TransferResult]:
        out, self.finished = self.finished, []
        return out

    def wait(self, job_ids: set[int]) -> None:
        return                      # every copy is done when submit returns

    def shutdown(self) -> None:
        self.region.cleanup()


class CPUTestTieringSpec(TieringOffloadingSpec):
    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            self._worker = SyncCPUWorker(self, kv_caches)
        return self._worker
