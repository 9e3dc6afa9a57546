"""One structured LLM call, done properly: cache, pool-wide rate limits, retries, re-asks, accounting.

:class:`LLMCaller` wraps ``openai.AsyncOpenAI`` (its own retries off: ours honour the pool's limits).
For each :class:`LLMRequest` it

1. looks the answer up in the response cache (a hit sends and pays nothing);
2. leases a permit from the pool's rate limiter with a token estimate, sends the request with
   ``response_format`` json_schema (or JSON mode, after an endpoint rejected json_schema with 400 once:
   the schema then goes into the prompt), and books the API's ``usage`` against the estimate;
3. retries 429/5xx/timeouts/connection errors with exponential backoff and full jitter, honouring
   ``Retry-After``; re-asks a bounded number of times when the reply is not JSON or violates the schema
   (telling the model what was wrong); and then gives up with an error result, never an exception.

The API key is wrapped in :class:`Secret` (its repr hides it) and scrubbed from every error message.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import re
import socket
from dataclasses import dataclass, field
from typing import Any, Callable

from operators.llm.cache import ResponseCache, cache_key
from operators.llm.ratelimit import LeaseClient
from operators.llm.schema import parse_json_reply, schema_errors
from operators.llm.usage import Prices

log = logging.getLogger(__name__)

SCHEMA_MARKER = "JSON schema:"  # the test server looks for it in JSON mode; harmless for models
ITEM_HEADER = "X-Changeforge-Item"


class Secret:
    """A string that does not print itself."""

    def __init__(self, value: str | None):
        self._value = value or ""

    def get(self) -> str:
        return self._value

    def __bool__(self) -> bool:
        return bool(self._value)

    def __repr__(self) -> str:
        return "Secret(****)"

    __str__ = __repr__


_KEYLIKE = re.compile(r"\b(sk|key|api)[-_][A-Za-z0-9_\-*]{6,}", re.I)


def redact(text: str, secret: Secret | None = None) -> str:
    """Remove the key (and anything shaped like one, e.g. a provider echoing a masked key)."""
    if secret and secret.get():
        text = text.replace(secret.get(), "****")
    return _KEYLIKE.sub("****", text)


@dataclass
class LLMConfig:
    model: str = ""
    base_url: str | None = None          # default: OPENAI_BASE_URL
    timeout_s: float = 120.0
    max_retries: int = 6                 # transport-level: 429, 5xx, timeouts, connection errors
    max_reasks: int = 2                  # content-level: malformed or schema-invalid replies
    backoff_base_s: float = 1.0
    backoff_max_s: float = 60.0
    temperature: float | None = 0.7
    max_tokens: int = 1500
    max_tokens_field: str = "max_tokens"  # OpenAI reasoning models want max_completion_tokens
    response_format: str = "json_schema"  # or json_object for endpoints known to lack schema support
    detail: str = "auto"                  # image detail level sent with every image
    price_per_mtok_in: float | None = None
    price_per_mtok_out: float | None = None
    use_cache: bool = True

    @property
    def prices(self) -> Prices:
        return Prices(self.price_per_mtok_in, self.price_per_mtok_out)


@dataclass
class LLMRequest:
    item: str                       # what the request is about (pair id); for error rows and tracing
    messages: list[dict]
    schema: dict                    # JSON schema of the reply object
    schema_name: str
    cache_parts: dict               # template version, image hashes, candidate index, ...
    image_tokens: int = 0           # estimate for the rate limiter
    check: Callable[[Any], str | None] | None = None  # extra semantic check beyond the schema


@dataclass
class LLMResult:
    item: str
    ok: bool
    value: Any = None
    error_type: str = ""
    error: str = ""
    cached: bool = False
    attempts: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost_usd: float | None = None
    response_format: str = ""
    cache_key: str = ""
    extras: dict = field(default_factory=dict)


class TransportError(Exception):
    """Retries exhausted on 429/5xx/timeouts/connection errors."""


class RequestRejected(Exception):
    """A 4xx the endpoint will keep returning (bad key, unknown model, request too large)."""


class InvalidReply(Exception):
    """Malformed or schema-violating replies after every allowed re-ask."""


def _retry_after(headers) -> float | None:
    if headers is None:
        return None
    for name, scale in (("retry-after-ms", 1e-3), ("retry-after", 1.0)):
        value = headers.get(name)
        if value:
            try:
                return max(0.0, float(value) * scale)
            except ValueError:
                continue  # an HTTP date; fall back to our own backoff
    return None


def estimate_text_tokens(messages: list[dict]) -> int:
    chars = 0
    for m in messages:
        c = m.get("content")
        if isinstance(c, str):
            chars += len(c)
        elif isinstance(c, list):
            chars += sum(len(p.get("text", "")) for p in c if isinstance(p, dict))
    return chars // 4 + 8 * len(messages)


def with_schema_in_prompt(messages: list[dict], schema: dict) -> list[dict]:
    """JSON mode has no schema slot: state it in the system message (JSON mode also requires the word
    JSON to appear in the prompt)."""
    note = f"Reply with one JSON object only. It must conform to this {SCHEMA_MARKER} {json.dumps(schema)}"
    out = [dict(m) for m in messages]
    if out and out[0].get("role") == "system" and isinstance(out[0].get("content"), str):
        out[0]["content"] = out[0]["content"] + "\n\n" + note
    else:
        out.insert(0, {"role": "system", "content": note})
    return out


class LLMCaller:
    def __init__(self, config: LLMConfig, api_key: Secret | None = None, lease: LeaseClient | None = None,
                 cache: ResponseCache | None = None, max_connections: int = 512):
        import httpx2
        import openai

        self.config = config
        self.secret = api_key if api_key is not None else Secret(os.environ.get("OPENAI_API_KEY"))
        self.lease = lease or LeaseClient(None)
        self.cache = cache if config.use_cache else None
        self.response_format = config.response_format
        self.worker = f"{socket.gethostname()}:{os.getpid()}"
        self._openai = openai
        limits = httpx2.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        self.client = openai.AsyncOpenAI(
            api_key=self.secret.get() or "not-needed",  # local servers often take no key
            base_url=config.base_url or os.environ.get("OPENAI_BASE_URL"),
            timeout=config.timeout_s, max_retries=0,
            http_client=httpx2.AsyncClient(limits=limits, timeout=config.timeout_s))

    def key_for(self, request: LLMRequest) -> str:
        params = {"temperature": self.config.temperature, "max_tokens": self.config.max_tokens,
                  "detail": self.config.detail}
        return cache_key({"model": self.config.model, "schema": request.schema_name, "params": params,
                          **request.cache_parts})

    async def call(self, request: LLMRequest) -> LLMResult:
        key = self.key_for(request)
        result = LLMResult(item=request.item, ok=False, cache_key=key)
        if self.cache is not None:
            hit = await self.cache.aget(key)
            if hit is not None and not schema_errors(hit.get("value"), request.schema):
                result.ok, result.value, result.cached = True, hit["value"], True
                result.response_format = hit.get("response_format", "")
                self.lease.add_usage({"cached": 1})
                return result
        try:
            await self._call_endpoint(request, result)
        except Exception as exc:  # noqa: BLE001 - whatever happens, the row gets a result
            result.ok, result.error_type = False, type(exc).__name__
            result.error = redact(str(exc) or repr(exc), self.secret)[:1000]
        result.cost_usd = self.config.prices.cost(result.prompt_tokens, result.completion_tokens)
        usage = {"prompt_tokens": result.prompt_tokens, "completion_tokens": result.completion_tokens,
                 "cost_usd": result.cost_usd or 0.0, "failed": 0 if result.ok else 1}
        self.lease.add_usage(usage)
        if result.ok and self.cache is not None:
            entry = {"value": result.value, "model": self.config.model, "response_format": result.response_format,
                     "item": request.item, "prompt_tokens": result.prompt_tokens,
                     "completion_tokens": result.completion_tokens}
            try:
                await self.cache.aput(key, entry)
            except Exception as exc:  # noqa: BLE001 - the answer is good; only a rerun would pay again
                log.warning("could not cache the answer for %s: %s", request.item, type(exc).__name__)
        return result

    async def _call_endpoint(self, request: LLMRequest, result: LLMResult) -> None:
        cfg = self.config
        conversation = list(request.messages)
        retries = reasks = 0
        fmt = self.response_format
        schema_rejected = ""   # the endpoint's 400 to json_schema, while we try JSON mode instead
        while True:
            if fmt == "json_schema":
                messages = conversation
                response_format = {"type": "json_schema", "json_schema": {
                    "name": request.schema_name, "schema": request.schema, "strict": False}}
            else:
                messages = with_schema_in_prompt(conversation, request.schema)
                response_format = {"type": "json_object"}
            estimate = estimate_text_tokens(messages) + request.image_tokens + cfg.max_tokens
            await self.lease.acquire(estimate)
            result.attempts += 1
            result.response_format = fmt
            try:
                kwargs = {cfg.max_tokens_field: cfg.max_tokens}
                if cfg.temperature is not None:
                    kwargs["temperature"] = cfg.temperature
                reply = await self.client.chat.completions.create(
                    model=cfg.model, messages=messages, response_format=response_format,
                    extra_headers={ITEM_HEADER: request.item[:200]}, **kwargs)
            except self._openai.APIStatusError as exc:
                self.lease.release(-estimate)
                status = exc.status_code
                if status == 400 and fmt == "json_schema":
                    # Perhaps an endpoint without json_schema support: try JSON mode. Only if that is
                    # accepted does this actor switch for good (a 400 can have other causes).
                    schema_rejected = self._message(exc)
                    fmt = "json_object"
                    continue
                if status == 400 and schema_rejected:
                    raise RequestRejected(f"HTTP 400: {schema_rejected}") from None
                if status in (408, 409, 429) or status >= 500:
                    retries += 1
                    if retries > cfg.max_retries:
                        raise TransportError(f"HTTP {status} after {retries} attempts") from None
                    await self._backoff(retries, _retry_after(exc.response.headers))
                    continue
                raise RequestRejected(f"HTTP {status}: {self._message(exc)}") from None
            except (self._openai.APITimeoutError, self._openai.APIConnectionError) as exc:
                self.lease.release(-estimate)
                retries += 1
                if retries > cfg.max_retries:
                    kind = "timeout" if isinstance(exc, self._openai.APITimeoutError) else "connection error"
                    raise TransportError(f"{kind} after {retries} attempts") from None
                await self._backoff(retries, None)
                continue
            except BaseException:
                self.lease.release(-estimate)  # cancelled or unexpected: the permit still goes back
                raise
            if schema_rejected and self.response_format == "json_schema":
                log.warning("endpoint rejected response_format json_schema (%s); using JSON mode",
                            schema_rejected[:200])
                self.response_format = "json_object"
            usage = reply.usage
            p = int(getattr(usage, "prompt_tokens", 0) or 0)
            c = int(getattr(usage, "completion_tokens", 0) or 0)
            result.prompt_tokens += p
            result.completion_tokens += c
            self.lease.release((p + c - estimate) if usage else 0.0)
            content = reply.choices[0].message.content if reply.choices else None
            problem = self._problem(content, request)
            if problem and reply.choices and reply.choices[0].finish_reason == "length":
                problem += f" (cut off at {cfg.max_tokens} tokens: raise --max-tokens)"
            if problem is None:
                result.ok, result.value = True, parse_json_reply(content)
                return
            reasks += 1
            if reasks > cfg.max_reasks:
                raise InvalidReply(f"invalid reply after {reasks} attempts: {problem}")
            conversation = list(request.messages) + [
                {"role": "assistant", "content": (content or "")[:4000]},
                {"role": "user", "content": f"Your reply was not usable: {problem}. Reply again with only "
                                            "the JSON object, conforming to the schema."}]

    def _problem(self, content: str | None, request: LLMRequest) -> str | None:
        try:
            value = parse_json_reply(content)
        except ValueError as exc:
            return str(exc)
        errors = schema_errors(value, request.schema)
        if errors:
            return "; ".join(errors)
        return request.check(value) if request.check else None

    def _message(self, exc) -> str:
        body = getattr(exc, "body", None)
        msg = body.get("message") if isinstance(body, dict) else None
        if isinstance(body, dict) and isinstance(body.get("error"), dict):
            msg = body["error"].get("message")
        return redact(str(msg or exc.message or ""), self.secret)[:500]

    async def _backoff(self, attempt: int, retry_after: float | None) -> None:
        cfg = self.config
        delay = min(cfg.backoff_max_s, cfg.backoff_base_s * 2 ** (attempt - 1)) * random.uniform(0.5, 1.0)
        if retry_after is not None:
            # The server said when: wait that long, plus a little jitter so actors don't stampede.
            delay = min(cfg.backoff_max_s, retry_after) + random.uniform(0, 0.1 * retry_after + 0.05)
        await asyncio.sleep(delay)

    async def aclose(self) -> None:
        await self.lease.flush()
        await self.client.close()

