"""The Redis tier of the prefix cache, in process, against the machine's real Redis: write-through,
loading into a second engine and back after eviction (greedy output identical to a cold
computation), the block format, the memory cap and a Redis that goes away and comes back."""

import os
import signal
import time

import pytest
from svc_helpers import REDIS_URL, RUN_REDIS_PREFIX, RedisServer, delete_prefix, redis_client

from inference import EngineConfig, LLMEngine, SamplingParams
from prefix_store import TierBlock, TierConfig
from prefix_store.tier_block import decode_block, encode_block
from prompts import PromptBuilder

MANUAL = (
    "The WX-200 washer has four programs. Cotton washes at 60 degrees for 95 minutes. Synthetics "
    "wash at 40 degrees for 70 minutes. Quick washes at 30 degrees for 20 minutes and suits "
    "lightly soiled loads. Wool washes cold with slow spins. To pause, press START for two "
    "seconds. Error F3 means the drain filter is blocked: unscrew the cap behind the kick plate "
    "and clean it. Error F5 means the door is not locked. Use at most 40 ml of detergent. "
) * 5
QUESTIONS = ["What does error F3 mean?", "How long does Cotton take?", "How do I pause?"]


def _engine(model_dir, prefix: str, url: str = REDIS_URL, gib: float = 0.1, **kw) -> LLMEngine:
    tier = TierConfig(url=url, prefix=prefix, retry_s=0.2, **kw.pop("tier", {}))
    return LLMEngine(EngineConfig(model_dir=model_dir, kv_cache_gib=gib, kv_tier=tier, **kw))


def _run(engine: LLMEngine, ids: list[int], use_cache: bool = True, max_tokens: int = 12):
    req = engine.add_request(ids, SamplingParams(max_tokens=max_tokens), use_cache=use_cache)
    while not req.finished:
        engine.step()
    engine.release(req)
    return req


def _manual_written(eng: LLMEngine, builder: PromptBuilder):
    """The manual computed by a first question and written to Redis; returns the prompt of
    another question about it."""
    _run(eng, builder.build(MANUAL, QUESTIONS[0]).token_ids)
    assert eng.tier.flush().result(30)
    return builder.build(MANUAL, QUESTIONS[2])


@pytest.fixture
def prefix():
    p = f"{RUN_REDIS_PREFIX}tier-{time.monotonic_ns()}:"
    yield p
    delete_prefix(redis_client(), p)


def test_block_format_round_trip_and_rejects_others():
    blk = TierBlock(b"h" * 16, b"p" * 16, tuple(range(16)), bytes(range(256)) * 4)
    raw = encode_block(blk, 16)
    back = decode_block(b"h" * 16, raw, 16, 1024)
    assert back.parent_hash == blk.parent_hash and back.token_ids == blk.token_ids
    assert bytes(back.payload) == blk.payload
    assert decode_block(b"h" * 16, raw, 16, 1023) is None  # another payload size
    assert decode_block(b"h" * 16, raw, 32, 1024) is None  # another block size
    assert decode_block(b"h" * 16, b"XXXX" + raw[4:], 16, 1024) is None  # not ours


def test_second_engine_loads_from_redis_and_answers_the_same(default_model_dir, prefix):
    a = _engine(default_model_dir, prefix)
    b = _engine(default_model_dir, prefix)
    try:
        builder = PromptBuilder(a.tokenizer)
        first = builder.build(MANUAL, QUESTIONS[0])
        second = builder.build(MANUAL, QUESTIONS[1])
        _run(a, first.token_ids)
        assert a.tier.flush().result(30)
        assert a.tier.blocks_written >= first.prefix_len // 16

        computed0 = b.prompt_tokens_computed
        warm = _run(b, second.token_ids)
        pre_question = second.prefix_len
        assert warm.num_tier_cached_tokens >= 0.95 * pre_question, (
            warm.num_tier_cached_tokens,
            pre_question,
        )
        assert warm.num_cached_tokens == warm.num_tier_cached_tokens
        assert (
            b.prompt_tokens_computed - computed0 == len(second.token_ids) - warm.num_cached_tokens
        )
        assert b.scheduler.num_prefix_hits_tier == warm.num_tier_cached_tokens
        # greedy output identical to a cold computation of the same prompt
        cold = _run(b, second.token_ids, use_cache=False)
        assert cold.num_cached_tokens == 0
        assert warm.output_token_ids == cold.output_token_ids
        b.kv_manager.check_integrity()
    finally:
        a.close()
        b.close()


