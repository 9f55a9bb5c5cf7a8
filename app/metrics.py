"""Prometheus metrics (docs/interfaces.md, "Metrics"): request histograms observed by the engine
thread, engine counters and gauges read at scrape time."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from inference.metrics import RequestMetrics

_LATENCY_BUCKETS = (
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0,
)  # fmt: skip
_STEP_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0)
_COUNT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
STEP_KINDS = ("decode", "prefill", "mixed")  # docqa:scheduler_step_seconds_by_kind's kinds
_ITL_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _EngineCollector:
    def __init__(self, runner):
        self.runner = runner

    def describe(self):
        return []

    def collect(self):
        c = self.runner.counters() if self.runner is not None else {}

        def counter(name, doc, key, labels=None):
            if labels:
                m = CounterMetricFamily(name, doc, labels=list(labels))
                for values, k in key:
                    m.add_metric(values, c.get(k, 0))
                return m
            return CounterMetricFamily(name, doc, value=c.get(key, 0))

        def gauge(name, doc, key):
            return GaugeMetricFamily(name, doc, value=c.get(key, 0))

        yield counter("docqa:prompt_tokens", "Prompt tokens of admitted requests", "prompt_tokens")
        yield counter(
            "docqa:prefix_cache_queries", "Prompt tokens looked up", "prefix_cache_queries"
        )
        yield counter(
            "docqa:prefix_cache_hits",
            "Looked-up prompt tokens served from the cache",
            [(["device"], "prefix_cache_hits_device"), (["redis"], "prefix_cache_hits_redis")],
            labels=["tier"],
        )
        yield counter(
            "docqa:prefix_cache_copied_tokens",
            "Of the device hits, tokens past the last full cached block whose KV slots were "
            "copied from a cached block holding them",
            "prefix_cache_hits_copied",
        )
        yield counter(
            "docqa:prompt_tokens_computed",
            "Prompt tokens run through the model (recompute included)",
            "prompt_tokens_computed",
        )
        yield counter("docqa:generation_tokens", "Output tokens", "generation_tokens")
        yield counter(
            "docqa:spec_decode_num_draft_tokens",
            "Prompt-lookup drafted tokens verified",
            "spec_draft_tokens",
        )
        yield counter(
            "docqa:spec_decode_num_accepted_tokens",
            "Of the drafted tokens, those that became the answers' tokens",
            "spec_accepted_tokens",
        )
        yield counter("docqa:num_preemptions", "Requests preempted", "num_preemptions")
        yield counter(
            "docqa:num_requests_cancelled", "Requests cancelled in the engine", "num_cancelled"
        )
        yield counter(
            "docqa:num_deferred_admissions",
            "Admissions deferred to reuse a prefix another request was computing",
            "num_deferred_admissions",
        )
        yield gauge("docqa:kv_cache_pinned_blocks", "KV blocks held by pins", "pinned_blocks")
        if "tier_up" in c:
            yield gauge("docqa:redis_tier_up", "1 while the Redis tier answers, else 0", "tier_up")
            yield counter(
                "docqa:redis_tier_blocks",
                "KV blocks moved to or from the Redis tier",
                [(["write"], "tier_blocks_written"), (["read"], "tier_blocks_loaded")],
                labels=["direction"],
            )
            yield counter(
                "docqa:redis_tier_bytes",
                "Bytes moved to or from the Redis tier",
                [(["write"], "tier_bytes_written"), (["read"], "tier_bytes_read")],
                labels=["direction"],
            )
            yield counter(
                "docqa:redis_tier_writes_dropped",
                "Blocks not written because the tier was degraded or behind",
                "tier_writes_dropped",
            )
            yield counter("docqa:redis_tier_errors", "Failed Redis tier calls", "tier_errors")
            yield counter(
                "docqa:redis_tier_lookups_abandoned",
                "Lookups a request stopped waiting for (Redis too slow)",
                "tier_lookups_abandoned",
            )
            yield counter(
                "docqa:redis_tier_claim_waits",
                "Lookups that waited for another replica computing the same prefix (its claim) "
                "instead of computing it too",
                "tier_claim_waits",
            )
            yield counter(
                "docqa:redis_tier_claim_waits_expired",
                "Waits on another replica's claim that ran out of time: the request computed "
                "what was still missing itself",
                "tier_claim_waits_expired",
            )
            yield counter(
                "docqa:redis_tier_relooks",
                "Lookups asked again before their request computed what the first did not find "
                "(it had waited for admission since)",
                "tier_relooks",
            )
            yield counter(
                "docqa:redis_tier_relooks_evicted",
                "Lookups asked again because the pool evicted part of the local prefix they "
                "started after while they ran",
                "tier_relooks_evicted",
            )
        yield gauge(
            "docqa:kv_cache_usage_perc",
            "Fraction of KV blocks referenced by running requests",
            "kv_cache_usage_perc",
        )
        yield gauge(
            "docqa:kv_cache_cached_blocks",
            "Free KV blocks still holding a prefix hash",
            "kv_cache_cached_blocks",
        )
        yield gauge("docqa:num_requests_running", "Requests running", "num_requests_running")
        yield gauge("docqa:num_requests_waiting", "Requests waiting", "num_requests_waiting")
        if "block_size" in c:
            # the Gateway API Inference Extension's model-server protocol: the KV cache's
            # block size in tokens and its number of blocks, as labels of a gauge of 1
            info = GaugeMetricFamily(
                "docqa:cache_config_info",
                "The KV cache's configuration: block_size (tokens a block) and num_gpu_blocks "
                "(blocks in the pool, on any device)",
                labels=["block_size", "num_gpu_blocks"],
            )
            info.add_metric([str(int(c["block_size"])), str(int(c["num_blocks"]))], 1.0)
            yield info


class ServiceMetrics:
    def __init__(self):
        self.registry = CollectorRegistry(auto_describe=False)
        self.ttft = Histogram(
            "docqa:time_to_first_token_seconds",
            "Arrival to first output token",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.itl = Histogram(
            "docqa:inter_token_latency_seconds",
            "Time per output token after the first",
            buckets=_ITL_BUCKETS,
            registry=self.registry,
        )
        self.queue = Histogram(
            "docqa:request_queue_time_seconds",
            "Arrival to first scheduled",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "docqa:e2e_request_latency_seconds",
            "Arrival to finish",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.step_time = Histogram(
            "docqa:scheduler_step_seconds",
            "Time of one engine step (model forward of a batch)",
            buckets=_STEP_BUCKETS,
            registry=self.registry,
        )
        self.step_time_by_kind = Histogram(
            "docqa:scheduler_step_seconds_by_kind",
            "Time of one engine step by what its batch carried: kind=decode (decode tokens only), "
            "prefill (prompt tokens only) or mixed (both: the steps whose prompt work holds up "
            "the answers decoding in them)",
            ["kind"],
            buckets=_STEP_BUCKETS,
            registry=self.registry,
        )
        for kind in STEP_KINDS:
            self.step_time_by_kind.labels(kind=kind)
        self.iteration_time = Histogram(
            "docqa:engine_iteration_seconds",
            "Engine thread time per step: the requests and cancellations taken before it, the "
            "step (scheduling, inputs, model, sampling) and the hand-off of its tokens, waits "
            "for the interpreter lock included; less docqa:scheduler_step_seconds, what "
            "serving adds to the model",
            buckets=_STEP_BUCKETS,
            registry=self.registry,
        )
        self.batch_size = Histogram(
            "docqa:batch_size",
            "Sequences per engine step",
            buckets=_COUNT_BUCKETS,
            registry=self.registry,
        )
        self.prefill_tokens = Histogram(
            "docqa:prefill_tokens_per_step",
            "Prompt tokens computed per engine step",
            buckets=(0, *_COUNT_BUCKETS),
            registry=self.registry,
        )
        self.decode_tokens = Histogram(
            "docqa:decode_tokens_per_step",
            "Decode tokens per engine step",
            buckets=(0, *_COUNT_BUCKETS),
            registry=self.registry,
        )
        self.saved = Counter(
            "docqa:prefill_seconds_saved",
            "Time to first token the prefix cache saved answers (each answer's ttft_saved_ms), "
            "by the tier its reused tokens came from, split in proportion to their counts",
            ["tier"],
            registry=self.registry,
        )
        for tier in ("device", "redis"):
            self.saved.labels(tier=tier)
        self._collector: _EngineCollector | None = None

    def attach(self, runner) -> None:
        self._collector = _EngineCollector(runner)
        self.registry.register(self._collector)

    # called from the engine thread
    def observe_step(
        self, seqs: int, prefill: int, decode: int, seconds: float, iteration: float
    ) -> None:
        """One step that ran a batch: ``seconds`` in the model, ``iteration`` of the engine
        thread's work for it from the commands before it to its tokens' hand-off."""
        self.step_time.observe(seconds)
        kind = "mixed" if prefill and decode else "prefill" if prefill else "decode"
        self.step_time_by_kind.labels(kind=kind).observe(seconds)
        self.iteration_time.observe(iteration)
        self.batch_size.observe(seqs)
        self.prefill_tokens.observe(prefill)
        self.decode_tokens.observe(decode)

    def observe_inter_token(self, seconds: float) -> None:
        self.itl.observe(seconds)

    def observe_request(
        self,
        m: RequestMetrics,
        started: bool,
        got_first_token: bool,
        cached_tokens: int = 0,
        redis_tokens: int = 0,
    ) -> None:
        if not started:
            return
        self.queue.observe(m.queue_ms / 1000)
        if got_first_token:
            self.ttft.observe(m.ttft_ms / 1000)
            if cached_tokens > 0 and m.ttft_saved_ms > 0:
                saved = m.ttft_saved_ms / 1000
                redis = saved * min(1.0, max(0, redis_tokens) / cached_tokens)
                self.saved.labels(tier="device").inc(max(0.0, saved - redis))
                self.saved.labels(tier="redis").inc(redis)
        self.e2e.observe(m.e2e_ms / 1000)

    def render(self) -> bytes:
        return generate_latest(self.registry)
