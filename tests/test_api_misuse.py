"""API misuse: calls after shutdown, inputs the cache must refuse (or store safely), and a
hypothesis fuzz of the public API with random, often invalid, arguments.

Rules checked: after `shutdown()` every data/control call raises CacheClosedError and nothing
hangs; grad-tracked KV is stored detached; NaN/inf KV raises KVValueError and changes nothing;
malformed queries, devices, adapter ids and resize arguments raise the library's typed errors;
every typed error leaves the cache exactly as it was (`snapshot`, and every open sequence's
data); the only exceptions the API raises are subclasses of TieredCacheError.
"""

from __future__ import annotations

import gc
import threading
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers import (
    assert_same_data,
    check_invariants,
    gathered,
    make_cache,
    pattern_value,
    snapshot,
    tokens,
    write_pattern_all,
)
from tests.oracles import (
    ATTENTION_TOL,
    query,
    ref_decode_attention,
    ref_prefill_attention,
)
from tiered_cache import TieredKVCache
from tiered_cache.errors import (
    ArgumentError,
    CacheClosedError,
    CapacityError,
    DTypeError,
    KVValueError,
    LayerError,
    ShapeError,
    StorageDisabledError,
    TieredCacheError,
    TierUnavailableError,
    TokenError,
)

H, D = 2, 4                                                 # helpers' geometry


def unchanged(cache, fn, exc=TieredCacheError, match=None):
    """fn() raises `exc` (a typed error) and the cache is exactly as it was."""
    before = snapshot(cache)
    data = gathered(cache)
    with pytest.raises(exc, match=match) as info:
        fn()
    assert isinstance(info.value, TieredCacheError), f"untyped: {info.value!r}"
    assert snapshot(cache) == before, f"{info.value!r} changed the cache"
    assert_same_data(gathered(cache), data)
    check_invariants(cache)
    return info.value


def write_dtype(cache) -> torch.dtype:
    """The dtype KV is written in: the storage dtype, float32 for FP8 storage."""
    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
            "fp8_e4m3": torch.float32}[cache.config.model.dtype]


def write_upto(cache, seq, layer: int, end: int | None = None) -> None:
    start = seq.written[layer]
    end = seq.num_tokens if end is None else end
    k, v = fz_pattern(cache, seq.salt, seq.token_ids, start, end, layer, write_dtype(cache))
    cache.write(seq, layer, k, v)


def busy_cache(**kw):
    """A cache with history: a cached prompt, a half-written open sequence, a hit."""
    cache = make_cache(num_q_heads=4, **kw)
    s = cache.open(tokens(8))
    for layer in range(cache.num_layers):
        write_upto(cache, s, layer)
    cache.close(s)
    half = cache.open(tokens(10, start=100))
    write_upto(cache, half, 0, 6)
    hit = cache.open(tokens(9))
    for layer in range(cache.num_layers):
        write_upto(cache, hit, layer)
    return cache, half, hit


# ---------------------------------------------------------------------------- after shutdown

# Every public attribute of TieredKVCache is in exactly one of these.
CLOSED_CALLS = {
    "open": lambda c, s, q: c.open(tokens(4)),
    "can_open": lambda c, s, q: c.can_open(4),
    "append": lambda c, s, q: c.append(s, [1]),
    "write": lambda c, s, q: c.write(s, 0, torch.zeros(1, H, D), torch.zeros(1, H, D)),
    "mark_computed": lambda c, s, q: c.mark_computed(s),
    "wait": lambda c, s, q: c.wait(s, 0),
    "gather": lambda c, s, q: c.gather(s, 0),
    "attention": lambda c, s, q: c.attention(q, [s], 0),
    "prefill_attention": lambda c, s, q: c.prefill_attention(q, s, 0),
    "close": lambda c, s, q: c.close(s),
    "invalidate": lambda c, s, q: c.invalidate(tokens(8)),
    "resize": lambda c, s, q: c.resize("gpu", 20),
}
# Introspection and lifecycle: allowed after shutdown (they must not hang either).
INTROSPECTION = {
    "stats": lambda c, s, q: c.stats(),
    "closed": lambda c, s, q: c.closed,
    "tiers": lambda c, s, q: c.tiers,
    "tier": lambda c, s, q: c.tier("gpu"),
    "locked": lambda c, s, q: _enter_and_leave(c.locked()),
    "open_sequences": lambda c, s, q: c.open_sequences(),
    "shutdown": lambda c, s, q: c.shutdown(),
}