def test_evicted_manual_is_loaded_back_from_redis(default_model_dir, prefix):
    eng = _engine(default_model_dir, prefix, gib=0.04)  # about 1,800 tokens
    try:
        builder = PromptBuilder(eng.tokenizer)
        p2 = _manual_written(eng, builder)

        def local_hit() -> int:
            return eng.kv_manager.find_cached_prefix(p2.token_ids).num_cached_tokens

        assert local_hit() >= 0.95 * p2.prefix_len
        # other manuals fill the pool until the manual is evicted (the system instructions
        # every prompt starts with may stay)
        filler = 0
        while local_hit() > 64:
            other = builder.build(f"Filler manual {filler}. " + "Unrelated text. " * 200, "Hi?")
            _run(eng, other.token_ids, max_tokens=1)
            filler += 1
            assert filler < 20
        loaded = _run(eng, p2.token_ids)
        assert loaded.num_cached_tokens >= 0.95 * p2.prefix_len
        assert loaded.num_tier_cached_tokens >= loaded.num_cached_tokens - 64
        cold = _run(eng, p2.token_ids, use_cache=False)
        assert loaded.output_token_ids == cold.output_token_ids
        eng.kv_manager.check_integrity()
    finally:
        eng.close()


def _evict_after(eng: LLMEngine, ids: list[int], keep: int) -> None:
    """Evict the cached blocks of ``ids``'s prefix past its first ``keep``, tail first, as the
    pool does when other admissions take its free blocks."""
    pool = eng.kv_manager.pool
    for block in reversed(eng.kv_manager.find_cached_prefix(ids).blocks[keep:]):
        assert block.ref_cnt == 0
        pool._evict(block)


def test_a_local_prefix_evicted_while_its_lookup_runs_is_looked_up_again(default_model_dir, prefix):
    """A request's lookup asks Redis for the blocks past its local prefix; meanwhile the pool
    evicts part of that prefix. The blocks found no longer join what is left: the lookup is
    asked again from there and the prefix loaded, not computed."""
    eng = _engine(default_model_dir, prefix)
    try:
        builder = PromptBuilder(eng.tokenizer)
        p2 = _manual_written(eng, builder)
        _evict_after(eng, p2.token_ids, 8)
        req = eng.add_request(p2.token_ids, SamplingParams(max_tokens=12))
        assert req.tier_lookup is not None and req.tier_lookup.start_block == 8
        found, _, _ = req.tier_lookup.fetch.result(30)
        assert len(found) >= p2.prefix_len // 16 - 8 - 1
        _evict_after(eng, p2.token_ids, 5)  # while the lookup ran
        while not req.finished:
            eng.step()
        eng.release(req)
        assert req.num_cached_tokens >= p2.prefix_len - 16
        assert req.num_tier_cached_tokens >= req.num_cached_tokens - 5 * 16
        assert eng.tier.relooks_evicted == 1
        cold = _run(eng, p2.token_ids, use_cache=False)
        assert req.output_token_ids == cold.output_token_ids
        eng.kv_manager.check_integrity()
    finally:
        eng.close()


