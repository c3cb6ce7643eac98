"""Vectorized murmur3 equals mmh3; routing and grouping are exact."""

import mmh3
import numpy as np
import pytest

from cube.hashing import as_keys, fmix64, murmur3_32
from cube.routing import group_by_owner, shard_of


def test_murmur3_matches_mmh3() -> None:
    rng = np.random.default_rng(0)
    keys = np.concatenate(
        [
            rng.integers(0, 2**64 - 1, 20_000, dtype=np.uint64, endpoint=True),
            np.array([0, 1, 2**32 - 1, 2**32, 2**63, 2**64 - 1], dtype=np.uint64),
        ]
    )
    expected = [mmh3.hash(int(k).to_bytes(8, "little"), 0, signed=False) for k in keys]
    assert murmur3_32(keys).tolist() == expected
    assert murmur3_32(keys[:100], seed=42).tolist() == [
        mmh3.hash(int(k).to_bytes(8, "little"), 42, signed=False) for k in keys[:100]
    ]


def test_fmix64_is_a_bijection_on_a_sample() -> None:
    keys = np.arange(1_000_000, dtype=np.uint64)
    assert np.unique(fmix64(keys)).shape[0] == keys.shape[0]


def test_shard_of_mod_and_murmur3() -> None:
    keys = np.array([0, 1, 2, 3, 10, 2**64 - 1], dtype=np.uint64)
    assert shard_of(keys, 3).tolist() == [int(k) % 3 for k in keys.tolist()]
    expected = [mmh3.hash(int(k).to_bytes(8, "little"), 0, signed=False) % 3 for k in keys]
    assert shard_of(keys, 3, "murmur3").tolist() == expected
    assert shard_of(keys, 1, "murmur3").tolist() == [0] * 6
    with pytest.raises(ValueError, match="partitioner"):
        shard_of(keys, 2, "crc")
    with pytest.raises(ValueError, match="shard_num"):
        shard_of(keys, 0)


def test_group_by_owner_keeps_request_order_and_scatters_back() -> None:
    keys = np.array([9, 4, 7, 2, 5, 8, 1], dtype=np.uint64)
    owners = shard_of(keys, 3)
    grouping = group_by_owner(owners, 3)
    for owner in range(3):
        positions = grouping.positions(owner)
        assert (owners[positions] == owner).all()
        assert list(positions) == sorted(positions)
    out = np.empty_like(keys)
    out[grouping.order] = keys[grouping.order]
    assert (out == keys).all()
    assert grouping.owners() == sorted(set(owners.tolist()))


def test_as_keys_rejects_negative_and_non_integer() -> None:
    assert as_keys([1, 2]).dtype == np.uint64
    with pytest.raises(OverflowError):
        as_keys(np.array([-1, 2]))
    with pytest.raises(OverflowError):
        as_keys([2**64])
    with pytest.raises(TypeError):
        as_keys(np.array([1.5]))
