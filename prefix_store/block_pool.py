"""Ref-counted KV blocks, an O(1) LRU free queue, the hash index and the copy sources.

Free queue order (head = evicted first):

    head -> [least recently freed ... most recently freed] <- tail

A request frees its blocks tail first (last block of its chain first), so within one chain the
tail is evicted before the blocks the rest of the chain depends on. Eviction is lazy: a freed
block keeps its hash and stays in the index until it is handed out again.

Copy sources: a prompt whose walk of full blocks stops inside block i may still share its first
tokens with a block that follows the same parent (the rest of a manual past its last full block,
the template tokens that open every question). ``children[parent]`` lists such blocks: indexed
full blocks, and the written first tokens of a finished request's last, partial block (a
partial tail). Their slots are only ever copied into a fresh block, never shared, so a block
shared by reference is always a full, indexed one. A partial tail is dropped when its block is
handed out again, like a hash.

    parent h(i-1) --+-- block 7  [a b c d e f g h]   (indexed, full)
                    +-- block 12 [a b c x y]         (partial tail: 5 written slots)
    prompt block i:             [a b c d z ...]   -> copy 4 slots of block 7, compute from z

Invariants (``check_integrity``):
- every block is either in the free queue (ref_cnt == 0) or referenced (ref_cnt > 0), never both;
- free + in use == total;
- every indexed hash maps to a block that holds that hash;
- every copy source holds its parent hash and the token ids of its written slots.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass(slots=True, eq=False)
class Block:
    block_id: int  # index into the per-layer KV tensors
    ref_cnt: int = 0  # requests currently using this block
    block_hash: bytes | None = None  # set once the block is full, its KV written and indexed
    # hash of the previous block in the chain (root for block 0); set for indexed blocks and
    # for partial tails
    parent_hash: bytes | None = None
    # ids of the written slots: all of them for a hashed block (checked on every hit), fewer
    # than block_size for a partial tail
    token_ids: tuple[int, ...] = ()
    # free-queue links; None when not in the queue
    prev_free: Block | None = field(default=None, repr=False)
    next_free: Block | None = field(default=None, repr=False)
    in_free_queue: bool = False


class FreeBlockQueue:
    """Doubly linked list of free blocks: O(1) append, pop from the head, remove anywhere."""

    def __init__(self, blocks: list[Block]):
        self.head: Block | None = None
        self.tail: Block | None = None
        self.num_free = 0
        for b in blocks:
            self.append(b)

    def append(self, block: Block) -> None:
        assert not block.in_free_queue
        block.prev_free, block.next_free = self.tail, None
        if self.tail is None:
            self.head = block
        else:
            self.tail.next_free = block
        self.tail = block
        block.in_free_queue = True
        self.num_free += 1

    def remove(self, block: Block) -> None:
        assert block.in_free_queue
        if block.prev_free is None:
            self.head = block.next_free
        else:
            block.prev_free.next_free = block.next_free
        if block.next_free is None:
            self.tail = block.prev_free
        else:
            block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        block.in_free_queue = False
        self.num_free -= 1

    def popleft(self) -> Block:
        if self.head is None:
            raise IndexError("no free blocks")
        block = self.head
        self.remove(block)
        return block

    def __iter__(self):
        b = self.head
        while b is not None:
            yield b
            b = b.next_free


MAX_CHILDREN = 16  # copy sources kept per parent hash: siblings share their common start alike


def common_prefix_len(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    i = 0
    while a[i] == b[i]:
        i += 1
    return i


class BlockPool:
    """All KV blocks of one engine. Block ids index the per-layer KV tensors."""

    def __init__(self, num_blocks: int):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.hash_index: dict[bytes, Block] = {}
        # parent hash -> {block id: block}, oldest first: the blocks whose first slots may be
        # copied into a prompt's block that follows that parent (at most MAX_CHILDREN each)
        self.children: dict[bytes, dict[int, Block]] = {}
        self.num_evictions = 0
        self._num_cached_free = 0  # free blocks that still hold a hash
        # (indexed?, hash) for every index change, once ``watch_index`` is called: read by
        # another thread (the replica registry) that publishes which hashes this pool holds
        self.index_events: deque[tuple[bool, bytes]] | None = None

    def watch_index(self) -> list[bytes]:
        """Start (or restart) recording index changes in ``index_events``; returns the hashes
        indexed now, the state the recorded changes apply to. Call it on the thread that owns
        the pool."""
        if self.index_events is None:
            self.index_events = deque()
        self.index_events.clear()
        return list(self.hash_index)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return self.free_queue.num_free

    @property
    def num_cached_free(self) -> int:
        """Free blocks that still hold a hash (reusable until evicted); kept as a counter so
        readers on other threads never walk the queue."""
        return self._num_cached_free

    def lookup(self, block_hash: bytes) -> Block | None:
        return self.hash_index.get(block_hash)

    def allocate(self, n: int) -> list[Block]:
        """Take ``n`` blocks from the head of the free queue (evicting their hashes).

        Raises IndexError, allocating nothing, when fewer than ``n`` are free.
        """
        if n > self.num_free:
            raise IndexError(f"need {n} free blocks, have {self.num_free}")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: list[Block]) -> None:
        """Take a reference on cached blocks (a prefix hit); free ones leave the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
                if block.block_hash is not None:
                    self._num_cached_free -= 1
            block.ref_cnt += 1

    def free(self, blocks: list[Block]) -> None:
        """Drop one reference on each block, in the given order (pass tail first)."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"block {block.block_id} freed more often than taken")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)
                if block.block_hash is not None:
                    self._num_cached_free += 1

    def register(
        self, block: Block, block_hash: bytes, parent_hash: bytes, token_ids: tuple[int, ...]
    ) -> bool:
        """Index a full block whose KV has been written.

        Returns False (and leaves the block unhashed) when another block already holds this
        hash: the index keeps one copy and this block is freed normally later.
        """
        if block.block_hash is not None:
            return block.block_hash == block_hash
        if block_hash in self.hash_index:
            return False
        block.block_hash = block_hash
        block.parent_hash = parent_hash
        block.token_ids = token_ids
        self.hash_index[block_hash] = block
        self._add_child(block)
        if block.ref_cnt == 0:
            self._num_cached_free += 1
        if self.index_events is not None:
            self.index_events.append((True, block_hash))
        return True

    def set_partial_tail(
        self, block: Block, parent_hash: bytes, token_ids: tuple[int, ...]
    ) -> None:
        """Offer the written first slots of a request's last, not full block (about to be freed
        by its only holder) as a copy source after ``parent_hash``."""
        if block.block_hash is not None or block.ref_cnt != 1 or not token_ids:
            return
        # the block came from ``allocate``, which dropped any earlier tail or hash it held
        block.parent_hash = parent_hash
        block.token_ids = token_ids
        self._add_child(block)

    def best_copy_source(
        self, parent_hash: bytes, token_ids: tuple[int, ...]
    ) -> tuple[Block | None, int]:
        """The copy source after ``parent_hash`` whose written ids share the longest start with
        ``token_ids``, and that length (0 and None when none shares any). Changes nothing."""
        best, best_n = None, 0
        for block in self.children.get(parent_hash, {}).values():
            n = common_prefix_len(block.token_ids, token_ids)
            if n > best_n:
                best, best_n = block, n
        return best, best_n

    def _add_child(self, block: Block) -> None:
        siblings = self.children.setdefault(block.parent_hash, {})
        siblings.pop(block.block_id, None)
        siblings[block.block_id] = block  # newest last
        if len(siblings) > MAX_CHILDREN:
            del siblings[next(iter(siblings))]

    def _drop_child(self, block: Block) -> None:
        siblings = self.children.get(block.parent_hash)
        if siblings is not None and siblings.pop(block.block_id, None) is not None and not siblings:
            del self.children[block.parent_hash]

    def _evict(self, block: Block) -> None:
        """Drop a free block's hash or partial tail (it is being reused, or the cache is
        reset)."""
        if block.parent_hash is not None:
            self._drop_child(block)
        if block.block_hash is not None:
            self._num_cached_free -= 1
            if self.hash_index.get(block.block_hash) is block:
                del self.hash_index[block.block_hash]
                if self.index_events is not None:
                    self.index_events.append((False, block.block_hash))
            block.block_hash = None
            self.num_evictions += 1
        block.parent_hash = None
        block.token_ids = ()

    def reset_cache(self) -> int:
        """Drop the hashes and partial tails of all free blocks; returns how many hashes were
        dropped."""
        n = 0
        for block in self.free_queue:
            if block.block_hash is not None:
                n += 1
            if block.parent_hash is not None:
                self._evict(block)
        return n

    def check_integrity(self) -> None:
        """Raise AssertionError if any pool invariant is broken."""
        in_queue = list(self.free_queue)
        assert len(in_queue) == self.num_free, "free count disagrees with the queue"
        assert len({b.block_id for b in in_queue}) == len(in_queue), "block twice in free queue"
        used = [b for b in self.blocks if b.ref_cnt > 0]
        assert all(b.ref_cnt >= 0 for b in self.blocks), "negative ref count"
        assert len(in_queue) + len(used) == self.num_blocks, "free + in use != total"
        for b in in_queue:
            assert b.ref_cnt == 0 and b.in_free_queue, f"free block {b.block_id} referenced"
        for b in used:
            assert not b.in_free_queue, f"referenced block {b.block_id} in free queue"
        for h, b in self.hash_index.items():
            assert b.block_hash == h, f"index entry points at block {b.block_id} without it"
        hashed = [b for b in self.blocks if b.block_hash is not None]
        assert len(hashed) == len(self.hash_index), "hashed block missing from the index"
        cached_free = sum(1 for b in in_queue if b.block_hash is not None)
        assert cached_free == self._num_cached_free, "cached-free counter disagrees"
        for parent, siblings in self.children.items():
            assert 0 < len(siblings) <= MAX_CHILDREN, "empty or oversized copy-source list"
            for block_id, b in siblings.items():
                assert b.block_id == block_id and b.parent_hash == parent, (
                    f"copy source {block_id} does not follow its parent"
                )
                assert b.token_ids, f"copy source {block_id} holds no token ids"
                assert b.block_hash is None or self.hash_index.get(b.block_hash) is b, (
                    f"copy source {block_id} holds an unindexed hash"
                )
