"""The Litestar app factory: settings, database, engine runner and metrics on ``app.state``;
/v1 routes behind the API-key guard; health, readiness and metrics outside it."""

from __future__ import annotations

import logging
import uuid
from pathlib import Path

from litestar import Litestar, MediaType, Response, Router, get
from litestar.datastructures import State
from litestar.di import Provide
from litestar.openapi import OpenAPIConfig
from litestar.openapi.plugins import SwaggerRenderPlugin
from litestar.openapi.spec import Components, SecurityScheme
from litestar.static_files import create_static_files_router

from app.api.conversations import (
    AskController,
    ConversationController,
    ManualQuestionController,
    RequestController,
)
from app.api.deps import auth_guard, not_draining, provide_qa, provide_tenant
from app.api.errors import EXCEPTION_HANDLERS, error_response
from app.api.manuals import ManualController
from app.api.openai_compat import ManualOpenAIController, OpenAIController
from app.api.openapi import finish_openapi
from app.api.request import DocqaRequest
from app.api.schemas import EngineInfo
from app.cancel_relay import CancelRelay
from app.db import Database
from app.engine_runner import EngineRunner
from app.metrics import CONTENT_TYPE, ServiceMetrics
from app.qa import QAService
from app.settings import Settings
from inference.model.config import dtype_name

log = logging.getLogger("docqa.api")

# which replica served a response (every /v1 response's X-Docqa-Replica header, and /ready's
# "replica"): behind a load balancer, which of them a manual's questions reach
REPLICA_HEADER = "x-docqa-replica"
REPLICA_ID = f"rep-{uuid.uuid4().hex[:12]}"

MAX_MULTIPART_PARTS = 16  # an upload has two (file, title)


WEB = Path(__file__).resolve().parent.parent / "web"  # the page's files


@get("/", include_in_schema=False, media_type=MediaType.HTML)
async def page() -> Response:
    """The page for people (app/web): manuals, questions, and what the cache saved."""
    return Response((WEB / "index.html").read_bytes(), media_type=MediaType.HTML)


@get("/health", tags=["system"], summary="Liveness", operation_id="health")
async def health() -> dict[str, str]:
    return {"status": "ok"}


async def redis_tier_status(state: State) -> str:
    """disabled (no DOCQA_REDIS_URL) | ok | degraded (configured but not answering): the
    engine's tier once it runs, a ping before."""
    url = state.settings.redis_url
    if not url:
        return "disabled"
    engine = state.runner.engine
    if engine is not None and engine.tier is not None:
        return engine.tier.status
    import redis.asyncio as aioredis

    from prefix_store.redis_client import node_url

    client = state.get("redis_client")
    if client is None:  # one node answers for a cluster too
        client = state.redis_client = aioredis.from_url(
            node_url(url)[0], socket_connect_timeout=0.5, socket_timeout=0.5
        )
    try:
        await client.ping()
        return "ok"
    except (aioredis.RedisError, OSError) as e:
        log.warning("redis tier degraded: %s", e)
        return "degraded"


@get(
    "/ready",
    tags=["system"],
    summary="Readiness: 200 once the model is loaded, else 503",
    operation_id="ready",
)
async def ready(state: State) -> Response:
    """A missing Redis only degrades caching: readiness stays 200 and reports the tier."""
    runner: EngineRunner = state.runner
    draining = state.get("draining", False)
    body = {
        "status": "draining" if draining else "ready" if runner.ready else runner.state,
        "model": runner.model_name,
        "tiers": {"device": "ok", "redis": await redis_tier_status(state)},
    }
    body["replica"] = REPLICA_ID
    if runner.error:
        body["error"] = runner.error
    if draining or not runner.ready:
        return Response(body, status_code=503, headers={"Retry-After": "5"})
    return Response(body)


@get(
    "/metrics",
    tags=["system"],
    summary="Prometheus metrics",
    media_type=CONTENT_TYPE,
    operation_id="metrics",
)
async def metrics(state: State) -> Response:
    return Response(state.metrics.render(), media_type=CONTENT_TYPE)


