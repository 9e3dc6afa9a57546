"""One structured LLM call, done properly: cache, pool-wide rate limits, retries, re-asks, accounting.

:class:`LLMCaller` posts OpenAI-compatible chat completions through a lean HTTP transport
(:mod:`operators.llm.transport`: plain JSON, no SDK models; retries are ours and honour the pool's limits).
For each :class:`LLMRequest` it

1. looks the answer up in the response cache, keyed on the rendered request (a hit sends and pays
   nothing);
2. leases a permit from the pool's rate limiter charged what the provider charges on arrival (prompt
   text + images by the model family's rule + the completion cap), sends the request with
   ``response_format`` json_schema in strict mode (or plain json_schema, or JSON mode with the schema in
   the prompt, after the endpoint rejected the former with 400 once);
3. adapts to 400s naming ``max_tokens`` (-> ``max_completion_tokens``), ``temperature`` (left out) or
   strict mode (dropped), judged against what *that attempt* sent, and shares what it learnt with the
   pool through the limiter (until a request is answered, one attempt at a time goes out, so a first
   wave costs a 400 per quirk, not one per request); reports 429s to the limiter, which pauses and slows
   the whole pool (Retry-After capped at ``max_retry_after_s``); stops the pool on a quota 429
   (:class:`QuotaExhausted`); retries 5xx and connections never made with exponential backoff and
   jitter; re-sends a timed-out request (or one whose connection broke after sending) once, with twice
   the timeout, and books its usage unknown (the provider may have billed it); re-asks a bounded number of times when the
   reply is not JSON or violates the schema (telling the model what was wrong), or with twice the room
   when it was cut off at the cap; and then gives up with an error result, never an exception.

The API key is a :class:`Secret` read where it is used (its repr hides it, a pickle carries only its
source) and scrubbed from every error message. Usage an endpoint does not report is unknown (None),
as is the usage of a request one of whose attempts may have been billed unreported.
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import hashlib
import json
import logging
import math
import os
import random
import re
import socket
from dataclasses import dataclass, field
from typing import Any, Callable
from urllib.parse import quote

from operators.llm.cache import ResponseCache, cache_key
from operators.llm.errors import ErrorReading, read_error
from operators.llm.images import image_token_rule, request_image_tokens
from operators.llm.ratelimit import LeaseClient, QuotaExhausted
from operators.llm.schema import parse_json_reply, schema_errors, strict_schema
from operators.llm.transport import ChatTransport, ConnectionFailed, HTTPStatus, Timeout
from operators.llm.usage import Prices

log = logging.getLogger(__name__)

DEFERRED = "Deferred"   # error_type of a request left to a provider batch (no row yet: a later pass answers it)
SCHEMA_MARKER = "JSON schema:"  # the test server looks for it in JSON mode; harmless for models
ITEM_HEADER = "X-Changeforge-Item"


class Secret:
    """An API key that does not print itself and never travels as a value.

    Made from a *source* (:meth:`from_source`): ``env:NAME`` (an environment variable of the process
    that uses it), ``file:/path`` (a secret file mounted on every node), or
    ``aws-sm:<secret id or ARN>[#json-field]`` (AWS Secrets Manager, read with the node's IAM role).
    The value is read where the key is used, on the worker, and a pickled Secret (an actor argument,
    a spilled object) carries the source only. A Secret made from a raw value pickles as
    ``env:OPENAI_API_KEY`` when it is that variable's value, and refuses to be pickled otherwise.
    """

    DEFAULT_SOURCE = "env:OPENAI_API_KEY"

    def __init__(self, value: str | None = None, source: str | None = None):
        self._value = value
        self.source = source

    @classmethod
    def from_source(cls, source: str = "") -> "Secret":
        source = source or cls.DEFAULT_SOURCE
        if not source.startswith(("env:", "file:", "aws-sm:")):
            raise ValueError(f"key source must be env:NAME, file:/path or aws-sm:<secret id>[#field], "
                             f"not {source.split(':')[0]!r}")
        return cls(None, source)

    def _resolve(self) -> str:
        kind, _, ref = self.source.partition(":")
        if kind == "env":
            return os.environ.get(ref, "")
        if kind == "file":
            with open(ref, encoding="utf-8") as f:
                return f.read().strip()
        import boto3
        secret_id, _, json_field = ref.partition("#")
        text = boto3.client("secretsmanager").get_secret_value(SecretId=secret_id)["SecretString"]
        return str(json.loads(text)[json_field]) if json_field else text.strip()

    def get(self) -> str:
        if self._value is None:
            self._value = self._resolve() if self.source else ""
        return self._value

    def __bool__(self) -> bool:
        return bool(self.get())

    def __repr__(self) -> str:
        return f"Secret({self.source or '****'})"

    __str__ = __repr__

    def __reduce__(self):
        if self.source:
            return (Secret.from_source, (self.source,))
        if not self._value:
            return (Secret, (None,))
        if self._value == os.environ.get("OPENAI_API_KEY"):
            return (Secret.from_source, (self.DEFAULT_SOURCE,))
        raise TypeError("a Secret holding a raw key is not sent to other processes: "
                        "make it with Secret.from_source('env:NAME' | 'file:/path' | 'aws-sm:<id>')")


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
    max_retries: int = 6                 # transport-level: 5xx, timeouts, connection errors
    max_rate_limit_retries: int = 30     # 429s: the pool slows down, so these are waits rather than failures
    max_reasks: int = 2                  # content-level: malformed, schema-invalid or cut-off replies
    backoff_base_s: float = 1.0
    backoff_max_s: float = 60.0
    temperature: float | None = 0.7
    max_tokens: int = 1500
    max_tokens_ceiling: int = 0          # a reply cut off at the cap is re-asked with twice the room, up to
                                         # this (default 4x max_tokens)
    max_tokens_field: str = "max_tokens"  # switched to max_completion_tokens by itself when a model asks for it
    response_format: str = "json_schema"  # or json_object for endpoints known to lack schema support
    strict_schema: bool = True           # json_schema strict mode (dropped by itself where rejected)
    detail: str = "auto"                  # image detail level sent with every image
    image_token_rule: str = ""           # override of the model family's image token rule (see images.py)
    max_request_bytes: int = 20_000_000  # larger requests become an error row instead of being sent
    max_retry_after_s: float = 300.0     # a Retry-After longer than this is waited this long
    reasoning_effort: str = ""           # sent as reasoning_effort when set (reasoning models)
    price_per_mtok_in: float | None = None
    price_per_mtok_out: float | None = None
    price_per_mtok_cached: float | None = None   # cached prompt tokens (prefix cache); None: the input price
    batch_discount: float = 0.5          # batch requests cost this share of the real-time prices
    use_cache: bool = True

    @property
    def prices(self) -> Prices:
        return Prices(self.price_per_mtok_in, self.price_per_mtok_out, self.price_per_mtok_cached)

    @property
    def batch_prices(self) -> Prices:
        return self.prices.scaled(self.batch_discount)


@dataclass
class LLMRequest:
    item: str                       # what the request is about (pair id); for error rows and tracing
    messages: list[dict]
    schema: dict                    # JSON schema of the reply object
    schema_name: str
    cache_parts: dict               # stage, candidate index, ... (the rendered request is keyed anyway)
    image_tokens: int = 0           # floor for the images' estimate (they are also counted from messages)
    check: Callable[[Any], str | None] | None = None  # extra semantic check beyond the schema
    # The reply's shape in words, added at the end of the user message only in json_schema mode (where
    # the schema is not in the messages); in JSON mode the schema stated there replaces it.
    reply_note: str = ""


@dataclass
class LLMResult:
    item: str
    ok: bool
    value: Any = None
    error_type: str = ""
    error: str = ""
    cached: bool = False
    attempts: int = 0
    prompt_tokens: int | None = 0       # None: unknown (some attempt may have been billed unreported)
    completion_tokens: int | None = 0
    cost_usd: float | None = None
    usage_complete: bool = True         # False: an attempt timed out or lost its connection after sending
    cached_tokens: int | None = None    # prompt tokens the provider served from its prefix cache
    reasoning_tokens: int | None = None  # completion tokens spent on reasoning, where reported
    batch_id: str = ""                  # answered through this provider batch (priced at the batch rate)
    response_format: str = ""
    cache_key: str = ""
    extras: dict = field(default_factory=dict)


class TransportError(Exception):
    """Retries exhausted on 429/5xx/timeouts/connection errors."""


class RequestRejected(Exception):
    """A 4xx the endpoint will keep returning (bad key, unknown model, request too large)."""


class RequestTooLarge(RequestRejected):
    """The request is over ``max_request_bytes``; it was not sent."""


class InvalidReply(Exception):
    """Malformed, schema-violating or cut-off replies after every allowed re-ask."""


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


def request_bytes(messages: list[dict]) -> int:
    """Size of the messages on the wire, near enough (data URLs dominate), without serialising them."""
    total = 0
    for m in messages:
        c = m.get("content")
        if isinstance(c, str):
            total += len(c.encode("utf-8")) + 40
        elif isinstance(c, list):
            for p in c:
                if isinstance(p, dict):
                    total += len(p.get("text", "").encode("utf-8")) + len((p.get("image_url") or {}).get("url", "")) + 60
    return total


def header_safe(text: str) -> str:
    """HTTP header values are ASCII: percent-encode the rest (a pair id may be any Unicode)."""
    return quote(text[:200], safe=" !#$&'()*+,/:;=?@[]~-._")


def keyed_messages(messages: list[dict]) -> list:
    """The messages as they are rendered, with each image URL replaced by the hash of its content."""
    out = []
    for m in messages:
        c = m.get("content")
        if isinstance(c, list):
            parts = []
            for p in c:
                if isinstance(p, dict) and p.get("type") == "image_url":
                    img = p.get("image_url") or {}
                    url = str(img.get("url", ""))
                    parts.append({"image": hashlib.sha256(url.encode()).hexdigest() if url.startswith("data:") else url,
                                  "detail": img.get("detail", "auto")})
                else:
                    parts.append(p)
            c = parts
        out.append({"role": m.get("role"), "content": c})
    return out


def with_schema_in_prompt(messages: list[dict], schema: dict) -> list[dict]:
    """JSON mode has no schema slot: state it at the end of the request's user message (JSON mode also
    requires the word JSON in the prompt). At the end, not in the system message: what a provider caches
    is the prompt's beginning, and the system text and a pair's images are the same in every stage while
    the schemas differ (a schema in ``response_format`` sits ahead of the messages in OpenAI's cache, so
    json_schema mode shares no prefix between stages)."""
    stated, closed = prompt_schema(schema)
    rule = " Every object must have all of its properties and no others." if closed else ""
    return with_note(messages, f"Reply with one JSON object only.{rule} It must conform to this {SCHEMA_MARKER} {stated}")


def with_note(messages: list[dict], note: str) -> list[dict]:
    """``messages`` with ``note`` added at the end of the first user message (a text part of its own)."""
    out = [dict(m) for m in messages]
    at = next((i for i, m in enumerate(out) if m.get("role") == "user"), None)
    if at is None:
        out.append({"role": "user", "content": note})
        return out
    content = out[at].get("content")
    if isinstance(content, list):
        out[at]["content"] = list(content) + [{"type": "text", "text": note}]
    else:
        out[at]["content"] = f"{content or ''}\n\n{note}"
    return out


def _canonical(node) -> str:
    return json.dumps(node, sort_keys=True, separators=(",", ":"))


def _closed_objects(node) -> bool:
    """Whether every object in ``node`` requires all of its properties and allows no others (the
    strict-mode shape every schema of ours has), so that one sentence can say so for all of them."""
    if isinstance(node, dict):
        if node.get("type") == "object" and (node.get("additionalProperties") is not False or
                                             sorted(node.get("required", [])) != sorted(node.get("properties", {}))):
            return False
        return all(_closed_objects(v) for v in node.values())
    if isinstance(node, list):
        return all(_closed_objects(v) for v in node)
    return True


def prompt_schema(schema: dict) -> tuple[str, bool]:
    """``schema`` as the prompt states it, and whether its objects are all closed. Compact: when every
    object requires all its properties and allows no others, ``required`` and ``additionalProperties``
    are left out (the caller says it in one sentence); each sub-schema that occurs more than once and is
    longer than a reference to it (a judge's review entry, once per candidate; a score, once per
    criterion) is stated once under ``$defs`` and referred to by ``$ref``. The schema is repeated in every
    request after the shared prefix, so each of its tokens is paid in full every time. For the model's
    reading only: replies are checked against the full ``schema``. Computed once per schema: every
    attempt of every request in JSON mode states one."""
    return _stated_schema(json.dumps(schema))


@functools.lru_cache(maxsize=256)
def _stated_schema(schema_json: str) -> tuple[str, bool]:
    schema = json.loads(schema_json)   # key order kept: the statement lists properties as given
    closed = _closed_objects(schema)

    def trim(node):
        if isinstance(node, dict):
            return {k: trim(v) for k, v in node.items()
                    if not (closed and node.get("type") == "object" and k in ("required", "additionalProperties"))}
        if isinstance(node, list):
            return [trim(v) for v in node]
        return node

    out = trim(schema)
    defs: dict[str, dict] = {}
    while True:   # greedily: the sub-schema whose one statement saves the most characters, until none does
        counts: dict[str, int] = {}
        for node in (out, *defs.values()):
            _count_subschemas(node, counts, top=True)
        gain = {t: n * len(t) - n * len(_ref(f"d{len(defs)}")) - len(t) - len(f'"d{len(defs)}":,')
                for t, n in counts.items()}
        best = max(gain, key=gain.get, default=None)
        if best is None or gain[best] <= 0:
            break
        name = f"d{len(defs)}"
        out = _swap_subschema(out, best, name, top=True)
        defs = {k: _swap_subschema(v, best, name, top=True) for k, v in defs.items()}
        defs[name] = json.loads(best)
    if defs:
        out["$defs"] = defs
    return json.dumps(out, separators=(",", ":")), closed


def _ref(name: str) -> str:
    return json.dumps({"$ref": f"#/$defs/{name}"}, separators=(",", ":"))


def _subschemas(node: dict):
    """A schema node's direct sub-schemas as (key, name or index, value); property names are not schemas."""
    for k, v in node.items():
        if k == "properties" and isinstance(v, dict):
            yield from ((k, n, s) for n, s in v.items())
        elif isinstance(v, dict):
            yield k, None, v
        elif isinstance(v, list):
            yield from ((k, i, s) for i, s in enumerate(v) if isinstance(s, dict))