def test_a_prefix_another_engine_is_computing_is_waited_for_not_computed_twice(
    default_model_dir, prefix
):
    """Two engines (two replicas) get the same cold prompt at once: the first claims it and
    computes it in 64-token chunks; the second, finding the first chunk's blocks written and
    the claim on the first of them, waits on it, then loads what the first wrote and computes
    only the rest, answering as a cold run would."""
    a = _engine(default_model_dir, prefix, max_num_batched_tokens=64, calibrate_prefill_cost=False)
    b = _engine(default_model_dir, prefix, calibrate_prefill_cost=False)
    try:
        ids = PromptBuilder(a.tokenizer).build(MANUAL, QUESTIONS[2]).token_ids
        params = SamplingParams(max_tokens=8)
        ra = a.add_request(ids, params)
        a.step()  # admitted once its lookup answers: nothing in Redis, so it claims the prompt
        deadline = time.monotonic() + 30
        while ra.num_computed_tokens == 0:
            assert time.monotonic() < deadline
            a.step()
        assert ra.tier_claim is not None and ra.num_computed_tokens < len(ids)
        # its first blocks are in Redis already: B finds them, and A's claim on the first
        assert a.tier.flush().result(30)
        rb = b.add_request(ids, params)
        while b.tier.claim_waits == 0:  # B's lookup finds A's claim and waits on it
            assert time.monotonic() < deadline
            b.step()
        assert rb.num_computed_tokens == 0 and rb.tier_lookup is not None
        while not ra.finished:
            a.step()
            b.step()
        assert ra.tier_claim is None  # released once the prompt was computed
        while not rb.finished:
            b.step()
        assert rb.num_tier_cached_tokens >= len(ids) - 2 * 16, (rb.num_tier_cached_tokens, len(ids))
        assert b.prompt_tokens_computed <= 2 * 16
        assert rb.output_token_ids == ra.output_token_ids
        for e, r in ((a, ra), (b, rb)):
            e.release(r)
            e.kv_manager.check_integrity()
        claims = list(redis_client().scan_iter(match=prefix + "claim:*"))
        assert claims == []
    finally:
        a.close()
        b.close()


def test_after_a_wait_a_lookup_waits_on_another_claim_it_finds(default_model_dir, prefix):
    """B's lookup waits on a claim on the prompt's first block, held by a replica computing
    another manual that starts the same way (the instructions). Meanwhile A starts computing
    this prompt: its first 20 blocks are written and it claims the 21st. When the first claim
    is released, B's lookup finds A's: B waits on it as well, then loads what A wrote, and
    computes only its question instead of the rest of the prompt beside A."""
    # A waits on the first claim only briefly: it stands for the replica computing this prompt
    a = _engine(
        default_model_dir, prefix, calibrate_prefill_cost=False, tier={"claim_wait_s": 0.05}
    )
    b = _engine(default_model_dir, prefix, calibrate_prefill_cost=False)
    r = redis_client()
    try:
        ids = PromptBuilder(b.tokenizer).build(MANUAL, QUESTIONS[1]).token_ids
        hashes = b.kv_manager.hasher().chain(ids)
        assert len(hashes) > 24

        def claim(i: int, owner: str) -> bytes:
            key = f"{prefix}claim:{hashes[i].hex()}".encode()
            assert r.set(key, owner, px=60_000)
            return key

        other = claim(0, "a replica computing another manual")
        rb = b.add_request(ids, SamplingParams(max_tokens=8))
        deadline = time.monotonic() + 30
        while b.tier.claim_waits == 0:
            assert time.monotonic() < deadline
            b.step()
        # A computes the prompt's first 20 blocks and writes them; "A" claims the 21st
        _run(a, ids[: 20 * 16 + 1], max_tokens=1)
        assert a.tier.flush().result(30)
        computing = claim(20, "A, computing the rest of this prompt")
        r.delete(other)
        deadline = time.monotonic() + 30
        while b.tier.claim_waits < 2:  # B's lookup again finds A's claim, and waits on it
            assert time.monotonic() < deadline and rb.num_computed_tokens == 0
            b.step()
        r.delete(computing)
        ra = _run(a, ids)  # A computes the rest and writes it (its claim released)
        assert a.tier.flush().result(30)
        while not rb.finished:
            assert time.monotonic() < deadline
            b.step()
        b.release(rb)
        assert rb.num_tier_cached_tokens >= len(ids) - 2 * 16, (rb.num_tier_cached_tokens, len(ids))
        assert b.prompt_tokens_computed <= 2 * 16
        assert rb.output_token_ids[:8] == ra.output_token_ids[:8]
        b.kv_manager.check_integrity()
    finally:
        a.close()
        b.close()


