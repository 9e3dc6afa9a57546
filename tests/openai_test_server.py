"""An OpenAI-compatible HTTP server for tests and benchmarks. Test equipment, not a model.

It answers ``POST /v1/chat/completions`` deterministically from the request: it reads the JSON schema it
is sent (``response_format.json_schema``, or in JSON mode the schema the client wrote into the prompt
after the marker ``JSON schema:``) and returns an object that conforms to it, whose strings and numbers
are derived from a hash of the request. Strings mention words from the prompt's ``region:`` line when
there is one, so a caption "talks about" the region it was given; bounded integers (scores) land in
the upper part of their range so that some fall below 7 and ties occur.

Faults are injected at runtime through ``POST /control/faults`` (or ``--faults '<json>'``):

    {"latency_ms": 50, "reject_json_schema": false, "retry_after_s": 1, "timeout_s": 30,
     "faults": [{"kind": "429"|"500"|"400"|"timeout"|"malformed"|"wrong_count", "rate": 0.2,
                 "match": "<substring of the X-Changeforge-Item header, optional>",
                 "match_text": "<substring of the prompt text, optional>"}]}

Whether a fault fires is a deterministic draw from (request hash, how often that exact request was
seen, fault kind), so a retried request can succeed and two runs of a test behave the same.

``GET /control/stats`` returns request counts (total, by status, per request key, successful
replies per key) and arrival timestamps; ``POST /control/reset`` clears them.

Standalone: ``python -m tests.openai_test_server --port 8011 --latency-ms 50``.
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import re
import sys
import time
from collections import Counter, defaultdict

from aiohttp import web

SCHEMA_MARKER = "JSON schema:"
WORD_RE = re.compile(r"[A-Za-z][A-Za-z\-]{2,}")


def _digest(*parts: object) -> int:
    h = hashlib.blake2b(repr(parts).encode(), digest_size=8)
    return int.from_bytes(h.digest(), "big")


class ServerState:
    def __init__(self, latency_ms: float = 0.0):
        self.config = {"latency_ms": latency_ms, "reject_json_schema": False, "retry_after_s": 1,
                       "timeout_s": 30.0, "faults": []}
        self.reset()

    def reset(self) -> None:
        self.total = 0
        self.by_status: Counter = Counter()
        self.seen_by_key: Counter = Counter()
        self.ok_by_key: Counter = Counter()
        self.timestamps: list[float] = []
        self.items_by_key: dict[str, str] = {}
        self.times_by_key: dict[str, list[float]] = defaultdict(list)

    def stats(self) -> dict:
        return {"total": self.total, "by_status": dict(self.by_status), "seen_by_key": dict(self.seen_by_key),
                "ok_by_key": dict(self.ok_by_key), "timestamps": self.timestamps,
                "items_by_key": self.items_by_key, "times_by_key": self.times_by_key}


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


def _n_images(messages: list) -> int:
    n = 0
    for m in messages:
        if isinstance(m.get("content"), list):
            n += sum(1 for p in m["content"] if isinstance(p, dict) and p.get("type") == "image_url")
    return n


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
    for fault in state.config.get("faults", []):
        match, match_text = fault.get("match"), fault.get("match_text")
        if match and match not in item:
            continue
        if match_text and match_text not in text:
            continue
        rate = float(fault.get("rate", 1.0))
        if (_digest(key, seen, fault["kind"]) % 10_000) < rate * 10_000:
            return fault["kind"]
    return None


def _error(status: int, message: str, headers: dict | None = None) -> web.Response:
    body = {"error": {"message": message, "type": "test_server_error", "code": status}}
    return web.json_response(body, status=status, headers=headers)


async def chat_completions(request: web.Request) -> web.Response:
    state: ServerState = request.app["state"]
    raw = await request.read()
    state.total += 1
    state.timestamps.append(time.time())
    try:
        body = json.loads(raw)
    except ValueError:
        state.by_status[400] += 1
        return _error(400, "request body is not JSON")
    messages = body.get("messages") or []
    rf = body.get("response_format") or {}
    key = hashlib.sha256(json.dumps([body.get("model"), messages, rf.get("type")], sort_keys=True)
                         .encode()).hexdigest()[:16]
    seen = state.seen_by_key[key]
    state.seen_by_key[key] += 1
    item = request.headers.get("X-Changeforge-Item", "")
    state.items_by_key[key] = item
    state.times_by_key[key].append(state.timestamps[-1])
    cfg = state.config
    if cfg.get("latency_ms"):
        await asyncio.sleep(float(cfg["latency_ms"]) / 1000)

    if rf.get("type") == "json_schema" and cfg.get("reject_json_schema"):
        state.by_status[400] += 1
        return _error(400, "response_format json_schema is not supported by this endpoint")
    texts = _texts(messages)
    fault = _fault_for(state, key, seen, item, "\n".join(texts))
    if fault == "429":
        state.by_status[429] += 1
        return _error(429, "rate limited (injected)", {"Retry-After": str(cfg.get("retry_after_s", 1))})
    if fault == "400":
        state.by_status[400] += 1
        return _error(400, "invalid request (injected)")
    if fault == "500":
        state.by_status[500] += 1
        return _error(500, "internal error (injected)")
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
    prompt_tokens = sum(len(t) for t in texts) // 4 + 85 * _n_images(messages) + 8 * len(messages)
    completion_tokens = max(1, len(content) // 4)
    state.by_status[200] += 1
    if fault is None:
        state.ok_by_key[key] += 1
    reply = {
        "id": f"chatcmpl-test-{key}-{seen}", "object": "chat.completion", "created": int(time.time()),
        "model": body.get("model", "test"),
        "choices": [{"index": 0, "finish_reason": "stop",
                     "message": {"role": "assistant", "content": content}}],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens},
    }
    return web.json_response(reply)


async def get_stats(request: web.Request) -> web.Response:
    return web.json_response(request.app["state"].stats())


async def post_reset(request: web.Request) -> web.Response:
    request.app["state"].reset()
    return web.json_response({"ok": True})


async def post_faults(request: web.Request) -> web.Response:
    state: ServerState = request.app["state"]
    update = await request.json()
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
    return app


# -- running it from tests and benchmarks -------------------------------------------------------
class ServerProcess:
    """The test server in its own process on 127.0.0.1 (so its CPU is not the caller's), with
    its control endpoints: counters, arrival times, fault configuration."""

    def __init__(self, latency_ms: float = 0.0, timeout_s: float = 20.0):
        import os
        import socket
        import subprocess
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.openai_test_server", "--port", str(self.port),
             "--latency-ms", str(latency_ms)], cwd=repo,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        deadline = time.time() + timeout_s
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                return
            except OSError:
                if time.time() > deadline or self.proc.poll() is not None:
                    self.close()
                    raise RuntimeError(f"test server did not start on port {self.port}")
                time.sleep(0.1)

    def _call(self, path: str, payload: dict | None = None) -> dict:
        import urllib.request
        data = None if payload is None else json.dumps(payload).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=data,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as resp:
            return json.loads(resp.read())

    def stats(self) -> dict:
        return self._call("/control/stats")

    def timestamps(self) -> list[float]:
        return sorted(self.stats()["timestamps"])

    def reset(self) -> None:
        self._call("/control/reset", {})

    def configure(self, **config) -> dict:
        return self._call("/control/faults", config)

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="OpenAI-compatible test server (test equipment, not a model)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8011)
    ap.add_argument("--latency-ms", type=float, default=0.0, help="delay added to every reply")
    ap.add_argument("--faults", default="", help="initial fault configuration as JSON (see module doc)")
    args = ap.parse_args(argv)
    config = json.loads(args.faults) if args.faults else None
    try:
        import uvloop  # noqa: F401 - faster loop when present; plain asyncio otherwise
        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:
        pass
    print(f"openai test server on http://{args.host}:{args.port}/v1", flush=True)
    web.run_app(make_app(args.latency_ms, config), host=args.host, port=args.port, print=None,
                access_log=None, backlog=4096)


if __name__ == "__main__":
    sys.exit(main())
