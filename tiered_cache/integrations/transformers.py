"""Hugging Face transformers integration: a `transformers.Cache` backed by a `TieredKVCache`.

```
from tiered_cache import TieredKVCache, CacheConfig
from tiered_cache.integrations.transformers import TieredCache, prefill

cache = TieredKVCache(CacheConfig.from_yaml("configs/default.yaml"))
past = TieredCache(cache, input_ids, model=model)    # opens the sequence, reuses the longest
past.num_cached_tokens                               # cached prefix from any tier
out = model.generate(input_ids, cache=past, max_new_tokens=8)   # computes only the suffix
past.close()                                         # its full blocks stay cached
```

One `TieredCache` is one request (batch size 1). It implements the transformers 5.x `Cache`
interface: every attention layer calls `update(key_states, value_states, layer_idx)` with the
KV of the tokens of the current forward; `update` writes them through `TieredKVCache.write`
(`[n, H, D]`, transposed from HF's `[1, H, n, D]`) and returns the layer's whole K/V from
`TieredKVCache.gather` in HF layout. `get_seq_length()` is the number of tokens whose KV is
cached, so the model derives the positions of the new tokens by itself (the rotary embedding and
the causal mask start at `num_cached_tokens`).

Token ids. The cache publishes a full block to the prefix index only with its real token ids
(they are hashed into the block's key), and `TieredKVCache.write` only accepts KV of tokens that
were declared first (`open` or `append`). The prompt is declared by `open`. New tokens
(generated tokens, the next turn of a chat) reach the cache in one of three ways:

1. `model=`: a forward pre-hook on the model reads `input_ids` of every forward that gets this
   cache and declares the tokens past the declared ones before any layer runs (it also checks
   that the tokens it sees continue the sequence, so passing the whole prompt to a plain
   forward call instead of the uncached suffix is an error, not silently wrong KV). With it,
   `generate` and plain forward calls need nothing else. The hook is removed by `close()`.
2. `prefill(model, past, input_ids)` declares the tokens of `input_ids` itself.
3. Without either, the KV of undeclared tokens is kept in a small per-layer tail next to the
   cache (attention still sees it) until their ids are declared with `append_tokens(ids)` or
   `close(token_ids=sequence)`; tail KV whose ids are never declared is dropped at close.

Unsupported (raise): batch size > 1, beam search, `crop` (assisted decoding), fp8 KV storage.
"""

from __future__ import annotations

import inspect

import numpy as np
import torch

from tiered_cache.cache import TieredKVCache
from tiered_cache.core.sequence import Sequence
from tiered_cache.data.pools import TORCH_DTYPES
from tiered_cache.errors import SequenceClosedError

MIN_TRANSFORMERS = "5.0"
"""Oldest transformers release whose `Cache` interface this module implements (tested: 5.24)."""


def _require_transformers():
    try:
        import transformers
    except ImportError as exc:  # pragma: no cover - the test venv has it
        raise ImportError(
            "tiered_cache.integrations.transformers needs transformers>="
            f"{MIN_TRANSFORMERS}; install it with `pip install 'tiered-cache[hf]'`") from exc
    from packaging.version import Version

    have = Version(transformers.__version__)
    if have.release < Version(MIN_TRANSFORMERS).release:
        raise ImportError(
            f"tiered_cache.integrations.transformers needs transformers>={MIN_TRANSFORMERS} "
            f"(the layered Cache API of 5.x), found {transformers.__version__}; upgrade with "
            "`pip install -U 'transformers>=5.0'`")
    return transformers


_require_transformers()

from transformers.cache_utils import Cache, CacheLayerMixin  # noqa: E402

DEFAULT_PREFILL_CHUNK_SIZE = 512

__all__ = ["TieredCache", "prefill", "MIN_TRANSFORMERS", "DEFAULT_PREFILL_CHUNK_SIZE"]


def _as_ids(token_ids, what: str = "input_ids") -> torch.Tensor:
    """A flat int64 CPU tensor of token ids from a list, array, `[n]` or `[1, n]` tensor."""
    if isinstance(token_ids, torch.Tensor):
        t = token_ids.detach()
    else:
        t = torch.as_tensor(np.asarray(token_ids))
    if t.dim() == 2:
        if t.shape[0] != 1:
            raise ValueError(f"{what}: TieredCache serves one sequence (batch size 1), got a "
                             f"batch of {t.shape[0]}; use one TieredCache per sequence")
        t = t[0]
    if t.dim() != 1:
        raise ValueError(f"{what}: expected token ids of shape [n] or [1, n], got "
                         f"{list(t.shape)}")
    return t.to(device="cpu", dtype=torch.long)


