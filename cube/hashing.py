"""Vectorized 64-bit mixing and MurmurHash3 over numpy uint64 key arrays.

Pure functions, no I/O. `fmix64` places keys in a shard's hash directory (and, a bijection,
identifies them there: `fmix64_inverse` gives a key back from its hash); `murmur3_32` is the
`murmur3` partitioner and must equal `mmh3.hash(key.to_bytes(8, "little"), 0, signed=False)`
for every key, in every component that routes keys (builder, server splits, SDK).
"""

from __future__ import annotations

import numpy as np

_M1 = np.uint64(0xFF51AFD7ED558CCD)
_M2 = np.uint64(0xC4CEB9FE1A85EC53)
_S33 = np.uint64(33)
_M1_INVERSE = np.uint64(pow(0xFF51AFD7ED558CCD, -1, 1 << 64))
_M2_INVERSE = np.uint64(pow(0xC4CEB9FE1A85EC53, -1, 1 << 64))

_C1 = np.uint32(0xCC9E2D51)
_C2 = np.uint32(0x1B873593)
_N = np.uint32(0xE6546B64)
_F1 = np.uint32(0x85EBCA6B)
_F2 = np.uint32(0xC2B2AE35)


def as_keys(keys: object) -> np.ndarray:
    """Return `keys` as a 1-D uint64 array (no copy when it already is one).

    Python ints outside [0, 2**64) raise OverflowError instead of wrapping silently.
    """
    if isinstance(keys, np.ndarray):
        if keys.dtype == np.uint64:
            return keys.reshape(-1)
        if keys.dtype.kind == "i" and keys.size and int(keys.min()) < 0:
            raise OverflowError("negative key in key array; keys are uint64")
        if keys.dtype.kind not in "iu":
            raise TypeError(f"keys must be integers, got dtype {keys.dtype}")
        return keys.astype(np.uint64).reshape(-1)
    return np.array(keys, dtype=np.uint64).reshape(-1)


def fmix64(keys: np.ndarray) -> np.ndarray:
    """MurmurHash3's 64-bit finalizer: a bijection on uint64 with full avalanche."""
    h = keys >> _S33
    h ^= keys
    tmp = np.empty_like(h)
    for multiplier in (_M1, _M2):  # in place: numpy's per-call cost dominates 1000-key batches
        np.multiply(h, multiplier, out=h)
        np.right_shift(h, _S33, out=tmp)
        h ^= tmp
    return h


def fmix64_inverse(hashes: np.ndarray) -> np.ndarray:
    """The key of each hash: `fmix64_inverse(fmix64(k)) == k` (x ^= x >> 33 undoes itself, and
    each odd multiplier has an inverse modulo 2**64)."""
    k = hashes >> _S33
    k ^= hashes
    tmp = np.empty_like(k)
    for multiplier in (_M2_INVERSE, _M1_INVERSE):
        np.multiply(k, multiplier, out=k)
        np.right_shift(k, _S33, out=tmp)
        k ^= tmp
    return k


def _rotl32(x: np.ndarray, r: int) -> np.ndarray:
    return (x << np.uint32(r)) | (x >> np.uint32(32 - r))


def _mix_block(h: np.ndarray, k: np.ndarray) -> np.ndarray:
    k = k * _C1
    k = _rotl32(k, 15)
    k *= _C2
    h = h ^ k
    h = _rotl32(h, 13)
    return h * np.uint32(5) + _N


def murmur3_32(keys: np.ndarray, seed: int = 0) -> np.ndarray:
    """MurmurHash3_x86_32 of each key's 8 little-endian bytes, as uint32."""
    keys = as_keys(keys)
    low = (keys & np.uint64(0xFFFFFFFF)).astype(np.uint32)
    high = (keys >> np.uint64(32)).astype(np.uint32)
    h = np.full(keys.shape, seed, dtype=np.uint32)
    h = _mix_block(h, low)
    h = _mix_block(h, high)
    h ^= np.uint32(8)
    h ^= h >> np.uint32(16)
    h *= _F1
    h ^= h >> np.uint32(13)
    h *= _F2
    h ^= h >> np.uint32(16)
    return h
