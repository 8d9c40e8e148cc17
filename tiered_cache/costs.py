"""Load or recompute: is a slow tier's copy of some blocks worth fetching?

A block found only in a slow tier (disk, remote) can be loaded, or its tokens can be prefilled
again on the GPU. Above a few milliseconds of latency, or below some bandwidth, recomputing wins;
loading anyway makes the request slower *and* spends the tier's bandwidth. This module holds the
two estimates and the comparison. Pure Python (no torch), so the control plane can call it.

The model
---------

Loading ``nblocks`` blocks of ``nbytes`` in total from a tier, in one request::

    load_seconds = latency + nbytes / bandwidth

``latency`` and ``bandwidth`` are exponentially weighted moving averages (EWMA, weight
``alpha`` for the newest sample) of what the tier actually did, fed by ``TierCost.observe``:

- a sample without payload (``nbytes == 0``: an existence check, a header read) is a latency
  sample: ``latency <- (1 - alpha) * latency + alpha * seconds``;
- a sample with payload is a bandwidth sample, after the latency estimate is taken out:
  ``bandwidth_sample = nbytes / max(seconds - latency, seconds * MIN_TRANSFER_FRACTION)``, then
  the same EWMA on bandwidth. The floor keeps a noisy latency estimate (one larger than a whole
  transfer) from turning a sample into infinite bandwidth.

Until a tier has samples its estimates are the priors it was built with (config values), so the
first decisions are the operator's. From the first sample on, measurements rule: the weight of
sample ``n`` (counting from 1) is ``max(alpha, 1 / n)``, so the estimate is the plain mean of the
samples until there are ``1 / alpha`` of them, and an EWMA after that. (A plain EWMA from the
prior would let a wrong prior linger for ~1/alpha requests; bandwidth samples are few.)

Recomputing ``num_tokens`` tokens that follow ``context_tokens`` already-cached tokens costs the
prefill FLOPs of the configured model at a stated throughput::

    linear    = 2 * num_params * num_tokens
    attention = 4 * num_layers * hidden * sum(context_tokens + i + 1 for i in range(num_tokens))
              = 4 * num_layers * hidden * (num_tokens * context_tokens
                                           + num_tokens * (num_tokens + 1) / 2)
    hidden    = num_q_heads * head_dim
    recompute_seconds = (linear + attention) / (prefill_tflops * 1e12)

These FLOPs are this module's functions (`linear_flops`, `attention_flops`, `causal_pairs`);
the replay's seconds-saved model (tools/replay/costs.py) and the eviction policies' cost context
(`crossover_context_tokens`, tiers/stack.py) use the same ones.

``2 * num_params`` per token is one multiply-add per weight (embeddings included in
``num_params``: close enough for 70B-class models, where they are ~1.5%). Attention is QK^T and
PV, each ``2 * hidden`` FLOPs per (query, key) pair and layer, with causal masking: token ``i``
of the span sees the context, the span's tokens before it and itself.

``prefill_tflops`` is the *achieved* dense throughput of prefill on the serving GPU(s), not the
datasheet peak. The default, ``DEFAULT_PREFILL_TFLOPS = 400``, is about 40% of an H100/H200's
989 dense BF16 TFLOPS, what large-batch prefill reaches in practice; set it per deployment
(times the tensor-parallel degree for a TP group).

The decision::

    worth_loading  <=>  load_seconds * margin <= recompute_seconds

``margin`` (default ``DEFAULT_MARGIN = 1.1``) asks a load to beat recomputation by 10% before it
is chosen: a load also occupies the tier and the network, and the estimates are averages.

NOTE: the model compares serial times. The cache prefetches loads layer by layer and overlaps
them with compute, so a load somewhat slower than recompute can still hide; counting it as a
loss is the conservative side (the cost is GPU time, never wrong data).

Worked example (70B-class, Llama-3-70B geometry): ``num_params = 70.6e9``, 80 layers, 64 query
heads of 128 (hidden 8192), 16-token blocks of 5 MiB (80 layers x 8 KV heads x 128 x 2 x 2 B
x 16 tokens). Recomputing one block at the start of a prompt: 2 * 70.6e9 * 16 = 2.26e12 FLOPs
-> 5.6 ms at 400 TFLOPS. Loading it over 1 GB/s with 1 ms latency: 1 + 5.2 = 6.2 ms -> recompute.
At 10 GB/s: 1.5 ms -> load. Deep in a 100K-token context the same block costs 4.2e12 more
attention FLOPs (16.1 ms in all), so loads pay off there at lower bandwidth.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

DEFAULT_PREFILL_TFLOPS = 400.0
DEFAULT_MARGIN = 1.1
DEFAULT_ALPHA = 0.1
MIN_TRANSFER_FRACTION = 0.1


def linear_flops(num_params: float, num_tokens: float) -> float:
    """FLOPs of the linear layers for `num_tokens` tokens: one multiply-add per weight."""
    return 2.0 * num_params * num_tokens


def attention_flops(num_layers: int, hidden: int, pairs: float) -> float:
    """FLOPs of attention over `pairs` (query, key) pairs: QK^T and PV, each `2 * hidden` per
    pair and layer (hidden = num_q_heads * head_dim)."""
    return 4.0 * num_layers * hidden * pairs


def causal_pairs(num_tokens: int, context_tokens: int) -> float:
    """(query, key) pairs of `num_tokens` new tokens after `context_tokens` cached ones, with
    causal masking: token i of the span sees the context, the span before it and itself."""
    return num_tokens * context_tokens + num_tokens * (num_tokens + 1) / 2


def crossover_context_tokens(num_params: float, num_layers: int, hidden: int) -> float:
    """The context length at which a token's attention FLOPs equal its linear layers'
    (`2 * num_params = 4 * num_layers * hidden * t`): ~53K tokens for a 70B-class model. The
    cost-aware policies weigh a block's depth against it."""
    return linear_flops(num_params, 1) / attention_flops(num_layers, hidden, 1)


