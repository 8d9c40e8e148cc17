"""Fidelity of the transformers integration: greedy generation through a `TieredCache` gives the
same tokens as transformers' own `DynamicCache`, and logits within 1e-5 (float32), whether the
prefix is reused from the device tier, from the host tier after a demotion, or from an earlier
turn of the conversation; a prompt that differs in the middle reuses only what comes before.

Tiny random-weight Llama (2 layers, hidden 64), nothing downloaded.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM  # noqa: E402

from tiered_cache import CacheConfig, TieredKVCache  # noqa: E402
from tiered_cache.core.invariants import check_invariants  # noqa: E402
from tiered_cache.errors import SequenceClosedError  # noqa: E402
from tiered_cache.integrations import transformers as tc_hf  # noqa: E402
from tiered_cache.integrations.transformers import TieredCache, prefill  # noqa: E402

BS = 16
ATOL = 1e-5
VOCAB = 512
NEW = 6


@pytest.fixture(scope="module")
def model():
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, max_position_embeddings=4096, attn_implementation="sdpa",
                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


def make_cache(gpu_blocks=64, host_blocks=256, migrator=True, **extra) -> TieredKVCache:
    data = {"model": {"name": "tiny-llama-test", "num_layers": 2, "num_kv_heads": 2,
                      "head_dim": 16, "num_q_heads": 4, "dtype": "float32"},
            "block_size": BS,
            "tiers": {"gpu": {"device": "cpu", "num_blocks": gpu_blocks},
                      "host": {"num_blocks": host_blocks, "memory": "pageable"}},
            "migrator": {"enabled": migrator}, "compactor": {"enabled": migrator}}
    data.update(extra)
    return TieredKVCache(CacheConfig.from_dict(data))


@pytest.fixture
def caches():
    made: list[TieredKVCache] = []
    yield made
    for c in made:
        if c.migrator is not None:
            c.migrator.drain()
        with c.locked():
            check_invariants(c)
        c.shutdown()


def prompt(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (1, n), generator=g)


GEN = dict(max_new_tokens=NEW, do_sample=False, return_dict_in_generate=True,
           output_logits=True)


def reference(model, ids):
    return model.generate(ids, cache=DynamicCache(config=model.config), **GEN)


def assert_same(out, ref):
    assert out.sequences.tolist() == ref.sequences.tolist()
    assert len(out.logits) == len(ref.logits) == NEW
    for a, b in zip(out.logits, ref.logits):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0)


def tiered_generate(model, cache, ids, **kw):
    past = TieredCache(cache, ids, model=model, **kw)
    out = model.generate(ids, cache=past, **GEN)
    return past, out


# ------------------------------------------------------------------------------- fidelity

def test_fresh_prompt_matches_dynamic_cache(model, caches):
    caches.append(cache := make_cache())
    ids = prompt(100, 1)
    past, out = tiered_generate(model, cache, ids)
    assert past.num_cached_tokens == 0
    assert_same(out, reference(model, ids))
    # The prompt and every generated token but the last were computed and declared.
    assert past.get_seq_length() == 100 + NEW - 1
    assert past.num_tokens == 100 + NEW - 1
    past.close()
    assert past.closed


def test_prefix_reused_from_gpu_tier(model, caches):
    caches.append(cache := make_cache())
    ids = prompt(150, 2)
    ref = reference(model, ids)
    past, _ = tiered_generate(model, cache, ids)
    past.close()
    past, out = tiered_generate(model, cache, ids)
    # reserve_last: the last prompt token is always computed, so 149 // 16 full blocks.
    assert past.num_cached_tokens == (150 - 1) // BS * BS == 144
    assert past.cached_tokens_by_tier == {"gpu": 144, "host": 0}
    assert_same(out, ref)
    past.close()


def test_prompt_of_exact_blocks_still_computes_last_token(model, caches):
    caches.append(cache := make_cache())
    ids = prompt(64, 3)
    past, _ = tiered_generate(model, cache, ids)
    past.close()
    past, out = tiered_generate(model, cache, ids)
    assert past.num_cached_tokens == 48
    assert_same(out, reference(model, ids))
    past.close()


@pytest.mark.parametrize("migrator", [True, False], ids=["migrator", "sync"])
def test_prefix_reused_from_host_tier_after_demotion(model, caches, migrator):
    # 12 device blocks: each 100-token request needs 7, so the next prompts push A out.
    caches.append(cache := make_cache(gpu_blocks=12, host_blocks=128, migrator=migrator))
    a = prompt(100, 4)
    ref = reference(model, a)
    past, _ = tiered_generate(model, cache, a)
    past.close()
    for seed in (5, 6, 7):
        past, _ = tiered_generate(model, cache, prompt(100, seed))
        past.close()
    if cache.migrator is not None:
        cache.migrator.drain()
    assert cache.stats()["demotions"] > 0
    past, out = tiered_generate(model, cache, a)
    assert past.num_cached_tokens == 96
    assert past.cached_tokens_by_tier["host"] > 0
    assert past.cached_tokens_by_tier["host"] + past.cached_tokens_by_tier["gpu"] == 96
    assert_same(out, ref)
    past.close()
    assert cache.stats()["promotions"] > 0


def test_second_turn_reuses_first_turn_and_reply(model, caches):
    caches.append(cache := make_cache())
    turn1 = prompt(90, 8)
    past, out1 = tiered_generate(model, cache, turn1)
    past.close()
    turn2 = torch.cat([out1.sequences, prompt(40, 9)], dim=1)
    past, out2 = tiered_generate(model, cache, turn2)
    # Turn 1's prompt and its reply, except the last generated token (its KV was never
    # computed), rounded down to full blocks.
    assert past.num_cached_tokens == (90 + NEW - 1) // BS * BS == 80
    assert_same(out2, reference(model, turn2))
    past.close()
    # A third turn reuses the second (this time continuing with the same TieredCache).
    turn3 = torch.cat([out2.sequences, prompt(30, 10)], dim=1)
    past = TieredCache(cache, turn3, model=model)
    assert past.num_cached_tokens == (turn2.shape[1] + NEW - 1) // BS * BS
    out3 = model.generate(turn3, cache=past, **GEN)
    assert_same(out3, reference(model, turn3))
    turn4 = torch.cat([out3.sequences, prompt(20, 11)], dim=1)
    out4 = model.generate(turn4, cache=past, **GEN)       # same object, next turn
    assert_same(out4, reference(model, turn4))
    past.close()


def test_prefix_differing_in_the_middle_reuses_only_what_precedes(model, caches):
    caches.append(cache := make_cache())
    a = prompt(200, 12)
    past, _ = tiered_generate(model, cache, a)
    past.close()
    b = a.clone()
    b[0, 100] = (b[0, 100] + 1) % VOCAB
    past = TieredCache(cache, b, model=model)
    assert past.num_cached_tokens == 100 // BS * BS == 96
    with torch.no_grad():
        logits = model(past.uncached_input_ids(), cache=past).logits
        ref = model(b, cache=DynamicCache(config=model.config)).logits
    torch.testing.assert_close(logits, ref[:, 96:], atol=ATOL, rtol=0)
    past.close()


# ------------------------------------------------------------------------------- forward, prefill

def test_plain_forward_with_uncached_suffix(model, caches):
    caches.append(cache := make_cache())
    ids = prompt(120, 13)
    past, _ = tiered_generate(model, cache, ids)
    past.close()
    past = TieredCache(cache, ids, model=model)
    assert past.get_seq_length() == 112
    suffix = past.uncached_input_ids()
    assert suffix.tolist() == ids[:, 112:].tolist()
    with torch.no_grad():
        out = model(suffix, cache=past)
        ref = model(ids, cache=DynamicCache(config=model.config))
        torch.testing.assert_close(out.logits, ref.logits[:, 112:], atol=ATOL, rtol=0)
        # Decode one token by hand: the hook declares it before the layers write its KV.
        nxt = out.logits[:, -1:].argmax(-1)
        out2 = model(nxt, cache=past)
        ref2 = model(torch.cat([ids, nxt], 1), cache=DynamicCache(config=model.config))
        torch.testing.assert_close(out2.logits[:, -1], ref2.logits[:, -1], atol=ATOL, rtol=0)
    assert past.num_tokens == 121
    past.close()


def test_forward_with_the_whole_prompt_is_rejected(model, caches):
    caches.append(cache := make_cache())
    ids = prompt(80, 14)
    past, _ = tiered_generate(model, cache, ids)
    past.close()
    past = TieredCache(cache, ids, model=model)
    assert past.num_cached_tokens == 64
    with pytest.raises(ValueError, match="uncached_input_ids"), torch.no_grad():
        model(ids, cache=past)
    # Nothing was written: the right call still works.
    assert past.get_seq_length() == 64
    with torch.no_grad():
        model(past.uncached_input_ids(), cache=past)
    past.close()


@pytest.mark.parametrize("chunk", [1, 7, 64, 4096])
def test_chunked_prefill_matches_one_forward(model, caches, chunk):
    caches.append(cache := make_cache())
    ids = prompt(300, 15)
    with torch.no_grad():
        ref = model(ids, cache=DynamicCache(config=model.config)).logits[:, -1]
    past = TieredCache(cache, ids, model=model)
    logits = prefill(model, past, ids, chunk_size=chunk)
    torch.testing.assert_close(logits, ref, atol=ATOL, rtol=0)
    assert past.get_seq_length() == 300
    past.close()
    # A longer prompt with the same start: prefill declares the extra tokens itself.
    longer = torch.cat([ids, prompt(50, 16)], 1)
    past = TieredCache(cache, ids[:, :200], model=model)   # prefill declares the rest
    logits = prefill(model, past, longer, chunk_size=chunk)
    with torch.no_grad():
        ref = model(longer, cache=DynamicCache(config=model.config)).logits[:, -1]
    torch.testing.assert_close(logits, ref, atol=ATOL, rtol=0)
    assert past.num_cached_tokens == 192
    assert past.num_tokens == 350
    past.close()


def test_prefill_works_with_dynamic_cache(model):
    ids = prompt(100, 17)
    with torch.no_grad():
        ref = model(ids).logits[:, -1]
    logits = prefill(model, DynamicCache(config=model.config), ids, chunk_size=30)
    torch.testing.assert_close(logits, ref, atol=ATOL, rtol=0)


def test_generate_with_prefill_chunk_size(model, caches):
    caches.append(cache := make_cache())
    ids = prompt(260, 18)
    past = TieredCache(cache, ids, model=model)
    out = model.generate(ids, cache=past, prefill_chunk_size=64, **GEN)
    assert_same(out, reference(model, ids))
    past.close()


# ------------------------------------------------------------------------------- declared tokens

def test_generated_tokens_are_declared_and_published(model, caches):
    caches.append(cache := make_cache())
    ids = prompt(100, 19)
    past = TieredCache(cache, ids, model=model)
    out = model.generate(ids, cache=past, **GEN)
    assert_same(out, reference(model, ids))
    assert past.num_tokens == past.get_seq_length() == 100 + NEW - 1
    past.close()
    nxt = torch.cat([out.sequences, prompt(20, 20)], 1)
    past = TieredCache(cache, nxt, model=model)
    assert past.num_cached_tokens == (100 + NEW - 1) // BS * BS
    past.close()


def test_append_tokens_then_forward(model, caches):
    caches.append(cache := make_cache())
    ids = prompt(70, 21)
    past = TieredCache(cache, ids[:, :40], model=model)
    prefill(model, past)
    past.append_tokens(ids[0, 40:])                 # the next turn, declared up front
    assert past.uncached_input_ids().tolist() == ids[:, 40:].tolist()
    logits = prefill(model, past)
    with torch.no_grad():
        ref = model(ids).logits[:, -1]
    torch.testing.assert_close(logits, ref, atol=ATOL, rtol=0)
    past.close()


# ------------------------------------------------------------------------------- lifecycle, errors

def test_close_keeps_blocks_and_removes_the_hook(model, caches):
    caches.append(cache := make_cache())
    ids = prompt(64, 22)
    with TieredCache(cache, ids, model=model) as past:
        assert len(model._forward_pre_hooks) == len(model._forward_hooks) == 1
        prefill(model, past)
    assert past.closed and len(model._forward_pre_hooks) == len(model._forward_hooks) == 0
    assert cache.stats()["open_sequences"] == 0
    assert cache.stats()["cached_blocks"] == 4
    past.close()                                    # idempotent
    with pytest.raises(SequenceClosedError):
        past.uncached_input_ids()


def test_two_bound_caches_on_one_model_do_not_interfere(model, caches):
    caches.append(cache := make_cache())
    a, b = prompt(50, 23), prompt(60, 24)
    pa = TieredCache(cache, a, model=model)
    pb = TieredCache(cache, b, model=model)
    oa = model.generate(a, cache=pa, **GEN)
    ob = model.generate(b, cache=pb, **GEN)
    assert_same(oa, reference(model, a))
    assert_same(ob, reference(model, b))
    assert pa.num_tokens == 50 + NEW - 1 and pb.num_tokens == 60 + NEW - 1
    pa.close()
    pb.close()


def test_batch_and_beam_search_are_rejected(model, caches):
    caches.append(cache := make_cache())
    with pytest.raises(ValueError, match="batch size 1"):
        TieredCache(cache, prompt(20, 25).repeat(2, 1), model=model)
    ids = prompt(20, 26)
    past = TieredCache(cache, ids, model=model)
    with pytest.raises((ValueError, NotImplementedError), match="batch size 1"):
        model.generate(ids, cache=past, max_new_tokens=3, num_beams=2, do_sample=False)
    past.close()


def test_bad_arguments(model, caches):
    caches.append(cache := make_cache())
    with pytest.raises(TypeError):
        TieredCache(object(), [1, 2, 3], model=model)
    with pytest.raises(ValueError, match="empty"):
        TieredCache(cache, [], model=model)
    fp8 = make_cache(model={"name": "fp8", "num_layers": 2, "num_kv_heads": 2, "head_dim": 16,
                            "num_q_heads": 4, "dtype": "fp8_e4m3"})
    caches.append(fp8)
    with pytest.raises(NotImplementedError, match="fp8"):
        TieredCache(fp8, [1, 2, 3], model=model)
    with pytest.raises(ValueError, match="chunk_size"):
        prefill(None, DynamicCache(), [1, 2], chunk_size=0)


def test_version_pin():
    import transformers
    from packaging.version import Version

    assert Version(transformers.__version__) >= Version(tc_hf.MIN_TRANSFORMERS)
    assert tc_hf.MIN_TRANSFORMERS == "5.0"


@pytest.mark.filterwarnings("ignore:.*past_key_values.*:FutureWarning")
def test_past_key_values_keyword_still_works(model, caches):
    caches.append(cache := make_cache())
    ids = prompt(70, 27)
    past, _ = tiered_generate(model, cache, ids)
    past.close()
    past = TieredCache(cache, ids, model=model)
    out = model.generate(ids, past_key_values=past, **GEN)   # older name of `cache`
    assert_same(out, reference(model, ids))
    past.close()


def test_failure_part_way_through_a_forward_poisons_the_cache(model, caches):
    caches.append(cache := make_cache())
    ids = prompt(40, 28)
    past = TieredCache(cache, ids, model=model)
    real = cache.write

    def failing_write(seq, layer, k, v):
        if layer == 1:
            raise MemoryError("injected")
        return real(seq, layer, k, v)

    cache.write = failing_write
    try:
        with pytest.raises(MemoryError), torch.no_grad():
            model(past.uncached_input_ids(), cache=past)
    finally:
        del cache.write
    with pytest.raises(RuntimeError, match="unusable"):
        past.uncached_input_ids()
    past.close()                        # still releases the sequence
    assert cache.stats()["open_sequences"] == 0
