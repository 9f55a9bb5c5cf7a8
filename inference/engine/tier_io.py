"""The engine's side of the second tier (Redis): lookups before admission, loads into the
pool, and write-through of newly indexed blocks.

A request whose prompt reaches past the pool's longest cached prefix asks the tier for the
blocks that follow (``start_lookup``); it is held back from admission until the answer is in,
or ``TierConfig.lookup_wait_s`` has passed. Where the chain stops short, the lookup claims its
first missing block for this process (``RedisTier.lookup``): the request computes it and the
claim is released once its prompt is computed. Where another replica holds the claim, the
request waits, polling, until the claim is gone (its blocks written) or
``TierConfig.claim_wait_s`` has passed (the holder's process renews its claims until it
releases them, so a claim outlives ``claim_ttl_s`` only while its holder is alive), and loads
what the other replica wrote: replicas never compute one prefix twice at once. The lookup after
a wait may find another claim, further on (another replica claimed the rest of the prompt
meanwhile): it waits on that one too, never on one claim twice. Found blocks are
copied into fresh blocks of the pool under a hold (``prefix_store.Hold``) that also keeps the
local prefix from eviction, then indexed like computed blocks, so admission finds them as a
cached prefix. Newly indexed blocks are read out of the pool on the engine thread (before they
can be reused) and written on the tier's own thread. Redis I/O never runs on the step path.
"""

from __future__ import annotations

import concurrent.futures
import time
from dataclasses import dataclass

from inference.engine.sequence import Request
from prefix_store import KVCacheManager, NoFreeBlocksError, RedisTier, TierBlock


@dataclass(slots=True)
class TierLookup:
    """A request's lookup in flight."""

    # -> (blocks found in order, the block hash claimed for this process or None, the block
    # hash another process claims or None); or, while waiting on a claim, -> bool (still held)
    fetch: concurrent.futures.Future
    start_block: int  # the prompt's first block asked for (the local prefix's length)
    deadline: float  # perf_counter time after which the request computes what it lacks
    claim: bytes | None = None  # the block another process claims, while waiting on it
    poll_at: float = 0.0  # when to ask again whether the claim is held
    # the claims this request has waited on: a lookup after a wait waits again only on
    # another (a replica claimed the rest of the prompt meanwhile), at most MAX_CLAIM_WAITS
    waited_on: tuple[bytes, ...] = ()


RELOOK_MIN_BLOCKS = 4  # a question's own blocks are not worth a second lookup
MAX_CLAIM_WAITS = 3  # claims one request waits on, one after the other
LOADED_KEPT = 65_536  # blocks loaded lately remembered at most (TierIO._loaded)


