"""Prefix cache: chained block hashes, the block pool and the KV cache manager.

Imports nothing else of docqa; the engine drives it.
"""

from prefix_store.block_pool import Block, BlockPool
from prefix_store.hashing import HASH_VERSION, BlockHasher, hash_block, root_hash
from prefix_store.kv_cache_manager import CachedPrefix, Hold, KVCacheManager, NoFreeBlocksError
from prefix_store.redis_tier import RedisTier
from prefix_store.tier_block import TierBlock, TierConfig

__all__ = [
    "HASH_VERSION",
    "Block",
    "BlockHasher",
    "BlockPool",
    "CachedPrefix",
    "Hold",
    "KVCacheManager",
    "NoFreeBlocksError",
    "RedisTier",
    "TierBlock",
    "TierConfig",
    "hash_block",
    "root_hash",
]