def _enter_and_leave(cm) -> None:
    with cm:
        pass


def test_every_public_method_is_classified():
    public = {n for n in dir(TieredKVCache) if not n.startswith("_")}
    data_attrs = {"config", "block_size", "num_layers", "num_kv_heads", "num_q_heads",
                  "head_dim", "has_storage", "device", "block_bytes", "allow_non_finite",
                  "hasher", "migrator", "compactor", "pools", "index", "executor", "health",
                  "registry"}
    unclassified = public - set(CLOSED_CALLS) - set(INTROSPECTION) - data_attrs
    assert not unclassified, f"classify these for the shutdown test: {sorted(unclassified)}"


def in_thread(fn, timeout: float = 10.0):
    """fn() on a thread, failing if it does not return within `timeout` (a hang)."""
    box: dict = {}

    def run():
        try:
            box["result"] = fn()
        except BaseException as exc:  # noqa: BLE001 - reported below
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"hung for {timeout} s"
    return box


@pytest.mark.parametrize("name", list(CLOSED_CALLS))
@pytest.mark.parametrize("migrator", [False, True], ids=["sync", "migrator"])
def test_calls_after_shutdown_raise_cache_closed_error(name, migrator):
    cache = make_cache(num_q_heads=4, extra={"migrator": {"enabled": migrator}})
    s = cache.open(tokens(8))
    write_pattern_all(cache, s)
    q = torch.zeros(1, 4, D)
    cache.shutdown()
    assert cache.closed and not cache.open_sequences()
    box = in_thread(lambda: CLOSED_CALLS[name](cache, s, q))
    assert isinstance(box.get("error"), CacheClosedError), box
    assert "shut down" in str(box["error"])


@pytest.mark.parametrize("name", list(INTROSPECTION))
def test_introspection_after_shutdown_does_not_hang(name):
    cache = make_cache(num_q_heads=4, extra={"migrator": {"enabled": True}})
    s = cache.open(tokens(8))
    cache.shutdown()
    box = in_thread(lambda: INTROSPECTION[name](cache, s, torch.zeros(1, 4, D)))
    if "error" in box:
        assert isinstance(box["error"], TieredCacheError), box
    cache.shutdown()                                    # idempotent


def test_shutdown_through_the_context_manager_then_open():
    with make_cache() as cache:
        cache.open(tokens(4))
    box = in_thread(lambda: cache.open(tokens(4)))
    assert isinstance(box.get("error"), CacheClosedError), box


# ---------------------------------------------------------------------------- grad-tracked KV


@pytest.mark.parametrize("dtype", ["float32", "fp8_e4m3"])
def test_kv_that_requires_grad_is_stored_detached(dtype):
    cache = make_cache(dtype=dtype, num_q_heads=4)
    other = cache.open(tokens(8, start=500))
    z = torch.zeros(8, H, D)
    for layer in range(cache.num_layers):
        cache.write(other, layer, z + 1, z + 2)
    s = cache.open(tokens(8))
    w = torch.randn(8, H, D, requires_grad=True)
    refs = []
    for layer in range(cache.num_layers):
        k = w * 2 + layer                       # non-leaf tensors in a graph
        v = w * 3 - layer
        refs += [weakref.ref(k), weakref.ref(v)]
        cache.write(s, layer, k, v)
        del k, v
    for pool in cache.pools:
        if pool is None:
            continue
        assert not pool.kv.requires_grad and pool.kv.grad_fn is None
        if pool.scales is not None:
            assert not pool.scales.requires_grad and pool.scales.grad_fn is None
    gc.collect()
    assert all(r() is None for r in refs), "the cache keeps the caller's KV tensors alive"
    for seq in (s, other):
        for layer in range(cache.num_layers):
            k, v = cache.gather(seq, layer)
            assert not k.requires_grad and not v.requires_grad
            assert k.grad_fn is None and v.grad_fn is None
    k, v = cache.gather(s, 1)
    torch.testing.assert_close(k, (w * 2 + 1).detach(),
                               **({} if dtype == "float32" else {"rtol": 0.07, "atol": 0.1}))
    out = cache.attention(torch.zeros(2, 4, D), [s, other], 0)
    assert not out.requires_grad
    cache.close(s)
    cache.close(other)


