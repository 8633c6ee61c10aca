"""OpenAI's error shape: `APIError`, which a client sees as the body
`{"error": {"message", "type", "param", "code"}}` with an HTTP status."""

from __future__ import annotations

from kvray.errors import InvalidArgumentError


class APIError(Exception):
    """An error a client sees as OpenAI's error body with this status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def __reduce__(self):  # handle callers receive it through Ray with its fields
        args = (self.status, self.message, self.type, self.param, self.code, self.headers)
        return _rebuild_api_error, (type(self), *args)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    @classmethod
    def invalid(cls, e: InvalidArgumentError) -> APIError:
        return cls(400, str(e), param=e.field, code="invalid_value")


def internal_error(request_id: str) -> APIError:
    """A 500 that names the request (its cause is in the server's log), never the cause."""
    return APIError(
        500,
        f"the server failed to complete request {request_id}; its cause is in the server's log",
        type="internal_server_error",
        code="internal_error",
    )


def _rebuild_api_error(cls, status, message, type, param, code, headers) -> APIError:
    return cls(status, message, type=type, param=param, code=code, headers=headers)
