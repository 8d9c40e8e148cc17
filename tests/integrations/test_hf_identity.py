"""KV is reused only under the identity it was computed under (integrations/hf_identity.py and
the checks of integrations/transformers.py): the attention mask and positions of the prompt,
the model's weights, its geometry; a copy of a cache is a correct copy, assisted decoding is
refused before a draft token is fed.

Random-weight Llama models of SmolLM2-135M's attention shape (9 query heads, 3 KV heads,
head_dim 64, hidden 576), 2 layers and a 512-token vocabulary so that they build in a blink;
nothing is downloaded (tests/integrations/test_integration_real_model.py runs the real model
when its package is installed).
"""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM  # noqa: E402

from tiered_cache import CacheConfig, TieredKVCache  # noqa: E402
from tiered_cache.core.invariants import check_invariants  # noqa: E402
from tiered_cache.errors import (  # noqa: E402
    ArgumentError,
    ConfigError,
    IdentityError,
    LayerError,
    UnsupportedError,
)
from tiered_cache.integrations import hf_identity  # noqa: E402
from tiered_cache.integrations.hf_identity import Layout  # noqa: E402
from tiered_cache.integrations.transformers import TieredCache, prefill  # noqa: E402

BS = 16
VOCAB = 512
PAD = 0
NEW = 5
ATOL = 1e-5
SHAPE = dict(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=64)


def llama(seed: int = 0, layers: int = 2, **shape) -> LlamaForCausalLM:
    cfg = LlamaConfig(vocab_size=VOCAB, intermediate_size=256, num_hidden_layers=layers,
                      max_position_embeddings=4096, attn_implementation="sdpa",
                      bos_token_id=None, eos_token_id=None, pad_token_id=PAD,
                      **{**SHAPE, **shape})
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    model.generation_config.pad_token_id = PAD
    return model


@pytest.fixture(scope="module")
def model():
    return llama()


def make_cache(layers: int = 2, kv_heads: int = 3, head_dim: int = 64, **extra) -> TieredKVCache:
    return TieredKVCache(CacheConfig.from_dict({
        "model": {"name": "smollm2-shaped", "num_layers": layers, "num_kv_heads": kv_heads,
                  "head_dim": head_dim, "num_q_heads": 9, "dtype": "float32"},
        "block_size": BS,
        "tiers": {"gpu": {"device": "cpu", "num_blocks": 64},
                  "host": {"num_blocks": 64, "memory": "pageable"}},
        "migrator": {"enabled": False}, "compactor": {"enabled": False}, **extra}))


@pytest.fixture
def cache():
    c = make_cache()
    yield c
    with c.locked():
        check_invariants(c)
    c.shutdown()


def prompt(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (1, n), generator=g)


GEN = dict(max_new_tokens=NEW, do_sample=False, return_dict_in_generate=True,
           output_logits=True)


def reference(model, ids, **kw):
    return model.generate(ids, cache=DynamicCache(config=model.config), **GEN, **kw)


def assert_same(out, ref) -> None:
    assert out.sequences.tolist() == ref.sequences.tolist()
    for a, b in zip(out.logits, ref.logits, strict=True):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0)


def cached_blocks(cache: TieredKVCache) -> int:
    return cache.stats()["cached_blocks"]


