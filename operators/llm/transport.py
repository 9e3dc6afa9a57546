"""The HTTP side of one chat-completions call, lean: a JSON body posted with aiohttp, a JSON reply read
back as a dict. The openai SDK builds and validates every request and reply through its typed models,
which cost several times the CPU of the request itself (see the README's LLM pool benchmark); our
replies are validated against their own schema anyway, so plain JSON is all we need.
"""
from __future__ import annotations

import asyncio
import json

from operators.llm.errors import error_object


class HTTPStatus(Exception):
    """A non-2xx reply: status, headers, the endpoint's error message and its error code/type."""

    def __init__(self, status: int, headers, message: str, code: str = "", error: dict | None = None):
        super().__init__(f"HTTP {status}: {message}")
        self.status_code, self.headers, self.message, self.code = status, headers, message, code
        self.error = error or {}     # the reply's error object as the provider sent it (read by its code)


class Timeout(Exception):
    """No reply within the timeout."""


class ConnectionFailed(Exception):
    """The endpoint could not be reached (``sent`` False: nothing can have been billed), or the
    connection broke after the request went out (``sent`` True: the provider may bill it)."""

    def __init__(self, message: str, sent: bool = True):
        super().__init__(message)
        self.sent = sent


def error_message(body: bytes) -> str:
    """The ``error.message`` of an OpenAI-style error body (or the body's start)."""
    try:
        data = json.loads(body)
    except ValueError:
        return body[:500].decode("utf-8", "replace")
    err = error_object(data)
    if err.get("message"):
        return str(err["message"])
    if isinstance(data, dict) and data.get("message"):
        return str(data["message"])
    return str(data)[:500]


def error_code(body: bytes) -> str:
    """``error.code`` and ``error.type`` of an OpenAI-style error body, joined (e.g.
    ``insufficient_quota``); empty when there are none."""
    err = error_object(body)
    return " ".join(dict.fromkeys(str(err[k]) for k in ("code", "type") if isinstance(err.get(k), str) and err.get(k)))


class ChatTransport:
    """aiohttp rather than httpx: httpx's connection pool checks every pooled connection on every
    request (O(connections) per request, the largest CPU cost left in our path after the SDK's models)."""

    def __init__(self, base_url: str, api_key: str, timeout_s: float, max_connections: int = 512):
        self.url = f"{base_url.rstrip('/')}/chat/completions"
        self.headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self.timeout_s, self.max_connections = timeout_s, max_connections
        self._session = None

    def _client(self):
        import aiohttp
        if self._session is None or self._session.closed:   # made in the running event loop
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.max_connections),
                timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        return self._session

    async def post(self, body: dict, headers: dict | None = None, timeout_s: float | None = None) -> dict:
        """``timeout_s``: this request's own timeout (a re-send after a timeout gets a longer one)."""
        import aiohttp
        # Only when given: aiohttp reads timeout=None as "no timeout at all".
        extra = {"timeout": aiohttp.ClientTimeout(total=timeout_s)} if timeout_s else {}
        try:
            async with self._client().post(self.url, data=json.dumps(body).encode(), **extra,
                                           headers={**self.headers, **(headers or {})}) as resp:
                status, resp_headers, content = resp.status, resp.headers, await resp.read()
        except asyncio.TimeoutError:
            raise Timeout("timeout") from None
        except aiohttp.ClientConnectorError as exc:
            raise ConnectionFailed(type(exc).__name__, sent=False) from None   # never reached the endpoint
        except aiohttp.ClientError as exc:
            raise ConnectionFailed(type(exc).__name__, sent=True) from None
        if status >= 300:
            raise HTTPStatus(status, resp_headers, error_message(content), error_code(content), error_object(content))
        try:
            return json.loads(content)
        except ValueError:
            raise HTTPStatus(502, resp_headers, "reply is not JSON") from None

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