def test_a_lookup_gone_stale_in_the_queue_is_asked_again_before_computing(
    default_model_dir, prefix
):
    """B's lookup for a cold prompt finds nothing (B claims it) while B's only slot is busy;
    A, not waiting on B, computes the prompt and writes it through. When B admits the prompt,
    its lookup's answer is stale: B looks again, loads what A wrote, and computes only the
    rest, answering as A did."""
    b = _engine(
        default_model_dir,
        prefix,
        max_num_seqs=1,
        calibrate_prefill_cost=False,
        tier={"relook_after_s": 0.2},
    )
    a = _engine(
        default_model_dir, prefix, calibrate_prefill_cost=False, tier={"claim_wait_s": 0.05}
    )
    try:
        builder = PromptBuilder(b.tokenizer)
        busy = b.add_request(
            builder.build(MANUAL, QUESTIONS[0]).token_ids, SamplingParams(max_tokens=400)
        )
        deadline = time.monotonic() + 60
        while busy.num_computed_tokens == 0:
            assert time.monotonic() < deadline
            b.step()
        ids = builder.build(MANUAL.upper(), QUESTIONS[2]).token_ids
        rb = b.add_request(ids, SamplingParams(max_tokens=8))
        while rb.tier_answered_at is None:  # nothing in Redis: B claims it, and waits its turn
            assert time.monotonic() < deadline
            b.step()
        assert rb.tier_claim is not None and rb.num_tier_cached_tokens == 0
        ra = _run(a, ids, max_tokens=8)  # A gave up waiting on B's claim and computed it
        assert a.tier.flush().result(30) and a.tier.claim_waits_expired == 1
        time.sleep(0.3)
        computed = b.prompt_tokens_computed
        b.abort(busy.request_id)
        while not rb.finished:
            assert time.monotonic() < deadline
            b.step()
        assert b.tier.relooks == 1
        # the instructions' blocks were in B's pool already; the rest came from Redis
        assert rb.num_cached_tokens >= len(ids) - 2 * 16, (rb.num_cached_tokens, len(ids))
        assert rb.num_tier_cached_tokens >= 0.9 * len(ids)
        assert b.prompt_tokens_computed - computed <= 2 * 16
        assert rb.output_token_ids == ra.output_token_ids and rb.tier_claim is None
        b.release(rb)
        b.kv_manager.check_integrity()
        assert list(redis_client().scan_iter(match=prefix + "claim:*")) == []
    finally:
        a.close()
        b.close()


def test_a_request_refused_at_admission_releases_its_claim(default_model_dir, prefix):
    """A cold prompt's lookup claims it; pins taken before its admission leave the pool too
    small for it: it fails with a clear error and its claim is gone from Redis at once (other
    replicas would otherwise wait on it for claim_wait_s)."""
    eng = _engine(default_model_dir, prefix, gib=0.0275, calibrate_prefill_cost=False)
    try:
        builder = PromptBuilder(eng.tokenizer)
        pinned = builder.build("The other pump has two modes. " * 36, QUESTIONS[0]).token_ids
        _run(eng, pinned, max_tokens=1)
        ids = builder.build(MANUAL.upper(), QUESTIONS[2]).token_ids
        req = eng.add_request(ids, SamplingParams(max_tokens=8))
        assert eng.pin("pinned", pinned) > 0
        deadline = time.monotonic() + 30
        while not req.finished:
            assert time.monotonic() < deadline
            eng.step()
        assert "KV blocks" in str(req.error) and req.tier_claim is None
        assert eng.tier.flush().result(30)
        assert list(redis_client().scan_iter(match=prefix + "claim:*")) == []
    finally:
        eng.close()


