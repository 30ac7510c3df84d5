"""``create_app(settings)``: the queen as a FastAPI application. Wiring only: the parts are
built here, put on ``app.state.queen`` (``runtime.QueenState``), and started and stopped with
the app; what each part does lives in its own package."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import redis.asyncio as aioredis
from fastapi import FastAPI
from fastapi.responses import Response
from starlette.middleware import Middleware

from queen_server import __version__, reports, web
from queen_server.audits.service import AuditService
from queen_server.audits.store import AuditStore
from queen_server.billing.service import Billing
from queen_server.catalog import ModelCatalog
from queen_server.catalog.hub import HubFiles
from queen_server.catalog.pins import DatabasePins
from queen_server.cluster.bus import RedisBus
from queen_server.cluster.directory import RedisDirectory
from queen_server.cluster.seal import BusSeal
from queen_server.errors import ApiError
from queen_server.files.service import make_files
from queen_server.finetune.orders import TRANSFER_SECRET
from queen_server.finetune.service import FineTuning
from queen_server.finetune.store import JobStore
from queen_server.http import (
    admin,
    earnings,
    files,
    fine_tuning,
    images,
    openai,
    training,
    worker_ws,
)
from queen_server.http import stats as stats_routes
from queen_server.http.error_handlers import error_response, install_error_handlers
from queen_server.http.fastpath import FastPath
from queen_server.http.spec import install_docs, publish_request_schemas
from queen_server.identity import QueenOrigins
from queen_server.images.audits import ImageAudits
from queen_server.images.links import ImageLinks
from queen_server.images.orders import ImageMeter
from queen_server.payouts.runner import PayoutRunner, make_backend
from queen_server.placement.groups import GroupService
from queen_server.placement.service import PlacementService
from queen_server.quoting import Pricer, worker_earn_msat_per_1k
from queen_server.replicas import Replicas
from queen_server.runtime import DispatchStats, QueenState
from queen_server.settings import QueenSettings
from queen_server.stats.metrics import Metrics
from queen_server.stats.store import StatsStore
from queen_server.stats.swarm import SwarmStats
from queen_server.storage.engine import Database
from queen_server.swarm.dispatch import Dispatcher
from queen_server.swarm.prefix import CacheScopes, PrefixAffinity
from queen_server.swarm.registry import Registry
from shared_schema.images import ImageGenerationRequest
from shared_schema.protocol import CLOSE_GOING_AWAY

log = logging.getLogger(__name__)


def create_app(settings: QueenSettings | None = None, *, use_db: bool = True) -> FastAPI:
    settings = settings or QueenSettings()
    registry = Registry()
    db = Database(settings.db, lock_timeout_s=settings.db_lock_timeout_s) if use_db else None
    # Replicas share one Redis (issue 18): keys' rate limits, the directory, the job bus.
    shared_redis = (aioredis.Redis.from_url(settings.redis_url, socket_timeout=2,
                                            socket_connect_timeout=2)
                    if settings.redis_url else None)
    billing = Billing(settings, db, shared_redis)
    stats = SwarmStats()

    def swarm_counts() -> dict[str, int]:
        """The whole swarm's counts for the metrics (every replica's, as the last heartbeat
        read them; none while the directory is unreachable)."""
        if state.replicas is None:
            return {"replicas": 1, "workers": len(registry), "jobs_in_flight": registry.leased}
        try:
            return state.replicas.swarm()
        except Exception:  # the shared Redis is down: no whole-swarm figures now
            return {}

    metrics = Metrics(workers=lambda: len(registry), queued=lambda: registry.waiting,
                      swarm=swarm_counts)

    hub = HubFiles(settings.hub_endpoint,
                   settings.hub_token.get_secret_value() if settings.hub_token else None,
                   settings.hub_timeout_s)
    catalog = ModelCatalog(hub, ttl_s=settings.catalog_ttl_s, retry_s=settings.catalog_retry_s,
                           wait_s=settings.price_wait_s, max_header_bytes=settings.max_header_bytes,
                           local_pins=settings.local_model_pins,
                           pins=DatabasePins(db) if db is not None else None)
    if settings.audits:  # answers of a model the queen cannot pin go first to proven workers
        registry.free.unaudited = lambda name: not catalog.verified(name)

    def size_class_of(model: str) -> str:
        return state.price_of(model).size_class

    pricer = Pricer(billing.prices, catalog, registry.claims)

    def known_size_class(model: str) -> str:
        """As ``size_class_of``, starting no reading: routing scores every model a worker
        lists when it joins, and a worker's list must not make the queen read the hub."""
        return pricer.price(model).size_class

    def earn_msat_per_1k(model: str) -> int:
        if settings.auth != "keys" or state.billing.ledger is None:
            return 0  # this queen does not pay its workers
        return worker_earn_msat_per_1k(state.price_of(model).completion_msat_per_1k,
                                       settings.worker_share, True)

    groups = GroupService(settings, registry, catalog)
    placement = PlacementService(settings, registry, catalog, speeds_for=stats.speeds_for,
                                 size_class_of=size_class_of, earn_msat_per_1k=earn_msat_per_1k,
                                 groups=groups)
    dispatcher = Dispatcher(registry, settings, DispatchStats(stats, metrics), known_size_class,
                            pinned=placement.pinned)
    dispatcher.groups = groups
    audits = AuditService(settings, registry, dispatcher, billing,
                          AuditStore(db.engine) if db is not None else None, metrics,
                          groups=groups)
    groups.named_by_audits = audits.named.__contains__
    # Image jobs (issue 38) are audited by rendering them again, under the same standing.
    image_audits = (ImageAudits(audits, registry, dispatcher,
                                lambda order: ImageMeter.of(
                                    order, settings.image_tokens_per_megapixel_step),
                                settings.image_audit_max_distance, catalog.audit_file)
                    if settings.audits and db is not None else None)
    state = QueenState(
        settings=settings,
        registry=registry,
        dispatcher=dispatcher,
        billing=billing,
        db=db,
        stats=stats,
        metrics=metrics,
        catalog=catalog,
        audits=audits,
        placement=placement,
        groups=groups,
        pricer=pricer,
        # Random until the start: then the operator's secret, or the one the database keeps.
        scopes=CacheScopes(settings.cache_scope_secret.get_secret_value().encode()
                           if settings.cache_scope_secret else None),
        affinity=PrefixAffinity(settings.affinity_entries),
    )
    replicas = None
    if settings.redis_url:
        replicas = Replicas(settings.replica_id, registry, dispatcher,
                            RedisBus(settings.redis_url, seal=BusSeal(
                                settings.cluster_secret.get_secret_value()
                                if settings.cluster_secret else "")),
                            RedisDirectory(settings.redis_url, client=shared_redis),
                            stats=stats,
                            answer=lambda what, arg: reports.part(state, what, arg),
                            address=",".join(settings.public_url)
                            or f"{settings.host}:{settings.port}")
    state.replicas = replicas
    state.image_audits = image_audits
    if db is not None:  # uploads for fine-tuning (issue 37): records in the database
        state.files = make_files(settings, db.engine)
        log.info("files: kept in %s", state.files.blobs.describe())
        state.image_links = ImageLinks(db.engine, state.files.blobs, settings.image_url_ttl_s,
                                       settings.image_sweep_interval_s)
        state.fine_tuning = FineTuning(settings, JobStore(db.engine), state.files, billing,
                                       registry.holders, state.price_of, registry=registry,
                                       dispatcher=dispatcher)
        audits.fine_tuned = state.fine_tuning.models  # ft: answers' adapters for auditors
        if state.fine_tuning.runner is not None:  # a trainer must have the memory: read here
            state.fine_tuning.runner.parameters_of = catalog.parameter_count
    # With replicas, each reads back what the others wrote of their workers.
    stats_store = (StatsStore(db.engine, stats, reload=replicas is not None)
                   if db is not None else None)
    origins = QueenOrigins(settings)  # what workers' signatures must name

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        if (warning := origins.startup_warning()) is not None:
            log.warning("%s", warning)
        if state.db is not None:
            await state.db.start()
            if settings.cache_scope_secret is None:  # every replica derives the same scopes
                state.scopes.secret = await state.db.shared_secret("cache_scope")
        if stats_store is not None:
            await stats_store.load()
            stats_store.start()
        await state.billing.start()
        if replicas is not None:
            await replicas.start()
        audits.start()
        if state.fine_tuning is not None:
            # alone, a queen fails the jobs it left unfinished (their holds are gone); beside
            # replicas it cannot tell its own from theirs, and leaves them
            await state.fine_tuning.start(
                recover=replicas is None,
                secret=await state.db.shared_secret(TRANSFER_SECRET) if state.db else None)
        if state.image_links is not None:
            state.image_links.start()
        placement.start()
        groups.start()
        http = httpx.AsyncClient(timeout=20, trust_env=False)
        payouts = None
        if state.db is not None and state.billing.ledger is not None:
            payouts = PayoutRunner(settings, state.db.engine, state.billing.ledger,
                                   make_backend(settings, http), http)
            payouts.start()
            log.info("payouts: %s backend, every %.0f s, threshold %d sats",
                     settings.lightning_backend, settings.payout_interval_s,
                     settings.payout_threshold_sats)
        try:
            yield
        finally:
            if replicas is not None:
                await replicas.stop()
            await groups.stop()  # tells every group's workers, while they are connected
            await registry.close_all(CLOSE_GOING_AWAY, "the queen is shutting down")
            await audits.stop()
            if state.fine_tuning is not None:
                await state.fine_tuning.stop()
            if state.image_links is not None:
                await state.image_links.stop()
            if state.image_audits is not None:
                await state.image_audits.stop()
            await placement.stop()
            if payouts is not None:
                await payouts.stop()
            await http.aclose()
            await catalog.close()
            await state.billing.stop()
            if shared_redis is not None:
                await shared_redis.aclose()
            if stats_store is not None:
                await stats_store.stop()
            if state.db is not None:
                await state.db.close()

    def render_error(error: ApiError) -> Response:
        metrics.errors.labels(error.code or "error").inc()
        return error_response(error)

    app = FastAPI(
        title="Apiary queen",
        docs_url=None,  # served by install_docs, from local files
        redoc_url=None,
        version=__version__,
        description="An OpenAI-compatible API served by a swarm of volunteer GPUs.",
        lifespan=lifespan,
        telemetry={"tracing": False, "metrics": False, "logs": False},
        # The innermost user middleware: middleware added later wraps the hot routes too.
        middleware=[Middleware(FastPath, handlers=openai.hot.handlers, render_error=render_error,
                               observe=metrics.observe_http)],
    )
    app.state.queen = state
    app.state.origins = origins
    app.include_router(openai.hot.router)
    app.include_router(openai.router)
    app.include_router(files.router)
    app.include_router(images.router)
    app.include_router(fine_tuning.router)
    app.include_router(training.router)
    app.include_router(earnings.router)
    app.include_router(admin.router)
    app.include_router(stats_routes.router)
    app.include_router(web.router)
    app.state.admin_session = web.admin_session_valid
    app.add_api_websocket_route("/worker", worker_ws.worker_endpoint)
    install_error_handlers(app, render_error)
    publish_request_schemas(app, (*openai.SCHEMAS, ImageGenerationRequest))
    install_docs(app)
    return app
