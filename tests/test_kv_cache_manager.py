import pytest

from prefix_store import KVCacheManager, NoFreeBlocksError

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
