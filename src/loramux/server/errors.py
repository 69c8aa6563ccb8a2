"""OpenAI-shaped errors: every failure the server returns is `{"error": {message, type, param, code}}`.

`APIError` is raised by the server's own checks; `from_exception` maps loramux's typed errors (and
anything else) to a status and body, so no request ever gets a bare 500 page or a stack trace.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import (
    AdapterCapacityError,
    AdapterError,
    AdapterNotFoundError,
    AdapterVersionError,
    ContextLengthError,
    ControlVectorError,
    DownloadError,
    EngineClosedError,
    FactorError,
    LoramuxError,
    ParameterError,
    RpcError,
    ScaleError,
    SourceError,
)

log = logging.getLogger("loramux.server")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 409: "invalid_request_error",
          410: "not_found_error", 413: "invalid_request_error", 415: "invalid_request_error", 421: "invalid_request_error",
          422: "invalid_request_error", 429: "rate_limit_error",
          502: "server_error", 503: "server_error"}


class APIError(Exception):
    """An error with an HTTP status and OpenAI's error fields."""

    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None,
                 type: str | None = None,  # noqa: A002 - OpenAI's field name
                 headers: dict[str, str] | None = None, extra: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.extra = dict(extra or {})  # more structured fields of the error object (n_prompt_tokens, n_ctx)
        self.status = status
        self.message = _utf8(message)
        self.code = code
        self.param = None if param is None else _utf8(param)
        self.type = type or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code,
                          **self.extra}}

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else {}
        return JSONResponse(self.body(), status_code=self.status, headers={**headers, **self.headers})

    def response_for(self, path: str) -> Response:
        """The error in the shape of the protocol that serves `path` (ERROR_SHAPES), OpenAI's otherwise."""
        best = max((p for p in ERROR_SHAPES if path.startswith(p)), key=len, default=None)
        return self.response() if best is None else ERROR_SHAPES[best](self)


# Path prefix → the error shape of the protocol served there (Anthropic's, Ollama's); each protocol module
# registers its own when imported. Every error on such a path, the guard's and validation's included, takes it.
ERROR_SHAPES: dict[str, Callable[[APIError], Response]] = {}


def _utf8(text: str) -> str:
    """`text` as it can be sent: a message or parameter that quotes the request may hold lone surrogates
    (JSON's "\\ud800"), which UTF-8 cannot encode; they are shown escaped instead of failing the response."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def model_not_found(name: str, known: list[str]) -> APIError:
    listed = ", ".join(known[:20]) + (" …" if len(known) > 20 else "")
    return APIError(404, f"The model {name!r} does not exist. Served models: {listed}. "
                         "GET /v1/models lists them; load an adapter with POST /v1/load_lora_adapter.",
                    code="model_not_found", param="model")


def context_length(message: str, n_prompt: int, n_ctx: int, param: str) -> APIError:
    """A prompt that does not fit: OpenAI's code (`context_length_exceeded`, which its clients and LangChain
    match) with llama-server's type and numbers (`exceed_context_size_error`, `n_prompt_tokens`, `n_ctx`)."""
    return APIError(400, message, code="context_length_exceeded", param=param, type="exceed_context_size_error",
                    extra={"n_prompt_tokens": n_prompt, "n_ctx": n_ctx})


def from_exception(exc: BaseException) -> APIError:
    """Map any exception to an APIError (typed loramux errors keep their code and parameter)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, RecursionError):  # a JSON body nested deeper than the parser goes
        return APIError(400, "the body is nested too deeply", code="invalid_request")
    if isinstance(exc, AdapterNotFoundError):
        return APIError(404, str(exc), code="adapter_not_found", param="lora")
    if isinstance(exc, AdapterCapacityError):
        return APIError(503, str(exc), code=exc.code, headers={"Retry-After": "5"})
    if isinstance(exc, AdapterVersionError):
        return APIError(410, str(exc), code=exc.code, param="model")
    if isinstance(exc, FactorError):
        return APIError(400, str(exc), code=exc.code, param=exc.factor or "factors")
    if isinstance(exc, ContextLengthError):
        return context_length(str(exc), exc.n_tokens, exc.n_ctx, "messages")
    if isinstance(exc, ParameterError):
        return APIError(400, str(exc), code=exc.code, param=exc.parameter)
    if isinstance(exc, ScaleError):
        return APIError(400, str(exc), code="invalid_scale", param="lora")
    if isinstance(exc, DownloadError):
        return APIError(502, str(exc), code=exc.code, param="lora_path")
    if isinstance(exc, (AdapterError, SourceError)):
        return APIError(400, str(exc), code=exc.code, param="lora_path")
    if isinstance(exc, ControlVectorError):
        return APIError(400, str(exc), code=exc.code, param="control_vector")
    if isinstance(exc, RpcError):  # the RPC workers are gone; the server restarts itself once they answer
        return APIError(503, str(exc), code=exc.code, headers={"Retry-After": "5"})
    if isinstance(exc, EngineClosedError):
        return APIError(503, "the server is shutting down", code="engine_closed")
    if isinstance(exc, LoramuxError):
        log.error("request failed: %s", exc)
        return APIError(500, str(exc), code=exc.code)
    log.error("unexpected error", exc_info=(type(exc), exc, exc.__traceback__))
    return APIError(500, f"internal error: {type(exc).__name__}", code="internal_error")


def validation_error(errors: Any) -> APIError:
    """A 400 naming the first bad fields of a body that failed validation (pydantic's `errors()` list)."""
    msg, param = _validation_message(list(errors))
    return APIError(400, msg, code="invalid_request", param=param)


def _validation_message(errors: list[Any]) -> tuple[str, str | None]:
    if not errors:
        return "invalid request body", None
    parts, param = [], None
    for e in errors[:5]:
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        where = ".".join(loc)
        param = param or (where or None)
        if e.get("type") == "extra_forbidden":
            parts.append(f"{where}: unknown field; this server does not support it (docs/server.md lists "
                         "the fields each endpoint takes)")
        elif e.get("type") == "json_invalid":
            parts.append("the body is not valid JSON: " + str(e.get("ctx", {}).get("error", e.get("msg"))))
        else:
            parts.append(f"{where or 'body'}: {e.get('msg')}")
    return "; ".join(parts), param


def install_handlers(app: FastAPI) -> None:
    """Register handlers so that validation errors, HTTP errors and crashes all answer OpenAI-shaped."""

    @app.exception_handler(APIError)
    async def _api(r: Request, exc: APIError) -> Response:
        return exc.response_for(r.url.path)

    @app.exception_handler(RequestValidationError)
    async def _invalid(r: Request, exc: RequestValidationError) -> Response:
        return validation_error(exc.errors()).response_for(r.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(r: Request, exc: StarletteHTTPException) -> Response:
        return APIError(exc.status_code, str(exc.detail), code=None).response_for(r.url.path)

    @app.exception_handler(LoramuxError)
    async def _loramux(r: Request, exc: LoramuxError) -> Response:
        return from_exception(exc).response_for(r.url.path)

    @app.exception_handler(Exception)
    async def _crash(r: Request, exc: Exception) -> Response:
        return from_exception(exc).response_for(r.url.path)


__all__ = ["ERROR_SHAPES", "APIError", "context_length", "from_exception", "install_handlers", "model_not_found", "validation_error"]