def test_query_that_requires_grad_is_refused_with_a_typed_error():
    cache, half, hit = busy_cache()
    q = torch.zeros(1, 4, D, requires_grad=True)
    unchanged(cache, lambda: cache.attention(q, [hit], 0), DTypeError, "requires grad")


# ---------------------------------------------------------------------------- non-finite KV


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("where", ["key", "value"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "fp8_e4m3"])
def test_non_finite_kv_raises_kv_value_error_and_changes_nothing(bad, where, dtype):
    cache, half, _ = busy_cache(dtype=dtype)
    wdt = torch.float32 if dtype != "bfloat16" else torch.bfloat16
    k = torch.zeros(4, H, D, dtype=wdt)
    v = torch.zeros(4, H, D, dtype=wdt)
    (k if where == "key" else v)[2, 1, 3] = bad
    unchanged(cache, lambda: cache.write(half, 0, k, v), KVValueError,
              rf"{where}: contains NaN or inf")


def test_non_finite_kv_is_stored_when_allowed():
    cache = make_cache(extra={"allow_non_finite_kv": True})
    s = cache.open(tokens(4))
    k = torch.zeros(4, H, D)
    k[1, 0, 0] = float("nan")
    for layer in range(cache.num_layers):
        cache.write(s, layer, k, k)
    got, _ = cache.gather(s, 0)
    assert torch.isnan(got[1, 0, 0]) and torch.equal(torch.nan_to_num(got), torch.zeros_like(got))
    cache.close(s)


def test_fp8_refuses_non_finite_kv_even_when_allowed():
    cache = make_cache(dtype="fp8_e4m3", extra={"allow_non_finite_kv": True})
    s = cache.open(tokens(4))
    k = torch.zeros(4, H, D)
    k[0, 0, 0] = float("inf")
    unchanged(cache, lambda: cache.write(s, 0, k, torch.zeros(4, H, D)), KVValueError)


# ---------------------------------------------------------------------------- queries, devices


@pytest.mark.parametrize("heads", [2, 6, 8, 1])
def test_attention_with_a_q_head_count_other_than_num_q_heads_raises_shape_error(heads):
    cache, half, hit = busy_cache()                 # num_q_heads 4, kv heads 2
    unchanged(cache, lambda: cache.attention(torch.zeros(1, heads, D), [hit], 0), ShapeError,
              r"\[1, 4, 4\]")
    unchanged(cache, lambda: cache.prefill_attention(torch.zeros(1, heads, D), hit, 0),
              ShapeError)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16, torch.int64])
def test_attention_with_a_q_dtype_other_than_the_caches_raises_dtype_error(dtype):
    cache, half, hit = busy_cache()                 # float32 cache
    q = torch.zeros(1, 4, D, dtype=dtype)
    unchanged(cache, lambda: cache.attention(q, [hit], 0), DTypeError, "dtype")
    unchanged(cache, lambda: cache.prefill_attention(q, hit, 0), DTypeError, "dtype")


def test_meta_device_tensors_raise_a_typed_error():
    cache, half, hit = busy_cache()
    meta = torch.zeros(2, H, D, device="meta")
    unchanged(cache, lambda: cache.write(half, 1, meta, meta), DTypeError, "meta")
    unchanged(cache, lambda: cache.write(half, 1, torch.zeros(2, H, D), meta), DTypeError)
    q = torch.zeros(1, 4, D, device="meta")
    unchanged(cache, lambda: cache.attention(q, [hit], 0), DTypeError, "meta")
    unchanged(cache, lambda: cache.prefill_attention(q, hit, 0), DTypeError, "meta")