def _count_subschemas(node: dict, counts: dict, top: bool = False) -> None:
    if not top and "$ref" not in node:
        text = _canonical(node)
        counts[text] = counts.get(text, 0) + 1
    for _, _, sub in _subschemas(node):
        _count_subschemas(sub, counts)


def _swap_subschema(node: dict, text: str, name: str, top: bool = False) -> dict:
    if not top and _canonical(node) == text:
        return {"$ref": f"#/$defs/{name}"}
    out = dict(node)
    for k, at, sub in _subschemas(node):
        new = _swap_subschema(sub, text, name)
        if at is None:
            out[k] = new
        else:
            out[k] = dict(out[k]) if isinstance(out[k], dict) else list(out[k])
            out[k][at] = new
    return out


def _count(value) -> int | None:
    """A token count as reported, or None when there is none or it is not a count."""
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float, str)):
        return None
    try:
        number = float(value)
    except ValueError:
        return None
    return int(number) if math.isfinite(number) and number >= 0 else None


def _mentions(message: str, *words: str) -> bool:
    low = message.lower()
    return any(w in low for w in words)


def error_reading(exc: HTTPStatus) -> ErrorReading:
    """What an error reply calls for, read by its code (:mod:`operators.llm.errors`)."""
    err = exc.error
    if not err:   # an HTTPStatus made without the body: its code and message
        codes = (exc.code or "").split()
        err = {"code": codes[0] if codes else "", "type": codes[-1] if codes else "", "message": exc.message}
    return read_error(exc.status_code, err, _retry_after(exc.headers))


