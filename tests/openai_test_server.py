"""An OpenAI-compatible HTTP server for tests and benchmarks. Test equipment, not a model.

It answers ``POST /v1/chat/completions`` deterministically from the request: it reads the JSON schema it
is sent (``response_format.json_schema``, or in JSON mode the schema the client wrote into the prompt
after the marker ``JSON schema:``) and returns an object that conforms to it, whose strings and numbers
are derived from a hash of the request. Strings mention words from the prompt's ``region:`` line when
there is one, so a caption "talks about" the region it was given; bounded integers (scores) land in
the upper part of their range so that some fall below 7 and ties occur.

Faults are injected at runtime through ``POST /control/faults`` (or ``--faults '<json>'``):

    {"latency_ms": 50, "reject_json_schema": false, "retry_after_s": 1, "timeout_s": 30,
     "faults": [{"kind": "429"|"500"|"502"|"503"|"400"|"timeout"|"malformed"|"wrong_count", "rate": 0.2,
                 "match": "<substring of the X-Changeforge-Item header, optional>",
                 "match_text": "<substring of the prompt text, optional>"}],
     "fault_seed": 0, "fault_draw": "independent"}

Whether a fault fires is a deterministic draw from (request hash, how often that exact request was
seen, fault kind, ``fault_seed``), so a retried request can succeed and two runs with one seed behave
the same. ``fault_draw`` ``independent`` (default) draws each fault on its own, in list order (the
first that fires wins, so later rates are effectively a little lower); ``exclusive`` draws once per
request and splits [0, 1) by the listed rates, so each kind fires at exactly its rate (a fault mix:
10 % 429 + 5 % 5xx + ... with the rates summing to at most 1). Any 5xx kind (``"500"``, ``"503"``)
answers with that status; an injected 429 carries ``Retry-After: retry_after_s``.

Provider behaviour, also set through ``/control/faults``:

    {"rpm_limit": 0, "tpm_limit": 0, "limit_window_s": 60,   # 429 (with Retry-After) over either limit
     "image_base": 85, "image_per_tile": 170,                # how an image is counted (tile rule)
     "reject_params": ["max_tokens", "temperature"],         # 400s as OpenAI's reasoning models send them
     "reject_strict": false, "omit_usage": false,
     "reasoning": false,                                     # 400 for max_tokens and for temperature != 1
     "usage_values": {}}                                     # override fields of every reply's usage

Tokens are counted as providers count them against TPM: on arrival, prompt (text + images by the
tile rule, each at its size and detail) plus the request's completion cap (``max_tokens`` or
``max_completion_tokens``), never refunded. A request over either limit in the trailing window is
refused with 429 and not counted. A reply longer than the cap is cut off with ``finish_reason``
``length``. A ``strict`` json_schema whose objects are not closed and fully required is refused with
400, as OpenAI does.

Money-side behaviour (the block "provider money" below): fault kinds ``"quota"`` (429
``insufficient_quota``, as OpenAI answers an account out of credit) and ``"slow"`` (the reply comes after
``slow_s`` seconds, complete and billed: a client that gave up earlier paid for it); ``"prefix_cache":
true`` reports ``usage.prompt_tokens_details.cached_tokens`` for the leading part of a request that
matches an earlier request's (by a stable token estimate: text at 4 characters a token in 128-token
chunks, images by the tile rule, at least ``prefix_cache_min`` tokens, in steps of 128, as OpenAI's
cache; ``{"clear_prefix_cache": true}`` empties it, as a provider's expires); and the Batch API: ``POST /v1/files`` (multipart, purpose=batch), ``GET /v1/files/{id}/content``,
``DELETE /v1/files/{id}``, ``POST /v1/batches``, ``GET /v1/batches/{id}``, ``POST /v1/batches/{id}/cancel``; a batch completes
``batch_delay_s`` after creation (and not while ``batch_hold`` is true: batches held in flight), its
lines answered as real-time requests would be; a share
``batch_fail_rate`` of its lines (drawn per custom_id and submission) goes to the error file, and the
output lines come back in an order of their own. ``batch_submissions`` in the stats counts how often
each custom_id was submitted, ``batch_polls`` how often each batch was asked for (``GET /v1/batches/{id}``).

Provider errors: ``"error_reply": {"status": 429, "body": {...}, "headers": {...}, "times": 1, "paths":
["chat", "files", "batches"]}`` answers the next ``times`` requests on those paths (or "poll": ``GET /v1/batches/{id}``) with that reply (a
provider's own error body, as documented); ``batch_fail_status`` (e.g. 400) makes a failed line a refused
reply (``response.status_code`` and an error body with ``batch_fail_code``) instead of an unrun line;
``batch_create_lost: N`` creates the next N batches and answers 504 (the reply lost); ``batch_status:
"failed"`` with ``batch_errors`` fails whole batches with that reason (no line runs); ``GET /v1/batches``
lists the batches, newest first, paged with ``limit`` and ``after``; ``batch_strip_images`` keeps only the
first 200 characters of each data URL of an uploaded batch file (a benchmark's memory, not the answers');
``batch_enqueued_limit``: tokens (prompt by this server's count, plus each line's cap) a model's batches in
progress may hold; a batch that would go over is created and then failed with ``token_limit_exceeded``
in its ``errors``, as OpenAI's enqueued-token limit does (``batches_refused``, ``enqueued_peak`` in the stats).

``GET /control/stats`` returns request counts (total, by status, per request key, successful
replies per key), arrival timestamps, the tokens charged per accepted request and each request's
time in the server; ``POST /control/reset`` clears them.

Standalone: ``python -m tests.openai_test_server --port 8011 --latency-ms 50``.
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import collections
import hashlib
import json
import math
import re
import struct
import sys
import time
from collections import Counter, defaultdict
from urllib.parse import unquote

from aiohttp import web

try:
    from tests.equipment import announce, listen_socket
except ModuleNotFoundError:   # run as a script (python tests/openai_test_server.py): its folder is on sys.path
    from equipment import announce, listen_socket

SCHEMA_MARKER = "JSON schema:"
WORD_RE = re.compile(r"[A-Za-z][A-Za-z\-]{2,}")


def _digest(*parts: object) -> int:
    h = hashlib.blake2b(repr(parts).encode(), digest_size=8)
    return int.from_bytes(h.digest(), "big")


DEFAULT_CONFIG = {"latency_ms": 0.0, "reject_json_schema": False, "retry_after_s": 1, "timeout_s": 30.0,
                  "faults": [], "rpm_limit": 0, "tpm_limit": 0, "limit_window_s": 60.0, "image_base": 85,
                  "image_per_tile": 170, "reject_params": [], "reject_strict": False, "omit_usage": False,
                  "reasoning": False, "usage_values": {}, "default_max_tokens": 4096, "fault_seed": 0, "fault_draw": "independent",
                  # provider money (see the module doc)
                  "slow_s": 5.0, "prefix_cache": False, "prefix_cache_min": 1024, "batch_delay_s": 0.0,
                  "batch_fail_rate": 0.0, "batch_fail_code": "server_error", "batch_hold": False,
                  # a provider's own error replies and lost answers (see "provider errors" below)
                  "error_reply": None, "batch_fail_status": 0, "batch_create_lost": 0, "batch_status": "",
                  "batch_errors": None, "batch_strip_images": False, "batch_enqueued_limit": 0}


class ServerState:
    def __init__(self, latency_ms: float = 0.0):
        self.config = dict(DEFAULT_CONFIG, latency_ms=latency_ms)
        self.reset()

    def reset(self) -> None:
        self.total = 0
        self.by_status: Counter = Counter()
        self.seen_by_key: Counter = Counter()
        self.ok_by_key: Counter = Counter()
        self.timestamps: list[float] = []
        self.items_by_key: dict[str, str] = {}
        self.times_by_key: dict[str, list[float]] = defaultdict(list)
        self.charges: list[tuple[float, int]] = []          # (arrival, tokens) of accepted requests
        self.window: collections.deque = collections.deque()  # the same, within the limit window
        self.window_tokens = 0
        self.spans: list[tuple[float, float]] = []           # (arrival, reply) of every request
        self.in_flight = self.max_in_flight = 0
        self.models: Counter = Counter()
        self.auth: Counter = Counter()                       # sha256 of the Authorization header, counted
        self.requests: list[dict] = []                       # the last few request bodies, for inspection
        self.reset_money()

    def stats(self) -> dict:
        return {"total": self.total, "by_status": dict(self.by_status), "seen_by_key": dict(self.seen_by_key),
                "ok_by_key": dict(self.ok_by_key), "timestamps": self.timestamps,
                "items_by_key": self.items_by_key, "times_by_key": self.times_by_key, "charges": self.charges,
                "spans": self.spans, "max_in_flight": self.max_in_flight, "models": dict(self.models), "auth": dict(self.auth),
                "requests": self.requests, **self.money_stats()}

    # -- provider money: prefix cache, files and batches ------------------------------------------
    def reset_money(self) -> None:
        self.prefixes: set[str] = set()                      # hashes of every request's leading chunks
        self.cached_tokens_total = 0
        self.files: dict[str, bytes] = {}
        self.batches: dict[str, dict] = {}
        self.batch_submissions: Counter = Counter()          # custom_id -> times submitted in a batch
        self.batch_lines_answered = 0
        self.batch_polls: Counter = Counter()                # batch id -> GET /v1/batches/{id} received
        self.slow_sent = 0                                   # slow replies completed (billed)
        self.error_replies: Counter = Counter()              # path -> configured error replies sent
        self.creates_lost = 0                                # batches created whose answer was lost
        self.batches_refused = 0                             # failed for the enqueued-token limit
        self.files_deleted = 0                               # DELETE /v1/files/{id} answered
        self.enqueued_peak = 0                               # most tokens in progress at once (accepted)

    def money_stats(self) -> dict:
        return {"cached_tokens_total": self.cached_tokens_total, "batch_submissions": dict(self.batch_submissions),
                "batches_created": len(self.batches), "batch_lines_answered": self.batch_lines_answered,
                "batch_polls": dict(self.batch_polls), "slow_sent": self.slow_sent,
                "error_replies": dict(self.error_replies), "creates_lost": self.creates_lost,
                "batches_refused": self.batches_refused, "enqueued_peak": self.enqueued_peak,
                "files_stored": len(self.files), "files_deleted": self.files_deleted}

    def admit(self, now: float, tokens: int) -> float | None:
        """Count a request against RPM and TPM the provider's way; seconds to wait if it is over."""
        cfg = self.config
        width = float(cfg.get("limit_window_s", 60.0))
        while self.window and self.window[0][0] <= now - width:
            self.window_tokens -= self.window.popleft()[1]
        rpm, tpm = float(cfg.get("rpm_limit") or 0), float(cfg.get("tpm_limit") or 0)
        if rpm and len(self.window) + 1 > rpm:
            return self.window[0][0] + width - now
        if tpm and self.window_tokens + tokens > tpm:
            excess, wait = self.window_tokens + tokens - tpm, width
            for t, n in self.window:
                excess -= n
                if excess <= 0:
                    wait = t + width - now
                    break
            return wait
        self.window.append((now, tokens))
        self.window_tokens += tokens
        self.charges.append((now, tokens))
        return None


