"""Two turns of a chat through `TieredCache` with a random-weight Llama (nothing downloaded):
the second turn reuses the KV of the first turn's prompt and reply.

    python examples/hf_generate.py
"""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tiered_cache import CacheConfig, TieredKVCache
from tiered_cache.integrations.transformers import TieredCache

torch.manual_seed(0)
llama = LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=512,
                    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=64, initializer_range=0.1,
                    bos_token_id=None, eos_token_id=None, pad_token_id=None)
model = LlamaForCausalLM(llama).eval()
# The cache's geometry must match the model's: layers, KV heads, head_dim.
cache = TieredKVCache(CacheConfig.from_dict({
    "model": {"name": "random-llama", "num_layers": 4, "num_kv_heads": 2, "head_dim": 64,
              "num_q_heads": 4},
    "tiers": {"gpu": {"device": "cpu", "num_blocks": 128}, "host": {"num_blocks": 512}},
}))

conversation = torch.randint(1, 1000, (1, 600))          # system prompt + first question
for turn in (1, 2):
    past = TieredCache(cache, conversation, model=model)   # opens; reuses the cached prefix
    print(f"turn {turn}: prompt {conversation.shape[1]} tokens, reused "
          f"{past.num_cached_tokens} {past.cached_tokens_by_tier}, computing "
          f"{conversation.shape[1] - past.num_cached_tokens}")
    out = model.generate(conversation, cache=past, max_new_tokens=8, do_sample=False,
                         prefill_chunk_size=512)           # prefill only the uncached suffix
    same = torch.equal(out, model.generate(conversation, max_new_tokens=8, do_sample=False))
    print(f"  reply: {out[0, conversation.shape[1]:].tolist()} (same as DynamicCache: {same})")
    past.close()                                           # blocks stay cached
    conversation = torch.cat([out, torch.randint(1, 1000, (1, 50))], dim=1)  # next question

print(f"hit rate {cache.stats()['hit_rate']:.0%}")
cache.shutdown()
