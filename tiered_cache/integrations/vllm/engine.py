"""A real vLLM engine with (or without) the connector, for the tests, the `run-vllm` job and
the benchmark: a tiny random-weight Llama written with transformers, token-id prompts, greedy
decoding. vLLM is imported inside the functions (this module is importable without it).

    model = write_tiny_llama(tmp_dir)
    set_cpu_env(in_process=True)              # before vLLM is imported
    llm = make_llm(model, connector={"tiers": {"host": {"num_blocks": 256}}})
    outs = generate(llm, [prompt_ids], max_tokens=8)
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}


def set_cpu_env(*, in_process: bool, kv_space_gib: int = 1) -> None:
    """vLLM's CPU build: KV space, no core binding; `in_process`: the engine core in this
    process (VLLM_ENABLE_V1_MULTIPROCESSING=0), else in its own process. Call it before torch
    runs anything.

    NOTE: OMP_WAIT_POLICY=PASSIVE (unless set). With libgomp's default, the OpenMP threads of
    vLLM's CPU kernels spin between parallel regions; on cores shared with other work (more
    runnable threads than cores) every small kernel then waits for a descheduled spinner, and
    an engine ran 10x slower here (a 64-token decode: 9 s against 1 s passive). libgomp also
    throttles the spin by itself once a process has more OpenMP threads than cores (a second
    thread running torch ops, as the connector's copy thread does), which would hand an engine
    with the connector an unfair head start over one without; the same policy for both keeps
    comparisons fair."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.update(CPU_ENV)
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(kv_space_gib)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if in_process else "1"


def write_tiny_llama(path: str | os.PathLike, *, layers: int = 4, hidden: int = 256,
                     heads: int = 8, kv_heads: int = 4, head_dim: int = 32, vocab: int = 512,
                     seed: int = 0) -> str:
    """A random-weight LlamaForCausalLM (float32, safetensors) in `path`; its directory."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    if (path / "model.safetensors").exists():
        return str(path)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, head_dim=head_dim,
                      max_position_embeddings=8192, tie_word_embeddings=False,
                      initializer_range=0.08, bos_token_id=None, eos_token_id=None,
                      pad_token_id=None)
    torch.manual_seed(seed)
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(path, safe_serialization=True)
    return str(path)


def transfer_config(connector: dict[str, Any] | str | None, *, engine_id: str | None = None):
    """vLLM's KVTransferConfig for the connector (`connector` is the tiered-cache config: a
    mapping or a YAML path)."""
    from vllm.config import KVTransferConfig

    from tiered_cache.integrations.vllm import CONNECTOR, MODULE

    kw: dict[str, Any] = {}
    if engine_id is not None:
        kw["engine_id"] = engine_id
    return KVTransferConfig(kv_connector=CONNECTOR, kv_connector_module_path=MODULE,
                            kv_role="kv_both", kv_load_failure_policy="recompute",
                            kv_connector_extra_config={"tiered_cache": connector or {}}, **kw)


def make_llm(model: str, *, connector: dict[str, Any] | str | None | bool = True,
             engine_id: str | None = None, tp: int = 1, executor: str = "uni",
             prefix_caching: bool = True, block_size: int = 32, max_model_len: int = 4096,
             gpu_blocks: int | None = None, max_num_batched_tokens: int | None = None,
             seed: int = 0, **kw: Any):
    """An `LLM`; `connector=False` builds it without the connector."""
    from vllm import LLM

    args: dict[str, Any] = dict(
        model=model, skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
        block_size=block_size, max_model_len=max_model_len,
        enable_prefix_caching=prefix_caching, seed=seed, tensor_parallel_size=tp,
        distributed_executor_backend=executor, **kw)
    if gpu_blocks is not None:
        args["num_gpu_blocks_override"] = gpu_blocks
    if max_num_batched_tokens is not None:
        args["max_num_batched_tokens"] = max_num_batched_tokens
    if connector is not False:
        args["kv_transfer_config"] = transfer_config(
            None if connector is True else connector, engine_id=engine_id)
    return LLM(**args)


@dataclass
class Output:
    tokens: list[int]
    cached_tokens: int          # vLLM's num_cached_tokens: its own prefix hit plus the connector's
    seconds: float
    ttft_s: float | None = None     # vLLM's first-token latency (engines with log stats on)


def generate(llm, prompts: list[list[int]], max_tokens: int) -> list[Output]:
    """Greedy generation of `max_tokens` tokens for each prompt (one batch)."""
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": [int(x) for x in p]} for p in prompts], sp,
                        use_tqdm=False)
    dt = time.perf_counter() - t0
    return [Output(list(o.outputs[0].token_ids), int(o.num_cached_tokens or 0), dt,
                   float(o.metrics.first_token_latency) if o.metrics is not None else None)
            for o in outs]


def connectors(llm) -> tuple[Any, Any]:
    """(scheduler-side, worker-side) connector of an in-process engine with the uni executor
    (None where they are not in this process)."""
    sched = worker = None
    core = getattr(getattr(llm.llm_engine, "engine_core", None), "engine_core", None)
    if core is not None:
        sched = getattr(core.scheduler, "connector", None)
    try:
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

        if has_kv_transfer_group():
            worker = get_kv_transfer_group()
    except Exception:                   # noqa: BLE001 - not in this process
        worker = None
    return sched, worker


def embedded_stats(engine_id: str, socket_dir: str | None) -> dict[str, Any] | None:
    """The `stats` of an engine's embedded service, asked over its socket (any process)."""
    import json

    from tiered_cache.integrations.vllm.embedded import socket_path
    from tiered_cache.wire.client import Client
    from tiered_cache.wire.ops import make_protocol

    path = socket_path(engine_id, socket_dir)
    if not os.path.exists(path):
        return None
    with Client(path, make_protocol(), timeout_s=10).connect() as c:
        c.call("hello")
        return json.loads(c.call("stats")["json"])
