"""Chained block hashes: the bytes every replica and restart must agree on.

    h_{-1} = xxh3_128("docqa-kv-v1" || model fingerprint || namespace)
    h_i    = xxh3_128(h_{i-1} || little-endian int32 ids of block i || extra_i)

Digests are the 16-byte big-endian xxh3_128 digests. Nothing here depends on Python's
per-process hash seed, so two processes (or two replicas) that loaded the same model agree.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xxhash

HASH_VERSION = b"docqa-kv-v1"

BlockHash = bytes  # 16-byte digest


def root_hash(model_fingerprint: bytes, namespace: bytes = b"") -> BlockHash:
    """h_{-1}: the seed of every chain for one model and one cache namespace (tenant)."""
    return xxhash.xxh3_128_digest(HASH_VERSION + model_fingerprint + namespace)


def hash_block(parent: BlockHash, token_ids: Sequence[int], extra: bytes = b"") -> BlockHash:
    """h_i from h_{i-1}, the block's token ids and its extra keys."""
    ids = np.asarray(token_ids, dtype="<i4").tobytes()
    return xxhash.xxh3_128_digest(parent + ids + extra)


class BlockHasher:
    """Hashes the full blocks of token sequences for one model and namespace."""

    def __init__(self, block_size: int, model_fingerprint: bytes, namespace: bytes = b""):
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.root = root_hash(model_fingerprint, namespace)

    def chain(
        self, token_ids: Sequence[int], start_block: int = 0, parent: BlockHash | None = None
    ) -> list[BlockHash]:
        """Hashes of full blocks ``start_block, start_block+1, ...`` of ``token_ids``.

        ``parent`` is the hash of block ``start_block - 1`` (the root when starting at 0).
        A trailing partial block is not hashed.
        """
        bs = self.block_size
        h = self.root if parent is None else parent
        if start_block > 0 and parent is None:
            raise ValueError("parent hash is required when start_block > 0")
        out: list[BlockHash] = []
        for i in range(start_block, len(token_ids) // bs):
            h = hash_block(h, token_ids[i * bs : (i + 1) * bs])
            out.append(h)
        return out