def _tensor_layouts():
    kv = torch.zeros(1, H, D)
    def nested():                   # built when the case runs (torch warns: prototype)
        return torch.nested.nested_tensor([torch.zeros(H, D)])

    return {
        "write-sparse-key": (DTypeError, "key: expected a dense",
                             lambda c, half, hit: c.write(half, 1, kv.to_sparse(), kv)),
        "write-sparse-value": (DTypeError, "value: expected a dense",
                               lambda c, half, hit: c.write(half, 1, kv, kv.to_sparse())),
        "write-mkldnn-key": (DTypeError, "key: expected a dense",
                             lambda c, half, hit: c.write(half, 1, kv.to_mkldnn(), kv)),
        "write-nested-key": (DTypeError, "key: expected a dense",
                             lambda c, half, hit: c.write(half, 1, nested(), kv)),
        "attention-sparse-q": (DTypeError, "q: expected a dense", lambda c, half, hit: c.attention(
            torch.zeros(1, 4, D).to_sparse(), [hit], 0)),
        "prefill-sparse-q": (DTypeError, "q: expected a dense",
                             lambda c, half, hit: c.prefill_attention(
                                 torch.zeros(1, 4, D).to_sparse(), hit, 0)),
        "open-meta-token-tensor": (TokenError, "token_ids: .*meta",
                                   lambda c, half, hit: c.open(
                                       torch.zeros(4, dtype=torch.long, device="meta"))),
        "append-sparse-token-tensor": (TokenError, "token_ids: .*sparse",
                                       lambda c, half, hit: c.append(
                                           half, torch.tensor([1, 2]).to_sparse())),
    }


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("case", list(_tensor_layouts()))
def test_sparse_mkldnn_nested_and_meta_tensors_raise_typed_errors(case):
    """Tensors that are not plain strided tensors with data (sparse, mkldnn, nested, meta)
    are refused by the facade's checks with a DTypeError (KV, q) or TokenError (token ids)
    naming the argument, before torch fails on them inside the finiteness check or a kernel;
    the cache is unchanged."""
    exc, match, fn = _tensor_layouts()[case]
    cache, half, hit = busy_cache()
    unchanged(cache, lambda: fn(cache, half, hit), exc, match)


# ---------------------------------------------------------------------------- arguments


@pytest.mark.parametrize("adapter", [3, b"lora", "", " lora", "lora\n", "a" * 257, "a\x00b",
                                     "\u200b", ["lora"], 1.5])
def test_bad_adapter_ids_raise_token_error(adapter):
    cache, half, hit = busy_cache()
    unchanged(cache, lambda: cache.open(tokens(8), adapter_id=adapter), TokenError,
              "adapter_id")
    unchanged(cache, lambda: cache.invalidate(tokens(8), adapter_id=adapter), TokenError,
              "adapter_id")


def test_adapters_do_not_share_blocks():
    cache = make_cache()
    s = cache.open(tokens(8), adapter_id="lora-a")
    write_pattern_all(cache, s)
    cache.close(s)
    for adapter in (None, "lora-b"):
        t = cache.open(tokens(8), adapter_id=adapter)
        assert t.num_cached_tokens == 0
        cache.close(t)
    t = cache.open(tokens(8), adapter_id="lora-a")
    assert t.num_cached_tokens == 8
    cache.close(t)


@pytest.mark.parametrize("tier, n, timeout, error", [
    ("disk", 10, 30.0, TierUnavailableError),
    ("GPU", 10, 30.0, TierUnavailableError),
    (None, 10, 30.0, TierUnavailableError),
    (0, 10, 30.0, TierUnavailableError),
    ("gpu", 0, 30.0, ArgumentError),
    ("gpu", -4, 30.0, ArgumentError),
    ("gpu", 2**41, 30.0, ArgumentError),
    ("host", "lots", 30.0, ArgumentError),
    ("host", 10.0, 30.0, ArgumentError),
    ("host", True, 30.0, ArgumentError),
    ("host", None, 30.0, ArgumentError),
    ("gpu", 20, 0, ArgumentError),
    ("gpu", 20, -1.0, ArgumentError),
    ("gpu", 20, float("nan"), ArgumentError),
    ("gpu", 20, float("inf"), ArgumentError),
    ("gpu", 20, "1s", ArgumentError),
    ("gpu", 20, True, ArgumentError),
])
def test_resize_with_bad_arguments_raises_a_typed_error_and_changes_nothing(tier, n, timeout,
                                                                           error):
    cache, half, hit = busy_cache()
    unchanged(cache, lambda: cache.resize(tier, n, timeout=timeout), error)


def test_resize_of_a_device_only_cache_has_no_host_tier():
    cache = make_cache(host_blocks=0)
    unchanged(cache, lambda: cache.resize("host", 8), TierUnavailableError, "no tier")