# -- request reading -----------------------------------------------------------------------------
def _texts(messages: list) -> list[str]:
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, str):
            out.append(content)
        elif isinstance(content, list):
            out.extend(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return out


def _png_size(url: str) -> tuple[int, int] | None:
    if not url.startswith("data:image/png;base64,"):
        return None
    raw = base64.b64decode(url[22:22 + 44])
    return struct.unpack(">II", raw[16:24]) if raw[:4] == b"\x89PNG" else None


def _image_tokens(messages: list, base: int, per_tile: int) -> int:
    """The tile rule: fit in 2048, then short side 768, 512-px tiles; base alone at detail low; an
    image of unknown size counts as the largest."""
    total = 0
    for m in messages:
        for p in m.get("content") if isinstance(m.get("content"), list) else []:
            if not (isinstance(p, dict) and p.get("type") == "image_url"):
                continue
            img = p.get("image_url") or {}
            if img.get("detail") == "low":
                total += base
                continue
            w, h = _png_size(str(img.get("url", ""))) or (2048, 2048)
            s = min(1.0, 2048 / max(w, h))
            w, h = w * s, h * s
            s = min(1.0, 768 / min(w, h))
            total += base + per_tile * math.ceil(w * s / 512) * math.ceil(h * s / 512)
    return total


def _strict_problem(schema: dict, path: str = "") -> str | None:
    if schema.get("type") == "object" or "properties" in schema:
        props = schema.get("properties", {})
        if schema.get("additionalProperties") is not False:
            return f"In context=({path}), 'additionalProperties' is required to be supplied and to be false"
        if sorted(schema.get("required", [])) != sorted(props):
            return f"In context=({path}), 'required' is required to be supplied and to be an array including every key in properties"
        for name, sub in props.items():
            problem = _strict_problem(sub, f"{path}'properties', '{name}', ")
            if problem:
                return problem
    for word in ("minLength", "maxLength"):
        if word in schema:
            return f"In context=({path}), '{word}' is not permitted"
    if isinstance(schema.get("items"), dict):
        return _strict_problem(schema["items"], f"{path}'items', ")
    return None


def _schema_from_prompt(texts: list[str]) -> dict | None:
    for text in reversed(texts):
        pos = text.rfind(SCHEMA_MARKER)
        if pos >= 0:
            start = text.find("{", pos)
            if start >= 0:
                try:
                    return json.JSONDecoder().raw_decode(text[start:])[0]
                except ValueError:
                    return None
    return None


def _prompt_words(texts: list[str]) -> tuple[list[str], list[str]]:
    joined = "\n".join(texts)
    region = []
    for line in joined.splitlines():
        if "region:" in line.lower():
            region = WORD_RE.findall(line.split(":", 1)[1])
            break
    words = [w.lower() for w in WORD_RE.findall(joined) if w.lower() != "json"]
    return region, words or ["change"]


# -- reply generation from a schema ----------------------------------------------------------------
class ReplyMaker:
    def __init__(self, seed: int, region: list[str], words: list[str], short_arrays: bool):
        self.seed, self.region, self.words, self.short_arrays = seed, region, words, short_arrays

    def make(self, schema: dict, path: str = "$"):
        if path == "$":
            self.defs = schema.get("$defs") or {}
        ref = schema.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/$defs/"):   # a schema stated compactly in a prompt
            schema = self.defs.get(ref.rsplit("/", 1)[-1]) or {}
        kind = schema.get("type")
        if isinstance(kind, list):
            kind = next((k for k in kind if k != "null"), "string")
        h = _digest(self.seed, path)
        if "enum" in schema:
            return schema["enum"][h % len(schema["enum"])]
        if kind == "object" or "properties" in schema:
            props = schema.get("properties", {})
            names = list(props)
            if self.short_arrays and path == "$" and len(names) > 1:
                names = names[:-1]  # a reply that misses one required item ("wrong number of captions")
            return {k: self.make(props[k], f"{path}.{k}") for k in names}
        if kind == "array":
            lo = int(schema.get("minItems", 1))
            n = max(0, lo - 1) if self.short_arrays else lo
            return [self.make(schema.get("items", {}), f"{path}[{i}]") for i in range(n)]
        if kind == "integer":
            lo, hi = int(schema.get("minimum", 0)), int(schema.get("maximum", 100))
            lo = max(lo, hi - 6)
            return hi - (h % (hi - lo + 1))
        if kind == "number":
            lo, hi = float(schema.get("minimum", 0)), float(schema.get("maximum", 1))
            return lo + (hi - lo) * ((h % 1000) / 999)
        if kind == "boolean":
            return bool(h % 2)
        n_words = 6 + h % 10
        picked = [self.words[(h >> (3 * i)) % len(self.words)] for i in range(n_words)]
        if self.region:
            picked.insert(min(2, len(picked)), " ".join(self.region))
        return f"{path.rsplit('.', 1)[-1]}: " + " ".join(picked) + "."


def _fault_for(state: ServerState, key: str, seen: int, item: str, text: str) -> str | None:
    cfg = state.config
    seed = int(cfg.get("fault_seed") or 0)
    salt = (seed,) if seed else ()   # seed 0 keeps the draws tests were written against
    exclusive = cfg.get("fault_draw") == "exclusive"
    u, edge = (_digest(key, seen, "exclusive", *salt) % 10_000), 0.0
    for fault in cfg.get("faults", []):
        match, match_text = fault.get("match"), fault.get("match_text")
        if match and match not in item:
            continue
        if match_text and match_text not in text:
            continue
        rate = float(fault.get("rate", 1.0))
        if exclusive:
            edge += rate
            if u < edge * 10_000:
                return fault["kind"]
        elif (_digest(key, seen, fault["kind"], *salt) % 10_000) < rate * 10_000:
            return fault["kind"]
    return None


def _prompt_tokens(body: dict, cfg: dict) -> int:
    """A request's prompt tokens: text at 4 characters a token, 8 a message, the images by the tile rule;
    a structured-output schema is billed as prompt, as OpenAI bills it (it leads the prompt: see
    _prefix_chunks)."""
    messages = body.get("messages") or []
    return sum(len(t) for t in _texts(messages)) // 4 + 8 * len(messages) + _schema_tokens(body) + \
        _image_tokens(messages, int(cfg.get("image_base", 85)), int(cfg.get("image_per_tile", 170)))


def _error(status: int, message: str, headers: dict | None = None) -> web.Response:
    body = {"error": {"message": message, "type": "test_server_error", "code": status}}
    return web.json_response(body, status=status, headers=headers)


async def chat_completions(request: web.Request) -> web.Response:
    state: ServerState = request.app["state"]
    raw = await request.read()
    arrival = time.time()
    state.total += 1
    state.timestamps.append(arrival)
    state.in_flight += 1
    state.max_in_flight = max(state.max_in_flight, state.in_flight)
    try:
        return await _answer(state, request, raw)
    finally:
        state.in_flight -= 1
        state.spans.append((arrival, time.time()))


def _error_reply(state: ServerState, path: str) -> web.Response | None:
    """The configured provider error reply (``error_reply``: {"status", "body", "headers", "times", "paths"}),
    while its ``times`` last, on the paths it names (chat, files, batches; default all)."""
    spec = state.config.get("error_reply")
    if not spec or int(spec.get("times", 1)) <= 0 or path not in (spec.get("paths") or ("chat", "files", "batches")):
        return None
    spec["times"] = int(spec.get("times", 1)) - 1
    state.by_status[int(spec["status"])] += 1
    state.error_replies[path] += 1
    return web.json_response(spec["body"], status=int(spec["status"]), headers=spec.get("headers") or {})


async def _answer(state: ServerState, request: web.Request, raw: bytes) -> web.Response:
    if not isinstance(request, _LineRequest):
        refused = _error_reply(state, "chat")
        if refused is not None:
            return refused
    try:
        body = json.loads(raw)
    except ValueError:
        state.by_status[400] += 1
        return _error(400, "request body is not JSON")
    state.models[str(body.get("model"))] += 1
    state.auth[hashlib.sha256(request.headers.get("Authorization", "").encode()).hexdigest()[:16]] += 1
    state.requests = (state.requests + [{k: v for k, v in body.items() if k != "messages"} |
                                        {"n_messages": len(body.get("messages") or [])}])[-20:]
    messages = body.get("messages") or []
    rf = body.get("response_format") or {}
    key = hashlib.sha256(json.dumps([body.get("model"), messages, rf.get("type")], sort_keys=True)
                         .encode()).hexdigest()[:16]
    seen = state.seen_by_key[key]
    state.seen_by_key[key] += 1
    item = unquote(request.headers.get("X-Changeforge-Item", ""))
    state.items_by_key[key] = item
    state.times_by_key[key].append(time.time())   # (a batch line has no HTTP arrival of its own)
    cfg = state.config
    rejected = [p for p in cfg.get("reject_params") or [] if p in body]
    if cfg.get("reasoning"):   # a reasoning model: no max_tokens, and temperature only at its default 1
        rejected += [p for p in ("max_tokens",) if p in body]
        rejected += [p for p in ("temperature",) if p in body and body[p] != 1]
    for param in rejected[:1]:
        state.by_status[400] += 1
        if param == "max_tokens":
            return _error(400, "Unsupported parameter: 'max_tokens' is not supported with this model. "
                               "Use 'max_completion_tokens' instead.")
        return _error(400, f"Unsupported value: '{param}' does not support {body[param]} with this model. "
                           "Only the default (1) value is supported.")
    if rf.get("type") == "json_schema" and cfg.get("reject_json_schema"):
        state.by_status[400] += 1
        return _error(400, "response_format json_schema is not supported by this endpoint")
    js = rf.get("json_schema") or {}
    if rf.get("type") == "json_schema" and js.get("strict"):
        problem = "strict mode is not supported" if cfg.get("reject_strict") else \
            _strict_problem(js.get("schema") or {})
        if problem:
            state.by_status[400] += 1
            return _error(400, f"Invalid schema for response_format '{js.get('name')}': {problem}.")
    texts = _texts(messages)
    prompt_tokens = _prompt_tokens(body, cfg)
    cap = int(body.get("max_completion_tokens") or body.get("max_tokens") or cfg.get("default_max_tokens", 4096))
    wait = state.admit(time.time(), prompt_tokens + cap)
    if wait is not None:
        state.by_status[429] += 1
        return _error(429, "Rate limit reached (requests or tokens per minute)",
                      {"Retry-After": str(max(1, math.ceil(wait))), "retry-after-ms": str(int(wait * 1000) + 1)})
    if cfg.get("latency_ms"):
        await asyncio.sleep(float(cfg["latency_ms"]) / 1000)
    fault = _fault_for(state, key, seen, item, "\n".join(texts))
    if fault == "quota":
        state.by_status[429] += 1
        return web.json_response({"error": {"message": "You exceeded your current quota, please check your plan "
                                            "and billing details.", "type": "insufficient_quota", "code":
                                            "insufficient_quota"}}, status=429)
    if fault == "slow":
        await asyncio.sleep(float(cfg.get("slow_s", 5.0)))
        state.slow_sent += 1
    if fault == "429":
        state.by_status[429] += 1
        return _error(429, "rate limited (injected)", {"Retry-After": str(cfg.get("retry_after_s", 1))})
    if fault == "400":
        state.by_status[400] += 1
        return _error(400, "invalid request (injected)")
    if fault and fault.isdigit() and fault.startswith("5"):
        state.by_status[int(fault)] += 1
        return _error(int(fault), "server error (injected)")
    if fault == "timeout":
        state.by_status["timeout"] += 1
        await asyncio.sleep(float(cfg.get("timeout_s", 30)))
        return _error(504, "too late (injected)")

    if rf.get("type") == "json_schema":
        schema = (rf.get("json_schema") or {}).get("schema") or {}
    else:
        schema = _schema_from_prompt(texts) or {"type": "object", "properties": {"text": {"type": "string"}}}
    region, words = _prompt_words(texts)
    maker = ReplyMaker(_digest(key), region, words, short_arrays=(fault == "wrong_count"))
    content = json.dumps(maker.make(schema))
    if fault == "malformed":
        content = content[: max(1, len(content) // 2)] + " ...(truncated"
    completion_tokens, finish = max(1, len(content) // 4), "stop"
    if completion_tokens > cap:   # cut off at the completion cap, as a model would be
        content, completion_tokens, finish = content[: cap * 4], cap, "length"
    state.by_status[200] += 1
    if fault is None and finish == "stop":
        state.ok_by_key[key] += 1
    reply = {
        "id": f"chatcmpl-test-{key}-{seen}", "object": "chat.completion", "created": int(time.time()),
        "model": body.get("model", "test"),
        "choices": [{"index": 0, "finish_reason": finish,
                     "message": {"role": "assistant", "content": content}}],
    }
    if not cfg.get("omit_usage"):
        reply["usage"] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                          "total_tokens": prompt_tokens + completion_tokens, **(cfg.get("usage_values") or {})}
        if cfg.get("prefix_cache"):
            cached = _prefix_cached_tokens(state, body, int(cfg.get("image_base", 85)),
                                           int(cfg.get("image_per_tile", 170)), int(cfg.get("prefix_cache_min", 1024)))
            reply["usage"]["prompt_tokens_details"] = {"cached_tokens": min(cached, prompt_tokens)}
    return web.json_response(reply)


async def get_stats(request: web.Request) -> web.Response:
    return web.json_response(request.app["state"].stats())


async def post_reset(request: web.Request) -> web.Response:
    request.app["state"].reset()
    return web.json_response({"ok": True})


async def post_faults(request: web.Request) -> web.Response:
    state: ServerState = request.app["state"]
    update = await request.json()
    if update.pop("clear_prefix_cache", False):   # the provider's prefix cache expired (e.g. hours later)
        state.prefixes.clear()
    state.config.update(update)
    return web.json_response(state.config)


def make_app(latency_ms: float = 0.0, config: dict | None = None) -> web.Application:
    app = web.Application(client_max_size=256 * 1024 * 1024)
    app["state"] = ServerState(latency_ms)
    if config:
        app["state"].config.update(config)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/control/stats", get_stats)
    app.router.add_post("/control/reset", post_reset)
    app.router.add_post("/control/faults", post_faults)
    add_batch_routes(app)
    add_hold(app)
    return app


# -- provider money: prefix cache and the Batch API ----------------------------------------------
def _prefix_chunks(body: dict, base: int, per_tile: int) -> list[tuple[str, int]]:
    """The request as a sequence of (content, tokens) chunks in the order a provider reads it: the
    response schema (part of the system prompt), then each message's text in 128-token chunks and its
    images (by the tile rule)."""
    chunks: list[tuple[str, int]] = [(json.dumps(body.get("response_format") or {}, sort_keys=True), _schema_tokens(body))]
    for m in body.get("messages") or []:
        chunks.append((f"<{m.get('role')}>", 4))
        content = m.get("content")
        parts = [{"type": "text", "text": content}] if isinstance(content, str) else \
            [p for p in content or [] if isinstance(p, dict)]
        for p in parts:
            if p.get("type") == "image_url":
                img = p.get("image_url") or {}
                tokens = _image_tokens([{"content": [p]}], base, per_tile)
                chunks.append((hashlib.sha256(str(img.get("url", "")).encode()).hexdigest() + str(img.get("detail")),
                               tokens))
            else:
                text = str(p.get("text", ""))
                for i in range(0, len(text), 512):
                    piece = text[i:i + 512]
                    chunks.append((piece, len(piece) // 4))
    return chunks


def _schema_tokens(body: dict) -> int:
    """The tokens of a json_schema response format's schema (4 characters a token); JSON mode has none."""
    rf = body.get("response_format") or {}
    if rf.get("type") != "json_schema":
        return 0
    return len(json.dumps((rf.get("json_schema") or {}).get("schema") or {})) // 4


def _prefix_cached_tokens(state: ServerState, body: dict, base: int, per_tile: int, minimum: int) -> int:
    """Tokens of the longest leading run of chunks an earlier request began with (0 under
    ``minimum``; in steps of 128), then remember this request's prefixes."""
    h, tokens, cached, prefixes = hashlib.sha256(), 0, 0, []
    for content, n in _prefix_chunks(body, base, per_tile):
        h.update(content.encode())
        tokens += n
        digest = h.copy().hexdigest()
        prefixes.append(digest)
        if digest in state.prefixes and cached == tokens - n:
            cached = tokens
    state.prefixes.update(prefixes)
    cached = cached // 128 * 128 if cached >= minimum else 0
    state.cached_tokens_total += cached
    return cached


class _LineRequest:
    """What ``_answer`` reads of an HTTP request, for a batch line."""

    def __init__(self, custom_id: str):
        self.headers = {"X-Changeforge-Item": custom_id, "Authorization": ""}


def _batch_object(b: dict) -> dict:
    return {k: v for k, v in b.items() if not k.startswith("_")}


async def post_file(request: web.Request) -> web.Response:
    state: ServerState = request.app["state"]
    refused = _error_reply(state, "files")
    if refused is not None:
        return refused
    reader = await request.multipart()
    purpose, content, filename = "", b"", "upload.jsonl"
    async for part in reader:
        if part.name == "purpose":
            purpose = (await part.read()).decode()
        elif part.name == "file":
            filename = part.filename or filename
            content = bytes(await part.read())
    if purpose != "batch":
        return _error(400, f"purpose must be batch, not {purpose!r}")
    if state.config.get("batch_strip_images"):
        content = _strip_images(content)
    file_id = f"file-{hashlib.sha256(content).hexdigest()[:12]}-{len(state.files)}"
    state.files[file_id] = content
    return web.json_response({"id": file_id, "object": "file", "bytes": len(content), "purpose": purpose,
                              "filename": filename, "created_at": int(time.time())})


def _strip_images(content: bytes) -> bytes:
    """A batch file with each data URL cut to its first 200 characters (its PNG header: the image still
    counts at its size): a benchmark's thousands of 1024 px lines need not all sit in this server's memory."""
    out = []
    for raw in content.splitlines():
        if not raw.strip():
            continue
        line = json.loads(raw)
        for m in (line.get("body") or {}).get("messages") or []:
            for p in m.get("content") if isinstance(m.get("content"), list) else []:
                if isinstance(p, dict) and p.get("type") == "image_url" and isinstance(p.get("image_url"), dict):
                    p["image_url"]["url"] = str(p["image_url"].get("url", ""))[:200]
        out.append(json.dumps(line).encode())
    return b"\n".join(out) + b"\n"


async def get_file_content(request: web.Request) -> web.Response:
    content = request.app["state"].files.get(request.match_info["file_id"])
    if content is None:
        return _error(404, "no such file")
    return web.Response(body=content, content_type="application/jsonl")


async def delete_file(request: web.Request) -> web.Response:
    state: ServerState = request.app["state"]
    file_id = request.match_info["file_id"]
    if state.files.pop(file_id, None) is None:
        return _error(404, "no such file")
    state.files_deleted += 1
    return web.json_response({"id": file_id, "object": "file", "deleted": True})


async def post_batch(request: web.Request) -> web.Response:
    state: ServerState = request.app["state"]
    refused = _error_reply(state, "batches")
    if refused is not None:
        return refused
    spec = await request.json()
    content = state.files.get(spec.get("input_file_id", ""))
    if content is None:
        return _error(400, "input_file_id not found")
    lines = [json.loads(line) for line in content.decode().splitlines() if line.strip()]
    ids = [line.get("custom_id") for line in lines]
    if len(set(ids)) != len(ids):
        return _error(400, "custom_id must be unique within a batch file")
    for cid in ids:
        state.batch_submissions[cid] += 1
    cfg = state.config
    tokens = sum(_prompt_tokens(line.get("body") or {}, cfg) + int((line.get("body") or {}).get("max_completion_tokens")
                 or (line.get("body") or {}).get("max_tokens") or cfg.get("default_max_tokens", 4096)) for line in lines)
    model = str((lines[0].get("body") or {}).get("model")) if lines else ""
    enqueued = sum(b["_tokens"] for b in state.batches.values() if b["status"] == "in_progress" and b["_model"] == model)
    limit = int(cfg.get("batch_enqueued_limit") or 0)
    state.enqueued_peak = max(state.enqueued_peak, enqueued + tokens if not limit or enqueued + tokens <= limit else 0)
    batch_id = f"batch_{len(state.batches):04d}_{hashlib.sha256(content).hexdigest()[:8]}"
    state.batches[batch_id] = {
        "id": batch_id, "object": "batch", "endpoint": spec.get("endpoint"), "input_file_id": spec["input_file_id"],
        "completion_window": spec.get("completion_window", "24h"), "status": "in_progress",
        "created_at": int(time.time()), "metadata": spec.get("metadata") or {}, "output_file_id": None,
        "error_file_id": None, "request_counts": {"total": len(lines), "completed": 0, "failed": 0},
        "_lines": lines, "_due": time.time() + float(state.config.get("batch_delay_s", 0.0)),
        "_tokens": tokens, "_model": model}
    if limit and enqueued + tokens > limit:
        # As OpenAI: created, then failed at validation, the reason in its errors; no line runs.
        b = state.batches[batch_id]
        b["status"], b["failed_at"], b["_tokens"] = "failed", int(time.time()), 0
        b["errors"] = {"object": "list", "data": [{"code": "token_limit_exceeded", "line": None, "param": None,
                       "message": f"Enqueued token limit reached for {model} in organization org-test. Limit: "
                                  f"{limit:,} enqueued tokens. Please try again once some in_progress batches have "
                                  "been completed."}]}
        state.batches_refused += 1
    if int(state.config.get("batch_create_lost") or 0) > 0:
        # Created, and its answer lost on the way back (a gateway timeout): the client cannot know.
        state.config["batch_create_lost"] = int(state.config["batch_create_lost"]) - 1
        state.creates_lost += 1
        return _error(504, "upstream request timeout")
    return web.json_response(_batch_object(state.batches[batch_id]))


async def list_batches(request: web.Request) -> web.Response:
    """``GET /v1/batches?limit=&after=``: newest first, a page at a time (as OpenAI lists them)."""
    state: ServerState = request.app["state"]
    ordered = sorted(state.batches.values(), key=lambda b: b["id"], reverse=True)
    after = request.query.get("after")
    if after:
        ids = [b["id"] for b in ordered]
        ordered = ordered[ids.index(after) + 1:] if after in ids else []
    limit = max(1, min(100, int(request.query.get("limit", 20))))
    page = ordered[:limit]
    return web.json_response({"object": "list", "data": [_batch_object(b) for b in page],
                              "first_id": page[0]["id"] if page else None, "last_id": page[-1]["id"] if page else None,
                              "has_more": len(ordered) > limit})


async def _finish_batch(state: ServerState, b: dict) -> None:
    """Answer every line as a real-time request would be answered; a share fails; shuffled."""
    outputs, errors = [], []
    rate = float(state.config.get("batch_fail_rate", 0.0))
    for line in b["_lines"]:
        cid = line.get("custom_id")
        if _digest(cid, state.batch_submissions[cid], "batch_fail") % 10_000 < rate * 10_000:
            code, status = state.config.get("batch_fail_code", "server_error"), int(state.config.get("batch_fail_status") or 0)
            if status:   # answered with an error status, as the provider's error file carries a refused line
                errors.append({"id": f"batch_req_{cid[:12]}", "custom_id": cid, "error": None,
                               "response": {"status_code": status, "request_id": f"req_{cid[:8]}",
                                            "body": {"error": {"message": "the line was refused (injected)",
                                                               "type": code, "param": None, "code": code}}}})
            else:
                errors.append({"id": f"batch_req_{cid[:12]}", "custom_id": cid, "response": None,
                               "error": {"code": code, "message": "the line failed (injected)"}})
            continue
        resp = await _answer(state, _LineRequest(cid), json.dumps(line.get("body") or {}).encode())
        state.batch_lines_answered += 1
        outputs.append({"id": f"batch_req_{cid[:12]}", "custom_id": cid, "error": None,
                        "response": {"status_code": resp.status, "request_id": f"req_{cid[:8]}",
                                     "body": json.loads(resp.body)}})
    outputs.sort(key=lambda o: _digest(o["custom_id"]))         # an order of the server's own
    for kind, rows in (("output_file_id", outputs), ("error_file_id", errors)):
        if rows:
            file_id = f"file-{b['id']}-{kind[:3]}"
            state.files[file_id] = "".join(json.dumps(r) + "\n" for r in rows).encode()
            b[kind] = file_id
    b["request_counts"] = {"total": len(b["_lines"]), "completed": len(outputs), "failed": len(errors)}
    b["status"], b["completed_at"] = "completed", int(time.time())


async def get_batch(request: web.Request) -> web.Response:
    state: ServerState = request.app["state"]
    b = state.batches.get(request.match_info["batch_id"])
    if b is None:
        return _error(404, "no such batch")
    state.batch_polls[b["id"]] += 1
    refused = _error_reply(state, "poll")
    if refused is not None:
        return refused
    # "batch_hold": every batch stays in progress until the switch is off (a kill lands while one is open).
    if b["status"] == "in_progress" and time.time() >= b["_due"] and not state.config.get("batch_hold"):
        if state.config.get("batch_status") == "failed":
            # The whole batch refused (e.g. OpenAI's enqueued-token limit): no line ran; the reason in errors.
            b["status"], b["failed_at"] = "failed", int(time.time())
            b["errors"] = {"object": "list", "data": state.config.get("batch_errors") or []}
            b["request_counts"] = {"total": len(b["_lines"]), "completed": 0, "failed": 0}
        else:
            b["status"] = "finalizing"
            await _finish_batch(state, b)
    return web.json_response(_batch_object(b))


async def cancel_batch(request: web.Request) -> web.Response:
    b = request.app["state"].batches.get(request.match_info["batch_id"])
    if b is None:
        return _error(404, "no such batch")
    if b["status"] in ("validating", "in_progress"):
        b["status"] = "cancelled"
    return web.json_response(_batch_object(b))


def add_batch_routes(app: web.Application) -> None:
    app.router.add_post("/v1/files", post_file)
    app.router.add_get("/v1/files/{file_id}/content", get_file_content)
    app.router.add_delete("/v1/files/{file_id}", delete_file)
    app.router.add_post("/v1/batches", post_batch)
    app.router.add_get("/v1/batches", list_batches)
    app.router.add_get("/v1/batches/{batch_id}", get_batch)
    app.router.add_post("/v1/batches/{batch_id}/cancel", cancel_batch)


# -- hold and release (issue 35): a kill lands at a known point, not in a race with latency ---------
# POST /_control/hold {"after": N}   from the (N+1)-th chat request on, every request waits on arrival
#                                    (before it is counted or answered) until released
# GET  /_control/held?at_least=K&timeout_s=T
#                                    waits until K requests are waiting (at most T s; 408 if not), then
#                                    {"held": waiting now, "passed": let through since the hold, "active"}
# POST /_control/release             lets every waiting request through and ends the hold
class Hold:
    def __init__(self):
        self.active, self.after, self.passed, self.waiting = False, 0, 0, 0
        self.gate = asyncio.Event()
        self.changed = asyncio.Condition()

    def view(self) -> dict:
        return {"active": self.active, "after": self.after, "passed": self.passed, "held": self.waiting}


@web.middleware
async def hold_middleware(request: web.Request, handler):
    hold: Hold = request.app["hold"]
    if hold.active and request.path == "/v1/chat/completions":
        if hold.passed < hold.after:
            hold.passed += 1
        else:
            gate = hold.gate
            async with hold.changed:
                hold.waiting += 1
                hold.changed.notify_all()
            try:
                await gate.wait()
            finally:
                async with hold.changed:
                    hold.waiting -= 1
                    hold.changed.notify_all()
    return await handler(request)


async def post_hold(request: web.Request) -> web.Response:
    hold: Hold = request.app["hold"]
    body = await request.json() if request.can_read_body else {}
    hold.active, hold.after, hold.passed = True, int(body.get("after", 0)), 0
    hold.gate = asyncio.Event()
    return web.json_response(hold.view())


async def get_held(request: web.Request) -> web.Response:
    hold: Hold = request.app["hold"]
    at_least = int(request.query.get("at_least", 0))
    timeout = float(request.query.get("timeout_s", 0))
    try:
        async with hold.changed:
            await asyncio.wait_for(hold.changed.wait_for(lambda: hold.waiting >= at_least), timeout or None)
    except asyncio.TimeoutError:
        return web.json_response(hold.view(), status=408)
    return web.json_response(hold.view())


async def post_release(request: web.Request) -> web.Response:
    hold: Hold = request.app["hold"]
    hold.active = False
    hold.gate.set()
    return web.json_response(hold.view())


def add_hold(app: web.Application) -> None:
    app["hold"] = Hold()
    app.middlewares.append(hold_middleware)
    app.router.add_post("/_control/hold", post_hold)
    app.router.add_get("/_control/held", get_held)
    app.router.add_post("/_control/release", post_release)


class HoldControl:
    """The hold switch from the test side (a mixin of ServerProcess)."""

    def hold(self, after: int = 0) -> dict:
        """Requests after the first ``after`` wait at the server until ``release``."""
        return self._call("/_control/hold", {"after": after})

    def wait_held(self, at_least: int, timeout_s: float = 120) -> dict:
        """Until ``at_least`` requests are waiting; TimeoutError after ``timeout_s``."""
        import urllib.error
        try:
            return self._call(f"/_control/held?at_least={at_least}&timeout_s={timeout_s}",
                              timeout=timeout_s + 30)
        except urllib.error.HTTPError as exc:
            if exc.code == 408:
                raise TimeoutError(f"fewer than {at_least} requests held after {timeout_s}s: "
                                   f"{json.loads(exc.read())}") from None
            raise

    def release(self) -> dict:
        return self._call("/_control/release", {})


# -- running it from tests and benchmarks -------------------------------------------------------
class ServerProcess(HoldControl):
    """The test server in its own process on 127.0.0.1 (so its CPU is not the caller's), with
    its control endpoints: counters, arrival times, fault configuration, the hold switch. It binds
    a port of its own (port 0) and reports it; the port's listener is checked to be that process."""

    def __init__(self, latency_ms: float = 0.0, timeout_s: float = 20.0):
        import os

        from tests.equipment import start_announced
        repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        self.proc, self.port, self._log = start_announced(
            [sys.executable, "-m", "tests.openai_test_server", "--port", "0", "--latency-ms", str(latency_ms)],
            timeout=timeout_s, cwd=repo)
        self.base_url = f"http://127.0.0.1:{self.port}/v1"

    def _call(self, path: str, payload: dict | None = None, timeout: float = 30) -> dict:
        import urllib.request
        data = None if payload is None else json.dumps(payload).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=data,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())

    def stats(self) -> dict:
        return self._call("/control/stats")

    def timestamps(self) -> list[float]:
        return sorted(self.stats()["timestamps"])

    def reset(self) -> None:
        self._call("/control/reset", {})

    def restore_defaults(self) -> dict:
        """No faults, no limits, no latency: the configuration a test starts from."""
        return self.configure(**DEFAULT_CONFIG)

    def configure(self, **config) -> dict:
        return self._call("/control/faults", config)

    def close(self) -> None:
        from tests.equipment import stop
        stop(self.proc)
        self._log.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="OpenAI-compatible test server (test equipment, not a model)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8011, help="0: a free port, printed at start")
    ap.add_argument("--latency-ms", type=float, default=0.0, help="delay added to every reply")
    ap.add_argument("--faults", default="", help="initial fault configuration as JSON (see module doc)")
    args = ap.parse_args(argv)
    config = json.loads(args.faults) if args.faults else None
    try:
        import uvloop  # noqa: F401 - faster loop when present; plain asyncio otherwise
        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:
        pass
    # The socket is bound here (port 0: one the kernel picks) and its port printed once it listens.
    sock = listen_socket(args.host, args.port)
    print(f"openai test server on http://{args.host}:{sock.getsockname()[1]}/v1", flush=True)
    announce(sock)
    web.run_app(make_app(args.latency_ms, config), sock=sock, print=None, access_log=None)


if __name__ == "__main__":
    sys.exit(main())
