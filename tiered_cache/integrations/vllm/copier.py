"""Copy jobs off the forward's thread: one CPU thread, or a CUDA side stream with events.

The worker side submits one job per layer (that layer's loads into vLLM's blocks, or its saves
out of them) and waits for one layer only: attention on layer l waits for layer l's load
(`wait_device`: on a GPU the compute stream waits on the event, the host does not block),
while the copies of the next layers go on. `wait_host` blocks until the job is done (before a
handle is released, or staged bytes are published).

- `ThreadPipeline` (CPU; the CPU twin of the CUDA path, and what runs here): jobs run in order
  on the `tc-vllm-copy` thread; a job's exception is kept and raised by its waits, never lost.
- `CudaPipeline`: jobs are enqueued on a side stream at submit time, after the compute
  stream's work so far (a save reads what attention just wrote); each records an event. Host
  memory on the other side is the daemon's pool or staging area, page-locked with
  cudaHostRegister by `SharedPool.register_cuda`, so the copies are DMA.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


class Job:
    """One submitted job."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.error: BaseException | None = None

    def wait_host(self, timeout: float | None = None) -> None:
        if not self.done.wait(timeout):
            raise TimeoutError("copy job still running")
        if self.error is not None:
            raise self.error

    def wait_device(self) -> None:
        self.wait_host()


class ThreadPipeline:
    """In-order jobs on one background thread."""

    device_type = "cpu"

    def __init__(self, name: str = "tc-vllm-copy") -> None:
        self._q: queue.Queue[tuple[Job, Callable[[], Any]] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self.errors = 0

    def submit(self, fn: Callable[[], Any]) -> Job:
        job = Job()
        self._q.put((job, fn))
        return job

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            job, fn = item
            try:
                fn()
            except BaseException as exc:     # noqa: BLE001 - kept for the waiter, counted
                job.error = exc
                self.errors += 1
                log.warning("copy job failed: %s: %s", type(exc).__name__, exc)
            finally:
                job.done.set()

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(timeout=10)


class _CudaJob(Job):
    def __init__(self, event, device) -> None:
        super().__init__()
        self.event = event
        self.device = device

    def wait_host(self, timeout: float | None = None) -> None:
        if self.error is not None:
            raise self.error
        self.event.synchronize()

    def wait_device(self) -> None:
        import torch

        if self.error is not None:
            raise self.error
        torch.cuda.current_stream(self.device).wait_event(self.event)


class CudaPipeline:
    """Jobs enqueued on a side stream, ordered after the compute stream's work so far."""

    device_type = "cuda"

    def __init__(self, device) -> None:
        import torch

        self.torch = torch
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(device=self.device)
        self.errors = 0

    def submit(self, fn: Callable[[], Any]) -> Job:
        torch = self.torch
        event = torch.cuda.Event()
        job = _CudaJob(event, self.device)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        try:
            with torch.cuda.stream(self.stream):
                fn()
        except BaseException as exc:         # noqa: BLE001 - kept for the waiter, counted
            job.error = exc
            self.errors += 1
            log.warning("copy job failed: %s: %s", type(exc).__name__, exc)
        event.record(self.stream)
        job.done.set()
        return job

    def close(self) -> None:
        self.stream.synchronize()


def pipeline_for(device) -> ThreadPipeline | CudaPipeline:
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return CudaPipeline(device)
    if device.type != "cpu":
        from tiered_cache.integrations.vllm.layout import LayoutError

        raise LayoutError(f"KV on a {device.type} device: the connector copies on CPU and CUDA")
    return ThreadPipeline()
