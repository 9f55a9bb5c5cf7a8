"""The second tier of the prefix cache: full KV blocks in Redis, shared by every replica.

A block goes to Redis once it is full and registered in the device pool (write-through), never
on the eviction path. Each block is one key

    {prefix}kv:{{kv-<fingerprint>-<group>}}:{block hash}  ->  header | token ids | K/V bytes

in one of ``GROUPS`` slot groups (the hash tag between braces; a block's group is its hash's
first byte modulo ``GROUPS``), each with its own index of keys by last use. On a Redis Cluster
(``DOCQA_REDIS_URL`` naming any node: ``prefix_store.redis_client``) a group's keys and its
index live on one master, the groups spread over the masters, and every read or write is one
pipeline, split by master. A group whose master is gone answers nothing: its blocks are misses
(computed again) and its writes are dropped, while the other groups serve on.

where the header (``prefix_store.tier_block``) lets a reader verify the block was written for
exactly these tokens. Because the namespace (tenant) is folded into the root of every hash
chain, tenants never share keys.

Redis I/O never runs on the engine thread's step path: writes go to a writer thread through a
bounded queue, lookups run on a loader thread and hand back a future. Any failure (absent,
slow, full) degrades the tier: writes are dropped, lookups answer "nothing", a warning is
logged once, and a health thread pings until Redis answers again.

Replicas do not compute the same prefix at once: lookups claim what they will compute
(``prefix_store.tier_claims``).

Memory is bounded twice: every key has a TTL, and each group's sorted set of keys by last use
lets the writer trim its oldest blocks once the group holds more than its share of
``max_bytes``.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Sequence

from prefix_store.redis_client import node_url, redis_client
from prefix_store.tier_block import (
    TierBlock,
    TierConfig,
    decode_block,
    encode_block,
    value_size,
)
from prefix_store.tier_claims import TierClaims

log = logging.getLogger("docqa.tier")

GROUPS = 16  # slot groups: hash tags the blocks spread over (a cluster's masters share them)
DEAD_GROUP_S = 2.0  # a group whose master did not answer is skipped this long


class RedisTier(TierClaims):
    """Write-through and lookup of full KV blocks for one model fingerprint."""

    def __init__(
        self, config: TierConfig, model_fingerprint: bytes, block_size: int, payload_bytes: int
    ):
        import redis  # a dependency of the service; imported here so the engine runs without

        self.config = config
        self.block_size = block_size
        self.payload_bytes = payload_bytes
        self.value_bytes = value_size(block_size, payload_bytes)
        self.max_blocks = max(1, config.max_bytes // self.value_bytes)
        self._group_blocks = max(1, self.max_blocks // GROUPS)  # each group's share of the cap
        fp = model_fingerprint.hex()[:32]
        # per group: the key prefix of its blocks, and its index of keys by last use
        self._prefixes = [f"{config.prefix}kv:{{kv-{fp}-{g:02d}}}:".encode() for g in range(GROUPS)]
        self._lru_keys = [p + b"lru" for p in self._prefixes]
        self._redis_errors = (redis.RedisError, OSError)
        self._client: redis.Redis | redis.RedisCluster = redis.Redis.from_url(
            node_url(config.url)[0]
        )  # until _connect: a client every call of which fails while Redis is away
        self.cluster = False
        self.owner = os.urandom(8).hex()  # this process's claims carry it
        self._claim_prefix = f"{config.prefix}claim:".encode()
        self._dead_until: dict[int, float] = {}  # group -> monotonic time to try it again
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
        self.claim_waits = 0  # lookups that waited for another replica computing the prefix
        # waits on another replica's claim that ran out of time (claim_wait_s): the request
        # computed what was still missing itself
        self.claim_waits_expired = 0
        self.relooks = 0  # lookups asked again before computing (their first answer was stale)
        # lookups asked again because the pool evicted part of the local prefix they started
        # after while they ran (what they found no longer joined it)
        self.relooks_evicted = 0
        self._loader = concurrent.futures.ThreadPoolExecutor(
            2, thread_name_prefix="docqa-tier-load"
        )
        self._writer = threading.Thread(
            target=self._write_loop, name="docqa-tier-write", daemon=True
        )
        self._health = threading.Thread(
            target=self._health_loop, name="docqa-tier-health", daemon=True
        )
        self._held_claims: set[bytes] = set()  # this process's claims, renewed until released
        # the renewer's own wake-up: ``_lock``'s notify() wakes one waiter, the writer's
        self._stop = threading.Event()
        self._renewer = threading.Thread(
            target=self._renew_loop, name="docqa-tier-claims", daemon=True
        )
        if not (self._connect() and self._ping()):
            self._degrade("not reachable at start")
        self._writer.start()
        self._health.start()
        self._renewer.start()

    # -- state -----------------------------------------------------------------------------
    @property
    def up(self) -> bool:
        return self._up

    @property
    def status(self) -> str:
        return "ok" if self._up else "degraded"

    def _connect(self) -> bool:
        """A new client for the URL (a cluster's where the server is one, which is asked of it
        each time, so a Redis that comes back as a cluster is seen as one); False where Redis
        does not answer."""
        import redis

        try:
            client = redis_client(self.config.url, self.config.timeout_s)
        except self._redis_errors:
            return False
        self.cluster = not isinstance(client, redis.Redis)
        self._client = client
        return True

    def _ping(self) -> bool:
        """Whether Redis answers (a cluster: any of its nodes, so a master that is gone does
        not hold the whole tier down)."""
        try:
            if self.cluster:
                return bool(self._client.ping(target_nodes=self._client.RANDOM))
            return bool(self._client.ping())
        except self._redis_errors:
            return False

    def _key(self, block_hash: bytes) -> tuple[int, bytes]:
        """(group, key) of a block."""
        g = block_hash[0] % GROUPS
        return g, self._prefixes[g] + block_hash.hex().encode()

    def _run(self, commands: list[tuple[int, str, tuple, dict]]) -> list:
        """Run (group, command, args, kwargs) in one pipeline; each result in order, a failed
        command's as its exception. On a cluster, where a pipeline to a master that is gone
        raises as a whole, the groups run one pipeline each instead, and a group that failed
        is skipped (its results errors) for ``DEAD_GROUP_S``. Raises when every command failed
        (Redis unreachable)."""
        results = self._pipeline(commands)
        if results is None:  # a cluster with a master gone: group by group
            results = [None] * len(commands)
            by_group: dict[int, list[int]] = {}
            for i, (g, *_) in enumerate(commands):
                by_group.setdefault(g, []).append(i)
            now = time.monotonic()
            for g, idx in by_group.items():
                got = None
                if self._dead_until.get(g, 0.0) <= now:
                    got = self._pipeline([commands[i] for i in idx])
                if got is None:
                    self._dead_until[g] = now + DEAD_GROUP_S
                    got = [ConnectionError(f"slot group {g} unreachable")] * len(idx)
                for i, r in zip(idx, got, strict=True):
                    results[i] = r
        failed = [r for r in results if isinstance(r, Exception)]
        if failed:
            self.errors += len(failed)
            if len(failed) == len(results):
                raise failed[0]
        return results

    def _pipeline(self, commands) -> list | None:
        """One pipeline's results (errors in place); None where a cluster's pipeline failed as
        a whole."""
        pipe = self._client.pipeline(transaction=False)
        for _, name, args, kwargs in commands:
            getattr(pipe, name)(*args, **kwargs)
        if not self.cluster:
            return pipe.execute(raise_on_error=False)
        try:
            return pipe.execute(raise_on_error=False)
        except self._redis_errors:
            return None

    def _degrade(self, why: str) -> None:
        self.errors += 1
        with self._lock:
            was_up, self._up = self._up, False
            self.reason = why
            dropped = sum(len(b) for b, _ in self._queue if isinstance(b, list))
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
            if not (self._connect() and self._ping()):
                continue  # (a new client each time: Redis may come back as a cluster)
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
            if isinstance(blocks, bytes):  # a claim to release, after the writes before it
                with contextlib.suppress(*self._redis_errors):
                    self._release_claim(blocks)
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
            cmds = []
            scores: dict[int, dict[bytes, float]] = {}
            for b in part:
                g, key = self._key(b.block_hash)
                cmds.append((g, "set", (key, encode_block(b, self.block_size)), {"ex": cfg.ttl_s}))
                scores.setdefault(g, {})[key] = now
            for g, group in scores.items():
                cmds.append((g, "zadd", (self._lru_keys[g], group), {}))
                cmds.append((g, "expire", (self._lru_keys[g], cfg.ttl_s), {}))
            results = self._run(cmds)
            stored = sum(r is True for r in results[: len(part)])
            self.blocks_written += stored
            self.bytes_written += stored * self.value_bytes
            self.writes_dropped += len(part) - stored
            self._trim(now, sorted(scores))

    def _trim(self, now: float, groups: list[int]) -> None:
        """Forget index entries past their TTL; evict each group's least recently used blocks
        beyond its share of the memory cap."""
        cmds = []
        for g in groups:
            cmds.append(
                (g, "zremrangebyscore", (self._lru_keys[g], "-inf", now - self.config.ttl_s), {})
            )
            cmds.append((g, "zcard", (self._lru_keys[g],), {}))
        counts = self._run(cmds)[1::2]
        for g, count in zip(groups, counts, strict=True):
            excess = count - self._group_blocks if isinstance(count, int) else 0
            if excess > 0:
                old = [k for k, _ in self._client.zpopmin(self._lru_keys[g], excess)]
                if old:
                    self._client.delete(*old)  # one group: one slot

    def indexed_blocks(self) -> int:
        """Blocks the groups' indexes hold (a blocking call; tests and tools)."""
        cmds = [(g, "zcard", (key,), {}) for g, key in enumerate(self._lru_keys)]
        return sum(n for n in self._run(cmds) if isinstance(n, int))

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
                values = self._get(part)
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
                self._touch([b.block_hash for b in out])
        except self._redis_errors as e:
            self._degrade(f"lookup failed: {e}")
            return []
        self.blocks_loaded += len(out)
        return out

    def _get(self, block_hashes: list[bytes]) -> list[bytes | None]:
        """The values of these blocks in order, None for a block not there (or whose group's
        master did not answer): one pipeline of GETs (a cluster's split by master)."""
        cmds = [(g, "get", (key,), {}) for g, key in map(self._key, block_hashes)]
        return [None if isinstance(v, Exception) else v for v in self._run(cmds)]

    def _touch(self, block_hashes: list[bytes]) -> None:
        now = time.time()
        cmds = []
        by_group: dict[int, dict[bytes, float]] = {}
        for h in block_hashes:
            g, key = self._key(h)
            by_group.setdefault(g, {})[key] = now
            cmds.append((g, "expire", (key, self.config.ttl_s), {}))
        for g, keys in by_group.items():
            cmds.append((g, "zadd", (self._lru_keys[g], keys), {"xx": True}))
        self._run(cmds)

    def count_present(self, block_hashes: Sequence[bytes]) -> int:
        """How many of these blocks Redis holds (a blocking call; not for the engine thread)."""
        if not block_hashes:
            return 0
        cmds = [(g, "exists", (key,), {}) for g, key in map(self._key, block_hashes)]
        try:
            return sum(n for n in self._run(cmds) if isinstance(n, int))
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
            "claim_waits": self.claim_waits,
            "claim_waits_expired": self.claim_waits_expired,
            "relooks": self.relooks,
            "relooks_evicted": self.relooks_evicted,
            "pending_bytes": self._pending_bytes,
        }

    def close(self, timeout: float = 5.0) -> None:
        with self._lock:
            self._closing = True
            self._lock.notify_all()
        self._stop.set()
        self._writer.join(timeout)
        self._loader.shutdown(wait=False, cancel_futures=True)
        with contextlib.suppress(self._redis_errors):
            self._client.close()