def test_a_claim_held_past_the_wait_limit_is_computed_and_counted(default_model_dir, prefix):
    """Another replica holds the prompt's claim and keeps it (its request stuck in a long
    queue): the engine waits ``claim_wait_s``, then computes the prompt itself, and counts
    the wait as expired."""
    from prefix_store.redis_tier import RedisTier

    eng = _engine(default_model_dir, prefix, tier={"claim_wait_s": 0.5})
    try:
        ids = PromptBuilder(eng.tokenizer).build(MANUAL, QUESTIONS[1]).token_ids
        holder = RedisTier(eng.tier.config, b"h" * 16, 16, 64)
        try:
            hasher = eng.kv_manager.hasher(b"")
            hashes = hasher.chain(ids)
            _, claimed, _ = holder.lookup(hashes[:4], hasher.root).result(10)
            assert claimed == hashes[0]  # and its process keeps it, renewing
            req = _run(eng, ids)
        finally:
            holder.close()
        assert eng.tier.claim_waits == 1 and eng.tier.claim_waits_expired == 1
        assert req.num_cached_tokens == 0 and req.error is None
        eng.kv_manager.check_integrity()
    finally:
        eng.close()


def test_a_claim_lives_while_its_holder_does_and_lapses_after(prefix):
    """A process renews its claims on a thread of its own (whatever its engine is doing) until
    it releases them; a holder that is gone stops renewing and its claim lapses."""
    from prefix_store.redis_tier import RedisTier

    cfg = TierConfig(url=REDIS_URL, prefix=prefix, claim_ttl_s=0.6)
    holder = RedisTier(cfg, b"f" * 16, 16, 64)
    other = RedisTier(cfg, b"f" * 16, 16, 64)
    try:
        h, g = b"\x01" * 16, b"\x02" * 16
        found, claimed, busy = holder.lookup([h], b"\x00" * 16).result(10)
        assert (found, claimed, busy) == ([], h, None)
        assert holder.lookup([g], b"\x00" * 16).result(10) == ([], g, None)
        assert other.lookup([h], b"\x00" * 16).result(10) == ([], None, h)
        time.sleep(1.5)  # two and a half times the claims' life, nobody renewing by hand
        assert other.claim_held(h).result(10) and other.claim_held(g).result(10)
        holder.release(g)  # released: no longer renewed, and gone at once
        assert holder.flush().result(10)
        assert not other.claim_held(g).result(10) and holder.held_claims == 1
        holder.close()  # the holder is gone: its claim lapses
        deadline = time.monotonic() + 10
        while other.claim_held(h).result(10):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        other.renew([h])  # another process's renewal takes nothing
        assert not other.claim_held(h).result(10)
    finally:
        holder.close()
        other.close()


def test_a_lookup_past_blocks_loaded_from_a_holder_still_sees_its_claim(prefix):
    """Replica B loaded the first blocks another replica writes as it computes a prefix, so
    B's next lookup starts after them: the holder's claim, on the chain's first block, is
    still seen (B waits), not passed by claiming a later block and computing the rest."""
    from prefix_store.redis_tier import RedisTier

    cfg = TierConfig(url=REDIS_URL, prefix=prefix)
    holder = RedisTier(cfg, b"f" * 16, 16, 64)
    other = RedisTier(cfg, b"f" * 16, 16, 64)
    try:
        first, later = [bytes([i]) * 16 for i in (1, 2, 3)], bytes([4]) * 16
        assert holder.lookup(first, b"\x00" * 16).result(10) == ([], first[0], None)
        # the blocks the holder computed so far are in B's pool; B looks past them
        found, claimed, busy = other.lookup([later], first[-1], before=first).result(10)
        assert (found, claimed, busy) == ([], None, first[0])
        assert other.held_claims == 0
        holder.release(first[0])
        assert holder.flush().result(10)
        assert other.lookup([later], first[-1], before=first).result(10) == ([], later, None)
    finally:
        holder.close()
        other.close()


