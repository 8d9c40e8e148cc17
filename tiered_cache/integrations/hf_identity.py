"""What the KV of a transformers model depends on besides its token ids, for `TieredCache`.

KV is reused only under the identity it was computed under. Token ids are already in every
block key; this module derives the rest:

- **weights**: a fingerprint of the model object handed to `TieredCache` (its class, its config,
  every parameter's and buffer's name, shape and dtype, and a strided sample of each tensor's
  bytes), so a base model and its fine-tune, configured under one `model.name`, never share KV;
- **geometry**: the model's layers, KV heads and head size checked against the cache's;
- **layout**: the attention mask and the positions of the prompt. KV of token t depends on the
  mask and the positions of tokens 0..t. A prompt whose mask is all ones at positions 0..n-1 is
  canonical (most requests); otherwise its identity is the shortest head after which every token
  is unmasked at the position after its predecessor's (a left-padded row: its padding; pad ids
  inside a prompt: up to the last one), so the next turn of the same conversation keys the same.

The identity becomes the adapter id the sequence is opened under (an opaque `hf-<digest>`; the
user's adapter id or the config's is folded in), hence part of the root key of every block, in
every tier and across processes.
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
import xxhash

from tiered_cache.errors import ArgumentError, ConfigError, UnsupportedError

SAMPLE_ELEMENTS = 4096
"""Elements sampled per tensor for the weights fingerprint, evenly strided over the tensor (all
of them for smaller tensors): ~3M elements of a 70B model's ~720 tensors, read once per model
object."""

_FINGERPRINTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


# ---------------------------------------------------------------------------- weights

def _tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from model.named_parameters()
    yield from model.named_buffers()


def _version(t: torch.Tensor) -> int:
    try:
        return t._version
    except RuntimeError:        # an inference tensor keeps no version counter
        return -1


def _state(model: torch.nn.Module) -> tuple:
    """Changes when a tensor is replaced or written in place (load_state_dict, an optimizer
    step, `param.data = ...`): the fingerprint is recomputed then."""
    return tuple((name, t.data_ptr(), _version(t)) for name, t in _tensors(model))


def _sample(name: str, t: torch.Tensor) -> bytes:
    if t.device.type == "meta":
        raise ArgumentError(
            f"model: parameter {name!r} is on the meta device (offloaded), so its bytes cannot be "
            "fingerprinted; pass TieredCache(..., weights_id='<a name unique to these weights>')")
    flat = t.detach().reshape(-1)
    n = flat.numel()
    if n > SAMPLE_ELEMENTS:
        # integer strides: a float linspace rounds past the end of a 28M-element tensor
        idx = torch.arange(SAMPLE_ELEMENTS, device=flat.device) * (n - 1) // (
            SAMPLE_ELEMENTS - 1)
        flat = flat[idx]
    flat = flat.cpu().contiguous()
    try:
        return flat.view(torch.uint8).numpy().tobytes()
    except (RuntimeError, TypeError):       # a tensor subclass or dtype numpy cannot view
        return repr(flat.tolist()).encode()


def _config_text(model: torch.nn.Module) -> str:
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        return ""
    # NOTE: keys starting with "_" (name or path, attention implementation) and the library
    # version do not change what the weights compute; everything else (rope scaling, norm eps,
    # dtype, ...) is part of the identity.
    items = {k: v for k, v in config.to_dict().items()
             if not k.startswith("_") and k != "transformers_version"}
    return json.dumps(items, sort_keys=True, default=str)


def weights_fingerprint(model: torch.nn.Module) -> str:
    """32 hex digits naming the weights of `model`: computed once per model object, again only
    after one of its tensors was replaced or written in place."""
    state = _state(model)
    found = _FINGERPRINTS.get(model)
    if found is not None and found[0] == state:
        return found[1]
    h = xxhash.xxh3_128()
    h.update(f"{type(model).__module__}.{type(model).__qualname__}\0".encode())
    h.update(_config_text(model).encode())
    for name, t in _tensors(model):
        h.update(f"\0{name}\0{tuple(t.shape)}\0{t.dtype}\0".encode())
        h.update(_sample(name, t))
    fingerprint = h.hexdigest()
    _FINGERPRINTS[model] = (state, fingerprint)
    return fingerprint


# ---------------------------------------------------------------------------- geometry

def _text_config(model):
    config = getattr(model, "config", None)
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def check_geometry(model: torch.nn.Module, num_layers: int, num_kv_heads: int,
                   head_dim: int) -> None:
    """Raise ConfigError (path: the cache's key) unless the model's layers, KV heads and head
    size are the cache's; UnsupportedError for layers other than full attention. Read from the
    model's config and from the layer indices its attention modules carry."""
    cfg = _text_config(model)
    heads = getattr(cfg, "num_attention_heads", None)
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    dim = getattr(cfg, "head_dim", None)
    if dim is None and heads and getattr(cfg, "hidden_size", None):
        dim = cfg.hidden_size // heads
    name = type(model).__name__
    for key, theirs, ours, field in (
            ("model.num_layers", getattr(cfg, "num_hidden_layers", None), num_layers,
             "num_hidden_layers"),
            ("model.num_kv_heads", kv, num_kv_heads, "num_key_value_heads"),
            ("model.head_dim", dim, head_dim, "head_dim")):
        if theirs is not None and theirs != ours:
            raise ConfigError(key, f"the cache holds {ours}, the model handed to TieredCache "
                                   f"has {theirs} ({field} of the {name} config): build the "
                                   "cache with the model's geometry")
    indices = {m.layer_idx for m in model.modules()
               if type(getattr(m, "layer_idx", None)) is int}
    if indices and indices != set(range(num_layers)):
        raise ConfigError("model.num_layers",
                          f"the cache holds {num_layers} layers, the attention modules of the "
                          f"{name} use layer indices {min(indices)}..{max(indices)} "
                          f"({len(indices)} layers): build the cache with the model's geometry")
    kinds = set(getattr(cfg, "layer_types", None) or ())
    if kinds - {"full_attention"}:
        raise UnsupportedError(
            f"TieredCache serves full-attention layers only; the {name} has "
            f"{sorted(kinds - {'full_attention'})} layers (sliding window, linear attention)")


# ---------------------------------------------------------------------------- layout

def _vector(value, n: int, what: str) -> np.ndarray:
    t = value.detach().cpu() if isinstance(value, torch.Tensor) else torch.as_tensor(
        np.asarray(value))
    if t.dim() == 2 and t.shape[0] == 1:
        t = t[0]
    if t.dim() != 1 or t.shape[0] != n:
        raise ArgumentError(f"{what}: expected shape [{n}] or [1, {n}] (one per prompt token), "
                            f"got {list(t.shape)}")
    return t.numpy()


def generate_positions(mask: np.ndarray) -> np.ndarray:
    """The positions `generate()` gives a prompt under `mask` (transformers 5: cumsum - 1, 0
    where masked); 0..n-1 for an all-ones mask."""
    pos = np.cumsum(mask.astype(np.int64)) - 1
    pos[mask == 0] = 0
    return pos


def inferred_mask(ids: np.ndarray, model: torch.nn.Module) -> np.ndarray:
    """The mask `generate()` builds when it is given none: zeros at the model's pad token id,
    unless that id is also an end-of-sequence id (then all ones)."""
    gen = getattr(model, "generation_config", None)
    pad = getattr(gen, "pad_token_id", None)
    eos = getattr(gen, "eos_token_id", None)
    eos_ids = set() if eos is None else set(eos if isinstance(eos, (list, tuple)) else [eos])
    ones = np.ones(len(ids), dtype=np.int8)
    if isinstance(pad, int) and pad not in eos_ids and (ids == pad).any():
        return (ids != pad).astype(np.int8)
    return ones


@dataclass(frozen=True)
class Layout:
    """The mask and positions of a prompt of `n` tokens, and what they are for every token after
    it (unmasked, each at the position after the previous one)."""

    mask: np.ndarray            # int8 [n]
    positions: np.ndarray       # int64 [n]
    head: int                   # tokens up to the last irregular one; 0: canonical
    digest: str | None          # identity of the head; None when canonical

    @classmethod
    def of(cls, ids: np.ndarray, model: torch.nn.Module, attention_mask=None,
           position_ids=None) -> Layout:
        n = len(ids)
        if attention_mask is None:
            mask = inferred_mask(ids, model)
        else:
            raw = _vector(attention_mask, n, "attention_mask")
            if not np.isin(raw, (0, 1)).all():
                raise ArgumentError("attention_mask: expected 0/1 values (a 2D padding mask)")
            mask = raw.astype(np.int8)
        if position_ids is None:
            positions = generate_positions(mask)
        else:
            positions = _vector(position_ids, n, "position_ids").astype(np.int64)
        prev = np.concatenate([[-1], positions[:-1]])
        irregular = np.flatnonzero((mask == 0) | (positions != prev + 1))
        head = int(irregular[-1]) + 1 if irregular.size else 0
        digest = None
        if head:
            h = xxhash.xxh3_128(b"tiered-cache/hf-layout/v1\0")
            h.update(head.to_bytes(8, "little"))
            h.update(mask[:head].tobytes())
            h.update(positions[:head].astype("<i8").tobytes())
            digest = h.hexdigest()
        return cls(mask, positions, head, digest)

    @property
    def canonical(self) -> bool:
        return self.head == 0

    def mask_until(self, end: int) -> np.ndarray:
        """The mask over tokens [0, end)."""
        n = len(self.mask)
        if end <= n:
            return self.mask[:end]
        return np.concatenate([self.mask, np.ones(end - n, dtype=np.int8)])

    def positions_of(self, start: int, end: int) -> np.ndarray:
        """The positions of tokens [start, end)."""
        n = len(self.positions)
        out = np.empty(end - start, dtype=np.int64)
        inside = max(0, min(end, n) - start)
        out[:inside] = self.positions[start:start + inside]
        if inside < end - start:
            last = self.positions[n - 1] if n else -1
            first = max(start, n)
            out[inside:] = last + 1 + np.arange(first - n, end - n)
        return out


def compose_adapter(adapter_id: str | None, weights: str, layout: Layout) -> str:
    """The adapter id a sequence is opened under: the user's (or config's) adapter, the weights
    and the layout, as one printable name of the hash namespace."""
    body = json.dumps({"adapter": adapter_id, "weights": weights, "layout": layout.digest},
                      sort_keys=True).encode()
    return "hf-" + xxhash.xxh3_128_hexdigest(b"tiered-cache/hf-identity/v1\0" + body)
