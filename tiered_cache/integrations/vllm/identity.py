"""What a vLLM engine's blocks are keyed by: the geometry every rank shares, the root salt of
each tensor-parallel rank, the adapter of a LoRA request. Plain Python, no vLLM, no torch.

A block's key is the daemon's chained hash (hashing.py): the root folds in the namespace
(model name, KV dtype, layers, KV heads *per rank*, head size, block size) and the salt;
vLLM's `cache_salt` is the request's salt and the LoRA name its adapter. Tensor parallel ranks
hold different heads of the same tokens, so each rank's part is its own chain: its root salt is
the request's salt prefixed with "rank r of n" (`rank_salt`). With one rank the salt is the
request's own, so a vLLM engine and any other tiered-cache engine of the same model and
geometry (the transformers integration, attached to the same daemon) share blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import xxhash

from tiered_cache.config import MAX_NAME_CHARS
from tiered_cache.errors import ConfigError

MAX_SALT_BYTES = 512
"""Longer `cache_salt`s are hashed (xxh3-128) to stay inside the daemon's salt field."""
MAX_ADAPTER_CHARS = 64
"""The daemon's `adapter` field; longer LoRA names are hashed."""
DTYPES = ("float32", "float16", "bfloat16")
"""KV dtypes the connector stores (the daemon's shared pool has no FP8 scales)."""


@dataclass(frozen=True)
class Geometry:
    """The KV of one engine as tiered-cache stores it: per rank, per block of `block_size`
    tokens, `num_layers` x (K, V) x `block_size` x `num_kv_heads` x `head_dim` of `dtype`."""

    model: str
    dtype: str
    num_layers: int
    num_kv_heads: int           # per rank
    head_dim: int
    block_size: int             # ours
    vllm_block_size: int
    tp_size: int = 1

    def __post_init__(self) -> None:
        where = "kv_connector_extra_config.tiered_cache"
        if self.dtype not in DTYPES:
            raise ConfigError(f"{where}.model.dtype", f"the connector stores {', '.join(DTYPES)} "
                              f"KV, got {self.dtype!r} (FP8 KV has per-block scales the "
                              "daemon's pool does not keep)")
        for name in ("num_layers", "num_kv_heads", "head_dim", "tp_size"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ConfigError(f"{where}.model.{name}", f"expected a positive int, got "
                                  f"{value!r}")
        check_block_size(self.block_size, self.vllm_block_size, f"{where}.block_size")

    @property
    def sub_blocks(self) -> int:
        """Our blocks per vLLM block."""
        return self.vllm_block_size // self.block_size

    def model_section(self) -> dict:
        """The `model:` section a node daemon serving this engine must have (its namespace
        must equal this engine's, and its pool geometry too)."""
        return {"name": self.model, "dtype": self.dtype, "num_layers": self.num_layers,
                "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim}


def check_block_size(ours: object, vllm_bs: int, path: str) -> int:
    """Ours must be a power of two that divides vLLM's (equal, or a vLLM block is k of ours)."""
    if type(ours) is not int or ours < 1 or ours & (ours - 1) or ours > 4096:
        raise ConfigError(path, f"expected a power of two in 1..4096, got {ours!r}")
    if vllm_bs % ours:
        raise ConfigError(path, f"{ours} does not divide vLLM's block size {vllm_bs}: a vLLM "
                                "block must be a whole number of tiered-cache blocks (use "
                                f"{default_block_size(vllm_bs)}, or leave block_size unset)")
    return ours


def default_block_size(vllm_bs: int) -> int:
    """vLLM's own block size when it is a power of two, else its largest power-of-two divisor
    (vLLM's CPU backend takes multiples of 32: 96 -> 32)."""
    if type(vllm_bs) is not int or vllm_bs < 1:
        raise ConfigError("block_size", f"vLLM's block size must be a positive int, got "
                                        f"{vllm_bs!r}")
    return min(vllm_bs & -vllm_bs, 4096)


def model_name(name: str) -> str:
    """A namespace model name: the served name when it fits, else a stable hash of it."""
    if name and len(name) <= MAX_NAME_CHARS and name.isprintable() and name.strip() == name:
        return name
    return "vllm-model:" + xxhash.xxh3_128_hexdigest(name.encode("utf-8", "surrogatepass"))


def rank_salt(cache_salt: str | None, rank: int, tp_size: int) -> bytes:
    """The root salt of rank `rank`'s part of a request salted `cache_salt`."""
    own = (cache_salt or "").encode("utf-8", "surrogatepass")
    if len(own) > MAX_SALT_BYTES:
        own = b"xxh3:" + xxhash.xxh3_128_digest(own)
    if tp_size == 1:
        return own
    if not 0 <= rank < tp_size:
        raise ValueError(f"rank {rank} outside a tensor-parallel group of {tp_size}")
    return b"vllm-tp\0" + f"{rank}/{tp_size}".encode() + b"\0" + own


def adapter_of(lora_name: str | None) -> str | None:
    """The daemon adapter of a LoRA request: its name, or a stable hash of a long one."""
    if lora_name is None:
        return None
    if 0 < len(lora_name) <= MAX_ADAPTER_CHARS and lora_name.isprintable() \
            and lora_name.strip() == lora_name:
        return lora_name
    return "lora:" + xxhash.xxh3_64_hexdigest(lora_name.encode("utf-8", "surrogatepass"))
