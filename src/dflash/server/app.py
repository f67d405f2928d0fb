"""`create_app(engine, settings)`: the FastAPI application behind `dflash serve`.

One app owns one engine, one generation worker (started and stopped with the app's lifespan, or on first
use; it runs as many requests at once as the engine batches), one metrics registry and the routes of every
API.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware

from dflash.server import (
    anthropic_messages,
    chat_page,
    info,
    openai_chat,
    openai_completions,
    openai_responses,
)
from dflash.server.auth import APIKeyMiddleware
from dflash.server.body_deadline import BodyDeadline
from dflash.server.context import ServerContext
from dflash.server.engine_port import EnginePort
from dflash.server.errors import install_error_handlers
from dflash.server.metrics import Metrics
from dflash.server.openapi_bodies import install_request_bodies
from dflash.server.origin_guard import BrowserGuard, BrowserPolicy
from dflash.server.prompt import PromptBuilder
from dflash.server.request_log import RequestCounter
from dflash.server.runner import TurnRunner
from dflash.server.settings import ServerSettings
from dflash.server.worker import GenerationWorker


def create_app(engine: EnginePort, settings: ServerSettings | None = None) -> FastAPI:
    settings = settings or ServerSettings()
    metrics = Metrics()
    worker = GenerationWorker(concurrency=settings.concurrency_for(engine.options), max_queue=settings.max_queue)
    metrics.bind_worker(lambda: worker.queue_depth, lambda: worker.running)
    prefix_cache = getattr(engine, "prefix_cache", None)  # only the real engine has one
    if prefix_cache is not None:
        metrics.bind_prefix_cache(prefix_cache.stats)
    speculation_pauses = getattr(engine, "speculation_pauses", None)  # only the real engine batches and pauses
    if speculation_pauses is not None:
        metrics.bind_speculation_pauses(speculation_pauses)
    ctx = ServerContext(
        engine=engine,
        settings=settings,
        prompts=PromptBuilder(engine, settings.chat_template, remap_developer_role=settings.remap_developer_role),
        worker=worker,
        runner=TurnRunner(engine, worker, metrics, settings.stall, settings.keepalive_s,
                          request_timeout_s=settings.request_timeout_s),
        metrics=metrics,
        model_name=settings.served_model_name or engine.model_name,
        created=int(time.time()),
    )
    if hasattr(engine, "step_observer"):  # only the batching engine reports its steps
        runner = ctx.runner
        # its steps stream every request's text from the engine loop thread: delivered once per step
        runner.flushed_per_step = bool(getattr(engine, "batched", False))

        def after_step(size: int) -> None:  # on the engine loop thread
            metrics.observe_batch(size)
            runner.flush_events()  # the step's streamed text, every request's, in one wake-up of the event loop

        setattr(engine, "step_observer", after_step)  # noqa: B010 (not part of EnginePort)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        worker.start()
        try:
            yield
        finally:
            worker.stop()

    app = FastAPI(title="dflash", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.ctx = ctx
    routers = [
        m.router for m in (info, openai_chat, openai_completions, openai_responses, anthropic_messages, chat_page)
    ]
    for router in routers:
        app.include_router(router)
    install_error_handlers(app)
    install_request_bodies(app)

    # Outermost last: counter and log see every answer; the browser guard runs before CORS preflights are
    # answered and before the key check (a preflight carries no key).
    app.add_middleware(BodyDeadline, timeout_s=settings.body_timeout_s)
    if settings.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=settings.api_key)
    if settings.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(settings.allowed_origins), allow_methods=["GET", "POST"],
                           allow_headers=["*"], max_age=600)
    policy = BrowserPolicy.for_server(settings.host, settings.allowed_hosts, settings.allowed_origins)
    app.add_middleware(BrowserGuard, policy=policy)
    app.add_middleware(RequestCounter, metrics=metrics, routes=[r for router in routers for r in router.routes])
    return app

