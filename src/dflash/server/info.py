"""`GET /health`, `GET /v1/models` (and `/v1/models/{id}`), `GET /metrics`."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from dflash.server.context import ServerContext, context_of

router = APIRouter()


def model_card(ctx: ServerContext) -> dict[str, object]:
    return {
        "id": ctx.model_name, "object": "model", "created": ctx.created, "owned_by": "dflash",
        "last_used_ms": ctx.runner.last_used_ms,
        "context_length": ctx.engine.max_ctx,
        "spec": str(getattr(ctx.engine.options, "spec", "none")),
    }


@router.get("/health")
async def health(request: Request) -> Response:
    ctx = context_of(request)
    return JSONResponse({
        "status": "ok", "model": ctx.model_name, "busy": ctx.worker.busy, "queued": ctx.worker.queue_depth,
    })


@router.get("/v1/models")
async def list_models(request: Request) -> Response:
    ctx = context_of(request)
    return JSONResponse({"object": "list", "data": [model_card(ctx)]})


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, request: Request) -> Response:
    ctx = context_of(request)
    ctx.resolve_model(model_id)
    return JSONResponse(model_card(ctx))


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    payload, content_type = context_of(request).metrics.render()
    return Response(payload, media_type=content_type)
