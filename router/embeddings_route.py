"""POST /v1/embeddings (OpenAI's shape) in front of the embedding pool
(router/embedding_pool.py): the body validated here, the inputs tokenized and embedded by
an embedding worker, the vectors returned as floats or as base64 of little-endian float32
(OpenAI's `encoding_format`). An app without an `embedding:` pool answers 404 naming the
model, as for any model it does not serve. Traced (kvray/tracing.py), a request is a root
span here and the worker's `embed` span."""

from __future__ import annotations

import base64
import logging
import uuid
from collections.abc import Mapping
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator

from kvray import tracing as attr
from kvray.errors import InvalidArgumentError, KvrayError
from kvray.router.api_error import APIError, internal_error
from kvray.router.ingress_parts import Admission, cause
from kvray.router.request_body import check_body, validate_body
from kvray.timeouts import wait_for
from kvray.tracing import RequestTrace, Tracing

logger = logging.getLogger(__name__)
MAX_INPUTS = 2048  # OpenAI's limit of inputs per request
INFO_CALL_S = 5.0  # how long the model's card waits for the pool


class EmbeddingsRequest(BaseModel):
    """OpenAI's body; a field it does not have is a 400 naming it."""

    model_config = ConfigDict(extra="forbid")

    model: str
    input: str | list[str] | list[int] | list[list[int]] = Field(
        description="a text, texts, token ids, or lists of token ids (at most 2048 inputs)"
    )
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None

    @field_validator("input")
    @classmethod
    def _inputs(cls, value):
        items = [value] if isinstance(value, str) else value
        if not items or len(items) > MAX_INPUTS or any(x == "" or x == [] for x in items):
            raise ValueError(f"1 to {MAX_INPUTS} non-empty inputs")
        return value

    def inputs(self) -> list[str | list[int]]:
        """One entry per input: a text or a list of token ids."""
        if isinstance(self.input, str) or (self.input and isinstance(self.input[0], int)):
            return [self.input]
        return list(self.input)


class EmbeddingsRoute:
    """`handle`: the embedding pool's deployment handle (None: the app has no pool);
    `model_name`: the model clients name for it."""

    def __init__(self, handle, model_name: str | None, admission: Admission, tracing: Tracing | None = None):
        self.handle = handle
        self.model_name = model_name
        self.admission = admission
        self.tracing = tracing  # None: untraced
        self._info: dict | None = None  # max_model_len, dimensions: asked once

    async def info(self) -> dict | None:
        """The embedding model's card fields (None without a pool); a pool that does not
        answer within INFO_CALL_S (none of its workers up yet) is a 503."""
        if self.handle is not None and self._info is None:
            try:
                self._info = await wait_for(self.handle.model_info.remote(), INFO_CALL_S)
            except Exception as e:  # noqa: BLE001 (starting, or gone: ask again next time)
                raise APIError(
                    503, f"the embedding pool did not answer: {type(e).__name__}", type="service_unavailable"
                ) from None
        return self._info

    async def alive(self, timeout: float) -> bool:
        """Whether a worker of the pool answers within `timeout` (/health)."""
        try:
            await wait_for(self.handle.check_health.remote(), timeout)
            return True
        except Exception:  # noqa: BLE001 (none up, or it failed its check)
            return False

    async def answer(self, body: dict, headers: Mapping[str, str] | None = None) -> dict:
        """The response body. Traced: a root span (its parent the `traceparent` in
        `headers`) and the worker's `embed` span under it."""
        trace = self.tracing.request(headers) if self.tracing is not None else None
        try:
            answer = await self._answer(body, trace)
        except BaseException as e:
            if trace is not None:
                trace.end(e)
            raise
        if trace is not None:
            trace.set({attr.PROMPT_TOKENS: answer["usage"]["prompt_tokens"]})
            trace.end()
        return answer

    async def _answer(self, body: dict, trace: RequestTrace | None) -> dict:
        check_body(body)
        req = validate_body(EmbeddingsRequest, body)
        if self.handle is None or req.model != self.model_name:
            raise APIError(404, f"model {req.model!r} does not exist", param="model", code="model_not_found")
        dimensions = (await self.info())["dimensions"]
        if req.dimensions not in (None, dimensions):
            raise APIError.invalid(
                InvalidArgumentError("dimensions", req.dimensions, f"{dimensions} (the model's)")
            )
        request_id = f"embd-{uuid.uuid4().hex[:12]}"
        if trace is not None:
            trace.set({attr.REQUEST_ID: request_id, attr.RESPONSE_MODEL: self.model_name})
        with self.admission.admitted(1):
            try:
                carrier = trace.carrier if trace is not None else None
                vectors, counts = await self.handle.embed.remote(req.inputs(), carrier)
            except Exception as e:  # noqa: BLE001 (the replica's error, out of Ray's wrapping)
                error = cause(e)
                if isinstance(error, InvalidArgumentError):
                    raise APIError.invalid(error) from None
                logger.error("kvray ingress: embeddings %s failed", request_id, exc_info=error)
                if isinstance(error, KvrayError):
                    raise APIError(503, str(error), type="service_unavailable") from None
                raise internal_error(request_id) from None
        tokens = sum(counts)
        return {
            "object": "list",
            "data": [
                {"object": "embedding", "index": i, "embedding": _encoded(v, req.encoding_format)}
                for i, v in enumerate(vectors)
            ],
            "model": self.model_name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }


def _encoded(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode()
    return vector.tolist()
