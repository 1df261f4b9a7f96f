"""Every error the HTTP layer can answer with, and the one place that turns an exception into a response.

Clients see OpenAI-shaped JSON, `{"error": {"message", "type", "param", "code"}}`, with a 4xx (or 503/504)
status. Messages say which field was wrong and what was expected; they never carry a traceback, a memory
address, a local path or an API key. Anything unexpected becomes a 500 with a generic message (the detail
goes to the replica's log only), so a user's input can never leak internals.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi.responses import JSONResponse

log = logging.getLogger("raydeploy.serve")


class APIError(Exception):
    """An error with an HTTP status and an OpenAI error body."""

    status: int = 400
    type: str = "invalid_request_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 status: int | None = None, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        if status is not None:
            self.status = status
        self.retry_after_s = retry_after_s

    def body(self) -> dict[str, Any]:
        param = None if self.param is None else _writable(self.param)
        return {"error": {"message": _writable(self.message), "type": self.type, "param": param,
                          "code": self.code}}

    def headers(self) -> dict[str, str]:
        if self.retry_after_s is None:
            return {}
        return {"Retry-After": str(max(1, int(round(self.retry_after_s))))}

    def __reduce__(self):  # survives pickling with its fields
        return (_rebuild, (type(self), self.message, self.param, self.code, self.status, self.retry_after_s))


def _writable(text: str) -> str:
    """`text` with anything UTF-8 cannot encode (a lone surrogate from a client's field name) escaped, so
    writing the error can never fail."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _rebuild(cls: type[APIError], message: str, param: str | None, code: str | None, status: int,
             retry_after_s: float | None) -> APIError:
    return cls(message, param=param, code=code, status=status, retry_after_s=retry_after_s)


class InvalidRequest(APIError):
    """400: a field has a bad value, or the body is not what the endpoint takes."""


class ModelNotFound(APIError):
    status = 404
    type = "invalid_request_error"

    def __init__(self, model: str, served: str) -> None:
        super().__init__(f"model '{model}' does not exist; this server serves '{served}'",
                         param="model", code="model_not_found")


class NotFound(APIError):
    status = 404
    type = "invalid_request_error"


class Unauthorized(APIError):
    status = 401
    type = "authentication_error"

    def __init__(self, message: str = "missing or invalid API key; send 'Authorization: Bearer <key>'") -> None:
        super().__init__(message, code="invalid_api_key")


class PayloadTooLarge(APIError):
    status = 413

    def __init__(self, limit_bytes: int) -> None:
        super().__init__(f"request body is larger than the limit of {limit_bytes} bytes (serving.max_body_bytes)",
                         code="request_too_large")


class UnsupportedMediaType(APIError):
    status = 415

    def __init__(self, found: str | None) -> None:
        super().__init__(f"Content-Type must be application/json, found {found or 'none'!r}",
                         code="unsupported_media_type")


class Overloaded(APIError):
    """503: the queue is full. Retriable after Retry-After seconds."""

    status = 503
    type = "server_error"

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message, code="overloaded", retry_after_s=retry_after_s)


class ServiceUnavailable(APIError):
    """503: the gang is starting, restarting or failed. Retriable unless the gang has failed for good."""

    status = 503
    type = "server_error"

    def __init__(self, message: str, retry_after_s: float | None = 5.0) -> None:
        super().__init__(message, code="service_unavailable", retry_after_s=retry_after_s)


class RequestTimeout(APIError):
    status = 504
    type = "server_error"

    def __init__(self, timeout_s: float) -> None:
        super().__init__(f"request did not finish within {timeout_s:g} s and was aborted", code="timeout")


class InternalError(APIError):
    status = 500
    type = "server_error"

    def __init__(self) -> None:
        super().__init__("internal server error; the details are in the server log", code="internal_error")


class RequestFailedError(APIError):
    """500 for one request the engine failed (the others went on); it is not retried. The message names the
    request, so its log lines can be found."""

    status = 500
    type = "server_error"


def to_api_error(exc: BaseException) -> APIError:
    """The one mapping from any exception to an `APIError` (unknown ones become a logged 500)."""
    if isinstance(exc, APIError):
        return exc
    log.error("unexpected error while serving a request", exc_info=exc)
    return InternalError()


def error_response(exc: BaseException) -> JSONResponse:
    err = to_api_error(exc)
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers())


def pydantic_error(exc: Any, prefix: str = "") -> InvalidRequest:
    """Turn a pydantic ValidationError into a 400 naming the first offending field (`param`)."""
    first = exc.errors(include_url=False, include_input=False)[0]
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body",)]
    # Union branches add their type name to the location (e.g. messages.0.content.str); drop those.
    loc = [p for p in loc if not _is_type_tag(p)]
    param = ".".join(loc) if loc else None
    msg = first.get("msg", "invalid value")
    if first.get("type") == "extra_forbidden":
        msg = "unknown parameter (not supported by this server)"
    where = f"'{prefix}{param}'" if param else "the request body"
    return InvalidRequest(f"{where}: {msg}", param=param, code="invalid_value")


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "list[str]", "list[int]", "list[list[int]]",
              "none", "function-after", "function-before", "function-wrap", "constrained-str", "json-or-python"}


def _is_type_tag(part: str) -> bool:
    return part in _TYPE_TAGS or part.startswith(("list[", "function-", "tagged-union[", "union["))
