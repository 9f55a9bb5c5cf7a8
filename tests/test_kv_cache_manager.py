import pytest

from prefix_store import KVCacheManager, NoFreeBlocksError, hash_block

FP = b"model"
BS = 4


def _mgr(n=8):
    return KVCacheManager(num_blocks=n, block_size=BS, model_fingerprint=FP)


def _run(mgr, rid, ids, namespace=b"", use_cache=True):
    """Admit a request, 'compute' its whole prompt, register, return its cached prefix."""
    cached = mgr.find_cached_prefix(ids, namespace) if use_cache else None
    mgr.allocate(rid, len(ids), cached, namespace, use_cache)
    mgr.register_computed(rid, ids, len(ids))
    mgr.check_integrity()
    return cached


def test_second_request_hits_shared_prefix():
    mgr = _mgr()
    a = list(range(10))  # blocks [0-3] [4-7], partial [8, 9]
    _run(mgr, "a", a)
    assert mgr.block_ids("a") == [0, 1, 2]
    b = list(range(8)) + [50, 51, 52]
    cached = _run(mgr, "b", b)
    assert cached.num_cached_tokens == 8
    assert mgr.block_ids("b") == [0, 1, 3]  # shares blocks 0 and 1
    assert mgr.pool.blocks[0].ref_cnt == 2
    mgr.free("a")
    mgr.free("b")
    mgr.check_integrity()


def test_full_hit_recomputes_last_block():
    mgr = _mgr()
    ids = list(range(8))  # exactly two blocks
    _run(mgr, "a", ids)
    mgr.free("a")
    cached = mgr.find_cached_prefix(ids)
    assert cached.num_cached_tokens == 4  # never all tokens: the last block is recomputed
    mgr.allocate("b", 8, cached)
    assert mgr.block_ids("b")[0] == 0 and mgr.block_ids("b")[1] != 1
    mgr.register_computed("b", ids, 8)  # duplicate of block 1's hash: index keeps one
    mgr.free("b")
    mgr.check_integrity()


def test_prefix_ending_mid_block_hits_full_blocks_only():
    mgr = _mgr()
    _run(mgr, "a", list(range(12)))
    mgr.free("a")
    assert mgr.find_cached_prefix(list(range(6)) + [99, 98]).num_cached_tokens == 4


def test_bypass_neither_reads_nor_registers():
    mgr = _mgr()
    ids = list(range(9))
    _run(mgr, "a", ids, use_cache=False)
    assert mgr.pool.hash_index == {}
    mgr.free("a")
    _run(mgr, "b", ids)
    assert len(mgr.pool.hash_index) == 2
    with pytest.raises(ValueError):
        mgr.allocate("c", 9, mgr.find_cached_prefix(ids), use_cache=False)
    mgr.free("b")
    mgr.check_integrity()


def test_namespaces_do_not_share():
    mgr = _mgr()
    ids = list(range(9))
    _run(mgr, "a", ids, namespace=b"t1")
    assert mgr.find_cached_prefix(ids, b"t2").num_cached_tokens == 0
    assert mgr.find_cached_prefix(ids, b"t1").num_cached_tokens == 8
    mgr.free("a")


def test_eviction_order_lru_then_chain_tail():
    mgr = _mgr(n=4)
    _run(mgr, "a", list(range(8)))  # blocks 0, 1
    mgr.free("a")
    _run(mgr, "b", [100 + i for i in range(8)])  # blocks 2, 3
    mgr.free("b")
    # queue: 1 (a's tail), 0, 3 (b's tail), 2; a new 1-block request evicts a's tail first
    _run(mgr, "c", [200, 201, 202])
    assert mgr.block_ids("c") == [1]
    assert mgr.find_cached_prefix(list(range(8)) + [7]).num_cached_tokens == 4
    assert mgr.find_cached_prefix([100 + i for i in range(8)] + [0]).num_cached_tokens == 8
    mgr.free("c")
    mgr.check_integrity()


