"""Hugging Face transformers integration: a `transformers.Cache` backed by a `TieredKVCache`.

```
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
cached, so the model derives the positions of the new tokens by itself.

Identity (hf_identity.py). KV is reused only under the identity it was computed under: the
token ids (the block keys), the model's weights (a fingerprint of `model`), its geometry
(checked against the cache's at construction) and the prompt's attention mask and positions
(`attention_mask=` / `position_ids=`; by default the mask `generate()` would infer from the
pad token and the positions `generate()` gives it). They are folded into the adapter id the
sequence is opened under, so another identity is another root: it misses.

Every forward that gets this cache goes through a forward pre-hook on `model`, which checks,
before any layer runs (so nothing is written when it refuses):
- `input_ids` continue the sequence (the tokens already declared must match; new ones are
  declared, so generated tokens and later turns are keyed by their real ids);
- the forward's 2D attention mask and its positions are those of the sequence's identity
  (IdentityError otherwise: KV computed under another mask must not land under this key);
- it carries token ids (KV from `inputs_embeds` cannot be keyed: IdentityError) and is not
  assisted decoding (which needs `crop`: UnsupportedError, before the draft tokens are fed).
KV written outside such a forward (another model object, the inner model called directly) is
refused (IdentityError). `copy.deepcopy(past)` opens an independent twin of the sequence over
the same cache and model, with the same KV.

Unsupported (raise UnsupportedError or ValueError): batch size > 1, beam search, `crop`
(assisted decoding), fp8 KV storage, layers other than full attention.
"""

from __future__ import annotations

import inspect
import sys
import types

import numpy as np
import torch

from tiered_cache.cache import TieredKVCache, _check_adapter
from tiered_cache.core.sequence import Sequence
from tiered_cache.data.pools import TORCH_DTYPES
from tiered_cache.errors import (
    ArgumentError,
    IdentityError,
    LayerError,
    SequenceClosedError,
    UnsupportedError,
    install_hint,
)
from tiered_cache.integrations import hf_identity
from tiered_cache.integrations.hf_identity import Layout

MIN_TRANSFORMERS = "5.0"
"""Oldest transformers release whose `Cache` interface this module implements (tested: 5.24)."""


def _require_transformers():
    try:
        import transformers
    except ImportError as exc:  # pragma: no cover - the test venv has it
        raise ImportError(
            "tiered_cache.integrations.transformers needs transformers>="
            f"{MIN_TRANSFORMERS}; install it with `{install_hint('hf')}`") from exc
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


def _in_assisted_decoding() -> bool:
    """Whether this forward runs inside `generate()`'s assisted decoding (an assistant model or
    prompt lookup), whose first forward already feeds draft tokens it may `crop` later.

    NOTE: read from the call stack because transformers tells a cache nothing of the decoding
    mode before that first forward (it checks `is_croppable` only after it)."""
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "_assisted_decoding" and "transformers" in code.co_filename:
            return True
        frame = frame.f_back
    return False


class _Hook:
    """A TieredCache's hook on its model. A copy of the model (copy.deepcopy copies its hooks)
    gets an inert one: the copy is another object, whose forwards must not write this cache."""

    def __init__(self, fn) -> None:
        self.fn = fn

    def __call__(self, *args):
        return self.fn(*args)

    def __deepcopy__(self, memo) -> _Hook:
        return _Hook(_inert)


def _inert(*args) -> None:
    return None


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
        raise UnsupportedError("TieredCache cannot be reset; close it and open a new one")

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove:
            raise UnsupportedError("TieredCache does not support crop (assisted decoding); "
                                   "written KV may already be published to other requests")

    def reorder_cache(self, beam_idx) -> None:
        if beam_idx.numel() != 1 or int(beam_idx.reshape(-1)[0]) != 0:
            raise UnsupportedError("TieredCache serves batch size 1: no beam search")

    def batch_repeat_interleave(self, repeats: int) -> None:
        if repeats != 1:
            raise UnsupportedError("TieredCache serves batch size 1: no beams or "
                                   "num_return_sequences > 1")

    def batch_select_indices(self, indices) -> None:
        if indices.numel() != 1 or int(indices.reshape(-1)[0]) != 0:
            raise UnsupportedError("TieredCache serves batch size 1")


