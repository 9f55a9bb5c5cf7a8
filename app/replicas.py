"""Replicas sharing one Postgres and one Redis: registration, the block hashes each one holds,
and prefix-aware routing of questions.

Every replica keeps, in Redis,

    {prefix}replicas                  hash: replica id -> {"url", "load", "seen", "started"}
    {prefix}replica:{id}:blocks       set of the block hashes its device pool indexes

refreshed every ``HEARTBEAT_S`` from the pool's index changes (the full set again after an
outage). A question arriving at any replica goes to the replica whose pool holds the longest
prefix of its prompt; when no replica holds any of it, to the least loaded one. A forwarded
request carries ``X-Docqa-Route: local`` and is never forwarded again; a replica that does not
answer is deregistered and the question is served where it arrived. Clients may send
``X-Docqa-Route: local`` themselves to pin a question to the replica they call.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass

import httpx
import redis.asyncio as aioredis

log = logging.getLogger("docqa.replicas")

HEARTBEAT_S = 0.5
STALE_S = 5.0  # a replica not heard from for this long is skipped and deregistered
ROUTE_HEADER = "x-docqa-route"  # "local": serve on this replica, never forward
FORWARDED_FROM_HEADER = "x-docqa-forwarded-from"
REPLICA_HEADER = "x-docqa-replica"  # on every /v1 response: the replica that served it
LOAD_MARGIN = 2  # forward for load only when a peer has this many fewer requests queued
_PASSED_HEADERS = ("authorization", "content-type", "accept")
_RETURNED_HEADERS = ("x-request-id", REPLICA_HEADER, "retry-after", "cache-control")


@dataclass(frozen=True)
class Peer:
    id: str
    url: str
    load: int
    seen: float


@dataclass(frozen=True)
class Forwarded:
    """A peer's answer to a forwarded request, its body streamed through as it comes."""

    status: int
    media_type: str
    headers: dict[str, str]
    body: AsyncIterator[bytes]


def leading_run(flags) -> int:
    n = 0
    for f in flags:
        if not f:
            break
        n += 1
    return n