def left_padded(n: int, pad: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = prompt(n, seed)
    ids[0, :pad] = PAD
    mask = torch.ones_like(ids)
    mask[0, :pad] = 0
    return ids, mask


# ---------------------------------------------------------------------------- mask, positions

def test_a_forward_under_another_mask_than_the_sequence_is_refused_before_writing(model, cache):
    """Opened without a mask (the ids have no pad token: all ones), fed a padded row's mask."""
    ids, mask = left_padded(80, 8, 1)
    ids[0, :8] = 7                         # not the pad id: nothing to infer from the ids
    past = TieredCache(cache, ids, model=model)
    with pytest.raises(IdentityError, match="attention_mask differs"):
        model.generate(ids, attention_mask=mask, cache=past, **GEN)
    assert past.get_seq_length() == 0 and past.num_tokens == 80
    past.close()
    assert cached_blocks(cache) == 0


@pytest.mark.slow                       # generation through a model, several ways
def test_left_padded_row_is_keyed_by_its_mask(model, cache):
    """A left-padded row's KV is reused by the same row under the same mask, never by the same
    ids under an all-ones mask; each answer is DynamicCache's under its own mask."""
    ids, mask = left_padded(100, 12, 2)
    ones = torch.ones_like(ids)
    past = TieredCache(cache, ids, model=model, attention_mask=mask)
    assert past.layout.head == 13              # the padding, and the first token at 0
    out = model.generate(ids, attention_mask=mask, cache=past, **GEN)
    assert_same(out, reference(model, ids, attention_mask=mask))
    past.close()
    published = cached_blocks(cache)
    assert published > 0

    past = TieredCache(cache, ids, model=model, attention_mask=ones)
    assert past.num_cached_tokens == 0
    out = model.generate(ids, attention_mask=ones, cache=past, **GEN)
    assert_same(out, reference(model, ids, attention_mask=ones))
    past.close()

    past = TieredCache(cache, ids, model=model, attention_mask=mask)
    assert past.num_cached_tokens == 96
    assert_same(model.generate(ids, attention_mask=mask, cache=past, **GEN),
                reference(model, ids, attention_mask=mask))
    past.close()


@pytest.mark.slow                       # generation through a model, several ways
def test_next_turn_of_a_padded_conversation_reuses_it(model, cache):
    ids, mask = left_padded(70, 5, 3)
    past = TieredCache(cache, ids, model=model, attention_mask=mask)
    out = model.generate(ids, attention_mask=mask, cache=past, **GEN)
    past.close()
    turn2 = torch.cat([out.sequences, prompt(30, 4)], 1)
    mask2 = torch.cat([mask, torch.ones(1, turn2.shape[1] - 70, dtype=mask.dtype)], 1)
    past = TieredCache(cache, turn2, model=model, attention_mask=mask2)
    assert past.layout.digest == Layout.of(ids[0].numpy(), model, mask).digest
    assert past.num_cached_tokens == (70 + NEW - 1) // BS * BS
    assert_same(model.generate(turn2, attention_mask=mask2, cache=past, **GEN),
                reference(model, turn2, attention_mask=mask2))
    past.close()


@pytest.mark.slow                       # generation through a model, several ways
def test_pad_ids_inside_a_prompt_all_ones_mask_then_none(model, cache):
    """The issue's case: the tokenizer's all-ones mask in one request, no mask in the next
    (generate() then infers zeros at the pad ids). The second must not reuse the first."""
    ids = prompt(90, 5)
    ids[0, 30:40] = PAD
    ones = torch.ones_like(ids)
    past = TieredCache(cache, ids, model=model, attention_mask=ones)
    assert_same(model.generate(ids, attention_mask=ones, cache=past, **GEN),
                reference(model, ids, attention_mask=ones))
    past.close()
    assert cached_blocks(cache) > 0
    past = TieredCache(cache, ids, model=model)          # the mask generate() will infer
    assert past.layout.head == 41 and past.num_cached_tokens == 0   # 40: at 30 after 0
    assert_same(model.generate(ids, cache=past, **GEN), reference(model, ids))
    past.close()


def test_opened_without_mask_but_fed_an_all_ones_one_with_pad_ids_is_refused(model, cache):
    ids = prompt(60, 6)
    ids[0, 20:25] = PAD
    past = TieredCache(cache, ids, model=model)          # infers zeros at the pad ids
    with pytest.raises(IdentityError, match="attends to every token"):
        model.generate(ids, attention_mask=torch.ones_like(ids), cache=past, **GEN)
    assert past.get_seq_length() == 0
    past.close()
    assert cached_blocks(cache) == 0


def test_positions_other_than_the_sequence_are_refused(model, cache):
    """Same ids, same mask: a plain forward puts the tokens at 0..n-1, generate() at the mask's
    cumulative sum; the KV differs, so a forward at other positions is refused, and prefill()
    (which passes the sequence's mask and positions) computes generate()'s KV."""
    ids, mask = left_padded(50, 6, 7)
    past = TieredCache(cache, ids, model=model, attention_mask=mask)
    with pytest.raises(IdentityError, match="positions"), torch.no_grad():
        model(past.uncached_input_ids(), attention_mask=mask, cache=past)
    assert past.get_seq_length() == 0
    logits = prefill(model, past, chunk_size=16)
    pos = torch.from_numpy(hf_identity.generate_positions(mask[0].numpy())).unsqueeze(0)
    with torch.no_grad():
        ref = model(ids, attention_mask=mask, position_ids=pos).logits[:, -1]
    torch.testing.assert_close(logits, ref, atol=ATOL, rtol=0)
    past.close()


def test_padded_prompt_through_chunked_generate_and_plain_forwards(model, cache):
    ids, mask = left_padded(120, 9, 24)
    ref = reference(model, ids, attention_mask=mask)
    past = TieredCache(cache, ids, model=model, attention_mask=mask)
    out = model.generate(ids, attention_mask=mask, cache=past, prefill_chunk_size=32, **GEN)
    assert_same(out, ref)
    past.close()
    past = TieredCache(cache, ids, model=model, attention_mask=mask)
    assert past.num_cached_tokens == 112
    with torch.no_grad():                           # a plain forward, told the identity
        logits = model(past.uncached_input_ids(), cache=past,
                       **past.forward_kwargs(120 - 112)).logits
    torch.testing.assert_close(logits[:, -1], ref.logits[0], atol=ATOL, rtol=0)
    past.close()


def test_explicit_position_ids_are_keyed(model, cache):
    ids = prompt(64, 8)
    shifted = torch.arange(100, 164).unsqueeze(0)
    past = TieredCache(cache, ids, model=model, position_ids=shifted)
    assert past.layout.head == 1
    with torch.no_grad():
        out = model(ids, position_ids=shifted, cache=past).logits
        ref = model(ids, position_ids=shifted).logits
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)
    past.close()
    plain = TieredCache(cache, ids, model=model)
    assert plain.num_cached_tokens == 0
    plain.close()


