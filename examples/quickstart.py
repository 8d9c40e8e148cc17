"""The core API in 30 lines: open a prompt, write its KV, reuse prefixes across requests/tiers.

    python examples/quickstart.py
"""

import torch

from tiered_cache import CacheConfig, TieredKVCache

config = CacheConfig.from_dict({
    "model": {"num_layers": 2, "num_kv_heads": 2, "head_dim": 64},
    "tiers": {"gpu": {"device": "cpu", "num_blocks": 32}, "host": {"num_blocks": 256}},
})
system = list(range(1, 257))                            # 256 shared tokens = 16 blocks

with TieredKVCache(config) as cache:
    for user in [0, 1, 2, 3, 0]:                        # user 0 comes back last
        prompt = system + [1000 + user] * 100           # shared prefix + a private question
        seq = cache.open(prompt, reserve_last=True)     # longest cached prefix, any tier
        n = len(prompt) - seq.num_cached_tokens         # the engine computes only these
        for layer in range(cache.num_layers):
            k, v = torch.randn(2, n, cache.num_kv_heads, cache.head_dim).unbind(0)
            cache.write(seq, layer, k, v)               # KV of the uncached tokens
        keys, values = cache.gather(seq, 0)             # full K/V of a layer: [len, H, D]
        print(f"user {user}: {len(prompt)} tokens, {seq.num_cached_tokens} reused "
              f"{seq.cached_tokens_by_tier}, K of layer 0 {tuple(keys.shape)}")
        cache.close(seq)                                # full blocks stay cached
    s = cache.stats()
    print(f"hit rate {s['hit_rate']:.0%}; hit tokens by tier {s['hit_tokens_by_tier']}")