@dataclass
class _Attempts:
    """One logical request's state across its attempts (what the decisions look at and change)."""
    conversation: list
    max_tokens: int
    ceiling: int
    timeout_s: float
    image_tokens: int
    retries: int = 0        # 5xx and connections never made (not billed)
    resends: int = 0        # re-sends after a timeout or a connection lost after sending (maybe billed)
    rate_limited: int = 0
    reasks: int = 0
    adaptations: int = 0
    json_fallback: str = ""  # the endpoint's 400 to json_schema, while this request tries JSON mode


def first_choice(reply) -> tuple[dict | None, str | None]:
    """A chat completion's first choice and its message text (None where the reply has none)."""
    choices = reply.get("choices") if isinstance(reply, dict) else None
    choice = choices[0] if choices and isinstance(choices[0], dict) else None
    return choice, (choice.get("message") or {}).get("content") if choice else None


def book_usage(result: LLMResult, usage) -> int:
    """Add one reply's reported usage to ``result``; returns the prompt tokens it reported (0 if none).
    A reply without readable usage makes the request's usage unknown (None), not zero."""
    p, c = (_count(usage.get("prompt_tokens")), _count(usage.get("completion_tokens") or 0)) \
        if isinstance(usage, dict) else (None, None)
    if p is None or c is None:
        result.prompt_tokens = result.completion_tokens = None
        return 0
    if result.prompt_tokens is not None and result.completion_tokens is not None:
        result.prompt_tokens += p
        result.completion_tokens += c
    for field_name, detail, key in (("cached_tokens", "prompt_tokens_details", "cached_tokens"),
                                    ("reasoning_tokens", "completion_tokens_details", "reasoning_tokens")):
        details = usage.get(detail)
        n = _count(details.get(key)) if isinstance(details, dict) else None
        if n is not None:
            setattr(result, field_name, (getattr(result, field_name) or 0) + n)
    return p


