import pytest

from prefix_store import BlockPool


def _ids(blocks):
    return [b.block_id for b in blocks]


def test_allocate_takes_lru_head_in_order():
    pool = BlockPool(4)
    assert _ids(pool.allocate(2)) == [0, 1]
    assert _ids(pool.allocate(2)) == [2, 3]
    assert pool.num_free == 0
    with pytest.raises(IndexError):
        pool.allocate(1)
    pool.check_integrity()


def test_failed_allocation_allocates_nothing():
    pool = BlockPool(3)
    pool.allocate(2)
    with pytest.raises(IndexError):
        pool.allocate(2)
    assert pool.num_free == 1
    pool.check_integrity()


def test_freed_blocks_keep_hash_until_reused_and_tail_goes_first():
    pool = BlockPool(4)
    chain = pool.allocate(3)  # blocks 0, 1, 2 of one request
    for i, b in enumerate(chain):
        pool.register(b, bytes([i]) * 16, bytes([i - 1 if i else 255]) * 16, (i,))
    pool.free(list(reversed(chain)))  # tail first
    pool.check_integrity()
    assert pool.num_cached_free == 3
    # queue: 3 (never used), then 2 (tail), 1, 0 (head of chain)
    assert _ids(pool.free_queue) == [3, 2, 1, 0]
    assert pool.lookup(bytes([0]) * 16) is chain[0]
    got = pool.allocate(2)
    assert _ids(got) == [3, 2]  # the chain's tail is evicted before its head
    assert pool.lookup(bytes([2]) * 16) is None
    assert pool.lookup(bytes([1]) * 16) is chain[1]
    assert pool.num_evictions == 1
    pool.check_integrity()


def test_touch_revives_cached_block_out_of_free_queue():
    pool = BlockPool(3)
    (b,) = pool.allocate(1)
    pool.register(b, b"h" * 16, b"p" * 16, (1, 2))
    pool.free([b])
    pool.touch([b])
    assert b.ref_cnt == 1 and not b.in_free_queue
    pool.touch([b])
    assert b.ref_cnt == 2
    pool.free([b, b])
    assert _ids(pool.free_queue) == [1, 2, 0]
    pool.check_integrity()


def test_duplicate_registration_keeps_one():
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    assert pool.register(a, b"x" * 16, b"p" * 16, (1,))
    assert not pool.register(b, b"x" * 16, b"p" * 16, (1,))
    assert b.block_hash is None and pool.lookup(b"x" * 16) is a
    pool.free([b, a])
    pool.check_integrity()


def test_double_free_is_an_error():
    pool = BlockPool(1)
    (b,) = pool.allocate(1)
    pool.free([b])
    with pytest.raises(RuntimeError):
        pool.free([b])
    pool.check_integrity()


def test_integrity_detects_corruption():
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    b.ref_cnt = 0  # referenced count lost without returning to the queue
    with pytest.raises(AssertionError):
        pool.check_integrity()


def test_index_events_record_registrations_and_evictions():
    pool = BlockPool(2)
    assert pool.index_events is None and pool.watch_index() == []
    [b] = pool.allocate(1)
    h = b"h" * 16
    assert pool.register(b, h, b"p" * 16, (1, 2))
    pool.free([b])
    assert pool.watch_index() == [h]  # a new snapshot: earlier events are dropped
    assert list(pool.index_events) == []
    pool.allocate(2)  # reuses b: its hash is evicted
    assert list(pool.index_events) == [(False, h)]
    pool.check_integrity()