@get(
    "/engine",
    tags=["system"],
    summary="Model, KV capacity, pool usage and hit counters",
    operation_id="getEngine",
)
async def engine_info(state: State) -> EngineInfo:
    runner: EngineRunner = state.runner
    e = runner.require_ready()
    c = runner.counters()
    spec = e.kv_spec
    device = e.runner
    queries = c["prefix_cache_queries"]
    return EngineInfo(
        model=runner.model_name,
        model_family=runner.model_family,
        quantization=runner.model_quantization,
        weights="random" if runner.random_weights else "files",
        dtype=dtype_name(device.dtype),
        kv_dtype=dtype_name(device.kv_dtype),
        device=str(device.device),
        attention_backend=device.attention_backend,
        linear_weight_bytes=device.model.linear_storage(),
        block_size=spec.block_size,
        max_model_len=e.max_model_len,
        kv_bytes_per_token=spec.bytes_per_token,
        kv_capacity_tokens=spec.num_tokens,
        kv_capacity_blocks=spec.num_blocks,
        max_concurrency=round(spec.max_concurrency, 3),
        max_batched_tokens=e.scheduler.config.max_num_batched_tokens,
        prefill_tokens_with_decodes=e.scheduler.config.prefill_tokens_with_decodes,
        blocks_in_use=c["num_blocks"] - c["num_free_blocks"],
        blocks_cached=c["kv_cache_cached_blocks"],
        blocks_free=c["num_free_blocks"],
        requests_running=c["num_requests_running"],
        requests_waiting=c["num_requests_waiting"],
        prompt_tokens_total=c["prompt_tokens"],
        prefix_cache_queries_total=queries,
        prefix_cache_hits_total=c["prefix_cache_hits"],
        prefix_cache_copied_tokens_total=c["prefix_cache_hits_copied"],
        prompt_tokens_computed_total=c["prompt_tokens_computed"],
        generation_tokens_total=c["generation_tokens"],
        num_preemptions_total=c["num_preemptions"],
        requests_cancelled_total=c["num_cancelled"],
        deferred_admissions_total=c["num_deferred_admissions"],
        pinned_blocks=c["pinned_blocks"],
        pin_budget_blocks=c["pin_budget_blocks"],
        prefix_cache_hit_rate=round(c["prefix_cache_hits"] / queries, 4) if queries else 0.0,
    )


def create_app(settings: Settings | None = None, runner: EngineRunner | None = None) -> Litestar:
    """The app. Migrations are not run here: ``docqa serve`` applies them before the event
    loop starts."""
    settings = settings or Settings.from_env()
    service_metrics = ServiceMetrics()
    runner = runner or EngineRunner(
        model=settings.model,
        dtype=settings.dtype,
        kv_cache_gib=settings.kv_cache_gib,
        kv_dtype=settings.kv_dtype,
        batch_invariant=settings.batch_invariant,
        cuda_graphs=settings.cuda_graphs,
        pin_budget=settings.pin_budget,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        prefill_tokens_with_decodes=settings.prefill_tokens_with_decodes,
        num_threads=settings.num_threads,
        max_waiting=settings.max_waiting_requests,
        kv_tier=settings.tier_config(),
        speculate=settings.speculate,
    )
    runner.observer = service_metrics
    service_metrics.attach(runner)
    db = Database(settings.database_url)
    qa = QAService(settings, db, runner)
    if settings.redis_url:
        qa.cancel_relay = CancelRelay(settings.redis_url, settings.redis_prefix, qa.cancel_local)

    def on_startup(app: Litestar) -> None:
        finish_openapi(app.openapi_schema, settings.max_tokens_cap)
        if runner.state == "loading" and not runner._thread.is_alive():
            runner.start()
        if qa.cancel_relay is not None:
            qa.cancel_relay.start()

    async def add_replica_header(response: Response) -> Response:
        response.headers[REPLICA_HEADER] = REPLICA_ID
        return response

    async def on_shutdown(app: Litestar) -> None:
        if qa.cancel_relay is not None:
            qa.cancel_relay.stop()
        runner.stop()
        await db.close()
        client = app.state.get("redis_client")
        if client is not None:
            await client.aclose()

    v1 = Router(
        path="/v1",
        route_handlers=[
            ManualController,
            ConversationController,
            AskController,
            RequestController,
            ManualQuestionController,
            OpenAIController,
            ManualOpenAIController,
            engine_info,
        ],
        guards=[not_draining, auth_guard],
        dependencies={
            "tenant": Provide(provide_tenant, sync_to_thread=False),
            "qa": Provide(provide_qa, sync_to_thread=False),
        },
        security=[{"bearer": []}],
    )
    openapi = OpenAPIConfig(
        title="docqa",
        version="0.1.0",
        description=(
            "Prefix-caching document Q&A. Every answer reports the prompt tokens served from "
            "the cache (usage.cached_tokens) and the time to first token that saved."
        ),
        path="/schema",
        render_plugins=[SwaggerRenderPlugin()],
        components=Components(
            security_schemes={
                "bearer": SecurityScheme(
                    type="http",
                    scheme="bearer",
                    description="API key (needed when DOCQA_API_KEYS is set)",
                )
            }
        ),
    )
    return Litestar(
        route_handlers=[
            page,
            create_static_files_router(path="/static", directories=[WEB], include_in_schema=False),
            health,
            ready,
            metrics,
            v1,
        ],
        state=State(
            {
                "settings": settings,
                "runner": runner,
                "metrics": service_metrics,
                "db": db,
                "qa": qa,
            }
        ),
        on_startup=[on_startup],
        on_shutdown=[on_shutdown],
        after_request=add_replica_header,
        exception_handlers=EXCEPTION_HANDLERS,
        openapi_config=openapi,
        request_max_body_size=settings.max_upload_bytes + 2**20,
        request_class=DocqaRequest,
        multipart_form_part_limit=MAX_MULTIPART_PARTS,
        debug=False,
    )


__all__ = ["create_app", "error_response"]
