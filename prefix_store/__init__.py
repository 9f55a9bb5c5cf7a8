"""Prefix cache: chained block hashes, the block pool and the KV cache manager.

Imports nothing else of docqa; the engine drives it.
"""

from prefix_store.block_pool import Block, BlockPool
from prefix_store.hashing import HASH_VERSION, BlockHasher, hash_block, root_hash
from prefix_store.kv_cache_manager import CachedPrefix, KVCacheManager, NoFreeBlocksError

__all__ = [
    "HASH_VERSION",
    "Block",
    "BlockHasher",
    "BlockPool",
    "CachedPrefix",
    "KVCacheManager",
    "NoFreeBlocksError",
    "hash_block",
    "root_hash",
]