WRONG_TYPES = {
    "close(3)": ("expected a Sequence", lambda c, half, hit: c.close(3)),
    "gather('seq', 0)": ("expected a Sequence", lambda c, half, hit: c.gather("seq", 0)),
    "write(None, ...)": ("expected a Sequence", lambda c, half, hit: c.write(
        None, 0, torch.zeros(1, H, D), torch.zeros(1, H, D))),
    "wait(object())": ("expected a Sequence", lambda c, half, hit: c.wait(object(), 0)),
    "attention(q, [3])": ("expected a Sequence", lambda c, half, hit: c.attention(
        torch.zeros(1, 4, D), [3], 0)),
    "attention(q, set)": ("seqs", lambda c, half, hit: c.attention(torch.zeros(1, 4, D),
                                                                   {hit}, 0)),
    "attention(q, seq)": ("seqs", lambda c, half, hit: c.attention(torch.zeros(1, 4, D),
                                                                   hit, 0)),
    "open(reserve_last=1)": ("reserve_last", lambda c, half, hit: c.open(tokens(4),
                                                                         reserve_last=1)),
    "can_open('x')": ("num_tokens", lambda c, half, hit: c.can_open("x")),
    "can_open(-1)": ("num_tokens", lambda c, half, hit: c.can_open(-1)),
    "can_open(2.0)": ("num_tokens", lambda c, half, hit: c.can_open(2.0)),
    "close(timeout='x')": ("timeout", lambda c, half, hit: c.close(hit, timeout="x")),
    "close(timeout=-1)": ("timeout", lambda c, half, hit: c.close(hit, timeout=-1)),
    "close(timeout=inf)": ("timeout", lambda c, half, hit: c.close(hit,
                                                                   timeout=float("inf"))),
    "wait(timeout=nan)": ("timeout", lambda c, half, hit: c.wait(hit, 0,
                                                                 timeout=float("nan"))),
    "wait(timeout=True)": ("timeout", lambda c, half, hit: c.wait(hit, 0, timeout=True)),
}


@pytest.mark.parametrize("call", list(WRONG_TYPES))
def test_wrong_argument_types_raise_argument_error(call):
    """Arguments of the wrong type or out of range (a non-Sequence where a sequence is
    expected, `seqs` that is not a list, `reserve_last` that is not a bool, `can_open("x")` or
    `can_open(-1)`, a timeout that is not a finite number >= 0) raise ArgumentError naming the
    argument: a TieredCacheError that is also a TypeError and a ValueError, so `except
    TypeError` keeps working. The cache is unchanged."""
    match, fn = WRONG_TYPES[call]
    cache, half, hit = busy_cache()
    err = unchanged(cache, lambda: fn(cache, half, hit), ArgumentError, match)
    assert isinstance(err, TypeError) and isinstance(err, ValueError)


def test_close_and_wait_take_a_zero_timeout():
    """0 is a valid timeout (do not wait): a close with no reader closes at once."""
    cache, half, hit = busy_cache()
    cache.wait(hit, 0, timeout=0)
    cache.close(hit, timeout=0)
    assert hit.closed
    assert cache.can_open(0) and cache.can_open(np.int64(4))


# ---------------------------------------------------------------------------- typed errors


TYPED_CASES = {
    "write wrong shape": (ShapeError, lambda c, half, hit: c.write(
        half, 1, torch.zeros(2, H, D + 1), torch.zeros(2, H, D + 1))),
    "write float64": (DTypeError, lambda c, half, hit: c.write(
        half, 1, torch.zeros(2, H, D, dtype=torch.float64),
        torch.zeros(2, H, D, dtype=torch.float64))),
    "write past tokens": (ShapeError, lambda c, half, hit: c.write(
        half, 0, torch.zeros(5, H, D), torch.zeros(5, H, D))),
    "write nan": (KVValueError, lambda c, half, hit: c.write(
        half, 1, torch.full((2, H, D), float("nan")), torch.zeros(2, H, D))),
    "bad layer": (LayerError, lambda c, half, hit: c.gather(hit, 7)),
    "bad tokens": (TokenError, lambda c, half, hit: c.open([1, -1])),
    "bad salt": (TokenError, lambda c, half, hit: c.open(tokens(4), salt=3)),
    "append bad tokens": (TokenError, lambda c, half, hit: c.append(half, [2**31])),
    "capacity": (CapacityError, lambda c, half, hit: c.open(tokens(4 * 64, start=900))),
    "prefill too many q": (ShapeError, lambda c, half, hit: c.prefill_attention(
        torch.zeros(20, 4, D), hit, 0)),
    "attention twice": (ShapeError, lambda c, half, hit: c.attention(
        torch.zeros(2, 4, D), [hit, hit], 0)),
    "mark_computed with storage": (StorageDisabledError, lambda c, half, hit: c.mark_computed(
        hit)),
}


