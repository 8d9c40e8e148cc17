"""README's transformers quick start runs as written, on a prompt cached in full too."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from tiered_cache import CacheConfig, TieredKVCache  # noqa: E402
from tiered_cache.integrations.transformers import _cache_kwarg  # noqa: E402

README = Path(__file__).resolve().parents[1] / "README.md"


def transformers_snippet() -> str:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), re.S)
    (snippet,) = [b for b in blocks if "TieredCache(" in b and "generate(" in b]
    return snippet


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    llama = LlamaConfig(vocab_size=200, hidden_size=64, intermediate_size=64,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, initializer_range=0.1, bos_token_id=None,
                        eos_token_id=None, pad_token_id=None)
    return LlamaForCausalLM(llama).eval()


def test_snippet_passes_the_cache_under_the_keyword_the_model_takes(model):
    assert f"generate(input_ids, {_cache_kwarg(model)}=past" in transformers_snippet()


def test_snippet_runs_and_reuses_a_prompt_cached_in_full(model):
    snippet = transformers_snippet()
    cache = TieredKVCache(CacheConfig.from_dict({
        "model": {"num_layers": 2, "num_kv_heads": 2, "head_dim": 16, "num_q_heads": 4},
        "block_size": 16, "tiers": {"gpu": {"device": "cpu", "num_blocks": 64},
                                    "host": {"num_blocks": 64}}}))
    input_ids = torch.randint(1, 200, (1, 32))        # two full blocks
    expected = model.generate(input_ids, max_new_tokens=32, do_sample=False)
    try:
        for turn in (1, 2):
            scope = {"cache": cache, "input_ids": input_ids, "model": model}
            exec(compile(snippet, str(README), "exec"), scope)
            past, out = scope["past"], scope["out"]
            assert torch.equal(out, expected), turn
            if turn == 2:
                # Both blocks of the prompt were cached; reserve_last gave the last one back
                # (blocks match whole), so the forward still had a token to give logits for.
                assert past.num_cached_tokens == 16
        assert cache.stats()["hit_tokens"] >= 16
    finally:
        cache.shutdown()
