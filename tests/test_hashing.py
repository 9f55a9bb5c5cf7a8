import os
import subprocess
import sys

from prefix_store import BlockHasher, hash_block, root_hash
from prefix_store.kv_cache_manager import KVCacheManager

FP = b"\x01" * 32
IDS = list(range(100, 148))  # three blocks of 16

# Pinned digest of the last block of IDS: a change here breaks every cache shared between
# replicas and restarts (docs/interfaces.md, "Prefix hashing").
GOLDEN_LAST = "348feccbc0d48af4a1ead90804920cd4"


def _chain_hex(namespace: bytes = b"") -> list[str]:
    return [h.hex() for h in BlockHasher(16, FP, namespace).chain(IDS)]


def test_layout_matches_contract_bytes():
    import xxhash

    root = xxhash.xxh3_128_digest(b"docqa-kv-v1" + FP + b"tenant")
    assert root_hash(FP, b"tenant") == root
    ids = b"".join(i.to_bytes(4, "little", signed=True) for i in IDS[:16])
    assert hash_block(root, IDS[:16]) == xxhash.xxh3_128_digest(root + ids)
    assert len(root) == 16
    # big-endian canonical digest
    assert root == xxhash.xxh3_128(b"docqa-kv-v1" + FP + b"tenant").intdigest().to_bytes(16, "big")


def test_golden_digest():
    assert _chain_hex()[-1] == GOLDEN_LAST


def test_subprocess_with_other_hashseed_reproduces():
    code = (
        "from prefix_store import BlockHasher;"
        f"print(BlockHasher(16, {FP!r}).chain({IDS!r})[-1].hex())"
    )
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        cwd=os.path.dirname(os.path.dirname(__file__)),
    )
    assert out.stdout.strip() == GOLDEN_LAST


def test_namespace_changes_every_hash():
    a, b = _chain_hex(b""), _chain_hex(b"tenant-b")
    assert len(a) == 3
    assert all(x != y for x, y in zip(a, b, strict=True))


def test_partial_block_not_hashed_and_chain_depends_on_parent():
    h = BlockHasher(16, FP)
    assert len(h.chain(IDS[:31])) == 1
    other = list(IDS)
    other[0] += 1  # change only block 0: every later hash changes too
    assert all(x != y for x, y in zip(h.chain(IDS), h.chain(other), strict=True))


def test_planted_collision_is_rejected():
    """A block indexed under our hash but holding other tokens (or another parent) never hits."""
    mgr = KVCacheManager(num_blocks=8, block_size=16, model_fingerprint=FP)
    hasher = mgr.hasher()
    hashes = hasher.chain(IDS)
    blocks = mgr.pool.allocate(3)
    # plant: block 0 carries the right hash but wrong tokens
    mgr.pool.register(blocks[0], hashes[0], hasher.root, tuple(range(16)))
    assert mgr.find_cached_prefix(IDS + [1]).num_cached_tokens == 0
    # plant: right tokens, wrong parent hash
    mgr.pool.free(blocks)
    mgr.pool.reset_cache()
    blocks = mgr.pool.allocate(3)
    mgr.pool.register(blocks[0], hashes[0], b"\x00" * 16, tuple(IDS[:16]))
    assert mgr.find_cached_prefix(IDS + [1]).num_cached_tokens == 0
    # control: correct tokens and parent hit
    mgr.pool.free(blocks)
    mgr.pool.reset_cache()
    blocks = mgr.pool.allocate(3)
    mgr.pool.register(blocks[0], hashes[0], hasher.root, tuple(IDS[:16]))
    assert mgr.find_cached_prefix(IDS + [1]).num_cached_tokens == 16
    mgr.pool.free(blocks)
    mgr.pool.check_integrity()
