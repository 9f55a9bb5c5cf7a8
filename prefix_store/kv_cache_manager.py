"""The KV cache manager the scheduler calls: longest cached prefix, allocate, register, free.

Token ranges of one request (block_size 4 shown):

    | cached (hit) | computed this request |  new this step  | (not yet) |
    0          num_cached            num_computed      num_computed + n

Rules (the hashing bytes are in prefix_store/hashing.py):
- a hit is accepted only if the stored block's token ids and parent hash equal ours, walking
  from the first block, so the whole prefix is verified;
- a block is registered only after its KV has been written (``register_computed``);
- duplicates (bypassed or concurrent prefills of the same prefix) are tolerated: the index keeps
  one, the other block is freed normally;
- when every prompt token would hit, the last block is left out of the hit and recomputed into
  a fresh block, so the first output token's logits exist;
- past the last full block that hits, the prompt's next block may start with tokens that a
  cached block after the same parent holds (``BlockPool.children``): with ``partial=True``
  those slots are copied into the request's fresh block at allocation (``copy_slots``) and
  count as cached. At least the last prompt token is always computed.

    | full blocks hit | copied | computed ... |
    0              k * bs   k * bs + m

Holds: a reference on blocks that belongs to no request (a pinned prefix, the blocks a
second-tier load fills) is a ``Hold``, kept in a table of its own: the pool counts it like a
request's reference, and no request id can name one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from prefix_store.block_pool import Block, BlockPool
from prefix_store.hashing import BlockHasher, hash_block


class NoFreeBlocksError(RuntimeError):
    """Not enough free KV blocks for an allocation; nothing was allocated."""


class CachedPrefix(NamedTuple):
    blocks: list[Block]  # hit blocks, in chain order; not yet referenced by the request
    num_cached_tokens: int  # len(blocks) * block_size + num_copied_tokens
    block_hashes: list[bytes]  # hashes of the hit blocks
    # a block after the last hit whose first num_copied_tokens slots hold the prompt's next
    # tokens: copied into the request's next (fresh) block at allocation
    copy_source: Block | None = None
    num_copied_tokens: int = 0

    def full_blocks_only(self) -> CachedPrefix:
        """The same prefix without the copied slots."""
        return CachedPrefix(
            self.blocks, self.num_cached_tokens - self.num_copied_tokens, self.block_hashes
        )


@dataclass(slots=True, eq=False)
class Hold:
    """Counted references on blocks outside any request (SGLang's ``lock_ref``): while held,
    the blocks stay out of the free queue, so nothing evicts or reuses them."""

    blocks: list[Block] = field(default_factory=list)  # in chain order; released tail first


@dataclass(slots=True)
class _RequestBlocks:
    hasher: BlockHasher  # carries the namespace's root hash
    use_cache: bool  # False for cache: "bypass" (no lookup, no registration)
    blocks: list[Block] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # hashes of full blocks so far


class KVCacheManager:
    """Maps requests to KV blocks of one ``BlockPool``.

    Mutates the pool only through ``allocate``, ``register_computed`` and ``free`` (requests)
    and ``hold``, ``hold_new``, ``index_block`` and ``release`` (holds); lookups
    (``find_cached_prefix``) never change anything and are always safe to call.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        model_fingerprint: bytes,
        copy_slots: Callable[[int, int, int], None] | None = None,
    ):
        """``copy_slots(src_block, dst_block, n)`` copies the KV of the first ``n`` slots of
        one block into another, every layer; without it no slots are ever copied."""
        self.block_size = block_size
        self.copy_slots = copy_slots
        self.model_fingerprint = model_fingerprint
        self.pool = BlockPool(num_blocks)
        self._hashers: dict[bytes, BlockHasher] = {}
        self._requests: dict[str, _RequestBlocks] = {}
        self._holds: set[Hold] = set()

    # -- lookups -------------------------------------------------------------------------
    def hasher(self, namespace: bytes = b"") -> BlockHasher:
        h = self._hashers.get(namespace)
        if h is None:
            h = self._hashers[namespace] = BlockHasher(
                self.block_size, self.model_fingerprint, namespace
            )
        return h

    def find_cached_prefix(
        self,
        token_ids: Sequence[int],
        namespace: bytes = b"",
        block_hashes: Sequence[bytes] | None = None,
        partial: bool = False,
    ) -> CachedPrefix:
        """Longest verified cached prefix of ``token_ids``, in full blocks, and with
        ``partial`` (and a ``copy_slots``) the tokens of the next block that a copy source
        holds.

        At most ``len(token_ids) - 1`` tokens are reported: when every token would hit, the
        last one is computed. ``block_hashes``, the chain of ``token_ids``'s full blocks in
        this namespace when the caller already has it, saves hashing them again (hits are
        still verified against token ids and parent hashes; copy sources against their parent
        hash and token ids).
        """
        bs = self.block_size
        max_blocks = (len(token_ids) - 1) // bs
        parent = self.hasher(namespace).root
        blocks: list[Block] = []
        hashes: list[bytes] = []
        for i in range(max_blocks):
            ids = tuple(token_ids[i * bs : (i + 1) * bs])
            if block_hashes is not None and i < len(block_hashes):
                h = block_hashes[i]
            else:
                h = hash_block(parent, ids)
            block = self.pool.lookup(h)
            if block is None or block.token_ids != ids or block.parent_hash != parent:
                break
            blocks.append(block)
            hashes.append(h)
            parent = h
        num_full = len(blocks) * bs
        room = min(bs, len(token_ids) - 1 - num_full)
        if partial and self.copy_slots is not None and room > 0:
            src, n = self.pool.best_copy_source(
                parent, tuple(token_ids[num_full : num_full + room])
            )
            if src is not None:
                return CachedPrefix(blocks, num_full + n, hashes, src, n)
        return CachedPrefix(blocks, num_full, hashes)

    # -- per request -----------------------------------------------------------------------
    def num_blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """New blocks a request needs to hold ``num_tokens`` tokens in all."""
        have = len(self._requests[request_id].blocks) if request_id in self._requests else 0
        return max(0, -(-num_tokens // self.block_size) - have)

    def can_allocate(self, num_blocks: int, cached: CachedPrefix | None = None) -> bool:
        # cached blocks that sit in the free queue stop being free once touched
        reclaimed = sum(1 for b in cached.blocks if b.ref_cnt == 0) if cached else 0
        if cached is not None and cached.copy_source is not None:
            reclaimed += cached.copy_source.ref_cnt == 0  # held while its slots are copied
        return num_blocks <= self.pool.num_free - reclaimed

    def allocate(
        self,
        request_id: str,
        num_tokens: int,
        cached: CachedPrefix | None = None,
        namespace: bytes = b"",
        use_cache: bool = True,
    ) -> list[Block]:
        """Make ``request_id`` hold blocks for ``num_tokens`` tokens in all.

        On the first call ``cached`` (from ``find_cached_prefix``) is taken: its blocks are
        referenced and become the request's first blocks, and its copy source's slots are
        copied into the next one (held meanwhile, so the allocation cannot evict it). Raises
        NoFreeBlocksError, changing nothing, when the pool cannot supply the new blocks.
        Returns the request's blocks.
        """
        state = self._requests.get(request_id)
        source = None
        if state is None:
            state = _RequestBlocks(self.hasher(namespace), use_cache)
            if cached is not None and (cached.blocks or cached.copy_source is not None):
                if not use_cache:
                    raise ValueError("a bypassing request cannot take cached blocks")
                need = -(-num_tokens // self.block_size) - len(cached.blocks)
                if not self.can_allocate(need, cached):
                    raise NoFreeBlocksError(f"need {need} blocks, {self.pool.num_free} free")
                self.pool.touch(cached.blocks)
                state.blocks.extend(cached.blocks)
                state.block_hashes.extend(cached.block_hashes)
                if cached.copy_source is not None and need > 0:
                    source = cached.copy_source
                    self.pool.touch([source])
            self._requests[request_id] = state
        need = -(-num_tokens // self.block_size) - len(state.blocks)
        if need > 0:
            try:
                state.blocks.extend(self.pool.allocate(need))
            except IndexError as e:
                if source is not None:
                    self.pool.free([source])
                if not state.blocks:
                    del self._requests[request_id]
                raise NoFreeBlocksError(str(e)) from None
        if source is not None:
            dst = state.blocks[len(cached.blocks)]
            self.copy_slots(source.block_id, dst.block_id, cached.num_copied_tokens)
            self.pool.free([source])
        return state.blocks

    def register_computed(
        self,
        request_id: str,
        token_ids: Sequence[int],
        num_computed_tokens: int,
        newly: list[tuple[Block, bytes, bytes, tuple[int, ...]]] | None = None,
    ) -> int:
        """Register the request's blocks that became full once ``num_computed_tokens`` tokens'
        KV is written. ``token_ids`` holds at least those tokens. Returns blocks newly indexed;
        each is appended to ``newly`` as (block, hash, parent hash, token ids) when given.
        """
        state = self._requests[request_id]
        if not state.use_cache:
            return 0
        bs = self.block_size
        num_full = num_computed_tokens // bs
        start = len(state.block_hashes)
        if num_full <= start:
            return 0
        parent = state.block_hashes[-1] if state.block_hashes else state.hasher.root
        added = 0
        for i in range(start, num_full):
            ids = tuple(token_ids[i * bs : (i + 1) * bs])
            h = hash_block(parent, ids)
            if self.pool.register(state.blocks[i], h, parent, ids):
                added += 1
                if newly is not None:
                    newly.append((state.blocks[i], h, parent, ids))
            state.block_hashes.append(h)
            parent = h
        return added

    def free(
        self,
        request_id: str,
        token_ids: Sequence[int] | None = None,
        num_computed_tokens: int = 0,
    ) -> None:
        """Release a request's blocks, tail first (its chain's tail is evicted first).

        With ``token_ids`` (holding at least the ``num_computed_tokens`` whose KV is written),
        a last block written only in part is offered as a copy source (a partial tail), so the
        request's next turn, or the next question after a warmed manual, copies those slots
        instead of computing them again."""
        state = self._requests.pop(request_id, None)
        if state is None:
            return
        bs = self.block_size
        i, written = divmod(num_computed_tokens, bs)
        if (
            token_ids is not None
            and state.use_cache
            and written
            and i == len(state.block_hashes)
            and i < len(state.blocks)
        ):
            parent = state.block_hashes[-1] if state.block_hashes else state.hasher.root
            tail = tuple(token_ids[i * bs : num_computed_tokens])
            self.pool.set_partial_tail(state.blocks[i], parent, tail)
        self.pool.free(list(reversed(state.blocks)))

    # -- holds ---------------------------------------------------------------------------------
    def hold(self, blocks: Sequence[Block] = ()) -> Hold:
        """A new hold referencing ``blocks`` (cached blocks leave the free queue until the hold
        is released)."""
        held = Hold(list(blocks))
        self.pool.touch(held.blocks)
        self._holds.add(held)
        return held

    def hold_new(self, held: Hold, num_blocks: int) -> list[Block]:
        """``num_blocks`` fresh blocks (whatever they cached is evicted) added to ``held``;
        raises NoFreeBlocksError, changing nothing, when fewer are free."""
        try:
            blocks = self.pool.allocate(num_blocks)
        except IndexError as e:
            raise NoFreeBlocksError(str(e)) from None
        held.blocks.extend(blocks)
        return blocks

    def index_block(
        self, block: Block, block_hash: bytes, parent_hash: bytes, token_ids: tuple[int, ...]
    ) -> bool:
        """Index a held block whose KV has been written from elsewhere (a second-tier load),
        under a hash the caller verified; False when another block already holds that hash."""
        return self.pool.register(block, block_hash, parent_hash, token_ids)

    def release(self, held: Hold) -> None:
        """Drop a hold's references, tail first (``free``'s order)."""
        self._holds.remove(held)
        self.pool.free(list(reversed(held.blocks)))

    @property
    def num_held_blocks(self) -> int:
        return sum(len(h.blocks) for h in self._holds)

    # -- reporting --------------------------------------------------------------------------
    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._requests[request_id].blocks]

    def holds(self, request_id: str) -> bool:
        return request_id in self._requests

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    def usage(self) -> float:
        """Fraction of blocks referenced by running requests."""
        return 1.0 - self.pool.num_free / self.pool.num_blocks

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        counts: dict[int, int] = {}
        held = [h.blocks for h in self._holds]
        for blocks in [s.blocks for s in self._requests.values()] + held:
            for b in blocks:
                counts[b.block_id] = counts.get(b.block_id, 0) + 1
        for b in self.pool.blocks:
            assert b.ref_cnt == counts.get(b.block_id, 0), (
                f"block {b.block_id}: ref_cnt {b.ref_cnt} but held {counts.get(b.block_id, 0)}x"
            )
