"""Shared helpers of the cache-manager tests (no tests here): block size 4 and a manager
factory under each hash algorithm."""

import pytest

from radixkv.cache import KVCacheManager

B = 4


@pytest.fixture(params=["sha256", "xxh3_128"])
def make(request):
    def make(num_blocks=32, **kw):
        return KVCacheManager(num_blocks, B, hash_algo=request.param, **kw)

    return make