@dataclass(frozen=True, slots=True)
class ModelFlops:
    """The parts of a model's shape that set its prefill FLOPs."""

    num_params: float
    num_layers: int
    num_q_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        for name in ("num_params", "num_layers", "num_q_heads", "head_dim"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: expected > 0, got {getattr(self, name)!r}")

    @property
    def hidden(self) -> int:
        return self.num_q_heads * self.head_dim

    def linear_flops(self, num_tokens: int) -> float:
        return linear_flops(self.num_params, num_tokens)

    def attention_flops(self, num_tokens: int, context_tokens: int) -> float:
        """Causal attention of `num_tokens` new tokens after `context_tokens` cached ones."""
        return attention_flops(self.num_layers, self.hidden,
                               causal_pairs(num_tokens, context_tokens))

    def prefill_flops(self, num_tokens: int, context_tokens: int = 0) -> float:
        if num_tokens < 0 or context_tokens < 0:
            raise ValueError(f"token counts must be >= 0, got {num_tokens}, {context_tokens}")
        return self.linear_flops(num_tokens) + self.attention_flops(num_tokens, context_tokens)


class TierCost:
    """Moving averages of one tier's measured latency and bandwidth.

    Why EWMAs rather than a window: O(1) per sample, no allocation, and old conditions (a server
    that was slow an hour ago) fade at a known rate. Thread-safe: copy threads observe while the
    scheduler asks.
    """

    def __init__(self, name: str, *, latency_s: float, bandwidth_bps: float,
                 alpha: float = DEFAULT_ALPHA) -> None:
        if latency_s < 0:
            raise ValueError(f"{name}: latency_s must be >= 0, got {latency_s}")
        if not bandwidth_bps > 0:
            raise ValueError(f"{name}: bandwidth_bps must be > 0, got {bandwidth_bps}")
        if not 0 < alpha <= 1:
            raise ValueError(f"{name}: alpha must be in (0, 1], got {alpha}")
        self.name = name
        self.alpha = alpha
        self._latency = float(latency_s)
        self._bandwidth = float(bandwidth_bps)
        self._lock = threading.Lock()
        self.latency_samples = 0
        self.bandwidth_samples = 0
        self.blocks_observed = 0

    @property
    def latency_s(self) -> float:
        return self._latency

    @property
    def bandwidth_bps(self) -> float:
        return self._bandwidth

    def observe(self, nbytes: int, seconds: float, nblocks: int = 0) -> None:
        """One request that moved `nbytes` (0 for a lookup) in `seconds`."""
        if seconds < 0 or nbytes < 0:
            return
        with self._lock:
            self.blocks_observed += nblocks
            if nbytes == 0:
                self.latency_samples += 1
                a = max(self.alpha, 1.0 / self.latency_samples)
                self._latency += a * (seconds - self._latency)
                return
            transfer = max(seconds - self._latency, seconds * MIN_TRANSFER_FRACTION)
            if transfer <= 0:
                return
            self.bandwidth_samples += 1
            a = max(self.alpha, 1.0 / self.bandwidth_samples)
            self._bandwidth += a * (nbytes / transfer - self._bandwidth)

    def load_seconds(self, nblocks: int, nbytes: int) -> float:
        """Estimated time to load `nblocks` blocks of `nbytes` in all in one request (0 for
        nothing to load)."""
        if nblocks <= 0 and nbytes <= 0:
            return 0.0
        return self._latency + nbytes / self._bandwidth

    def snapshot(self) -> dict[str, float | int | str]:
        return {"tier": self.name, "latency_s": self._latency,
                "bandwidth_bps": self._bandwidth, "latency_samples": self.latency_samples,
                "bandwidth_samples": self.bandwidth_samples,
                "blocks_observed": self.blocks_observed}


@dataclass(frozen=True, slots=True)
class LoadDecision:
    """Both estimates behind one decision, so callers can count and log skipped loads."""

    tier: str
    load_s: float
    recompute_s: float
    load: bool


class CostModel:
    """Prefill cost of the configured model against each tier's measured load cost."""

    def __init__(self, model: ModelFlops, *, prefill_tflops: float = DEFAULT_PREFILL_TFLOPS,
                 margin: float = DEFAULT_MARGIN) -> None:
        if not prefill_tflops > 0:
            raise ValueError(f"prefill_tflops: expected > 0, got {prefill_tflops}")
        if not margin > 0:
            raise ValueError(f"margin: expected > 0, got {margin}")
        self.model = model
        self.prefill_tflops = float(prefill_tflops)
        self.margin = float(margin)
        self.tiers: dict[str, TierCost] = {}

    def add_tier(self, tier: TierCost) -> TierCost:
        self.tiers[tier.name] = tier
        return tier

    def recompute_seconds(self, num_tokens: int, context_tokens: int = 0) -> float:
        return self.model.prefill_flops(num_tokens, context_tokens) / (self.prefill_tflops * 1e12)

    def decide(self, tier: str | TierCost, *, nblocks: int, nbytes: int, num_tokens: int,
               context_tokens: int = 0) -> LoadDecision:
        """Load `nblocks` blocks (`nbytes`, holding `num_tokens` tokens that follow
        `context_tokens` tokens the request already has) from `tier`, or recompute them?"""
        cost = tier if isinstance(tier, TierCost) else self.tiers[tier]
        load_s = cost.load_seconds(nblocks, nbytes)
        recompute_s = self.recompute_seconds(num_tokens, context_tokens)
        return LoadDecision(cost.name, load_s, recompute_s, load_s * self.margin <= recompute_s)

    def worth_loading(self, tier: str | TierCost, *, nblocks: int, nbytes: int, num_tokens: int,
                      context_tokens: int = 0) -> bool:
        return self.decide(tier, nblocks=nblocks, nbytes=nbytes, num_tokens=num_tokens,
                           context_tokens=context_tokens).load

    def worth_blocks(self, tier: str, nblocks: int, context_blocks: int, *, block_bytes: int,
                     block_size: int) -> bool:
        """`worth_loading` in blocks (BlockIndex's `worth`); True for a tier not modelled."""
        cost = self.tiers.get(tier)
        if cost is None:
            return True
        return self.worth_loading(cost, nblocks=nblocks, nbytes=nblocks * block_bytes,
                                  num_tokens=nblocks * block_size,
                                  context_tokens=context_blocks * block_size)


def from_config(config) -> CostModel | None:
    """The cost model `config` asks for (`cost_model`), without tiers (each slow tier kind adds
    its own prior: tiered_cache.tiers), or None when the model's size is not known
    (`model.num_params`): without it there is no prefill cost to compare with."""
    cm, model = config.cost_model, config.model
    if not (cm.enabled and model.num_params):
        return None
    return CostModel(ModelFlops(model.num_params, model.num_layers, config.num_q_heads,
                                model.head_dim),
                     prefill_tflops=cm.prefill_tflops, margin=cm.margin)
