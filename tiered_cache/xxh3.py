"""Chained XXH3-128 keys of many blocks in one compiled call (numba), for 17-128-byte inputs.

A block's key is xxh3-128(parent key || its token ids as int32 little-endian bytes): 16 + 4 x
block_size bytes, 80 for 16-token blocks. Computed block by block in Python each key costs two
byte-string copies and a call (~250 ns here, the largest single cost of a 64-block prefix hit);
`chain` computes a run of them in one call, exactly the bytes `xxhash.xxh3_128_digest` returns
(XXH3's 17-128-byte path with the default secret and seed 0: `XXH3_len_17to128_128b`, and the
canonical big-endian digest; tests/test_xxh3.py checks every length against xxhash).

Only the default hash function and inputs of 17-128 bytes take this path (`fits`); anything
else is hashed by the caller as before.
"""

from __future__ import annotations

import numpy as np

from tiered_cache.jit import njit

_P1 = np.uint64(0x9E3779B185EBCA87)
_P2 = np.uint64(0xC2B2AE3D27D4EB4F)
_P4 = np.uint64(0x85EBCA77C2B2AE63)
_MX = np.uint64(0x165667919E3779F9)
_M32 = np.uint64(0xFFFFFFFF)
_S32 = np.uint64(32)
_S37 = np.uint64(37)

# XXH3's default secret (kSecret), the 128 bytes the 17-128-byte path reads
SECRET = np.array([
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
], dtype=np.uint8)
SECRET_WORDS = SECRET.view("<u8").astype(np.uint64)     # read as XXH_readLE64 reads it


def fits(block_size: int) -> bool:
    """Whether keys of blocks of `block_size` tokens take the compiled path: 16 + 4 x
    block_size bytes within 17-128, in whole 8-byte words (an even block size up to 28)."""
    return 0 < block_size <= 28 and block_size % 2 == 0


@njit(cache=True, inline="always")
def _fold(a, b):
    """XXH3_mul128_fold64: the 128-bit product's halves xored (portable 32-bit limbs)."""
    a_lo, a_hi = a & _M32, a >> _S32
    b_lo, b_hi = b & _M32, b >> _S32
    lo_lo = a_lo * b_lo
    hi_lo = a_hi * b_lo
    lo_hi = a_lo * b_hi
    hi_hi = a_hi * b_hi
    cross = (lo_lo >> _S32) + (hi_lo & _M32) + lo_hi
    upper = (hi_lo >> _S32) + (cross >> _S32) + hi_hi
    lower = (cross << _S32) | (lo_lo & _M32)
    return lower ^ upper


@njit(cache=True, inline="always")
def _avalanche(h):
    h ^= h >> _S37
    h *= _MX
    return h ^ (h >> _S32)


@njit(cache=True, inline="always")
def _bswap(x):
    y = np.uint64(0)
    for _ in range(8):
        y = (y << np.uint64(8)) | (x & np.uint64(0xFF))
        x >>= np.uint64(8)
    return y


@njit(cache=True, inline="always")
def _hash(w, n, sw):
    """xxh3-128 (high, low) of the n bytes (17 <= n <= 128, n % 8 == 0) whose little-endian
    8-byte words are w[:n // 8] (XXH3_len_17to128_128b, seed 0)."""
    lo = np.uint64(n) * _P1
    hi = np.uint64(0)
    last = n // 8
    for i in range((n - 1) // 32, -1, -1):     # XXH128_mix32B, the innermost pair first
        a = 2 * i                       # head words a, a + 1; tail words b, b + 1
        b = last - 2 * (i + 1)
        lo += _fold(w[a] ^ sw[4 * i], w[a + 1] ^ sw[4 * i + 1])
        lo ^= w[b] + w[b + 1]
        hi += _fold(w[b] ^ sw[4 * i + 2], w[b + 1] ^ sw[4 * i + 3])
        hi ^= w[a] + w[a + 1]
    h_lo = _avalanche(lo + hi)
    h_hi = np.uint64(0) - _avalanche(lo * _P1 + hi * _P4 + np.uint64(n) * _P2)
    return h_hi, h_lo


@njit(cache=True)
def chain(p_hi, p_lo, tokens, bs, n, sw, out):
    """Keys of blocks 0..n-1 of `tokens` (int32, at least n x bs): key i = xxh3-128(key i-1 ||
    block i's tokens as int32 little-endian bytes), key -1 the digest whose big-endian words
    are (p_hi, p_lo); key i's big-endian words into out[2 i], out[2 i + 1]."""
    half = bs // 2
    w = np.empty(2 + half, np.uint64)
    w[0] = _bswap(p_hi)                 # the digest's bytes, read little-endian
    w[1] = _bswap(p_lo)
    m = 16 + 4 * bs
    for i in range(n):
        base = i * bs
        for j in range(half):
            w[2 + j] = np.uint64(np.uint32(tokens[base + 2 * j])) | \
                (np.uint64(np.uint32(tokens[base + 2 * j + 1])) << _S32)
        h_hi, h_lo = _hash(w, m, sw)
        out[2 * i] = h_hi
        out[2 * i + 1] = h_lo
        w[0] = _bswap(h_hi)
        w[1] = _bswap(h_lo)


def chain_keys(parent: bytes, tokens: np.ndarray, block_size: int, n: int) -> bytes:
    """The n chained keys after `parent` (16 bytes) over `tokens` (int32, at least n x
    block_size, `fits(block_size)`), joined: 16 bytes each, as xxh3_128_digest gives them."""
    out = np.empty(2 * n, np.uint64)
    hi = int.from_bytes(parent[:8], "big")
    lo = int.from_bytes(parent[8:], "big")
    chain(np.uint64(hi), np.uint64(lo), tokens, block_size, n, SECRET_WORDS, out)
    return out.byteswap().tobytes()


def warm_up() -> None:
    chain_keys(bytes(16), np.zeros(16, np.int32), 16, 1)