def test_inputs_embeds_are_refused(model, cache):
    ids = prompt(40, 9)
    past = TieredCache(cache, ids, model=model)
    with pytest.raises(IdentityError, match="inputs_embeds"), torch.no_grad():
        model(inputs_embeds=model.model.embed_tokens(ids), cache=past)
    assert past.get_seq_length() == 0
    past.close()
    assert cached_blocks(cache) == 0


def test_kv_written_outside_a_forward_of_the_model_is_refused(model, cache):
    ids = prompt(40, 10)
    past = TieredCache(cache, ids, model=model)
    with pytest.raises(IdentityError, match="outside a forward"), torch.no_grad():
        model.model(ids, cache=past)                 # the inner module: no check ran
    other = llama(seed=1)
    with pytest.raises(IdentityError, match="outside a forward"), torch.no_grad():
        other(ids, cache=past)
    assert past.get_seq_length() == 0
    past.close()
    assert cached_blocks(cache) == 0


# ---------------------------------------------------------------------------- weights

def fine_tune(model: LlamaForCausalLM, scale: float = 1e-2) -> LlamaForCausalLM:
    tuned = copy.deepcopy(model)
    g = torch.Generator().manual_seed(123)
    with torch.no_grad():
        for p in tuned.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return tuned


def test_a_fine_tune_under_the_same_model_name_does_not_reuse_the_base_kv(model, cache):
    ids = prompt(64, 11)
    past = TieredCache(cache, ids, model=model)
    model.generate(ids, cache=past, **GEN)
    past.close()
    tuned = fine_tune(model)
    past = TieredCache(cache, ids, model=tuned)
    assert past.num_cached_tokens == 0
    assert_same(tuned.generate(ids, cache=past, **GEN), reference(tuned, ids))
    past.close()


def test_the_same_weights_in_another_object_share_kv(model, cache):
    ids = prompt(64, 12)
    past = TieredCache(cache, ids, model=model)
    model.generate(ids, cache=past, **GEN)
    past.close()
    twin = copy.deepcopy(model)                       # a second load of the same checkpoint
    assert hf_identity.weights_fingerprint(twin) == hf_identity.weights_fingerprint(model)
    past = TieredCache(cache, ids, model=twin)
    assert past.num_cached_tokens == 48
    past.close()


def test_weights_written_in_place_are_another_identity(cache):
    m = llama(seed=2)
    ids = prompt(64, 13)
    past = TieredCache(cache, ids, model=m)
    m.generate(ids, cache=past, **GEN)
    past.close()
    before = hf_identity.weights_fingerprint(m)
    with torch.no_grad():
        m.model.layers[1].mlp.down_proj.weight.mul_(1.5)     # an optimizer step, say
    assert hf_identity.weights_fingerprint(m) != before
    past = TieredCache(cache, ids, model=m)
    assert past.num_cached_tokens == 0
    past.close()