class _TieredLayer(CacheLayerMixin):
    """One model layer's view of a `TieredCache`; all state lives in the owner."""

    is_compileable = False
    is_sliding = False
    is_croppable = False
    supports_early_init = False

    def __init__(self, owner: TieredCache, layer: int) -> None:
        super().__init__()
        self._owner = owner
        self._layer = layer
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        return self._owner._update(self._layer, key_states, value_states)

    def get_seq_length(self) -> int:
        return self._owner._layer_length(self._layer)

    def get_mask_sizes(self, query_length) -> tuple[int, int]:
        # Older 5.x releases pass `cache_position` (a tensor of the query's positions).
        if isinstance(query_length, torch.Tensor):
            query_length = int(query_length.shape[0])
        return self.get_seq_length() + int(query_length), 0

    def get_max_length(self) -> int:
        return -1

    def offload(self):
        pass

    def prefetch(self):
        pass

    def reset(self) -> None:
        raise NotImplementedError("TieredCache cannot be reset; close it and open a new one")

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove:
            raise NotImplementedError("TieredCache does not support crop (assisted decoding); "
                                      "written KV may already be published to other requests")

    def reorder_cache(self, beam_idx) -> None:
        if beam_idx.numel() != 1 or int(beam_idx.reshape(-1)[0]) != 0:
            raise NotImplementedError("TieredCache serves batch size 1: no beam search")

    def batch_repeat_interleave(self, repeats: int) -> None:
        if repeats != 1:
            raise NotImplementedError("TieredCache serves batch size 1: no beams or "
                                      "num_return_sequences > 1")

    def batch_select_indices(self, indices) -> None:
        if indices.numel() != 1 or int(indices.reshape(-1)[0]) != 0:
            raise NotImplementedError("TieredCache serves batch size 1")