@pytest.mark.parametrize("case", list(TYPED_CASES))
def test_every_typed_error_leaves_the_cache_exactly_as_it_was(case):
    exc, fn = TYPED_CASES[case]
    cache, half, hit = busy_cache()
    unchanged(cache, lambda: fn(cache, half, hit), exc)


# ---------------------------------------------------------------------------- fuzz

def fz_pattern(cache, key, toks, start: int, end: int, layer: int, dtype=torch.float32):
    """Pattern KV keyed by (salt, adapter_id): a block shared across tenants or adapters
    shows."""
    j = torch.arange(H * D, dtype=torch.float32).view(H, D)
    c = torch.tensor([pattern_value(key, toks, p, int(layer)) for p in range(start, end)],
                     dtype=torch.float32).view(-1, 1, 1)
    return (c + j).to(dtype), (-c - 2 * j).to(dtype)


def fz_key(seq):
    return (seq.salt, seq.adapter_id)


def fz_check(cache, seq) -> None:
    for layer in range(cache.num_layers):
        k, v = cache.gather(seq, layer)
        ek, ev = fz_pattern(cache, fz_key(seq), seq.token_ids, 0, seq.written[layer], layer)
        assert torch.equal(k, ek) and torch.equal(v, ev), \
            f"sequence {seq.id} layer {layer}: not the KV of its tokens"


VALID_TOKENS = st.lists(st.integers(0, 3), max_size=14)            # shared prefixes
TOKENS = st.one_of(
    VALID_TOKENS, VALID_TOKENS, VALID_TOKENS,
    st.lists(st.integers(-2, 2**31 + 1), max_size=6),              # some out of range
    st.sampled_from([None, "1234", b"12", 3, [1.5], [True], np.zeros((2, 2), np.int64),
                     torch.zeros(3), np.array([1, 2], dtype=np.int16),
                     torch.tensor([1, 2, 3])]))
SALTS = st.sampled_from([None, None, None, "t1", "t1", b"t2", 3, ["x"]])
ADAPTERS = st.sampled_from([None] * 5 + ["lora", "lora", "", "a\n", 7, "x" * 300])
LAYERS = st.sampled_from([0, 1] * 4 + [-1, 2, True, 1.0, "0", np.int64(1), None])


