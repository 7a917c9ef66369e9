"""Who may call the server, and how much they may send: one ASGI middleware in front of the app.

* `api_key` (`--api-key`, or env SPECDECODE_API_KEY): every request but `/health` and the
  dashboard's own files (`/`, `/static/...`: the page loads, its API calls need the key) must carry
  `Authorization: Bearer KEY` or `x-api-key: KEY` (Anthropic's clients), compared in constant time;
  else 401 in OpenAI's error shape (Anthropic's on the Messages API's paths). The key never appears
  in a response or a log line.
* `max_body_bytes` (`--max-body-bytes`): a request body over it gets 413, decided from
  Content-Length when given, else while the body is read (the body is buffered, then replayed to
  the app: requests are small JSON documents).
"""
from __future__ import annotations

import hmac
import ipaddress
import json
import sys

from .errors import anthropic_error_body
from .protocol import error_body

DEFAULT_MAX_BODY_BYTES = 4 * 2**20
OPEN_PATHS = ("/health", "/")
OPEN_PREFIXES = ("/static/",)
ANTHROPIC_PREFIX = "/v1/messages"        # paths answered in Anthropic's error shape


def exposed_without_key(host: str, api_key: str | None) -> bool:
    """True when the server listens beyond the loopback interface without a key (worth a warning)."""
    if api_key:
        return False
    if host in ("localhost", ""):
        return host == ""
    try:
        return not ipaddress.ip_address(host).is_loopback
    except ValueError:          # a host name: assume it is reachable from elsewhere
        return True


def warn_if_exposed(host: str, api_key: str | None) -> None:
    if exposed_without_key(host, api_key):
        print(f"warning: listening on {host} without an API key: anyone who can reach this port may use "
              f"the server (set --api-key or SPECDECODE_API_KEY)", file=sys.stderr)


class Guard:
    """ASGI middleware: API key check and request body limit (see the module docstring)."""

    def __init__(self, app, api_key: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        if max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes}")
        self.app, self.max_body_bytes = app, max_body_bytes
        self.key = api_key.encode() if api_key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        headers = dict(scope.get("headers") or [])
        if self.key is not None and path not in OPEN_PATHS and not path.startswith(OPEN_PREFIXES):
            given = headers.get(b"authorization", b"")
            token = given[7:].strip() if given[:7].lower() == b"bearer " else b""
            other = headers.get(b"x-api-key", b"").strip()
            # both compared, whatever the first gives: the time taken does not tell which was sent
            good = hmac.compare_digest(token, self.key) | hmac.compare_digest(other, self.key)
            if not good:
                what = "a wrong API key" if token or other else \
                    "no API key (send Authorization: Bearer KEY or x-api-key: KEY)"
                return await _reply(send, 401, f"{what}: this server requires its API key",
                                    "invalid_api_key", path)
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            return await _reply(send, 413, _too_big(int(length), self.max_body_bytes), "request_too_large", path)
        if scope.get("method") not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        chunks, size = [], 0
        while True:                              # read (at most the limit), then replay
            message = await receive()
            if message["type"] != "http.request":
                return await self.app(scope, _replay([message]), send)
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body_bytes:
                return await _reply(send, 413, _too_big(size, self.max_body_bytes), "request_too_large", path)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        return await self.app(scope, _replay([{"type": "http.request", "body": body, "more_body": False}], receive),
                              send)


def _too_big(size: int, limit: int) -> str:
    return f"request body of {size} bytes exceeds --max-body-bytes {limit}"


def _replay(messages: list[dict], then=None):
    pending = list(messages)

    async def receive():
        if pending:
            return pending.pop(0)
        if then is not None:
            return await then()                  # e.g. http.disconnect, for streaming responses
        return {"type": "http.disconnect"}
    return receive


async def _reply(send, status: int, message: str, code: str, path: str = "") -> None:
    shaped = anthropic_error_body(status, message) if path.startswith(ANTHROPIC_PREFIX) else \
        error_body(status, message, None, code)
    body = json.dumps(shaped).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
