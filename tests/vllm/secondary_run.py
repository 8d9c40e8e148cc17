"""One real vLLM engine (the CPU build, in process) whose OffloadingConnector runs
TieringOffloadingSpec (tests/vllm/cpu_tiering_spec.py) with tiered-cache's secondary tier
beneath vLLM's CPU pool. Prints `RESULT {json}` last.

    python tests/vllm/secondary_run.py WORKDIR CONFIG_JSON MODE

MODE: `sequence` (one prompt; again after vLLM's prefix cache and CPU pool were emptied, so
its chunks can only come from our tier; again after a byte of every page on disk was flipped;
again after every page was replaced by noise under valid records: see main); `write` (the
prompt once, its chunks stored); `read` (the prompt once in a fresh engine).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402

BLOCK = 32


def write_tiny_llama(path: Path) -> Path:
    """A random-weight 2-layer Llama saved with safetensors (no tokenizer: token-id prompts)."""
    if (path / "config.json").exists():
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=256,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=2048, tie_word_embeddings=False,
                      initializer_range=0.5)   # large weights: tokens that depend on the KV
    LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    return path


def tier_of():
    from tiered_cache.integrations.vllm_secondary import TieredCacheTier

    found = list(TieredCacheTier.instances)
    assert len(found) == 1, found
    return found[0]


def rewrite_pages(tier, how: str) -> int:
    """Replace (noise, under valid records) or damage (a flipped byte) every page on disk."""
    from tiered_cache.pages import identity

    disk = tier.store.disk
    pool = disk.pool
    rng = np.random.default_rng(7)
    n = 0
    for entry in list(disk._index.values()):
        if how == "noise":
            noise = rng.standard_normal(pool.layout.payload_bytes // 4).astype(np.float32)
            payload = noise.view(np.uint8)
            head = identity.encode_header(disk.digest, entry.header.root,
                                          identity.stored_key(entry.header), payload)
            [entry.header] = pool.write([entry.slot], [head], [payload])
        else:
            with open(pool.dir / "payloads", "r+b") as f:
                off = entry.slot * pool.layout.payload_stride + 100
                f.seek(off)
                b = f.read(1)
                f.seek(off)
                f.write(bytes([b[0] ^ 0x40]))
        n += 1
    return n


def main(argv: list[str]) -> int:
    work, config, mode = Path(argv[0]), json.loads(argv[1]), argv[2]
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    model = write_tiny_llama(work / "model")
    chunk_guess = 2 * 2 * 2 * BLOCK * 64 * 4           # layers x K|V x heads x block x dim x 4
    extra = {
        "spec_name": "CPUTestTieringSpec", "spec_module_path": "tests.vllm.cpu_tiering_spec",
        "cpu_bytes_to_use": 64 * chunk_guess,
        "secondary_tiers": [{"type": "TieredCacheTier",
                             "module_path": "tiered_cache.integrations.vllm_secondary",
                             "config": config}],
    }
    llm = LLM(model=str(model), skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
              block_size=BLOCK, max_model_len=2048, enable_prefix_caching=True, seed=0,
              distributed_executor_backend="uni", gpu_memory_utilization=0.5,
              kv_transfer_config=KVTransferConfig(kv_connector="OffloadingConnector",
                                                  kv_role="kv_both",
                                                  kv_connector_extra_config=extra))
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, detokenize=False)
    rng = np.random.default_rng(3)
    prompt = [int(x) for x in rng.integers(1, 500, 8 * BLOCK + 5)]
    filler = [[int(x) for x in rng.integers(1, 500, BLOCK + 3)] for _ in range(3)]

    def generate(ids: list[int]) -> list[int]:
        [out] = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
        return list(out.outputs[0].token_ids)

    def settle() -> None:
        for f in filler:               # later steps: the stores of the last prompt finish
            generate(f)

    def snapshot() -> dict:
        return dict(tier_of().counts)

    result: dict = {}
    if mode == "read":                 # another process wrote the chunks: a fresh engine
        result["tokens"] = generate(prompt)
        result["counts"] = snapshot()
    elif mode == "write":
        result["tokens"] = generate(prompt)
        settle()
        result["counts"] = snapshot()
    else:
        assert mode == "sequence", mode
        tier = tier_of()
        result["first"] = generate(prompt)
        settle()
        result["stored"] = snapshot()
        # 1. vLLM's prefix cache and CPU pool emptied: the chunks can only come from our tier
        assert llm.reset_prefix_cache(reset_connector=True)
        result["served"] = generate(prompt)
        result["after_served"] = snapshot()
        # 2. a byte of every page on disk flipped: each record fails verification, is dropped,
        # and vLLM recomputes those chunks (and stores them again)
        result["corrupted"] = rewrite_pages(tier, "corrupt")
        assert llm.reset_prefix_cache(reset_connector=True)
        result["recomputed"] = generate(prompt)
        settle()
        result["after_corrupt"] = snapshot()
        result["disk_after_corrupt"] = tier.store.disk.stats()
        # 3. control: noise under valid records is served as is, and changes the tokens, so
        # the comparisons above can fail
        result["noised"] = rewrite_pages(tier, "noise")
        assert llm.reset_prefix_cache(reset_connector=True)
        result["noise"] = generate(prompt)
        result["after_noise"] = snapshot()
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