def test_a_lookup_past_its_own_process_claim_claims_the_rest_of_its_prompt(prefix):
    """Replica B's request for manual X finds the instructions' last block claimed by B itself
    (another of its requests computes manual Y, which shares that block): it claims the first
    block of X past it, so replica A, asking about X, waits instead of computing X beside B."""
    from prefix_store.redis_tier import RedisTier

    cfg = TierConfig(url=REDIS_URL, prefix=prefix)
    b = RedisTier(cfg, b"f" * 16, 16, 64)
    a = RedisTier(cfg, b"f" * 16, 16, 64)
    try:
        shared = bytes([1]) * 16
        x = [bytes([10 + i]) * 16 for i in range(3)]
        y = [bytes([20 + i]) * 16 for i in range(3)]
        assert b.lookup([shared, *y], b"\x00" * 16).result(10) == ([], shared, None)
        # B's request for X: the shared block is B's own claim; X's first block is claimed
        assert b.lookup([shared, *x], b"\x00" * 16).result(10) == ([], x[0], None)
        assert b.held_claims == 2
        # the same request asked again keeps the claim it holds, past B's other one
        assert b.lookup([shared, *x], b"\x00" * 16, mine=x[0]).result(10) == ([], None, None)
        # a third request of B for X passes both of B's claims
        assert b.lookup([shared, *x], b"\x00" * 16).result(10) == ([], x[1], None)
        # and the request holding the shared block's claim, asked again, keeps it
        assert b.lookup([shared, *y], b"\x00" * 16, mine=shared).result(10) == ([], None, None)
        # A, about X, sees B computing it: on the shared block, and (holding the shared
        # block already) on X's first
        assert a.lookup([shared, *x], b"\x00" * 16).result(10) == ([], None, shared)
        assert a.lookup(x, shared).result(10) == ([], None, x[0])
        assert a.held_claims == 0
    finally:
        a.close()
        b.close()


def test_a_release_dropped_with_the_write_queue_is_not_renewed_for_good(prefix, tmp_path):
    """Redis fails under a queued write with a release behind it: the failure drops the
    queue, release included; the claim is no longer renewed, so it lapses instead of holding
    the other replicas up for good once Redis is back."""
    from prefix_store.redis_tier import RedisTier

    server = RedisServer(tmp_path).start()
    tier = RedisTier(TierConfig(url=server.url, prefix=prefix, claim_ttl_s=0.6), b"f" * 16, 16, 64)
    try:
        h = b"\x03" * 16
        assert tier.lookup([h], b"\x00" * 16).result(10) == ([], h, None)
        server.stop()
        tier.write([TierBlock(b"\x04" * 16, b"\x00" * 16, tuple(range(16)), b"\x00" * 64)])
        tier.release(h)
        deadline = time.monotonic() + 10
        while tier.status != "degraded":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert tier.held_claims == 0
    finally:
        tier.close()
        server.stop()


def test_memory_cap_trims_the_oldest_blocks(default_model_dir, prefix):
    # room for 20 blocks of this model (22.5 KiB per token, 16 tokens a block)
    eng = _engine(default_model_dir, prefix, tier={"max_bytes": 20 * 370_000})
    try:
        builder = PromptBuilder(eng.tokenizer)
        _run(eng, builder.build(MANUAL, QUESTIONS[0]).token_ids, max_tokens=1)
        assert eng.tier.flush().result(30)
        r = redis_client()
        keys = [k for k in r.scan_iter(match=prefix + "kv:*", count=1000) if not k.endswith(b"lru")]
        assert eng.tier.blocks_written > 30
        assert len(keys) <= 20 and eng.tier.indexed_blocks() == len(keys)
    finally:
        eng.close()


