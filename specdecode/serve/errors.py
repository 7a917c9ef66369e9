"""OpenAI's error shape: `{"error": {"message", "type", "param", "code"}}`, and the exception a
handler raises to answer with it (ApiError: the status, the message naming the field and its limit)."""
from __future__ import annotations

import json

ERROR_TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 405: "invalid_request_error",
               413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error", 503: "server_error"}
# Anthropic's error types by status (the Messages API's paths answer in its shape)
ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                         404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                         500: "api_error", 503: "overloaded_error", 529: "overloaded_error"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)


def stream_error(status: int, message: str) -> dict:
    """An error event in a stream, which has no status line of its own: its code names the status
    (e.g. "service_unavailable" for 503)."""
    from http import HTTPStatus
    return error_body(status, message, code=HTTPStatus(status).name.lower())


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}       # OpenAI's: a string such as "invalid_api_key", or null


def anthropic_error_body(status: int, message: str) -> dict:
    """Anthropic's error shape: `{"type": "error", "error": {"type", "message"}}`."""
    kind = ANTHROPIC_ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


async def read_json(http):
    """A request's JSON body (any JSON value), or the 400 that names what is malformed."""
    try:
        return json.loads(await http.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"malformed JSON body: {exc}") from None
