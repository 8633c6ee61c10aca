"""The OpenAPI document's request bodies: the routes read their bodies themselves (for
OpenAI-shaped errors and the size limit), so FastAPI cannot see them; these helpers tell it."""

from __future__ import annotations

from pydantic import BaseModel

from kvray.router.embeddings_route import EmbeddingsRequest
from kvray.router.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from kvray.router.responses_api import ResponsesRequest

BODIES = (
    CompletionRequest,
    ChatCompletionRequest,
    ResponsesRequest,
    EmbeddingsRequest,
    TokenizeRequest,
    DetokenizeRequest,
)


def openapi_body(model: type[BaseModel]) -> dict:
    """A route's `openapi_extra`: its JSON body is `model`."""
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def openapi_schemas() -> dict[str, dict]:
    """The JSON schemas of the request bodies and every model they use, by name."""
    from pydantic.json_schema import models_json_schema

    _, top = models_json_schema(
        [(m, "validation") for m in BODIES], ref_template="#/components/schemas/{model}"
    )
    return top["$defs"]