def test_out_of_blocks_changes_nothing():
    mgr = _mgr(n=2)
    _run(mgr, "a", list(range(5)))
    with pytest.raises(NoFreeBlocksError):
        mgr.allocate("b", 9)
    assert not mgr.holds("b")
    mgr.check_integrity()
    mgr.free("a")
    assert mgr.pool.num_free == 2


def test_incremental_registration_during_decode():
    mgr = _mgr()
    ids = list(range(6))
    mgr.allocate("a", 6)
    assert mgr.register_computed("a", ids, 6) == 1
    ids += [6, 7]  # two decode tokens fill block 1
    mgr.allocate("a", 8)
    assert mgr.register_computed("a", ids, 7) == 0
    assert mgr.register_computed("a", ids, 8) == 1
    mgr.free("a")
    assert mgr.find_cached_prefix(ids + [8]).num_cached_tokens == 8
    mgr.check_integrity()


def _copying_mgr(n=8):
    """A manager whose slot copies are recorded as (source block, destination block, slots)."""
    copies: list[tuple[int, int, int]] = []
    mgr = KVCacheManager(n, BS, FP, copy_slots=lambda s, d, k: copies.append((s, d, k)))
    return mgr, copies


def test_next_block_start_is_copied_from_an_indexed_sibling():
    mgr, copies = _copying_mgr()
    a = list(range(12))  # [0-3] [4-7] [8-11], all full and indexed
    _run(mgr, "a", a)
    mgr.free("a")  # queue: 3 4 5 6 7 2 1 0
    b = list(range(10)) + [70, 71, 72]  # block 2 starts 8 9, then differs
    assert mgr.find_cached_prefix(b).num_cached_tokens == 8  # full blocks only
    cached = mgr.find_cached_prefix(b, partial=True)
    assert cached.num_cached_tokens == 10 and cached.num_copied_tokens == 2
    assert cached.copy_source is mgr.pool.blocks[2]
    blocks = mgr.allocate("b", len(b), cached)
    # blocks 0 and 1 shared; block 2 held while its first two slots go into fresh block 3
    assert [x.block_id for x in blocks] == [0, 1, 3, 4]
    assert copies == [(2, 3, 2)]
    assert mgr.pool.blocks[2].ref_cnt == 0 and mgr.pool.blocks[2].block_hash is not None
    mgr.register_computed("b", b, len(b))
    mgr.free("b")
    mgr.check_integrity()
    # the sibling b filled is a copy source too: the longest common start wins
    c = list(range(10)) + [70, 5, 5]
    cached = mgr.find_cached_prefix(c, partial=True)
    assert cached.copy_source is mgr.pool.blocks[3] and cached.num_cached_tokens == 11


def test_partial_tail_of_a_finished_request_is_a_copy_source_until_reused():
    mgr, copies = _copying_mgr()
    a = list(range(6))  # [0-3], then a tail of two written slots in block 1
    mgr.allocate("a", 6)
    mgr.register_computed("a", a, 6)
    mgr.free("a", a, 6)  # queue: 2 3 4 5 6 7 1 0
    mgr.check_integrity()
    b = a + [9, 9]
    cached = mgr.find_cached_prefix(b, partial=True)
    assert cached.copy_source is mgr.pool.blocks[1] and cached.num_cached_tokens == 6
    # the same prompt again: at most all tokens but the last count as cached
    assert mgr.find_cached_prefix(a, partial=True).num_cached_tokens == 5
    mgr.allocate("b", len(b), cached)
    assert copies == [(1, 2, 2)] and mgr.block_ids("b") == [0, 2]
    mgr.free("b")
    # handing block 1 out again drops its tail: only the full block 0 still hits
    mgr.allocate("c", 7 * BS)  # every free block but block 0
    assert 1 in mgr.block_ids("c") and 0 not in mgr.block_ids("c")
    assert mgr.find_cached_prefix(b, partial=True).num_cached_tokens == 4
    mgr.free("c")
    mgr.check_integrity()


