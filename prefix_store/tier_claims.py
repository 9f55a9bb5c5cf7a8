"""Claims on a prefix being computed, the Redis tier's part in computing each prefix once
across replicas.

Replicas do not compute the same prefix at once: a lookup that finds the chain missing from
some block on claims that block (``{prefix}claim:{hash}``, SET NX with a TTL) before that
request computes it; a thread of the process renews its claims every third of the TTL until
they are released (not the engine's steps: a step of long prefills on a busy machine can take
longer than the TTL, and a claim that lapsed under a live holder let another replica compute
the same prefix again); another replica's lookup that finds the claim taken, on that block or
on one the holder has written already (which that replica may hold in its pool by now, loaded
from what the holder wrote so far), waits, polling, until the holder releases it (after its
request's prompt is computed and its blocks are written through) or it lapses, then loads what
the holder wrote (``TierIO``). Claims of this process's own requests are left to the engine's
scheduler, which never prefills a shared prefix twice; but a lookup whose first missing block
another request of this process claims (whose prompt may part from this one's after it) claims
the first block past it that nobody claims, so the rest of its prompt is claimed too and
another replica waits on it rather than computing it beside this one.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Sequence

OWN_CLAIM_SCAN = 16  # blocks past this process's own claim a lookup looks at for one to claim


class TierClaims:
    """The claim operations of ``RedisTier`` (a part of it: they use its client, its loader
    thread, its owner id, its lock, its write queue, its held claims and its ``_fetch``)."""

    def lookup(
        self,
        block_hashes: Sequence[bytes],
        parent: bytes,
        before: Sequence[bytes] = (),
        mine: bytes | None = None,
    ) -> concurrent.futures.Future:
        """``fetch``, then, where the chain stops short, a claim on its first missing block:
        the future resolves to (the blocks found, the block hash this process now claims or
        None, the block hash another process claims or None). Another process computing this
        chain is seen whether its claim is on the first missing block, on one it has already
        written (it claimed the chain where its own lookup stopped) or on one of ``before``:
        the blocks ahead of these that this process holds already (a lookup that loaded the
        first part of what the other is still computing starts after it). ``mine``: the
        claim the asking request holds already (a lookup asked again): where the chain's
        first missing block is claimed by this process, but not as ``mine``, the lookup claims
        the first block past it that nobody claims, unless it reaches ``mine``. Never
        raises."""
        fut: concurrent.futures.Future
        if not block_hashes or not self._up or self._closing:
            fut = concurrent.futures.Future()
            fut.set_result(([], None, None))
            return fut
        return self._loader.submit(self._lookup, list(block_hashes), parent, list(before), mine)

    def _lookup(
        self, block_hashes: list[bytes], parent: bytes, before: list[bytes], mine: bytes | None
    ):
        found = self._fetch(block_hashes, parent)
        if len(found) == len(block_hashes) or not self._up:
            return found, None, None
        missing = block_hashes[len(found)]
        try:
            held = self._claimed_by_others(before + block_hashes[: len(found)])
            if held is not None:
                return found, None, held
            if self._claim(missing):
                return found, missing, None
            holder = self._client.get(self._claim_key(missing))
            if holder is not None and holder.decode() == self.owner and missing != mine:
                # another request of this process claims that block, and its prompt may part
                # from this one's after it: this one claims the first block past it nobody
                # claims (not again where it holds one: ``mine``)
                after = block_hashes[len(found) + 1 : len(found) + 1 + OWN_CLAIM_SCAN]
                claimed, busy = self._claim_after_own(after, mine)
                return found, claimed, busy
        except self._redis_errors:
            return found, None, None  # no claims without Redis: compute
        busy = holder is not None and holder.decode() != self.owner
        return found, None, missing if busy else None

    def _claim_key(self, block_hash: bytes) -> bytes:
        return self._claim_prefix + block_hash.hex().encode()

    def _claim(self, block_hash: bytes) -> bool:
        """Claim ``block_hash`` for this process unless someone holds it (SET NX, the TTL)."""
        ttl_ms = int(self.config.claim_ttl_s * 1000)
        if not self._client.set(self._claim_key(block_hash), self.owner, nx=True, px=ttl_ms):
            return False
        with self._lock:
            self._held_claims.add(block_hash)
        return True

    def _holders(self, block_hashes: list[bytes]) -> list:
        """Each block's claim holder (bytes), None where unclaimed, or the error (one
        pipeline)."""
        pipe = self._client.pipeline(transaction=False)
        for h in block_hashes:
            pipe.get(self._claim_key(h))
        return pipe.execute(raise_on_error=False)

    def _claim_after_own(
        self, block_hashes: list[bytes], mine: bytes | None
    ) -> tuple[bytes | None, bytes | None]:
        """Claim the first of these blocks nobody claims, passing those this process claims:
        (the block claimed, None), or (None, the block another process claims first), or
        (None, None) where this process claims them all or the request's own claim ``mine``
        comes first."""
        for h, holder in zip(block_hashes, self._holders(block_hashes), strict=True):
            if h == mine:
                return None, None
            if isinstance(holder, bytes) and holder.decode() == self.owner:
                continue
            if holder is not None:  # another process's (or an error: leave it)
                return None, h if isinstance(holder, bytes) else None
            if self._claim(h):
                return h, None
            return None, h  # taken since: by another process, or this one (then none waits)
        return None, None

    def _claimed_by_others(self, block_hashes: list[bytes]) -> bytes | None:
        """The last of these blocks another process claims, or None."""
        if not block_hashes:
            return None
        holders = self._holders(block_hashes)
        for h, holder in zip(reversed(block_hashes), reversed(holders), strict=True):
            if isinstance(holder, bytes) and holder.decode() != self.owner:
                return h
        return None

    def claim_held(self, block_hash: bytes) -> concurrent.futures.Future:
        """Whether another process still claims ``block_hash`` (False when Redis fails)."""

        def held() -> bool:
            try:
                holder = self._client.get(self._claim_key(block_hash))
            except self._redis_errors:
                return False
            return holder is not None and holder.decode() != self.owner

        return self._loader.submit(held)

    def release(self, block_hash: bytes) -> None:
        """Release this process's claim on ``block_hash`` once the writes queued before are in
        Redis (so a process waiting on it finds the blocks). It is no longer renewed from now:
        a release the write queue drops (Redis failing) leaves the claim to lapse, never to be
        renewed for good."""
        with self._lock:
            self._held_claims.discard(block_hash)
            if self._up:
                self._queue.append((block_hash, None))
                self._lock.notify()

    _RENEW = (
        "if redis.call('get', KEYS[1]) == ARGV[1] then "
        "return redis.call('pexpire', KEYS[1], ARGV[2]) end return 0"
    )

    def renew(self, block_hashes: Sequence[bytes]) -> None:
        """Renew this process's claims on ``block_hashes`` for ``claim_ttl_s`` more (a
        failure only lets a claim lapse)."""
        if not block_hashes or not self._up or self._closing:
            return
        ttl_ms = int(self.config.claim_ttl_s * 1000)
        for h in block_hashes:
            key = self._claim_key(h)
            try:
                self._client.eval(self._RENEW, 1, key, self.owner, ttl_ms)
            except self._redis_errors:
                return

    def _renew_loop(self) -> None:
        """Renew the claims this process holds, every third of their TTL, until it closes."""
        while not self._stop.wait(self.config.claim_ttl_s / 3):
            with self._lock:
                held = list(self._held_claims)
            self.renew(held)

    @property
    def held_claims(self) -> int:
        with self._lock:
            return len(self._held_claims)

    _RELEASE = (
        "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end "
        "return 0"
    )

    def _release_claim(self, block_hash: bytes) -> None:
        self._client.eval(self._RELEASE, 1, self._claim_key(block_hash), self.owner)
