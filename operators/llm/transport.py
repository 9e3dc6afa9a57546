"""The HTTP side of one chat-completions call, lean: a JSON body posted with httpx, a JSON reply read
back as a dict. The openai SDK builds and validates every request and reply through its typed models,
which cost several times the CPU of the request itself (see the README's LLM pool benchmark); our
replies are validated against their own schema anyway, so plain JSON is all we need.
"""
from __future__ import annotations

import json


class HTTPStatus(Exception):
    """A non-2xx reply: status, headers and the endpoint's error message."""

    def __init__(self, status: int, headers, message: str):
        super().__init__(f"HTTP {status}: {message}")
        self.status_code, self.headers, self.message = status, headers, message


class Timeout(Exception):
    """No reply within the timeout."""


class ConnectionFailed(Exception):
    """The endpoint could not be reached, or the connection broke."""


def error_message(body: bytes) -> str:
    """The ``error.message`` of an OpenAI-style error body (or the body's start)."""
    try:
        data = json.loads(body)
    except ValueError:
        return body[:500].decode("utf-8", "replace")
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if data.get("message"):
            return str(data["message"])
    return str(data)[:500]


class ChatTransport:
    def __init__(self, base_url: str, api_key: str, timeout_s: float, max_connections: int = 512):
        import httpx2
        self._httpx = httpx2
        self.url = f"{base_url.rstrip('/')}/chat/completions"
        self.headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        limits = httpx2.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        self.client = httpx2.AsyncClient(limits=limits, timeout=timeout_s)

    async def post(self, body: dict, headers: dict | None = None) -> dict:
        httpx = self._httpx
        try:
            resp = await self.client.post(self.url, content=json.dumps(body).encode(),
                                          headers={**self.headers, **(headers or {})})
        except httpx.TimeoutException:
            raise Timeout("timeout") from None
        except httpx.TransportError as exc:
            raise ConnectionFailed(type(exc).__name__) from None
        if resp.status_code >= 300:
            raise HTTPStatus(resp.status_code, resp.headers, error_message(resp.content))
        try:
            return json.loads(resp.content)
        except ValueError:
            raise HTTPStatus(502, resp.headers, "reply is not JSON") from None

    async def aclose(self) -> None:
        await self.client.aclose()
