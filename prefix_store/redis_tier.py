"""The second tier of the prefix cache: full KV blocks in Redis, shared by every replica.

A block goes to Redis once it is full and registered in the device pool (write-through), never
on the eviction path. Each block is one key

    {prefix}kv:{model fingerprint}:{block hash}  ->  header | token ids | K/V bytes

where the header carries a magic, a format version, the block size, the payload length and the
parent hash. A reader verifies all of them (and the caller checks the token ids against its own
prompt), so a hit is only taken for exactly the tokens that produced it. Because the namespace
(tenant) is folded into the root of every hash chain, tenants never share keys.

Redis I/O never runs on the engine thread's step path: writes go to a writer thread through a
bounded queue, lookups run on a loader thread and hand back a future. Any failure (absent,
slow, full) degrades the tier: writes are dropped, lookups answer "nothing", a warning is
logged once, and a health thread pings until Redis answers again.

Memory is bounded twice: every key has a TTL, and a sorted set of keys by last use lets the
writer trim the oldest blocks once the tier holds more than ``max_bytes``.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import struct
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

log = logging.getLogger("docqa.tier")

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
    batch_blocks: int = 32  # blocks per pipelined write or MGET
    # a request waits at most this long for its lookup; then it computes what it lacks
    lookup_wait_s: float = 2.0

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


def decode_block(
    block_hash: bytes, value: bytes, block_size: int, payload_bytes: int
) -> TierBlock | None:
    """The block stored under ``block_hash``, or None when the value is not one docqa wrote
    for this block size and payload size."""
    if len(value) != _HEADER.size + 4 * block_size + payload_bytes:
        return None
    magic, version, bs, n, parent = _HEADER.unpack_from(value)
    if magic != _MAGIC or version != _VERSION or bs != block_size or n != payload_bytes:
        return None
    off = _HEADER.size
    ids = tuple(np.frombuffer(value, dtype="<i4", count=block_size, offset=off).tolist())
    payload = memoryview(value)[off + 4 * block_size :]
    return TierBlock(block_hash, parent, ids, payload)


class RedisTier:
    """Write-through and lookup of full KV blocks for one model fingerprint."""

    def __init__(
        self, config: TierConfig, model_fingerprint: bytes, block_size: int, payload_bytes: int
    ):
        import redis  # a dependency of the service; imported here so the engine runs without

        self.config = config
        self.block_size = block_size
        self.payload_bytes = payload_bytes
        self.value_bytes = _HEADER.size + 4 * block_size + payload_bytes
        self.max_blocks = max(1, config.max_bytes // self.value_bytes)
        self._key_prefix = f"{config.prefix}kv:{model_fingerprint.hex()[:32]}:".encode()
        self._lru_key = self._key_prefix + b"lru"
        self._redis_errors = (redis.RedisError, OSError)
        self._client = redis.Redis.from_url(
            config.url,
            socket_timeout=config.timeout_s,
            socket_connect_timeout=min(config.timeout_s, 1.0),
            health_check_interval=0,
        )
        # state
        self._lock = threading.Condition()
        self._queue: deque[tuple[list[TierBlock], concurrent.futures.Future | None]] = deque()
        self._pending_bytes = 0
        self._behind = False  # writes are being dropped for a full queue
        self._up = True
        self.reason = ""  # why the tier is degraded
        self._closing = False
        # counters (read by metrics)
        self.blocks_written = 0
        self.bytes_written = 0
        self.blocks_loaded = 0
        self.bytes_read = 0
        self.writes_dropped = 0
        self.errors = 0
        self.lookups_abandoned = 0  # lookups a request stopped waiting for (slow Redis)
        self._loader = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="docqa-tier-load"
        )
        self._writer = threading.Thread(
            target=self._write_loop, name="docqa-tier-write", daemon=True
        )
        self._health = threading.Thread(
            target=self._health_loop, name="docqa-tier-health", daemon=True
        )
        try:
            self._client.ping()
        except self._redis_errors as e:
            self._degrade(f"not reachable at start: {e}")
        self._writer.start()
        self._health.start()

    # -- state -----------------------------------------------------------------------------
    @property
    def up(self) -> bool:
        return self._up

    @property
    def status(self) -> str:
        return "ok" if self._up else "degraded"

    def _degrade(self, why: str) -> None:
        self.errors += 1
        with self._lock:
            was_up, self._up = self._up, False
            self.reason = why
            dropped = sum(len(blocks) for blocks, _ in self._queue)
            waiters = [f for _, f in self._queue if f is not None]
            self._queue.clear()
            self._pending_bytes = 0
            self._lock.notify_all()
        self.writes_dropped += dropped
        for f in waiters:
            if not f.done():
                f.set_result(False)
        if was_up:
            log.warning("redis tier degraded (local-only caching until it answers): %s", why)

    def _health_loop(self) -> None:
        while not self._closing:
            time.sleep(self.config.retry_s)
            if self._up or self._closing:
                continue
            try:
                self._client.ping()
            except self._redis_errors:
                continue
            with self._lock:
                self._up = True
                self.reason = ""
            log.warning("redis tier is back")

    # -- writes ------------------------------------------------------------------------------
    def write(self, blocks: list[TierBlock]) -> bool:
        """Queue blocks for write-through; never blocks. False when they were dropped (tier
        degraded, or the queue is over its byte limit because Redis is slower than the
        engine)."""
        if not blocks:
            return True
        size = len(blocks) * self.value_bytes
        with self._lock:
            if not self._up:
                self.writes_dropped += len(blocks)
                return False
            if self._pending_bytes + size > self.config.max_pending_bytes:
                self.writes_dropped += len(blocks)
                if not self._behind:  # once per backlog; the counter tells the rest
                    log.warning("redis tier is slower than the engine: dropping writes")
                self._behind = True
                return False
            self._queue.append((blocks, None))
            self._pending_bytes += size
            self._lock.notify()
        return True

    def flush(self) -> concurrent.futures.Future:
        """A future that resolves to True once every write queued before it is in Redis
        (False when they were dropped)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if not self._up:
                fut.set_result(False)
                return fut
            self._queue.append(([], fut))
            self._lock.notify()
        return fut

    def _write_loop(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._closing:
                    self._lock.wait()
                if self._closing and not self._queue:
                    return
                blocks, waiter = self._queue.popleft()
            if waiter is not None:
                waiter.set_result(True)
                continue
            try:
                self._write_batch(blocks)
            except self._redis_errors as e:
                self._degrade(f"write failed: {e}")
            finally:
                with self._lock:
                    self._pending_bytes = max(
                        0, self._pending_bytes - len(blocks) * self.value_bytes
                    )
                    if not self._queue:
                        self._behind = False

    def _write_batch(self, blocks: list[TierBlock]) -> None:
        cfg = self.config
        now = time.time()
        for i in range(0, len(blocks), cfg.batch_blocks):
            part = blocks[i : i + cfg.batch_blocks]
            pipe = self._client.pipeline(transaction=False)
            scores = {}
            nbytes = 0
            for b in part:
                key = self._key_prefix + b.block_hash.hex().encode()
                value = encode_block(b, self.block_size)
                nbytes += len(value)
                pipe.set(key, value, ex=cfg.ttl_s)
                scores[key] = now
            pipe.zadd(self._lru_key, scores)
            pipe.expire(self._lru_key, cfg.ttl_s)
            pipe.execute()
            self.blocks_written += len(part)
            self.bytes_written += nbytes
        self._trim(now)

    def _trim(self, now: float) -> None:
        """Forget index entries past their TTL; evict the least recently used blocks beyond
        the memory cap."""
        pipe = self._client.pipeline(transaction=False)
        pipe.zremrangebyscore(self._lru_key, "-inf", now - self.config.ttl_s)
        pipe.zcard(self._lru_key)
        _, count = pipe.execute()
        excess = count - self.max_blocks
        if excess > 0:
            old = [k for k, _ in self._client.zpopmin(self._lru_key, excess)]
            if old:
                self._client.delete(*old)

    # -- lookups -----------------------------------------------------------------------------
    def fetch(self, block_hashes: Sequence[bytes], parent: bytes) -> concurrent.futures.Future:
        """Look up a run of consecutive blocks of one chain (``parent`` is the hash before the
        first). The future resolves to the leading blocks Redis holds, in order, each verified
        to carry its parent's hash; it stops at the first miss. Never raises: a failing Redis
        gives an empty list."""
        fut: concurrent.futures.Future
        if not block_hashes or not self._up or self._closing:
            fut = concurrent.futures.Future()
            fut.set_result([])
            return fut
        return self._loader.submit(self._fetch, list(block_hashes), parent)

    def _fetch(self, block_hashes: list[bytes], parent: bytes) -> list[TierBlock]:
        out: list[TierBlock] = []
        step = self.config.batch_blocks
        try:
            for i in range(0, len(block_hashes), step):
                part = block_hashes[i : i + step]
                keys = [self._key_prefix + h.hex().encode() for h in part]
                values = self._client.mget(keys)
                for h, v in zip(part, values, strict=True):
                    if v is None:
                        break
                    blk = decode_block(h, v, self.block_size, self.payload_bytes)
                    if blk is None or blk.parent_hash != parent:
                        break
                    out.append(blk)
                    self.bytes_read += len(v)
                    parent = h
                else:
                    continue
                break
            if out:
                self._touch([self._key_prefix + b.block_hash.hex().encode() for b in out])
        except self._redis_errors as e:
            self._degrade(f"lookup failed: {e}")
            return []
        self.blocks_loaded += len(out)
        return out

    def _touch(self, keys: list[bytes]) -> None:
        pipe = self._client.pipeline(transaction=False)
        now = time.time()
        pipe.zadd(self._lru_key, dict.fromkeys(keys, now), xx=True)
        for k in keys:
            pipe.expire(k, self.config.ttl_s)
        pipe.execute()

    def count_present(self, block_hashes: Sequence[bytes]) -> int:
        """How many of these blocks Redis holds (a blocking call; not for the engine thread)."""
        if not block_hashes:
            return 0
        keys = [self._key_prefix + h.hex().encode() for h in block_hashes]
        try:
            return int(self._client.exists(*keys))
        except self._redis_errors as e:
            self._degrade(f"lookup failed: {e}")
            return 0

    def counters(self) -> dict[str, float]:
        return {
            "up": 1.0 if self._up else 0.0,
            "blocks_written": self.blocks_written,
            "bytes_written": self.bytes_written,
            "blocks_loaded": self.blocks_loaded,
            "bytes_read": self.bytes_read,
            "writes_dropped": self.writes_dropped,
            "errors": self.errors,
            "lookups_abandoned": self.lookups_abandoned,
            "pending_bytes": self._pending_bytes,
        }

    def close(self, timeout: float = 5.0) -> None:
        with self._lock:
            self._closing = True
            self._lock.notify_all()
        self._writer.join(timeout)
        self._loader.shutdown(wait=False, cancel_futures=True)
        with contextlib.suppress(self._redis_errors):
            self._client.close()