def test_fingerprint_is_computed_once_per_model_object(model, monkeypatch):
    hf_identity.weights_fingerprint(model)
    calls = []
    real = hf_identity._sample
    monkeypatch.setattr(hf_identity, "_sample", lambda *a: calls.append(1) or real(*a))
    for _ in range(3):
        hf_identity.weights_fingerprint(model)
    assert calls == []


def test_weights_id_names_weights_that_cannot_be_read(cache):
    with torch.device("meta"):
        meta = llama(seed=3)
    with pytest.raises(ArgumentError, match="weights_id"):
        hf_identity.weights_fingerprint(meta)
    a, b = llama(seed=4), llama(seed=5)
    ids = prompt(40, 14)
    past = TieredCache(cache, ids, model=a, weights_id="ckpt-7")
    prefill(a, past)
    past.close()
    past = TieredCache(cache, ids, model=b, weights_id="ckpt-7")   # the caller vouches
    assert past.num_cached_tokens == 32
    past.close()
    with pytest.raises(ArgumentError, match="weights_id"):
        TieredCache(cache, ids, model=a, weights_id="")


def test_adapter_id_is_checked_before_it_is_folded_in(model, cache):
    from tiered_cache.errors import TokenError

    with pytest.raises(TokenError, match="adapter_id"):
        TieredCache(cache, [1, 2, 3], model=model, adapter_id="bad\nid")
    a = TieredCache(cache, prompt(40, 23), model=model, adapter_id="lora-a")
    prefill(model, a)
    a.close()
    b = TieredCache(cache, prompt(40, 23), model=model, adapter_id="lora-b")
    assert b.num_cached_tokens == 0
    b.close()


def test_model_is_required(cache):
    with pytest.raises(TypeError):
        TieredCache(cache, [1, 2, 3])       # model= is required
    with pytest.raises(ArgumentError, match="model"):
        TieredCache(cache, [1, 2, 3], model=None)


# ---------------------------------------------------------------------------- geometry

@pytest.mark.parametrize("other, key", [
    (dict(layers=3), "model.num_layers"),
    (dict(layers=1), "model.num_layers"),
    (dict(num_key_value_heads=1), "model.num_kv_heads"),
    (dict(head_dim=32), "model.head_dim"),
], ids=["more-layers", "fewer-layers", "kv-heads", "head-dim"])
def test_a_model_of_another_geometry_is_refused_at_construction(cache, other, key):
    m = llama(seed=6, **other)
    ids = prompt(48, 15)
    with pytest.raises(ConfigError) as info:
        TieredCache(cache, ids, model=m)
    assert info.value.path == key
    stats = cache.stats()
    assert stats["cached_blocks"] == 0 and stats["open_sequences"] == 0
    assert m._forward_pre_hooks == {}


def test_a_model_whose_modules_disagree_with_its_config_is_refused(cache):
    m = llama(seed=7, layers=3)
    m.config.num_hidden_layers = 2                 # the config lies; the modules do not
    with pytest.raises(ConfigError, match="layer indices 0..2"):
        TieredCache(cache, prompt(20, 16), model=m)


def test_sliding_window_layers_are_refused(cache):
    m = llama(seed=8)
    m.config.layer_types = ["sliding_attention", "full_attention"]
    with pytest.raises(UnsupportedError, match="full-attention"):
        TieredCache(cache, prompt(20, 17), model=m)


def test_update_of_a_layer_the_cache_does_not_have(model, cache):
    past = TieredCache(cache, prompt(20, 18), model=model)
    k = torch.zeros(1, 3, 1, 64)
    with pytest.raises(LayerError):
        past.update(k, k, 2)
    past.close()


# ---------------------------------------------------------------------------- copies, crop