class TierIO:
    def __init__(self, tier: RedisTier, kv: KVCacheManager, runner):
        self.tier = tier
        self.kv = kv
        self.runner = runner  # reads and writes blocks' K/V (``ModelRunner.read_blocks``)
        self._pending: list[Request] = []  # requests whose lookup is in flight
        # blocks loaded from the tier lately (hash -> perf_counter time): another replica may
        # still be computing the prefix they start, under a claim on one of them
        self._loaded: dict[bytes, float] = {}

    @property
    def up(self) -> bool:
        return self.tier.up

    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    def start_lookup(self, req: Request) -> None:
        """Ask the tier for the prompt's blocks past the local pool's longest prefix; the
        request is admitted once the answer is in (``install_ready``)."""
        req.tier_lookup = self._lookup(req)
        if req.tier_lookup is not None:
            self._pending.append(req)

    def _lookup(self, req: Request, waited_on: tuple[bytes, ...] = ()) -> TierLookup | None:
        """The lookup of the prompt's blocks past the local prefix, None where the pool holds
        them all. ``waited_on``: the claims the request waited on before this lookup (none
        is waited on twice)."""
        kv = self.kv
        hashes = req.prompt_hashes(kv.hasher(req.namespace))
        max_blocks = (req.num_prompt_tokens - 1) // kv.block_size
        k = len(kv.find_cached_prefix(req.prompt_token_ids, req.namespace, hashes).blocks)
        if k >= max_blocks:
            return None
        parent = hashes[k - 1] if k else kv.hasher(req.namespace).root
        return TierLookup(
            self.tier.lookup(
                hashes[k:max_blocks], parent, self._loaded_of(hashes[:k]), req.tier_claim
            ),
            k,
            time.perf_counter() + self.tier.config.lookup_wait_s,
            waited_on=waited_on,
        )

    def _loaded_of(self, hashes: list[bytes]) -> list[bytes]:
        """Those of a request's local blocks that were loaded from the tier within the longest
        wait on a claim: where another replica's claim on the prefix may sit, which a lookup
        starting after them asks about as well (only they: most local blocks were computed
        here or loaded long ago, and asking about hundreds costs milliseconds)."""
        if not self._loaded:
            return []
        horizon = time.perf_counter() - self.tier.config.claim_wait_s
        return [h for h in hashes if self._loaded.get(h, 0.0) > horizon]

    def _note_loaded(self, block_hashes: list[bytes]) -> None:
        now = time.perf_counter()
        horizon = now - self.tier.config.claim_wait_s
        if len(self._loaded) > LOADED_KEPT or next(iter(self._loaded.values()), now) < horizon:
            kept = [(h, t) for h, t in self._loaded.items() if t > horizon]
            self._loaded = dict(kept[-LOADED_KEPT // 2 :])
        for h in block_hashes:
            self._loaded.pop(h, None)  # kept in the order loaded: the oldest first
            self._loaded[h] = now

    def install_ready(self) -> None:
        """Install the blocks that finished lookups found, release the requests whose lookup
        finished or ran out of time; poll the claims waited on."""
        now = time.perf_counter()
        still: list[Request] = []
        for req in self._pending:
            lookup = req.tier_lookup
            if req.finished:  # aborted while its lookup ran
                req.tier_lookup = None
            elif lookup.claim is not None:  # another replica is computing the prefix
                if self._still_claimed(lookup, now):
                    still.append(req)
                else:  # released (its blocks written), or waited long enough: look again
                    self._look_again(req, lookup.waited_on + (lookup.claim,), still)
            elif not lookup.fetch.done():
                if now > lookup.deadline:  # a slow Redis: compute instead of waiting
                    req.tier_lookup = None
                    self.tier.lookups_abandoned += 1
                else:
                    still.append(req)
            else:
                found, claimed, busy = lookup.fetch.result()
                req.tier_lookup = None
                req.tier_answered_at = now
                if claimed is not None:
                    if req.tier_claim is not None and req.tier_claim != claimed:
                        self.tier.release(req.tier_claim)  # a lookup again claimed further on
                    req.tier_claim = claimed
                if found and not self._install(req, lookup.start_block, found):
                    # the pool evicted part of the local prefix while the lookup ran, so the
                    # blocks found start past what is left of it: look again from there
                    self.tier.relooks_evicted += 1
                    self._look_again(req, lookup.waited_on, still)
                elif (  # a lookup that claims a block finds no other's claim (busy is None)
                    busy is not None
                    and busy not in lookup.waited_on
                    and len(lookup.waited_on) < MAX_CLAIM_WAITS
                ):
                    j = lookup.start_block + len(found)
                    deadline = now + self.tier.config.claim_wait_s
                    held = self.tier.claim_held(busy)
                    req.tier_lookup = TierLookup(
                        held, j, deadline, busy, now + 0.1, waited_on=lookup.waited_on
                    )
                    self.tier.claim_waits += 1
                    still.append(req)
        self._pending = still

    def _look_again(self, req: Request, waited_on: tuple[bytes, ...], still: list) -> None:
        """A new lookup for ``req`` (kept pending in ``still`` unless the pool holds its
        prompt)."""
        req.tier_lookup = self._lookup(req, waited_on)
        if req.tier_lookup is not None:
            still.append(req)

    def relook(self, req: Request, uncached_blocks: int) -> bool:
        """Before a request computes ``uncached_blocks`` full blocks of its prompt, on the word
        of a lookup that answered more than ``TierConfig.relook_after_s`` ago (it waited for
        admission since): look once more, as another replica may have written them since, or
        this one computed and then evicted them. A claim it holds stays held (the new lookup
        finds it its own) unless the new lookup claims a later block. True while the new
        lookup runs (the request waits for it)."""
        answered = req.tier_answered_at
        if req.tier_relooked or answered is None or uncached_blocks < RELOOK_MIN_BLOCKS:
            return False
        if not self.up or time.perf_counter() - answered < self.tier.config.relook_after_s:
            return False
        req.tier_relooked = True
        self.tier.relooks += 1
        self.start_lookup(req)
        return req.tier_lookup is not None

    def _still_claimed(self, lookup: TierLookup, now: float) -> bool:
        """Whether to keep waiting on another replica's claim: asked every 0.1 s until it is
        released or the wait's deadline passes."""
        if now > lookup.deadline:
            self.tier.claim_waits_expired += 1
            return False
        if not lookup.fetch.done():
            return True
        if not lookup.fetch.result():
            return False
        if now >= lookup.poll_at:
            lookup.fetch = self.tier.claim_held(lookup.claim)
            lookup.poll_at = now + 0.1
        return True

    def release_claim(self, req: Request) -> None:
        """Release the request's claim (its prompt is computed, or it finished): after the
        writes queued so far, so a replica waiting on it finds the blocks."""
        if req.tier_claim is not None:
            self.tier.release(req.tier_claim)
            req.tier_claim = None

    def _install(self, req: Request, start: int, found: list[TierBlock]) -> bool:
        """Copy the blocks a lookup found (from prompt block ``start`` on) into the pool and
        index them; False, installing nothing, where the local prefix no longer reaches
        ``start`` (evicted while the lookup ran)."""
        kv = self.kv
        bs = kv.block_size
        hashes = req.prompt_hashes(kv.hasher(req.namespace))
        local = kv.find_cached_prefix(req.prompt_token_ids, req.namespace, hashes)
        k = len(local.blocks)
        if k < start:  # part of the local prefix was evicted meanwhile
            return False
        todo: list[tuple[int, TierBlock]] = []  # (prompt block, its tier block)
        for i, blk in enumerate(found):
            j = start + i
            if j < k:  # computed locally meanwhile
                continue
            ids = tuple(req.prompt_token_ids[j * bs : (j + 1) * bs])
            if blk.block_hash != hashes[j] or blk.token_ids != ids:
                break
            todo.append((j, blk))
        reclaimed = sum(1 for b in local.blocks if b.ref_cnt == 0)
        todo = todo[: max(0, kv.pool.num_free - reclaimed)]
        if not todo:
            return True
        # the hold keeps the local prefix from eviction while the fresh blocks are taken
        held = kv.hold(local.blocks)
        try:
            fresh = kv.hold_new(held, len(todo))
        except NoFreeBlocksError:
            kv.release(held)
            return True
        self.runner.write_blocks([b.block_id for b in fresh], [blk.payload for _, blk in todo])
        for block, (j, blk) in zip(fresh, todo, strict=True):
            parent = hashes[j - 1] if j else kv.hasher(req.namespace).root
            if kv.index_block(block, blk.block_hash, parent, blk.token_ids):
                req.tier_loaded.add(blk.block_hash)
        self._note_loaded([blk.block_hash for _, blk in todo])
        kv.release(held)
        return True

    def write_through(self, newly: list) -> None:
        """Hand newly indexed blocks (block, hash, parent hash, token ids) to the tier: their
        K/V is read here, on the engine thread, before the blocks can be reused."""
        rows = self.runner.read_blocks([b.block_id for b, *_ in newly])
        self.tier.write(
            [
                TierBlock(h, parent, ids, row)
                for row, (_, h, parent, ids) in zip(rows, newly, strict=True)
            ]
        )

    def write_prefix(self, token_ids: list[int], namespace: bytes = b"") -> int:
        """Write the locally cached full blocks of ``token_ids`` to the tier (again); returns
        the blocks queued. The caller waits on ``tier.flush()``."""
        cached = self.kv.find_cached_prefix(list(token_ids) + [0], namespace)
        if not cached.blocks:
            return 0
        self.write_through([(b, b.block_hash, b.parent_hash, b.token_ids) for b in cached.blocks])
        return len(cached.blocks)

    def wait(self, timeout: float) -> None:
        """Nothing could be scheduled: wait (briefly) for a lookup to finish instead of
        spinning."""
        pending = [r.tier_lookup.fetch for r in self._pending if r.tier_lookup is not None]
        if pending:
            concurrent.futures.wait(
                pending, timeout=timeout, return_when=concurrent.futures.FIRST_COMPLETED
            )

    def close(self) -> None:
        """Stop the tier's threads (queued writes are flushed first)."""
        self.tier.close()