class ReplicaRegistry:
    def __init__(self, redis_url: str, prefix: str, url: str, runner, routing: bool = True):
        self.id = f"rep-{uuid.uuid4().hex[:12]}"
        self.url = url.rstrip("/")
        self.runner = runner
        self.routing = routing
        self._replicas_key = f"{prefix}replicas"
        self._prefix = prefix
        self.redis = aioredis.from_url(redis_url, socket_timeout=1.0, socket_connect_timeout=0.5)
        self.http = httpx.AsyncClient(
            timeout=httpx.Timeout(connect=1.0, read=None, write=30.0, pool=5.0)
        )
        self.up = False
        self.started = time.time()
        self.num_forwarded = 0
        self.num_deregistered = 0
        self._task: asyncio.Task | None = None
        self._resync = True
        self._stopping = False

    def blocks_key(self, replica_id: str) -> str:
        return f"{self._prefix}replica:{replica_id}:blocks"

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        with contextlib.suppress(aioredis.RedisError, OSError):
            await self.deregister(self.id)
        await self.redis.aclose()
        await self.http.aclose()

    async def _run(self) -> None:
        while not self._stopping:
            try:
                if self.runner.ready:
                    await self._publish_blocks()
                await self._heartbeat()
                if not self.up:
                    log.info("replica %s registered at %s", self.id, self.url)
                self.up = True
            except (aioredis.RedisError, OSError) as e:
                if self.up:
                    log.warning("replica registry unreachable (serving locally): %s", e)
                self.up = False
                self._resync = True
            except Exception:
                log.exception("replica registry update failed")
            await asyncio.sleep(HEARTBEAT_S)

    def load(self) -> int:
        c = self.runner.counters()
        return int(c.get("num_requests_running", 0) + c.get("num_requests_waiting", 0))

    async def _heartbeat(self) -> None:
        info = {"url": self.url, "load": self.load(), "seen": time.time(), "started": self.started}
        pipe = self.redis.pipeline(transaction=False)
        pipe.hset(self._replicas_key, self.id, json.dumps(info))
        pipe.expire(self.blocks_key(self.id), int(STALE_S * 4))
        await pipe.execute()

    async def _publish_blocks(self) -> None:
        engine = self.runner.engine
        pool = engine.kv_manager.pool
        key = self.blocks_key(self.id)
        if self._resync or pool.index_events is None:
            held = await self.runner.call(lambda e: e.kv_manager.pool.watch_index())
            pipe = self.redis.pipeline(transaction=False)
            pipe.delete(key)
            for i in range(0, len(held), 1000):
                pipe.sadd(key, *held[i : i + 1000])
            await pipe.execute()
            self._resync = False
            return
        events = pool.index_events
        state: dict[bytes, bool] = {}
        for _ in range(min(len(events), 100_000)):
            added, h = events.popleft()
            state[h] = added
        if not state:
            return
        add = [h for h, a in state.items() if a]
        rem = [h for h, a in state.items() if not a]
        pipe = self.redis.pipeline(transaction=False)
        if add:
            pipe.sadd(key, *add)
        if rem:
            pipe.srem(key, *rem)
        try:
            await pipe.execute()
        except (aioredis.RedisError, OSError):
            self._resync = True
            raise

    async def deregister(self, replica_id: str) -> None:
        pipe = self.redis.pipeline(transaction=False)
        pipe.hdel(self._replicas_key, replica_id)
        pipe.delete(self.blocks_key(replica_id))
        await pipe.execute()

    # -- routing ------------------------------------------------------------------------------
    async def peers(self) -> list[Peer]:
        """Live replicas other than this one; stale ones are deregistered on the way."""
        raw = await self.redis.hgetall(self._replicas_key)
        now = time.time()
        out = []
        for rid, blob in raw.items():
            rid = rid.decode()
            if rid == self.id:
                continue
            try:
                info = json.loads(blob)
            except ValueError:
                continue
            if now - float(info.get("seen", 0)) > STALE_S:
                log.warning("replica %s has not been heard from; deregistering it", rid)
                self.num_deregistered += 1
                await self.deregister(rid)
                continue
            out.append(Peer(rid, info["url"], int(info.get("load", 0)), float(info["seen"])))
        return out

    async def route(self, block_hashes: list[bytes]) -> Peer | None:
        """The replica that should serve a prompt with these block hashes; None for this one."""
        if not (self.routing and self.up and self.runner.ready):
            return None
        try:
            peers = await self.peers()
            if not peers:
                return None
            pool = self.runner.engine.kv_manager.pool
            local = leading_run(pool.lookup(h) is not None for h in block_hashes)
            hits = [0] * len(peers)
            if block_hashes:
                pipe = self.redis.pipeline(transaction=False)
                for p in peers:
                    pipe.smismember(self.blocks_key(p.id), block_hashes)
                hits = [leading_run(r) for r in await pipe.execute()]
        except (aioredis.RedisError, OSError) as e:
            log.warning("routing skipped (registry unreachable): %s", e)
            return None
        best = max(range(len(peers)), key=lambda i: (hits[i], -peers[i].load))
        if hits[best] > local:
            return peers[best]
        if hits[best] == 0 and local == 0:
            idle = min(peers, key=lambda p: p.load)
            if idle.load + LOAD_MARGIN <= self.load():
                return idle
        return None

    async def forward(
        self,
        peer: Peer,
        method: str,
        path: str,
        body: bytes,
        headers: Mapping[str, str],
    ) -> Forwarded | None:
        """Send a request (``path`` with its query) to ``peer`` and stream its answer back;
        None (after deregistering the peer) when it does not answer, so the caller serves the
        request itself."""
        passed = {k: v for k, v in headers.items() if k.lower() in _PASSED_HEADERS}
        passed[ROUTE_HEADER] = "local"
        passed[FORWARDED_FROM_HEADER] = self.id
        url = peer.url + path
        try:
            upstream = await self.http.send(
                self.http.build_request(method, url, content=body, headers=passed),
                stream=True,
            )
        except httpx.TransportError as e:
            log.warning("replica %s at %s did not answer (%s); deregistering it", peer.id, url, e)
            self.num_deregistered += 1
            with contextlib.suppress(aioredis.RedisError, OSError):
                await self.deregister(peer.id)
            return None
        self.num_forwarded += 1

        async def relay():
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            finally:
                await upstream.aclose()

        out = {k: upstream.headers[k] for k in _RETURNED_HEADERS if k in upstream.headers}
        out.setdefault(REPLICA_HEADER, peer.id)
        return Forwarded(
            upstream.status_code,
            upstream.headers.get("content-type", "application/json"),
            out,
            relay(),
        )

    async def forward_cancel(self, request_id: str, headers: Mapping[str, str]) -> dict | None:
        """Cancel a request that runs on another replica (it was forwarded there)."""
        if not self.up:
            return None
        try:
            peers = await self.peers()
        except (aioredis.RedisError, OSError):
            return None
        headers = {k: v for k, v in headers.items() if k.lower() == "authorization"}
        headers[ROUTE_HEADER] = "local"
        for p in peers:
            try:
                r = await self.http.post(
                    f"{p.url}/v1/requests/{request_id}/cancel", headers=headers, timeout=30.0
                )
            except httpx.TransportError:
                continue
            if r.status_code == 200:
                return r.json()
        return None

    def is_local_only(self, headers: Mapping[str, str]) -> bool:
        """Whether the request must be served here: forwarded already, or asked to stay."""
        return headers.get(ROUTE_HEADER, "").lower() == "local" or FORWARDED_FROM_HEADER in headers
