"""Request bodies in `/openapi.json`.

The API routes read their JSON by hand (`body.py`: size limit, parse errors and field errors in each API's own
format), so FastAPI cannot see what they expect. This declares each POST route's body from the same pydantic
models the routes validate with; parsing is not affected.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from dflash.server.schemas_anthropic import CountTokensRequest, MessagesRequest
from dflash.server.schemas_openai import ChatCompletionRequest, CompletionRequest
from dflash.server.schemas_responses import (
    FunctionCallItem,
    FunctionCallOutputItem,
    MessageItem,
    ReasoningItem,
    ResponsesRequest,
)

REQUEST_MODELS: dict[str, type[BaseModel]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
    "/v1/responses": ResponsesRequest,
    "/v1/messages": MessagesRequest,
    "/v1/messages/count_tokens": CountTokensRequest,
}
# `ResponsesRequest.input` holds raw objects (each item is validated by its own type later); documented as these.
_RESPONSES_ITEMS: tuple[type[BaseModel], ...] = (MessageItem, FunctionCallItem, FunctionCallOutputItem, ReasoningItem)
_REF = "#/components/schemas/{model}"


def install_request_bodies(app: FastAPI) -> None:
    """Makes `app.openapi()` (served at `/openapi.json`) declare the body of every route in `REQUEST_MODELS`."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            add_request_bodies(schema)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def add_request_bodies(schema: dict[str, Any]) -> None:
    models = [*REQUEST_MODELS.values(), *_RESPONSES_ITEMS]
    refs, definitions = models_json_schema([(m, "validation") for m in models], ref_template=_REF)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for name, definition in definitions.get("$defs", {}).items():
        components.setdefault(name, definition)
    items = [refs[(m, "validation")] for m in _RESPONSES_ITEMS]
    responses_name = refs[(ResponsesRequest, "validation")]["$ref"].rsplit("/", 1)[-1]
    components[responses_name]["properties"]["input"] = {
        "title": "Input",
        "anyOf": [{"type": "string"}, {"type": "array", "items": {"anyOf": items}}],
    }
    for path, model in REQUEST_MODELS.items():
        operation = schema.get("paths", {}).get(path, {}).get("post")
        if operation is not None:
            operation["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": refs[(model, "validation")]}},
            }