def test_redis_going_away_degrades_to_local_and_comes_back(default_model_dir, prefix, tmp_path):
    server = RedisServer(tmp_path).start()
    eng = _engine(default_model_dir, prefix, url=server.url)
    try:
        builder = PromptBuilder(eng.tokenizer)
        _run(eng, builder.build(MANUAL, QUESTIONS[0]).token_ids, max_tokens=2)
        assert eng.tier.flush().result(30) and eng.tier.status == "ok"
        server.stop()
        # requests keep succeeding, answered from the local pool
        p = builder.build(MANUAL, QUESTIONS[1]).token_ids
        req = _run(eng, p, max_tokens=2)
        assert req.num_cached_tokens > 0 and req.num_tier_cached_tokens == 0
        _run(eng, builder.build("Another manual. " * 40, "Why?").token_ids, max_tokens=2)
        deadline = time.monotonic() + 10
        while eng.tier.status != "degraded" and time.monotonic() < deadline:
            _run(eng, builder.build(f"More text {time.time()}. " * 20, "Why?").token_ids, 2)
        assert eng.tier.status == "degraded"
        assert eng.tier.writes_dropped > 0 or eng.tier.errors > 0
        server.start()  # same port
        deadline = time.monotonic() + 10
        while eng.tier.status != "ok" and time.monotonic() < deadline:
            time.sleep(0.1)
        assert eng.tier.status == "ok"
        written = eng.tier.blocks_written
        _run(eng, builder.build("A manual after the outage. " * 30, "What?").token_ids, 2)
        assert eng.tier.flush().result(30)
        assert eng.tier.blocks_written > written
        assert redis_client(server.url).dbsize() > 0
    finally:
        eng.close()
        server.stop()


def test_a_stalled_redis_never_holds_up_the_engine(default_model_dir, prefix, tmp_path):
    """A Redis that stops answering (SIGSTOP) costs a request at most the lookup wait; steps and
    writes never wait for it, and the tier recovers when it answers again."""
    server = RedisServer(tmp_path).start()
    tier = {"timeout_s": 3.0, "lookup_wait_s": 0.3}
    eng = _engine(default_model_dir, prefix, url=server.url, tier=tier)
    try:
        builder = PromptBuilder(eng.tokenizer)
        _run(eng, builder.build(MANUAL, QUESTIONS[0]).token_ids, max_tokens=1)
        assert eng.tier.flush().result(30)
        baseline = []
        for i in range(2):
            t0 = time.perf_counter()
            _run(eng, builder.build(f"Baseline {i}. " * 60, "Why?").token_ids, max_tokens=2)
            baseline.append(time.perf_counter() - t0)
        os.kill(server.proc.pid, signal.SIGSTOP)
        try:
            stalled = []
            for i in range(3):
                t0 = time.perf_counter()
                req = _run(eng, builder.build(f"Stalled {i}. " * 60, "Why?").token_ids, 2)
                stalled.append(time.perf_counter() - t0)
                assert req.finish_reason == "length"
            # each request waited at most the lookup wait, never the 3 s socket timeout
            assert max(stalled) < max(baseline) + 0.3 + 1.5, (stalled, baseline)
            assert eng.tier.lookups_abandoned >= 1
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        deadline = time.monotonic() + 15
        while eng.tier.status != "ok" and time.monotonic() < deadline:
            time.sleep(0.1)
        assert eng.tier.status == "ok"
    finally:
        eng.close()
        server.stop()


def test_a_request_named_like_a_load_shares_nothing_with_it(default_model_dir, prefix):
    """A second-tier load takes its blocks under a hold outside the request table: a running
    request named ``tier:<the loading request's id>`` keeps its own blocks, and both answer as
    computed cold."""
    a = _engine(default_model_dir, prefix)
    b = _engine(default_model_dir, prefix)
    try:
        builder = PromptBuilder(a.tokenizer)
        _run(a, builder.build(MANUAL, QUESTIONS[0]).token_ids, max_tokens=1)
        assert a.tier.flush().result(30)
        other = builder.build("A manual of another washer. " * 30, "How?").token_ids
        params = SamplingParams(max_tokens=6, ignore_eos=True)
        named = b.add_request(other, params, request_id="tier:y")
        b.step()  # admitted: it holds blocks while the load runs
        loading = b.add_request(builder.build(MANUAL, QUESTIONS[1]).token_ids, params, "y")
        while not (named.finished and loading.finished):
            b.step()
        assert loading.num_tier_cached_tokens > 0
        for req, ids in ((named, other), (loading, loading.prompt_token_ids)):
            b.release(req)
            cold = _run(b, ids, use_cache=False, max_tokens=6)
            assert req.output_token_ids == cold.output_token_ids, req.request_id
        b.kv_manager.check_integrity()
    finally:
        a.close()
        b.close()