class TieredCache(Cache):
    """A transformers `Cache` for one sequence (batch size 1) whose KV lives in a
    `TieredKVCache`, shared with every other request of that cache computed under the same
    identity (weights, geometry, attention mask and positions; see the module docstring).

    `TieredCache(cache, input_ids, model=model)` checks the model against the cache, then opens
    the sequence with `reserve_last=True`: the longest cached prefix (any tier) is reused, and
    at least the last token is left to compute so that the forward produces logits. Then either:

    - `model.generate(input_ids, cache=past, ...)`: generate slices the prompt to the tokens
      after `past.get_seq_length()` itself and puts them at the right positions; or
    - `model(past.uncached_input_ids(), cache=past)` (positions follow from the cache length;
      a prompt with zeros in its mask needs `prefill`, which passes the mask and positions);
    - `prefill(model, past, input_ids, chunk_size=512)` for long prompts, in bounded memory.

    model: the model whose forwards compute this KV (required: its weights and geometry are
        part of the identity). Only forwards of this object may write to the cache.
    attention_mask, position_ids: `[n]` or `[1, n]`, as given to `generate()` or the forward.
        None: the mask `generate()` infers (zeros at the pad token id unless it is also the
        end-of-sequence id) and the positions `generate()` gives under it.
    weights_id: names the weights instead of the fingerprint (models whose tensors cannot be
        read, e.g. offloaded to the meta device); the caller vouches that it is unique.

    `close()` releases the sequence; its full blocks stay cached for later requests.
    """

    def __init__(self, cache: TieredKVCache, input_ids, *, model, attention_mask=None,
                 position_ids=None, salt: str | bytes | None = None,
                 adapter_id: str | None = None, weights_id: str | None = None) -> None:
        if not isinstance(cache, TieredKVCache):
            raise TypeError(f"cache: expected a TieredKVCache, got {type(cache).__name__}")
        if not cache.has_storage:
            raise ValueError("TieredCache needs a cache with tensor storage (storage: tensors)")
        dtype_name = cache.config.model.dtype
        if dtype_name == "fp8_e4m3":
            raise UnsupportedError("TieredCache supports float32/float16/bfloat16 KV storage; "
                                   "fp8_e4m3 is not supported by this integration")
        if not isinstance(model, torch.nn.Module):
            raise ArgumentError(
                f"model: expected the torch model whose forwards compute this KV, got "
                f"{type(model).__name__} (its weights and geometry are part of the identity "
                "KV is reused under)")
        if weights_id is not None and (not isinstance(weights_id, str) or not weights_id.strip()
                                       or not weights_id.isprintable()):
            raise ArgumentError(f"weights_id: expected a non-empty printable str, got "
                                f"{weights_id!r}")
        ids = _as_ids(input_ids)
        if ids.numel() == 0:
            raise ValueError("input_ids: the prompt is empty")
        _check_adapter(adapter_id)          # folded into the composed id: checked here
        hf_identity.check_geometry(model, cache.num_layers, cache.num_kv_heads, cache.head_dim)
        layout = Layout.of(ids.numpy(), model, attention_mask, position_ids)
        weights = weights_id if weights_id is not None else hf_identity.weights_fingerprint(model)
        base = adapter_id if adapter_id is not None else cache.config.adapter_id
        self._setup(cache, model, layout, salt, hf_identity.compose_adapter(base, weights,
                                                                             layout))
        self._open(ids.numpy(), reserve_last=True)

    def _setup(self, cache: TieredKVCache, model, layout: Layout, salt, adapter: str) -> None:
        self.cache = cache
        self.model = model
        self.layout = layout
        """The attention mask and positions this sequence's KV is computed (and keyed) under."""
        self.prompt_length: int = len(layout.mask)
        self._salt = salt
        self._adapter = adapter
        self._dtype = TORCH_DTYPES[cache.config.model.dtype]
        self._hooks: list = []
        self._armed: tuple[int, int] | None = None     # (start, tokens) of a checked forward
        self._closed = False
        self._failed: BaseException | None = None
        self._lengths = [0] * cache.num_layers        # after close
        super().__init__(layers=[_TieredLayer(self, i) for i in range(cache.num_layers)])

    def _open(self, tokens: np.ndarray, *, reserve_last: bool) -> None:
        self.seq: Sequence = self.cache.open(tokens, salt=self._salt, adapter_id=self._adapter,
                                             reserve_last=reserve_last)
        self.num_cached_tokens: int = self.seq.num_cached_tokens
        """Prompt tokens whose KV came from the cache (computed by an earlier request)."""
        self.cached_tokens_by_tier: dict[str, int] = dict(self.seq.cached_tokens_by_tier)
        """Those tokens by the tier they were found in (`gpu`, `host`, ...)."""
        try:
            self._bind(self.model)
        except BaseException:
            self.cache.close(self.seq)
            raise

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

    def forward_kwargs(self, num_tokens: int, device=None) -> dict[str, torch.Tensor]:
        """The `attention_mask` and `position_ids` a forward of the next `num_tokens` tokens
        must be given so that it computes KV under this sequence's identity (empty for a
        canonical prompt: all ones at positions 0..n-1 is what a forward does by default)."""
        self._check_open()
        if self.layout.canonical:
            return {}
        p = self.get_seq_length()
        mask = torch.from_numpy(self.layout.mask_until(p + num_tokens).astype(np.int64))
        pos = torch.from_numpy(self.layout.positions_of(p, p + num_tokens))
        return {"attention_mask": mask.unsqueeze(0).to(device),
                "position_ids": pos.unsqueeze(0).to(device)}

    def _bind(self, model) -> None:
        pre = model.register_forward_pre_hook(_Hook(self._pre_hook), with_kwargs=True)
        post = model.register_forward_hook(_Hook(self._post_hook), with_kwargs=True,
                                           always_call=True)
        self._hooks = [pre, post]

    def _unbind(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def append_tokens(self, token_ids) -> None:
        """Declare the next tokens of the sequence (after `num_tokens`) ahead of the forward
        that computes them (which must then feed exactly these ids)."""
        self._check_open()
        ids = _as_ids(token_ids, "token_ids")
        if ids.numel():
            self.cache.append(self.seq, ids.numpy())

    def close(self) -> None:
        """Release the sequence: full, written blocks stay cached (and evictable), the rest is
        freed. Idempotent."""
        if self._closed:
            return
        self._lengths = [self._layer_length(i) for i in range(len(self.layers))]
        self._unbind()
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

    # ------------------------------------------------------------------ copies
    def __deepcopy__(self, memo) -> TieredCache:
        """An independent twin: a new sequence of the same cache, model and identity, holding
        the same KV (full blocks are shared through the prefix index; the rest is copied)."""
        self._check_open()
        written = self.seq.written[0]
        twin = object.__new__(type(self))
        twin._setup(self.cache, self.model, self.layout, self._salt, self._adapter)
        if written == 0:            # nothing computed yet: a fresh open of the same tokens
            twin._open(self.seq.token_ids[:self.seq.num_tokens], reserve_last=True)
            memo[id(self)] = twin
            return twin
        twin._open(self.seq.token_ids[:written], reserve_last=False)
        try:
            start = twin.seq.written[0]
            for layer in range(len(self.layers)):
                if start < written:
                    k, v = self.cache.gather(self.seq, layer)
                    self.cache.write(twin.seq, layer, k[start:written].contiguous(),
                                     v[start:written].contiguous())
            rest = self.seq.token_ids[written:self.seq.num_tokens]
            if len(rest):
                self.cache.append(twin.seq, rest)
        except BaseException:
            twin.close()
            raise
        twin.num_cached_tokens = self.num_cached_tokens
        twin.cached_tokens_by_tier = dict(self.cached_tokens_by_tier)
        memo[id(self)] = twin
        return twin

    def __copy__(self) -> TieredCache:
        return self.__deepcopy__({})

    def __reduce_ex__(self, protocol):
        raise ArgumentError("a TieredCache cannot be pickled: it is a handle on an open "
                            "sequence of a live cache (copy.deepcopy opens a twin)")

    # ------------------------------------------------------------------ Cache internals
    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if type(layer_idx) is not int or not 0 <= layer_idx < len(self.layers):
            raise LayerError(f"layer {layer_idx!r}: this TieredCache holds "
                             f"{len(self.layers)} layers")
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def _check_open(self) -> None:
        if self._closed:
            raise SequenceClosedError("this TieredCache is closed")
        if self._failed is not None:
            raise RuntimeError(
                "this TieredCache is unusable: a forward failed part-way through its layers "
                f"({type(self._failed).__name__}: {self._failed}), so the layers hold different "
                "lengths; close() it (published blocks are complete and stay cached) and open a "
                "new one") from self._failed

    def _layer_length(self, layer: int) -> int:
        if self._closed:
            return self._lengths[layer]
        return self.seq.written[layer]

    def _mine(self, args, kwargs) -> bool:
        return (kwargs.get("cache") is self or kwargs.get("past_key_values") is self
                or any(a is self for a in args))

    def _pre_hook(self, module, args, kwargs):
        if self._closed or module is not self.model or not self._mine(args, kwargs):
            return None
        self._check_open()
        if _in_assisted_decoding():
            raise UnsupportedError(
                "TieredCache does not support assisted decoding (assistant_model, "
                "prompt_lookup_num_tokens): it feeds draft tokens and crops those rejected, "
                "and KV published to other requests cannot be cropped; use plain decoding")
        ids = kwargs.get("input_ids")
        if ids is None and args and isinstance(args[0], torch.Tensor):
            ids = args[0]
        if ids is None:
            raise IdentityError(
                "a forward with this TieredCache must be given input_ids: KV computed from "
                "inputs_embeds cannot be keyed by token ids")
        ids = _as_ids(ids)
        p, n = self.get_seq_length(), int(ids.numel())
        self._check_continues(ids, p)
        self._check_mask(kwargs.get("attention_mask"), p + n)
        self._check_positions(kwargs.get("position_ids"), p, n)
        d = self.seq.num_tokens
        if p + n > d:
            self.cache.append(self.seq, ids[d - p:].numpy())
        self._armed = (p, n)
        return None

    def _post_hook(self, module, args, kwargs, output):
        if self._mine(args, kwargs):
            self._armed = None
        return None

    def _check_continues(self, ids: torch.Tensor, p: int) -> None:
        """`ids` are fed at positions [p, p + n): those already declared must match."""
        d, n = self.seq.num_tokens, int(ids.numel())
        m = min(n, d - p)
        if m > 0 and not torch.equal(ids[:m], self._declared(p, p + m)):
            raise ValueError(
                f"input_ids do not continue the cached sequence: the cache holds KV of "
                f"{p} tokens, so a forward must be given the tokens from position {p} on "
                "(past.uncached_input_ids()); generate() slices the full prompt itself")

    def _check_mask(self, mask, end: int) -> None:
        """The forward's mask over tokens [0, end) must be the sequence's."""
        if mask is None:
            if self.layout.mask_until(end).all():
                return
            raise IdentityError(
                f"this forward attends to every token (no attention_mask, or generate() dropped "
                f"an all-ones one), but this TieredCache was "
                f"opened under a mask with zeros in its first {self.layout.head} tokens (given, "
                "or inferred from the pad token as generate() does): pass the same "
                "attention_mask to the forward (prefill() does), or open the TieredCache with "
                "the mask the forward uses")
        if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or mask.shape[0] != 1:
            shape = list(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
            raise IdentityError(f"attention_mask: TieredCache keys 2D padding masks [1, n] "
                                f"only; a {shape} mask cannot be keyed")
        if mask.shape[1] != end:
            raise IdentityError(f"attention_mask covers {mask.shape[1]} tokens, the cache and "
                                f"this forward {end}")
        # NOTE: one device sync: beyond the irregular head every token must be unmasked.
        head = min(self.layout.head, end)
        same = bool(mask[0, head:].all())
        if same and head:
            same = np.array_equal(mask[0, :head].detach().cpu().numpy() != 0,
                                  self.layout.mask[:head] != 0)
        if not same:
            raise IdentityError(
                "attention_mask differs from the one this TieredCache was opened under (given "
                "to it, or inferred from the pad token as generate() does): KV computed under "
                "another mask must not be reused or published under this one; open the "
                "TieredCache with attention_mask= the mask the forwards use")

    def _check_positions(self, position_ids, p: int, n: int) -> None:
        """The forward's positions of tokens [p, p + n) must be the sequence's (a forward
        without position_ids puts them at p..p+n-1)."""
        canonical = self.layout.canonical
        want = np.arange(p, p + n) if canonical else self.layout.positions_of(p, p + n)
        if position_ids is None:
            if canonical or np.array_equal(want, np.arange(p, p + n)):
                return
            got = f"none (so {p}..{p + n - 1})"
        else:
            if not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2 \
                    or tuple(position_ids.shape) != (1, n):
                shape = (list(position_ids.shape) if isinstance(position_ids, torch.Tensor)
                         else type(position_ids).__name__)
                raise IdentityError(f"position_ids: expected shape [1, {n}], got {shape}")
            have = position_ids[0].detach().cpu().numpy()
            if np.array_equal(have, want):
                return
            got = f"{have[:8].tolist()}..."
        raise IdentityError(
            f"the positions of this forward's tokens ({got}) differ from those this TieredCache "
            f"was opened under ({want[:8].tolist()}...): pass position_ids= to TieredCache "
            "as the forwards use them (prefill() passes the sequence's own)")

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
        if self._armed is None:
            raise IdentityError(
                "KV written to this TieredCache outside a forward of the model it was opened "
                "for (another model object, or an inner module called directly): its identity "
                "cannot be checked, so it is refused")
        if key_states.dim() != 4 or key_states.shape[0] != 1:
            raise ValueError(f"TieredCache serves batch size 1; got key states of shape "
                             f"{list(key_states.shape)} (expected [1, heads, tokens, head_dim])")
        start, n = self._armed
        if self.seq.written[layer] != start or key_states.shape[2] != n:
            raise IdentityError(
                f"layer {layer}: KV of {key_states.shape[2]} tokens after "
                f"{self.seq.written[layer]}, but the forward fed {n} tokens after {start}")
        k = key_states[0].transpose(0, 1)           # [1, H, n, D] -> [n, H, D]
        v = value_states[0].transpose(0, 1)
        self.cache.write(self.seq, layer, k.to(self._dtype).contiguous(),
                         v.to(self._dtype).contiguous())
        keys, values = self.cache.gather(self.seq, layer)
        keys = keys.to(device=key_states.device, dtype=key_states.dtype)
        values = values.to(device=value_states.device, dtype=value_states.dtype)
        return keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0)


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
    are declared). None, for a `TieredCache`: its declared, uncomputed tokens. For a
    `TieredCache` each chunk gets the attention mask and positions of the sequence's identity.
    Works with any transformers `Cache` (e.g. `DynamicCache`, the no-reuse baseline).
    """
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(f"chunk_size: expected a positive int, got {chunk_size!r}")
    start = past.get_seq_length()
    if isinstance(past, TieredCache):
        past._check_open()
        if model is not past.model:
            raise ArgumentError("prefill: `model` is not the model this TieredCache was opened "
                                "for (its weights are part of the KV's identity)")
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
        extra = (past.forward_kwargs(int(chunk.numel()), device)
                 if isinstance(past, TieredCache) else {})
        out = model(input_ids=chunk.unsqueeze(0).to(device), use_cache=True,
                    **{kwarg: past}, **extra, **forward_kwargs)
        logits = out.logits[:, -1]
    assert logits is not None               # (suffix is not empty: one chunk at least)
    return logits