class TieredCache(Cache):
    """A transformers `Cache` for one sequence (batch size 1) whose KV lives in a
    `TieredKVCache`, shared with every other request of that cache.

    `TieredCache(cache, input_ids)` opens the sequence with `reserve_last=True`: the longest
    cached prefix (any tier) is reused, and at least the last token is left to compute so that
    the forward produces logits. Then either:

    - `model.generate(input_ids, cache=past, ...)`: generate slices the prompt to the tokens
      after `past.get_seq_length()` itself and puts them at the right positions; or
    - `model(past.uncached_input_ids(), cache=past)` (positions follow from the cache length);
    - `prefill(model, past, input_ids, chunk_size=512)` for long prompts, in bounded memory.

    Pass `model=` (or call `bind(model)`) so that tokens generated or fed later are declared to
    the cache with their ids (see the module docstring). `close()` releases the sequence; its
    full blocks stay cached for later requests.
    """

    def __init__(self, cache: TieredKVCache, input_ids, *, model=None,
                 salt: str | bytes | None = None, adapter_id: str | None = None) -> None:
        if not isinstance(cache, TieredKVCache):
            raise TypeError(f"cache: expected a TieredKVCache, got {type(cache).__name__}")
        if not cache.has_storage:
            raise ValueError("TieredCache needs a cache with tensor storage (storage: tensors)")
        dtype_name = cache.config.model.dtype
        if dtype_name == "fp8_e4m3":
            raise NotImplementedError("TieredCache supports float32/float16/bfloat16 KV "
                                      "storage; fp8_e4m3 is not supported by this integration")
        ids = _as_ids(input_ids)
        if ids.numel() == 0:
            raise ValueError("input_ids: the prompt is empty")
        self.cache = cache
        self._dtype = TORCH_DTYPES[dtype_name]
        self._tail: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * cache.num_layers
        self._hooks: list = []
        self._closed = False
        self._failed: BaseException | None = None
        self._lengths = [0] * cache.num_layers        # after close
        super().__init__(layers=[_TieredLayer(self, i) for i in range(cache.num_layers)])
        self.seq: Sequence = cache.open(ids.numpy(), salt=salt, adapter_id=adapter_id,
                                        reserve_last=True)
        self.num_cached_tokens: int = self.seq.num_cached_tokens
        """Prompt tokens whose KV came from the cache (computed by an earlier request)."""
        self.cached_tokens_by_tier: dict[str, int] = dict(self.seq.cached_tokens_by_tier)
        """Those tokens by the tier they were found in (`gpu`, `host`)."""
        self.prompt_length: int = int(ids.numel())
        if model is not None:
            self.bind(model)

    # ------------------------------------------------------------------ public helpers
    @property
    def num_tokens(self) -> int:
        """Tokens declared to the cache so far (prompt plus appended ones)."""
        return self.seq.num_tokens

    @property
    def token_ids(self) -> torch.Tensor:
        """The declared token ids, `[num_tokens]` int64."""
        return self._declared(0, self.seq.num_tokens)

    def _declared(self, start: int, end: int) -> torch.Tensor:
        return torch.from_numpy(self.seq.token_ids[start:end].astype(np.int64))

    @property
    def closed(self) -> bool:
        return self._closed

    def uncached_input_ids(self) -> torch.Tensor:
        """`[1, n]` ids of the declared tokens whose KV is not computed yet: what a plain
        forward call must be given (right after open: the prompt after `num_cached_tokens`)."""
        self._check_open()
        return self._declared(self.get_seq_length(), self.seq.num_tokens).unsqueeze(0)

    def bind(self, model) -> TieredCache:
        """Install a forward pre-hook on `model` that declares the ids of tokens fed with this
        cache. Idempotent per model; removed by `close()` / `unbind()`."""
        self._check_open()
        if any(m is model for m, _ in self._hooks):
            return self
        handle = model.register_forward_pre_hook(self._pre_hook, with_kwargs=True)
        self._hooks.append((model, handle))
        return self

    def unbind(self) -> None:
        for _, handle in self._hooks:
            handle.remove()
        self._hooks = []

    def append_tokens(self, token_ids) -> None:
        """Declare the next tokens of the sequence (after `num_tokens`); KV already computed
        for them (the tail of an unbound cache) is written to the cache at once."""
        self._check_open()
        ids = _as_ids(token_ids, "token_ids")
        if ids.numel():
            self.cache.append(self.seq, ids.numpy())
        self._flush()

    def close(self, token_ids=None) -> None:
        """Release the sequence: full, written blocks stay cached (and evictable), the rest is
        freed. `token_ids`: optionally the whole sequence so far (e.g. `generate`'s output),
        to declare the ids of computed tokens the cache has not seen (unbound caches).
        Idempotent."""
        if self._closed:
            return
        try:
            if token_ids is not None and self._tail_length() and self._failed is None:
                ids = _as_ids(token_ids, "token_ids")
                d = self.seq.num_tokens
                if ids.numel() < d or not torch.equal(ids[:d], self.token_ids):
                    raise ValueError("close(token_ids): the ids do not start with this "
                                     "sequence's declared tokens")
                self.append_tokens(ids[d:d + self._tail_length()])
        finally:
            self._lengths = [self._layer_length(i) for i in range(len(self.layers))]
            self.unbind()
            self._tail = [None] * len(self._tail)
            self._closed = True
            try:
                self.cache.close(self.seq)
            except SequenceClosedError:
                pass        # the cache was shut down first: nothing left to release

    def __enter__(self) -> TieredCache:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return (f"TieredCache({state}, tokens={self.seq.num_tokens}, "
                f"cached={self.num_cached_tokens}, length={self.get_seq_length()})")

    # ------------------------------------------------------------------ Cache internals
    def _check_open(self) -> None:
        if self._closed:
            raise SequenceClosedError("this TieredCache is closed")
        if self._failed is not None:
            raise RuntimeError(
                "this TieredCache is unusable: a forward failed part-way through its layers "
                f"({type(self._failed).__name__}: {self._failed}), so the layers hold different "
                "lengths; close() it (published blocks are complete and stay cached) and open a "
                "new one") from self._failed

    def _tail_length(self, layer: int = 0) -> int:
        t = self._tail[layer]
        return 0 if t is None else int(t[0].shape[0])

    def _layer_length(self, layer: int) -> int:
        if self._closed:
            return self._lengths[layer]
        return self.seq.written[layer] + self._tail_length(layer)

    def _pre_hook(self, module, args, kwargs):
        mine = (kwargs.get("cache") is self or kwargs.get("past_key_values") is self
                or any(a is self for a in args))
        if not mine or self._closed:
            return None
        ids = kwargs.get("input_ids")
        if ids is None and args and isinstance(args[0], torch.Tensor):
            ids = args[0]
        if ids is not None:
            self._observe(_as_ids(ids))
        return None

    def _observe(self, ids: torch.Tensor) -> None:
        """`ids` are fed at positions [P, P + n), P = the cache length: check the ones already
        declared, declare the rest."""
        p, d, n = self.get_seq_length(), self.seq.num_tokens, int(ids.numel())
        if p < d:
            m = min(n, d - p)
            if not torch.equal(ids[:m], self._declared(p, p + m)):
                raise ValueError(
                    f"input_ids do not continue the cached sequence: the cache holds KV of "
                    f"{p} tokens, so a forward must be given the tokens from position {p} on "
                    "(past.uncached_input_ids()); generate() slices the full prompt itself")
        if p + n > d and p <= d:
            self.cache.append(self.seq, ids[d - p:].numpy())
        # p > d: tokens of unknown ids sit in the tail; these stay there too (positions would
        # not line up), until append_tokens / close(token_ids) declares them in order.

    def _update(self, layer: int, key_states: torch.Tensor, value_states: torch.Tensor):
        self._check_open()
        try:
            return self._update_layer(layer, key_states, value_states)
        except BaseException as exc:
            if len({self._layer_length(i) for i in range(len(self.layers))}) > 1:
                self._failed = exc      # earlier layers already took this forward's tokens
            raise

    def _update_layer(self, layer: int, key_states: torch.Tensor,
                      value_states: torch.Tensor):
        if key_states.dim() != 4 or key_states.shape[0] != 1:
            raise ValueError(f"TieredCache serves batch size 1; got key states of shape "
                             f"{list(key_states.shape)} (expected [1, heads, tokens, head_dim])")
        k = key_states[0].transpose(0, 1)           # [1, H, n, D] -> [n, H, D]
        v = value_states[0].transpose(0, 1)
        tail = self._tail[layer]
        if tail is not None:
            k = torch.cat([tail[0], k])
            v = torch.cat([tail[1], v])
        written = self.seq.written[layer]
        m = max(0, min(int(k.shape[0]), self.seq.num_tokens - written))
        if m:
            self.cache.write(self.seq, layer, k[:m].to(self._dtype).contiguous(),
                             v[:m].to(self._dtype).contiguous())
        self._tail[layer] = (k[m:], v[m:]) if k.shape[0] > m else None
        keys, values = self.cache.gather(self.seq, layer)
        keys = keys.to(device=key_states.device, dtype=key_states.dtype)
        values = values.to(device=value_states.device, dtype=value_states.dtype)
        if self._tail[layer] is not None:
            keys = torch.cat([keys, self._tail[layer][0]])
            values = torch.cat([values, self._tail[layer][1]])
        return keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0)

    def _flush(self) -> None:
        """Write tail KV whose ids are now declared."""
        for layer, tail in enumerate(self._tail):
            if tail is None:
                continue
            m = max(0, min(int(tail[0].shape[0]),
                           self.seq.num_tokens - self.seq.written[layer]))
            if m:
                self.cache.write(self.seq, layer, tail[0][:m].to(self._dtype).contiguous(),
                                 tail[1][:m].to(self._dtype).contiguous())
            self._tail[layer] = (tail[0][m:], tail[1][m:]) if tail[0].shape[0] > m else None