class Fuzz:
    """The fuzz's model: the sequences handed out (closed ones too)."""

    def __init__(self, cache) -> None:
        self.cache = cache
        self.seqs: list = []

    def pick(self, data):
        """Mostly an open sequence; sometimes a closed one, or not a sequence at all."""
        live = [x for x in self.seqs if not x.closed]
        dead = [x for x in self.seqs if x.closed]
        kind = data.draw(st.sampled_from(["open"] * 8 + ["closed", "garbage"]))
        if kind == "open" and live:
            return data.draw(st.sampled_from(live))
        if kind == "closed" and dead:
            return data.draw(st.sampled_from(dead))
        return data.draw(st.sampled_from([None, 3, "seq"]))

    def kv(self, data, seq, layer):
        """KV for `write(seq, layer, ...)`: the pattern of the next tokens in some valid
        form, or something invalid."""
        kind = data.draw(st.sampled_from(["good"] * 6 + ["grad", "noncontig", "shape",
                                                         "dtype", "nan", "meta", "numpy",
                                                         "mismatch", "too_many"]))
        valid = isinstance(layer, (int, np.integer)) and not isinstance(layer, bool) \
            and 0 <= layer < self.cache.num_layers
        start = seq.written[layer] if valid and hasattr(seq, "written") else 0
        total = seq.num_tokens if hasattr(seq, "num_tokens") else 4
        n = data.draw(st.integers(0, max(0, total - start))) if kind != "too_many" else \
            total - start + 1
        toks = seq.token_ids if hasattr(seq, "token_ids") else np.arange(total + 2)
        key = fz_key(seq) if hasattr(seq, "salt") else None
        lyr = int(layer) if valid else 0
        k, v = fz_pattern(self.cache, key, np.asarray(toks), start, start + n, lyr)
        if kind == "grad":
            k, v = k.clone().requires_grad_(), v.clone().requires_grad_()
        elif kind == "noncontig":
            k, v = k.transpose(0, 1).contiguous().transpose(0, 1), v
        elif kind == "shape":
            k = k.reshape(n, H * D)
        elif kind == "dtype":
            k = k.double()
        elif kind == "nan":
            k = k.clone()
            if n:
                k[0, 0, 0] = float("nan")
        elif kind == "meta":
            k = k.to("meta")
        elif kind == "numpy":
            k = k.numpy()
        elif kind == "mismatch":
            v = v[:max(0, n - 1)]
        return k, v

    def step(self, data) -> None:
        c = self.cache
        op = data.draw(st.sampled_from(["open"] * 3 + ["write"] * 5 + ["attention"] * 2
                                       + ["prefill"] * 2 + ["append", "gather", "close",
                                                            "invalidate", "resize", "wait",
                                                            "can_open", "mark_computed"]))
        seq = self.pick(data)
        mutates_on_error = False
        if op == "open":
            call = lambda: self.seqs.append(c.open(          # noqa: E731
                data.draw(TOKENS), salt=data.draw(SALTS), adapter_id=data.draw(ADAPTERS),
                reserve_last=data.draw(st.sampled_from([False, False, False, True, 1]))))
        elif op == "write":
            layer = data.draw(LAYERS)
            k, v = self.kv(data, seq, layer)
            call = lambda: c.write(seq, layer, k, v)         # noqa: E731
        elif op == "append":
            call = lambda: c.append(seq, data.draw(TOKENS))   # noqa: E731
        elif op == "gather":
            call = lambda: c.gather(seq, data.draw(LAYERS))   # noqa: E731
        elif op in ("attention", "prefill"):
            heads = data.draw(st.sampled_from([4, 4, 4, 4, 2, 6]))
            seed = data.draw(st.integers(0, 1000))
            dtype = data.draw(st.sampled_from([torch.float32] * 4 + [torch.float64]))
            layer = data.draw(LAYERS)
            if op == "attention":
                live = [x for x in self.seqs if not x.closed]
                seqs = data.draw(st.sampled_from([[seq], [seq], live[-2:], live[-3:],
                                                  [seq, seq], [], seq]))
                n = len(seqs) if isinstance(seqs, list) else 1
                q = query(c, n, seed, dtype, heads)
                call = lambda: self.check_attention(q, seqs, layer)   # noqa: E731
            else:
                n = data.draw(st.integers(0, 5))
                q = query(c, n, seed, dtype, heads)
                call = lambda: self.check_prefill(q, seq, layer)      # noqa: E731
        elif op == "close":
            call = lambda: c.close(seq)                       # noqa: E731
        elif op == "invalidate":
            call = lambda: c.invalidate(data.draw(TOKENS), salt=data.draw(SALTS),  # noqa: E731
                                        adapter_id=data.draw(ADAPTERS))
        elif op == "resize":
            mutates_on_error = True             # a shrink that times out may have moved blocks
            tier = data.draw(st.sampled_from(["gpu", "host", "disk", None]))
            n = data.draw(st.sampled_from([4, 12, 16, 24, 40, 0, -1, "8", 2.0]))
            call = lambda: c.resize(tier, n, timeout=0.05)    # noqa: E731
        elif op == "wait":
            call = lambda: c.wait(seq, data.draw(LAYERS), timeout=0.5)   # noqa: E731
        elif op == "can_open":
            call = lambda: c.can_open(data.draw(st.sampled_from([0, 4, 100, 10**6])))  # noqa
        else:
            call = lambda: c.mark_computed(seq)               # noqa: E731
        before = snapshot(c)
        try:
            call()
        except TieredCacheError:
            if not mutates_on_error:
                assert snapshot(c) == before, f"a typed error from {op} changed the cache"
        except Exception as exc:  # noqa: BLE001 - the point of the fuzz
            raise AssertionError(f"{op}: untyped {type(exc).__name__}: {exc}") from exc
        check_invariants(c)
        for s in c.open_sequences():
            fz_check(c, s)

    def check_attention(self, q, seqs, layer):
        out = self.cache.attention(q, seqs, layer)
        ks, vs = zip(*(fz_pattern(self.cache, fz_key(s), s.token_ids, 0, s.written[layer],
                                  layer) for s in seqs))
        torch.testing.assert_close(out.double(), ref_decode_attention(q, ks, vs),
                                   **ATTENTION_TOL)

    def check_prefill(self, q, seq, layer):
        out = self.cache.prefill_attention(q, seq, layer)
        k, v = fz_pattern(self.cache, fz_key(seq), seq.token_ids, 0, seq.written[layer], layer)
        torch.testing.assert_close(out.double(), ref_prefill_attention(q, k, v),
                                   **ATTENTION_TOL)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.slow                       # 40 long random call sequences
