"""Errors a request gets, as OpenAI-style bodies: {"error": {"code", "message", "type"}} (llama-server's)."""
from __future__ import annotations

from fastapi.responses import JSONResponse

TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
         405: "invalid_request_error", 413: "invalid_request_error", 500: "server_error",
         501: "not_supported_error", 503: "unavailable_error"}


class ApiError(Exception):
    """A request that cannot be served: its status and one line saying why."""

    def __init__(self, status: int, message: str, type_: str | None = None) -> None:
        """status: the HTTP status; type_: OpenAI's error type (by default the status's)."""
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_ or TYPES.get(status, "server_error")


def error_body(status: int, message: str, type_: str | None = None) -> dict:
    """The JSON of an error: {"error": {"code", "message", "type"}}."""
    return {"error": {"code": status, "message": message, "type": type_ or TYPES.get(status, "server_error")}}


def error_response(err: ApiError) -> JSONResponse:
    """An ApiError as a JSON response with its status."""
    return JSONResponse(error_body(err.status, err.message, err.type), status_code=err.status)