# ---------------------------------------------------------------------- chunked prefill

def _cache_kwarg(model) -> str:
    """The name under which `model.forward` takes the cache (`cache` since 5.x renamed it)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


@torch.no_grad()
def prefill(model, past: Cache, input_ids=None, chunk_size: int = DEFAULT_PREFILL_CHUNK_SIZE,
            **forward_kwargs) -> torch.Tensor:
    """Run `model` over the tokens of `input_ids` whose KV `past` does not hold yet, in chunks
    of `chunk_size` tokens (activations and attention scores stay bounded by the chunk, so a
    100K-token prompt fits), and return the logits of the last token, `[1, vocab]`.

    `input_ids`: the whole sequence (`[n]` or `[1, n]`); the first `past.get_seq_length()`
    tokens are skipped (for a `TieredCache` they must equal its declared tokens; ids past them
    are declared). None, for a `TieredCache`: its declared, uncomputed tokens. Works with any
    transformers `Cache` (e.g. `DynamicCache`, the no-reuse baseline).
    """
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(f"chunk_size: expected a positive int, got {chunk_size!r}")
    start = past.get_seq_length()
    if isinstance(past, TieredCache):
        past._check_open()
        if input_ids is None:
            ids = past.token_ids
        else:
            ids = _as_ids(input_ids)
            d = past.num_tokens
            known = min(d, int(ids.numel()))
            if not torch.equal(ids[:known], past.token_ids[:known]):
                raise ValueError("input_ids do not start with the tokens the TieredCache was "
                                 "opened with")
            if ids.numel() > d:
                past.append_tokens(ids[d:])
    else:
        if input_ids is None:
            raise ValueError("input_ids is required unless past is a TieredCache")
        ids = _as_ids(input_ids)
    suffix = ids[start:]
    if suffix.numel() == 0:
        raise ValueError(f"nothing to prefill: the cache already holds all {start} tokens "
                         "(a TieredCache always leaves at least the last prompt token)")
    device = model.device if hasattr(model, "device") else None
    kwarg = _cache_kwarg(model)
    params = inspect.signature(model.forward).parameters
    if "logits_to_keep" in params:
        forward_kwargs.setdefault("logits_to_keep", 1)
    logits = None
    for chunk in torch.split(suffix, chunk_size):
        out = model(input_ids=chunk.unsqueeze(0).to(device), use_cache=True,
                    **{kwarg: past}, **forward_kwargs)
        logits = out.logits[:, -1]
    return logits

