"""The prefix cache's guard (engine/prefix_cache.py): a block it does not hold cannot be
parked as idle, whether or not Python runs with -O."""

from __future__ import annotations

import pytest

from decodekit.engine.block_pool import PoolCorrupted
from decodekit.engine.prefix_cache import ROOT_KEY, PrefixCache, block_key


def test_parking_a_block_the_cache_does_not_hold_raises():
    cache = PrefixCache()
    with pytest.raises(PoolCorrupted, match="block 5 was released to the prefix cache"):
        cache.park(5)
    assert cache.idle_blocks() == set()


def test_a_registered_block_parks_and_is_evicted():
    cache = PrefixCache()
    tokens = [1, 2, 3, 4]
    cache.register(7, block_key(ROOT_KEY, tokens), tokens)
    cache.park(7)
    assert cache.idle_blocks() == {7} and cache.evict() == 7 and not cache.is_cached(7)