class LLMCaller:
    def __init__(self, config: LLMConfig, api_key: Secret | None = None, lease: LeaseClient | None = None,
                 cache: ResponseCache | None = None, max_connections: int = 512, batch=None):
        self.config = config
        self.batch = batch    # a BatchState: requests the cache cannot answer wait for a provider batch
        self.batch_run_id = ""  # the run taking batch replies (its later passes book their cache hits nowhere)
        self.secret = api_key if api_key is not None else Secret.from_source()
        self.lease = lease or LeaseClient(None)
        self.cache = cache if config.use_cache else None
        self.base_url = (config.base_url or os.environ.get("OPENAI_BASE_URL") or "").rstrip("/")
        self.worker = f"{socket.gethostname()}:{os.getpid()}"
        self.image_rule = image_token_rule(config.model, config.image_token_rule)
        # What this endpoint does not accept (QUIRKS), from the settings and from its 400s, shared with
        # the pool; confirmed once a request sent with exactly these was answered.
        self.quirks = {q for q, on in (("max_completion_tokens", config.max_tokens_field == "max_completion_tokens"),
                                       ("no_temperature", config.temperature is None),
                                       ("no_strict", not config.strict_schema),
                                       ("json_object", config.response_format != "json_schema")) if on}
        self.confirmed = False
        self._probe: asyncio.Lock | None = None
        if not self.base_url:
            raise ValueError("no endpoint: set base_url or OPENAI_BASE_URL")
        self.transport = ChatTransport(self.base_url, self.secret.get(), config.timeout_s, max_connections)

    @property
    def response_format(self) -> str:
        return "json_object" if "json_object" in self.quirks else "json_schema"

    def key_for(self, request: LLMRequest, max_tokens: int | None = None) -> str:
        """Everything that determines the answer: endpoint, model, the rendered messages (images by
        content hash), the schema and the sampling parameters. Not the completion cap: an answer that
        fitted is the same answer under a larger cap (raising --max-tokens after cut-offs re-pays
        nothing). ``max_tokens``: the key of a re-ask with a raised cap after a cut-off (a batch line
        of its own)."""
        params: dict = {"temperature": self.config.temperature}
        if self.config.reasoning_effort:
            params["reasoning_effort"] = self.config.reasoning_effort
        if max_tokens is not None and max_tokens != self.config.max_tokens:
            params["max_tokens"] = max_tokens
        parts = {"endpoint": self.base_url, "model": self.config.model, "schema_name": request.schema_name,
                 "schema": request.schema, "params": params, "messages": keyed_messages(request.messages),
                 "parts": request.cache_parts}
        if request.reply_note:   # only v4 templates have one: older keys stay as they were
            parts["reply_note"] = request.reply_note
        return cache_key(parts)

    def legacy_key_for(self, request: LLMRequest) -> str:
        """The key changeforge <= 0.1 stored answers under (with the completion cap): read on a miss,
        so an old cache is not paid for again."""
        params = {"temperature": self.config.temperature, "max_tokens": self.config.max_tokens}
        return cache_key({"endpoint": self.base_url, "model": self.config.model, "schema_name": request.schema_name,
                          "schema": request.schema, "params": params, "messages": keyed_messages(request.messages),
                          "parts": request.cache_parts})

    async def cached(self, request: LLMRequest, key: str) -> dict | None:
        """The cache's valid entry for ``request`` (under ``key``, or the legacy key), or None."""
        if self.cache is None:
            return None
        for k in (key, None):
            try:
                hit = await self.cache.aget(k or self.legacy_key_for(request))
            except Exception as exc:  # noqa: BLE001 - a cache that fails is a miss
                log.warning("cache read for %s failed (%s): asking the endpoint", request.item, type(exc).__name__)
                hit = None
            if isinstance(hit, dict) and not schema_errors(hit.get("value"), request.schema):
                return hit
            if self.config.reasoning_effort:
                break               # no legacy entry can have been asked with a reasoning effort
        return None

    async def call(self, request: LLMRequest) -> LLMResult:
        key = self.key_for(request)
        result = LLMResult(item=request.item, ok=False, cache_key=key)
        hit = await self.cached(request, key)
        if hit is not None:
            result.ok, result.value, result.cached = True, hit["value"], True
            result.response_format = str(hit.get("response_format", ""))
            result.extras["answered_in_run"] = hit.get("batch_run_id", "")
            self.lease.add_usage({"cached": 1})
            return result
        if self.batch is not None and self.cache is None and self.batch_run_id:
            # --no-cache: an answer this run already took from a batch (and booked) is not booked again.
            taken = await asyncio.to_thread(self.batch.remembered, key, self.batch_run_id)
            if taken is not None:
                result.ok, result.value, result.cached = True, taken["value"], True
                result.response_format = str(taken.get("response_format", ""))
                result.extras["answered_in_run"] = self.batch_run_id
                self.lease.add_usage({"cached": 1})
                return result
        if self.batch is not None:
            answered = await self._batch_line(request, result, key, self.config.max_tokens)
            if answered is not None:
                return answered
        if self.lease.stopped:
            result.error_type, result.error = "QuotaExhausted", self.lease.stopped
            return result
        try:
            size = request_bytes(request.messages)
            if self.config.max_request_bytes and size > self.config.max_request_bytes:
                raise RequestTooLarge(
                    f"request is {size / 1e6:.2f} MB, over the {self.config.max_request_bytes / 1e6:.2f} MB bound "
                    "(--max-request-bytes); lower --max-image-side or use --image-format jpeg")
            await self._call_endpoint(request, result)
        except Exception as exc:  # noqa: BLE001 - whatever happens, the row gets a result
            result.ok, result.error_type = False, type(exc).__name__
            result.error = redact(str(exc) or repr(exc), self.secret)[:1000]
        known = result.usage_complete and result.prompt_tokens is not None and result.completion_tokens is not None
        if not known:
            result.prompt_tokens = result.completion_tokens = None
        result.cost_usd = self.config.prices.cost(result.prompt_tokens, result.completion_tokens,
                                                  result.cached_tokens) if known else None
        if known and "batch_cost" in result.extras:
            # A batch line cut off, re-asked in real time: that line at the batch price, the rest at real time's.
            before = result.extras["batch_tokens"]
            result.cost_usd = (result.extras["batch_cost"] or 0.0) + self.config.prices.cost(
                result.prompt_tokens - before[0], result.completion_tokens - before[1],
                (result.cached_tokens or 0) - (before[2] if len(before) > 2 else 0))
        usage = {"prompt_tokens": result.prompt_tokens or 0, "completion_tokens": result.completion_tokens or 0,
                 "cost_usd": result.cost_usd or 0.0, "failed": 0 if result.ok else 1, "usage_unknown": 0 if known else 1}
        self.lease.add_usage(usage)
        await self._store(request, result, max_tokens=result.extras.get("max_tokens", self.config.max_tokens))
        return result

    async def _batch_line(self, request: LLMRequest, result: LLMResult, key: str, max_tokens: int,
                          prior: tuple = (), asked: LLMRequest | None = None, reasks: int = 0) -> LLMResult | None:
        """The batch's side of a request whose line is ``key`` (``asked``: the request as this line asks it,
        a re-ask's conversation; default ``request``; with ``max_tokens``): its reply, its failure, or its
        line deferred (``DEFERRED``); None: send it in real time (its line failed once, ``--batch-fallback
        realtime``). ``prior``: the replies of the lines before it, unusable, whose re-ask this line is
        (``reasks`` of them so far; billed: booked with this one)."""
        kind, record = await asyncio.to_thread(self.batch.lookup, key)
        if kind == "result":
            return await self._from_batch(request, result, record, max_tokens, prior, asked, reasks)
        if kind == "failed":
            result.error_type, result.error = "BatchFailed", f"batch line failed for good: {record.get('reason', '')}"
            if not prior:
                return result
            for earlier in prior:                      # the unusable replies before it were billed
                self._book_batch_reply(result, earlier)
            return self._priced_batch(result)
        if kind == "realtime":
            if prior:    # the re-ask goes in real time, with its room; the replies before it are billed
                for earlier in prior:
                    self._book_batch_reply(result, earlier)
                if result.prompt_tokens is not None and result.completion_tokens is not None:
                    result.extras["batch_cost"] = self.config.batch_prices.cost(
                        result.prompt_tokens, result.completion_tokens, result.cached_tokens)
                    result.extras["batch_tokens"] = (result.prompt_tokens, result.completion_tokens,
                                                     result.cached_tokens or 0)
                result.extras["start_max_tokens"] = max_tokens
                result.extras["start_reasks"] = reasks     # real time re-asks only what is left
            return None
        st = self.attempts_for(asked or request)
        st.max_tokens = max_tokens
        _, body, prompt_estimate = self._body(asked or request, st, frozenset(self.quirks))
        # What the provider counts against its enqueued-token limit: the prompt and the completion cap.
        await asyncio.to_thread(self.batch.defer, key, request.item, body, prompt_estimate + max_tokens)
        result.error_type = DEFERRED
        return result

    def _book_batch_reply(self, result: LLMResult, record: dict) -> None:
        reply = record.get("body") or {}
        result.attempts += 1
        result.batch_id = str(record.get("batch_id", ""))
        book_usage(result, reply.get("usage") if isinstance(reply, dict) else None)

    def _priced_batch(self, result: LLMResult) -> LLMResult:
        known = result.prompt_tokens is not None and result.completion_tokens is not None
        result.cost_usd = self.config.batch_prices.cost(result.prompt_tokens, result.completion_tokens,
                                                        result.cached_tokens) if known else None
        if not known:
            result.prompt_tokens = result.completion_tokens = None
        # A batch reply without usage was billed all the same: unknown, never free (as in real time).
        self.lease.add_usage({"prompt_tokens": result.prompt_tokens or 0, "completion_tokens": result.completion_tokens or 0,
                              "cost_usd": result.cost_usd or 0.0, "failed": 0 if result.ok else 1,
                              "usage_unknown": 0 if known else 1})
        return result

    async def _from_batch(self, request: LLMRequest, result: LLMResult, record: dict, max_tokens: int,
                          prior: tuple = (), asked: LLMRequest | None = None, reasks: int = 0) -> LLMResult:
        """A batch's reply to this request, taken as a real-time reply would be (checked against the
        schema and the stage's check), booked at the batch price with its batch id, and cached. An
        unusable reply is asked again as real time asks it, up to ``max_reasks`` times, each a line of its
        own in the next round of batches: cut off at its cap, the same question with twice the room (up
        to the ceiling; its key names the cap); otherwise the question, the reply and what was wrong with
        it. Every reply of the chain was billed and is booked with the last."""
        result.response_format = "json_object" if "json_object" in self.quirks else "json_schema"
        choice, content = first_choice(record.get("body") or {})
        problem = self._problem(content, request)
        cut = bool(choice and choice.get("finish_reason") == "length")
        if problem is not None and reasks < self.config.max_reasks:
            if cut:
                room = min(self.config.max_tokens_ceiling or 4 * self.config.max_tokens, 2 * max_tokens)
                again, key = request, self.key_for(request, max_tokens=room)
            else:
                room = max_tokens
                again = dataclasses.replace(request, messages=list(request.messages) + [
                    {"role": "assistant", "content": (content or "")[:4000]},
                    {"role": "user", "content": f"Your reply was not usable: {problem}. Reply again with only "
                                                "the JSON object, conforming to the schema."}])
                key = self.key_for(again, max_tokens=room)
            if room > max_tokens or not cut:
                return await self._batch_line(request, result, key, room, (*prior, record), again, reasks + 1)
        for earlier in prior:
            self._book_batch_reply(result, earlier)
        self._book_batch_reply(result, record)
        if problem is None:
            result.ok, result.value = True, parse_json_reply(content)
            result.extras["max_tokens"] = max_tokens
        else:
            note = f" (cut off at {max_tokens} tokens{' after a re-ask with more room' if prior else ''}: " \
                "raise --max-tokens)" if cut else ""
            result.error_type, result.error = "InvalidReply", \
                f"invalid reply from batch {result.batch_id} after {len(prior) + 1} attempts: {problem}{note}"
        self._priced_batch(result)
        await self._store(request, result, batch_id=result.batch_id, batch_run_id=self.batch_run_id)
        if result.ok and self.cache is None and self.batch_run_id:
            await asyncio.to_thread(self.batch.remember, result.cache_key, self.batch_run_id,
                                    {"value": result.value, "response_format": result.response_format})
        return result

    async def _store(self, request: LLMRequest, result: LLMResult, **extra) -> None:
        """Cache a valid answer (a failure to write costs only a rerun's request)."""
        if not result.ok or self.cache is None:
            return
        entry = {"value": result.value, "model": self.config.model, "response_format": result.response_format,
                 "item": request.item, "prompt_tokens": result.prompt_tokens,
                 "completion_tokens": result.completion_tokens, **extra}
        try:
            await self.cache.aput(result.cache_key, entry)
        except Exception as exc:  # noqa: BLE001 - the answer is good; only a rerun would pay again
            log.warning("could not cache the answer for %s: %s", request.item, type(exc).__name__)

    def _quirk_of_400(self, message: str, sent: frozenset, fmt: str) -> str | None:
        """The quirk a 400 names that the attempt did not have (already learnt since, or new), or None
        when it is not one we know how to adapt to."""
        if "max_completion_tokens" not in sent and "max_tokens" in message and \
                _mentions(message, "max_completion_tokens", "unsupported parameter", "not supported"):
            return "max_completion_tokens"
        if "no_temperature" not in sent and _mentions(message, "temperature"):
            return "no_temperature"
        if fmt == "json_schema" and "no_strict" not in sent and _mentions(message, "strict"):
            return "no_strict"
        return None

    async def _learn(self, quirk: str | None = None, answered: frozenset | None = None) -> None:
        """Add ``quirk`` and share it with the pool, or (``answered``: the quirks of an attempt that was
        answered) confirm; then take what the pool learnt."""
        if quirk in self.quirks:
            return                                   # learnt since this attempt went out: just send again
        if quirk:
            log.warning("endpoint rejected a parameter of %s; adapting: %s", self.config.model, quirk)
            self.quirks.add(quirk)
        self.confirmed = self.confirmed or answered is not None
        pool = await self.lease.quirks(self.config.model, self.quirks, answered == self.quirks)
        if pool:
            learnt, confirmed = pool
            self.quirks |= set(learnt)
            self.confirmed = self.confirmed or (confirmed is not None and set(confirmed) == self.quirks)

    async def _probe_turn(self) -> bool:
        """Until a request has been answered, attempts go out one at a time (each learning from the 400s
        of the one before, or from the pool). True: this attempt holds the turn (released after sending)."""
        if self.confirmed:
            return False
        if self._probe is None:
            self._probe = asyncio.Lock()
        try:
            await asyncio.wait_for(self._probe.acquire(), self.config.timeout_s + 5.0)
        except asyncio.TimeoutError:
            return False                             # bounded: go without the turn
        if not self.confirmed:
            await self._learn()
        if self.confirmed:
            self._probe.release()
            return False
        return True

    async def _send(self, body: dict, item: str, estimate: float, probing: bool, timeout_s: float) -> dict:
        try:
            probe = await self.lease.acquire(estimate)
            try:
                reply = await self.transport.post(body, {ITEM_HEADER: header_safe(item)}, timeout_s)
            except HTTPStatus as exc:
                self.lease.release()
                if exc.status_code != 429:
                    self.lease.probe_answered(probe)   # the provider answered: the pool may go on
                raise
            except BaseException:
                self.lease.release()   # failed or cancelled: the permit is done with
                self.lease.probe_answered(probe)       # no answer to wait for (bounded either way)
                raise
            self.lease.probe_answered(probe)
            return reply
        finally:
            if probing:
                self._probe.release()

    def _body(self, request: LLMRequest, st: "_Attempts", sent: frozenset) -> tuple[str, dict, int]:
        """What this attempt sends: (response format, request body, prompt estimate). Also the line of a
        batch file (:mod:`operators.llm.batch`)."""
        cfg = self.config
        fmt = "json_object" if st.json_fallback or "json_object" in sent else "json_schema"
        if fmt == "json_schema":
            messages = with_note(st.conversation, request.reply_note) if request.reply_note else st.conversation
            strict = self._strict_schema(request.schema) if "no_strict" not in sent else None
            response_format = {"type": "json_schema", "json_schema": {
                "name": request.schema_name, "schema": strict or request.schema, "strict": bool(strict)}}
        else:
            messages = with_schema_in_prompt(st.conversation, request.schema)
            response_format = {"type": "json_object"}
        body = {"model": cfg.model, "messages": messages, "response_format": response_format,
                ("max_completion_tokens" if "max_completion_tokens" in sent else "max_tokens"): st.max_tokens}
        if cfg.temperature is not None and "no_temperature" not in sent:
            body["temperature"] = cfg.temperature
        if cfg.reasoning_effort:
            body["reasoning_effort"] = cfg.reasoning_effort
        # What the provider charges against TPM on arrival: prompt (text + images) + the completion cap.
        return fmt, body, estimate_text_tokens(messages) + st.image_tokens

    def attempts_for(self, request: LLMRequest) -> "_Attempts":
        cfg = self.config
        return _Attempts(conversation=list(request.messages), max_tokens=cfg.max_tokens,
                         ceiling=cfg.max_tokens_ceiling or 4 * cfg.max_tokens, timeout_s=cfg.timeout_s,
                         image_tokens=max(request.image_tokens, request_image_tokens(request.messages, self.image_rule)))

    async def _call_endpoint(self, request: LLMRequest, result: LLMResult) -> None:
        """Attempts until an answer or a reason to stop; each outcome goes to the decision it calls for:
        adapt (a 400 naming a parameter), fall back (JSON mode), wait (429), stop (quota), retry (5xx,
        a connection never made), re-send once (a timeout or a connection lost: maybe billed), re-ask
        (an unusable reply)."""
        st = self.attempts_for(request)
        st.max_tokens = result.extras.get("start_max_tokens", st.max_tokens)   # a batch line's re-ask: its room
        st.reasks = result.extras.get("start_reasks", 0)                       # ... and the re-asks it made
        while True:
            probing = await self._probe_turn()
            sent = frozenset(self.quirks)            # what this attempt sends: its 400 is judged against it
            fmt, body, prompt_estimate = self._body(request, st, sent)
            result.attempts += 1
            result.response_format = fmt
            try:
                reply = await self._send(body, request.item, prompt_estimate + st.max_tokens, probing, st.timeout_s)
            except HTTPStatus as exc:
                if exc.status_code == 400 and await self._adapt(exc, st, sent, fmt):
                    continue
                if exc.status_code == 429 or error_reading(exc).kind == "quota":
                    await self._wait(exc, st)
                    continue
                await self._retry(exc, st)
                continue
            except (Timeout, ConnectionFailed) as exc:
                await self._resend_or_retry(exc, st, result)
                continue
            if await self._answered(reply, request, result, st, sent, prompt_estimate):
                return

    async def _adapt(self, exc: HTTPStatus, st: "_Attempts", sent: frozenset, fmt: str) -> bool:
        """A 400: adapt to a parameter it names, or fall back to JSON mode once. False: not ours to fix."""
        message = self._message(exc)
        quirk = self._quirk_of_400(message, sent, fmt)
        if quirk and st.adaptations < 8:
            st.adaptations += 1
            await self._learn(quirk)
            return True
        if fmt == "json_schema":
            # Perhaps an endpoint without json_schema support: try JSON mode. Only if that is
            # accepted is it learnt for good (a 400 can have other causes).
            st.json_fallback = message
            return True
        if st.json_fallback:
            raise RequestRejected(f"HTTP 400: {st.json_fallback}") from None
        return False

    async def _wait(self, exc: HTTPStatus, st: "_Attempts") -> None:
        """A 429 (or a quota code): a quota, read by its code or its limit's period, stops the job; a rate
        limit waits (the pool, in a storm) at most ``max_retry_after_s`` a time and
        ``max_rate_limit_retries`` times, whatever its message says."""
        cfg = self.config
        message = self._message(exc)
        reading = error_reading(exc)
        if reading.kind == "quota":
            reason = f"provider quota exhausted ({reading.code or exc.code or 'quota'}" + \
                (f", per {reading.period}" if reading.period else "") + f"): {message[:300]}"
            await self.lease.stop(reason)
            raise QuotaExhausted(reason) from None
        st.rate_limited += 1
        if st.rate_limited > cfg.max_rate_limit_retries:
            raise TransportError(f"HTTP 429 after {st.rate_limited} attempts") from None
        retry_after = _retry_after(exc.headers)
        if retry_after is not None:
            retry_after = min(retry_after, cfg.max_retry_after_s)   # a provider asking for hours: capped
        if self.lease.limiter is not None:
            # A storm: the whole pool waits, then slows down (own_wait 0: the lease waits).
            # A scattered 429: only this request waits its Retry-After.
            own_wait = min(await self.lease.throttle(retry_after), cfg.max_retry_after_s)
            await asyncio.sleep(own_wait + random.uniform(0, 0.05 + 0.1 * own_wait))
        else:
            await self._backoff(st.rate_limited, retry_after)

    async def _retry(self, exc: HTTPStatus, st: "_Attempts") -> None:
        """A 5xx, 408 or 409 (answered, so not billed): backoff, up to ``max_retries``; other statuses
        are permanent."""
        status = exc.status_code
        if status in (408, 409) or status >= 500:
            st.retries += 1
            if st.retries > self.config.max_retries:
                raise TransportError(f"HTTP {status} after {st.retries} attempts") from None
            await self._backoff(st.retries, _retry_after(exc.headers))
            return
        raise RequestRejected(f"HTTP {status}: {self._message(exc)}") from None

    async def _resend_or_retry(self, exc: Exception, st: "_Attempts", result: LLMResult) -> None:
        """No reply. A connection never made cost nothing: retried like a 5xx. A timeout or a
        connection lost after sending may be billed without usage reported: the request's usage
        becomes unknown, and it is re-sent once, with twice the timeout (a thinking model billed
        seven times and still failing is what re-sending up to ``max_retries`` did)."""
        if isinstance(exc, ConnectionFailed) and not exc.sent:
            st.retries += 1
            if st.retries > self.config.max_retries:
                raise TransportError(f"connection error after {st.retries} attempts") from None
            await self._backoff(st.retries, None)
            return
        result.usage_complete = False
        result.prompt_tokens = result.completion_tokens = None
        kind = "timeout" if isinstance(exc, Timeout) else "connection lost after sending"
        st.resends += 1
        if st.resends > 1:
            raise TransportError(f"{kind} on the re-send (timeout {st.timeout_s:.0f} s); the provider may have "
                                 "billed both: usage unknown") from None
        st.timeout_s *= 2
        log.warning("%s for %s: re-sent once with a %.0f s timeout", kind, result.item, st.timeout_s)

    async def _answered(self, reply, request: LLMRequest, result: LLMResult, st: "_Attempts", sent: frozenset,
                        prompt_estimate: int) -> bool:
        """A reply: learn from it, book its usage, and either take the answer (True) or re-ask."""
        cfg = self.config
        if st.json_fallback and "json_object" not in self.quirks:
            log.warning("endpoint rejected response_format json_schema (%s); using JSON mode", st.json_fallback[:200])
            self.quirks.add("json_object")
        if not self.confirmed:
            await self._learn(answered=sent | ({"json_object"} if st.json_fallback else set()))
        usage = reply.get("usage") if isinstance(reply, dict) else None
        self.lease.release(book_usage(result, usage) - prompt_estimate)   # only an under-estimate is booked
        choice, content = first_choice(reply)
        problem = self._problem(content, request)
        if problem is None:
            result.ok, result.value = True, parse_json_reply(content)
            result.extras["max_tokens"] = st.max_tokens
            return True
        self._reask(st, request, content, problem, choice is not None and choice.get("finish_reason") == "length")
        return False

    def _reask(self, st: "_Attempts", request: LLMRequest, content: str | None, problem: str, cut_off: bool) -> None:
        st.reasks += 1
        if st.reasks > self.config.max_reasks:
            if cut_off:
                problem += f" (cut off at {st.max_tokens} tokens: raise --max-tokens)"
            raise InvalidReply(f"invalid reply after {st.reasks} attempts: {problem}")
        if cut_off:
            # Cut off by the cap: the same question again with more room (a thinking model may have
            # spent the cap on reasoning); nothing to tell the model.
            st.max_tokens = min(st.ceiling, st.max_tokens * 2)
            st.conversation = list(request.messages)
            return
        st.conversation = list(request.messages) + [
            {"role": "assistant", "content": (content or "")[:4000]},
            {"role": "user", "content": f"Your reply was not usable: {problem}. Reply again with only "
                                        "the JSON object, conforming to the schema."}]

    def _strict_schema(self, schema: dict) -> dict | None:
        """Strict form of ``schema``, computed once per schema object (stages reuse theirs)."""
        memo = self.__dict__.setdefault("_strict_memo", {})
        hit = memo.get(id(schema))
        if hit is None or hit[0] is not schema:
            if len(memo) > 256:
                memo.clear()
            hit = memo[id(schema)] = (schema, strict_schema(schema))
        return hit[1]

    def _problem(self, content: str | None, request: LLMRequest) -> str | None:
        try:
            value = parse_json_reply(content)
        except ValueError as exc:
            return str(exc)
        errors = schema_errors(value, request.schema)
        if errors:
            return "; ".join(errors)
        return request.check(value) if request.check else None

    def _message(self, exc: HTTPStatus) -> str:
        return redact(str(exc.message or ""), self.secret)[:500]

    async def _backoff(self, attempt: int, retry_after: float | None) -> None:
        cfg = self.config
        delay = min(cfg.backoff_max_s, cfg.backoff_base_s * 2 ** (attempt - 1)) * random.uniform(0.5, 1.0)
        if retry_after is not None:
            # The server said when: wait that long, plus a little jitter so actors don't stampede.
            delay = min(cfg.backoff_max_s, retry_after) + random.uniform(0, 0.1 * retry_after + 0.05)
        await asyncio.sleep(delay)

    async def aclose(self) -> None:
        await self.lease.flush()
        await self.transport.aclose()