def test_deepcopy_is_an_independent_twin_with_the_same_kv(model, cache):
    ids = prompt(90, 19)
    past = TieredCache(cache, ids[:, :70], model=model)
    prefill(model, past)                           # 70 tokens: 4 full blocks and 6 private
    twin = copy.deepcopy(past)
    assert twin is not past and twin.seq is not past.seq
    assert twin.get_seq_length() == past.get_seq_length() == 70
    torch.testing.assert_close(cache.gather(twin.seq, 1)[0], cache.gather(past.seq, 1)[0])
    ref = reference(model, ids)
    assert_same(model.generate(ids, cache=past, **GEN), ref)
    past.close()                                   # the twin does not depend on it
    assert_same(model.generate(ids, cache=twin, **GEN), ref)
    twin.close()
    third = TieredCache(cache, ids, model=model)
    with pytest.raises(ArgumentError, match="pickled"):
        pickle.dumps(third)
    third.close()


def test_a_copy_of_the_model_cannot_write_the_original_cache(model, cache):
    """copy.deepcopy(model) while a TieredCache is open on it copies the model's hooks: the
    copy's are inert, so its forwards are refused like any other model's."""
    ids = prompt(40, 22)
    past = TieredCache(cache, ids, model=model)
    clone = copy.deepcopy(model)
    with pytest.raises(IdentityError, match="outside a forward"), torch.no_grad():
        clone(ids, cache=past)
    assert past.get_seq_length() == 0
    prefill(model, past)                           # the original still works
    past.close()


def test_deepcopy_of_a_closed_cache_is_refused(model, cache):
    past = TieredCache(cache, prompt(20, 20), model=model)
    past.close()
    from tiered_cache.errors import SequenceClosedError

    with pytest.raises(SequenceClosedError):
        copy.deepcopy(past)


@pytest.mark.parametrize("how", ["prompt_lookup", "assistant"])
def test_assisted_decoding_is_refused_before_a_draft_token_is_fed(model, cache, how):
    ids = prompt(64, 21)
    ids[0, 40:48] = ids[0, 10:18]                  # something for prompt lookup to find
    past = TieredCache(cache, ids, model=model)
    kw = ({"prompt_lookup_num_tokens": 3} if how == "prompt_lookup"
          else {"assistant_model": llama(seed=9)})
    with pytest.raises(UnsupportedError, match="assisted decoding"):
        model.generate(ids, cache=past, max_new_tokens=4, do_sample=False, **kw)
    assert past.get_seq_length() == 0 and past.num_tokens == 64
    past.close()
    assert cached_blocks(cache) == 0


# ---------------------------------------------------------------------------- layout units

def test_layout_units(model):
    ids = np.arange(1, 11)
    canonical = Layout.of(ids, model)
    assert canonical.canonical and canonical.digest is None
    assert Layout.of(ids, model, attention_mask=np.ones(10)).canonical
    padded = Layout.of(ids, model, attention_mask=[0, 0, 1, 1, 1, 1, 1, 1, 1, 1])
    assert padded.head == 3 and padded.positions.tolist() == [0, 0, 0, 1, 2, 3, 4, 5, 6, 7]
    assert padded.positions_of(8, 13).tolist() == [6, 7, 8, 9, 10]
    assert padded.mask_until(12).tolist() == [0, 0] + [1] * 10
    with_pad = ids.copy()
    with_pad[4] = PAD
    inferred = Layout.of(with_pad, model)
    assert inferred.head == 6 and inferred.mask.tolist()[4] == 0
    assert len({canonical.digest, padded.digest, inferred.digest}) == 3
    with pytest.raises(ArgumentError, match="shape"):
        Layout.of(ids, model, attention_mask=np.ones(9))
    with pytest.raises(ArgumentError, match="0/1"):
        Layout.of(ids, model, attention_mask=np.full(10, 2))


def test_pad_equal_to_eos_infers_no_mask(model):
    m = copy.copy(model)
    m.generation_config = copy.deepcopy(model.generation_config)
    m.generation_config.eos_token_id = PAD
    ids = np.array([5, PAD, 6])
    assert Layout.of(ids, m).canonical


def test_fingerprint_samples_the_ends_of_a_large_tensor():
    """Evenly strided over the whole tensor, first and last element included (an index
    computed in float32 ran past the end of SmolLM2's 28M-element embedding)."""
    big = torch.nn.Linear(1, 28_311_552, bias=False)
    a = hf_identity.weights_fingerprint(big)
    with torch.no_grad():
        big.weight[-1] += 1.0
    assert hf_identity.weights_fingerprint(big) != a
