"""The Redis tier's configuration and its value format: one full KV block per key,

    header | token ids (int32, little-endian) | K/V bytes of all layers

where the header carries a magic, a format version, the block size, the payload length and the
parent hash. A reader verifies all of them (and the caller checks the token ids against its own
prompt), so a hit is only taken for exactly the tokens that produced it.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

_MAGIC = b"DQKV"
_VERSION = 1
_HEADER = struct.Struct("<4sHHI16s")  # magic, version, block size, payload bytes, parent hash


@dataclass(frozen=True)
class TierConfig:
    url: str
    prefix: str = "docqa:"  # key prefix; tests use one of their own per run
    ttl_s: int = 24 * 3600
    max_bytes: int = 2 * 2**30  # blocks beyond this are trimmed, least recently used first
    timeout_s: float = 2.0  # socket timeout of every Redis call
    max_pending_bytes: int = 256 * 2**20  # writes queued beyond this are dropped
    retry_s: float = 1.0  # how often a degraded tier checks whether Redis is back
    batch_blocks: int = 32  # blocks per pipelined write or read
    # a request waits at most this long for its lookup; then it computes what it lacks
    lookup_wait_s: float = 2.0
    # a prefix another replica claimed (it is computing it) is waited for this long at most;
    # a claim lapses ``claim_ttl_s`` after its holder last renewed it (a live holder renews
    # it every third of that until its prompt is computed: a replica that died holds others
    # up by ``claim_ttl_s`` at most)
    claim_wait_s: float = 30.0
    claim_ttl_s: float = 10.0
    # a lookup answered longer ago than this is asked again before its request computes
    # blocks it did not find (``TierIO.relook``)
    relook_after_s: float = 1.0

    def __post_init__(self):
        if self.ttl_s < 1:
            raise ValueError(f"the Redis tier TTL must be at least 1 s, got {self.ttl_s}")
        if self.max_bytes < 1:
            raise ValueError("the Redis tier memory cap must be positive")


class TierBlock(NamedTuple):
    block_hash: bytes
    parent_hash: bytes
    token_ids: tuple[int, ...]
    payload: bytes | memoryview  # the block's K/V for all layers


def encode_block(block: TierBlock, block_size: int) -> bytes:
    payload = memoryview(block.payload).cast("B")
    ids = np.asarray(block.token_ids, dtype="<i4").tobytes()
    head = _HEADER.pack(_MAGIC, _VERSION, block_size, len(payload), block.parent_hash)
    return b"".join((head, ids, payload))


def value_size(block_size: int, payload_bytes: int) -> int:
    """The bytes of one stored block."""
    return _HEADER.size + 4 * block_size + payload_bytes


def decode_block(
    block_hash: bytes, value: bytes, block_size: int, payload_bytes: int
) -> TierBlock | None:
    """The block stored under ``block_hash``, or None when the value is not one docqa wrote
    for this block size and payload size."""
    if len(value) != value_size(block_size, payload_bytes):
        return None
    magic, version, bs, n, parent = _HEADER.unpack_from(value)
    if magic != _MAGIC or version != _VERSION or bs != block_size or n != payload_bytes:
        return None
    off = _HEADER.size
    ids = tuple(np.frombuffer(value, dtype="<i4", count=block_size, offset=off).tolist())
    payload = memoryview(value)[off + 4 * block_size :]
    return TierBlock(block_hash, parent, ids, payload)