@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_fuzz_the_public_api_with_random_often_invalid_arguments(data):
    cache = make_cache(gpu_blocks=16, host_blocks=16, num_q_heads=4,
                       write_policy=data.draw(st.sampled_from(["write_back",
                                                               "write_through"])))
    fuzz = Fuzz(cache)
    try:
        for _ in range(2):                          # something to work on from the start
            fuzz.seqs.append(cache.open(data.draw(st.lists(st.integers(0, 3), min_size=1,
                                                           max_size=14))))
        for _ in range(data.draw(st.integers(10, 40))):
            fuzz.step(data)
        for s in cache.open_sequences():
            fz_check(cache, s)
            cache.close(s)
        check_invariants(cache)
        assert all(t.pinned_blocks == 0 for t in cache.tiers)
    finally:
        cache.shutdown()


# ---------------------------------------------------------------------------- docs/errors.md

DOC = Path(__file__).resolve().parent.parent / "docs" / "errors.md"


def error_modules():
    """Every module of the package (and of tiered_cache.migrator / .kernels) that imports
    here; one that needs an optional extra that is not installed is skipped."""
    import importlib
    import pkgutil

    import tiered_cache.kernels
    import tiered_cache.migrator

    mods = []
    for pkg in (tiered_cache, tiered_cache.migrator, tiered_cache.kernels):
        for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
            if info.name.endswith("__main__"):
                continue
            try:
                mods.append(importlib.import_module(info.name))
            except ImportError:
                continue
    return mods


def documented_errors():
    """Every exception class defined in the package (public or private)."""
    out = {}
    for mod in error_modules():
        for name, obj in vars(mod).items():
            if (isinstance(obj, type) and issubclass(obj, BaseException)
                    and obj.__module__ == mod.__name__ and name == obj.__name__):
                out[name] = obj
    return out


def doc_section(text: str, name: str) -> str:
    start = text.find(f"### `{name}`")
    assert start >= 0, f"docs/errors.md has no section for {name}"
    end = len(text)
    for marker in ("\n### ", "\n## "):
        i = text.find(marker, start + 1)
        if i >= 0:
            end = min(end, i)
    return text[start:end]


def test_docs_errors_md_lists_every_error_class_with_its_bases():
    text = DOC.read_text()
    classes = documented_errors()
    assert {"TieredCacheError", "ArgumentError", "CorruptRecord", "DiskFullError",
            "StoreAuthError", "DaemonTimeoutError", "DeadlineExceeded", "CorruptBlocks",
            "BadEntryError", "InvariantError"} <= set(classes)
    for name, cls in sorted(classes.items()):
        section = doc_section(text, name)
        assert "Base" in section, f"{name}: the section does not give its base classes"
        for base in cls.__bases__:
            assert f"`{base.__name__}`" in section, f"{name}: base {base.__name__} missing"
        assert len(section) > 120, f"{name}: say when it is raised and what to do"
        start = text.find(f"### `{name}`")
        chapter = text[text.rfind("\n## ", 0, start):start].split("\n")[1]
        assert cls.__module__ in chapter or f"`{cls.__module__}`" in section, \
            f"{name}: the section does not say it lives in {cls.__module__}"
        if issubclass(cls, TieredCacheError):
            assert name in text.split("## `tiered_cache.errors`")[0], \
                f"{name} is missing from the hierarchy"