def test_no_partial_tail_without_its_ids_or_when_bypassing():
    mgr, _ = _copying_mgr()
    a = list(range(6))
    mgr.allocate("a", 6)
    mgr.register_computed("a", a, 6)
    mgr.free("a")  # no ids given: nothing offered
    assert mgr.find_cached_prefix(a + [1], partial=True).num_cached_tokens == 4
    mgr.allocate("b", 6, use_cache=False)
    mgr.free("b", a, 6)
    assert mgr.pool.children == {mgr.pool.blocks[0].parent_hash: {0: mgr.pool.blocks[0]}}
    mgr.check_integrity()


def test_copy_source_in_a_full_pool_fails_the_allocation_cleanly():
    """Held for its slots, the source cannot also be the fresh block the prompt needs."""
    mgr, copies = _copying_mgr(n=3)
    a = list(range(6))
    mgr.allocate("a", 6)
    mgr.register_computed("a", a, 6)
    mgr.free("a", a, 6)
    b = a + [7, 7, 7]  # needs three blocks: block 0 shared, two fresh
    cached = mgr.find_cached_prefix(b, partial=True)
    assert cached.copy_source is not None
    with pytest.raises(NoFreeBlocksError):
        mgr.allocate("b", len(b), cached)
    assert not mgr.holds("b") and copies == [] and mgr.pool.num_free == 3
    mgr.check_integrity()
    mgr.allocate("b", len(b), cached.full_blocks_only())  # without the copy it fits
    assert mgr.block_ids("b")[0] == 0
    mgr.free("b")
    mgr.check_integrity()


def test_a_hold_keeps_its_blocks_out_of_eviction_and_out_of_the_request_table():
    """A hold (a pin, a second-tier load) references cached blocks like a request does, so
    allocations take other blocks; a request named like a hold shares nothing with it; fresh
    blocks taken into a hold are indexed once written, and released tail first."""
    mgr = _mgr(6)
    ids = list(range(12))  # three full blocks
    _run(mgr, "a", ids)
    mgr.free("a")  # blocks 0-2 cached and free
    cached = mgr.find_cached_prefix(ids + [0])
    held = mgr.hold(cached.blocks)
    assert [b.block_id for b in held.blocks] == [0, 1, 2]
    assert [b.ref_cnt for b in mgr.pool.blocks] == [1, 1, 1, 0, 0, 0]
    mgr.check_integrity()
    # a request whose id looks like a hold's allocates its own blocks, never these
    mgr.allocate("pin:a", 12)
    assert mgr.block_ids("pin:a") == [3, 4, 5]
    with pytest.raises(NoFreeBlocksError):
        mgr.allocate("b", 4)  # the held blocks are not free
    mgr.free("pin:a")
    assert mgr.find_cached_prefix(ids + [0]).num_cached_tokens == 12
    # fresh blocks into the hold, indexed under a verified hash, then released tail first
    fresh = mgr.hold_new(held, 1)
    assert [b.block_id for b in fresh] == [5]  # "pin:a" freed its blocks tail first
    more = list(range(12, 16))
    parent = cached.block_hashes[-1]
    assert mgr.index_block(fresh[0], hash_block(parent, more), parent, tuple(more))
    with pytest.raises(NoFreeBlocksError):
        mgr.hold_new(held, 3)  # two free blocks left: nothing taken
    assert mgr.num_held_blocks == 4
    mgr.check_integrity()
    mgr.release(held)
    assert mgr.num_held_blocks == 0 and mgr.pool.num_free == 6
    assert [b.block_id for b in mgr.pool.free_queue] == [4, 3, 5, 2, 1, 0]  # tail first
    assert mgr.find_cached_prefix(ids + more + [0]).num_cached_tokens == 16
    mgr.check_integrity()
