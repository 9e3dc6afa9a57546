"""A fault-injecting reverse proxy in front of the local S3-compatible server (test equipment).

For a seeded fraction of requests it answers ``503 SlowDown`` or ``500 InternalError`` (S3's XML
error bodies, as AWS sends them under load) or drops the connection without answering; every other
request is forwarded unchanged. Clients point their endpoint at the proxy exactly as they would at
a real S3 endpoint, so what is tested is their own retry configuration.

    python -m tests.s3_fault_proxy --upstream http://127.0.0.1:9000 --port 9100 --fraction 0.05

Started from tests (``FaultProxyProcess``) it binds a port of its own (``--port 0``, the default) and
prints it (``tests.equipment.announce``); the starter accepts it as ready only when the listener on
that port is the process it started.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys

from aiohttp import ClientSession, ClientTimeout, web

try:
    from tests.equipment import announce, listen_socket
except ModuleNotFoundError:   # run as a script (python tests/s3_fault_proxy.py): its folder is on sys.path
    from equipment import announce, listen_socket

HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade",
              "proxy-authorization", "proxy-authenticate", "content-length", "host"}
FAULTS = ("slowdown", "internal", "drop")

ERROR_XML = ('<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
             '<Message>{message}</Message><RequestId>fault-{n}</RequestId></Error>')


def make_app(upstream: str, fraction: float, seed: int) -> web.Application:
    state = {"fraction": fraction, "rng": random.Random(seed), "requests": 0,
             "faults": {k: 0 for k in FAULTS}, "forwarded": 0}

    async def proxy(request: web.Request) -> web.StreamResponse:
        state["requests"] += 1
        n = state["requests"]
        if state["rng"].random() < state["fraction"]:
            kind = FAULTS[state["rng"].randrange(len(FAULTS))]
            state["faults"][kind] += 1
            await request.read()
            if kind == "drop":
                request.transport.close()   # no answer at all: a connection reset mid-request
                raise asyncio.CancelledError
            code, status, msg = (("SlowDown", 503, "Please reduce your request rate.")
                                 if kind == "slowdown" else
                                 ("InternalError", 500, "We encountered an internal error."))
            return web.Response(status=status, text=ERROR_XML.format(code=code, message=msg, n=n),
                                content_type="application/xml")
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        headers["Host"] = upstream.split("://", 1)[1]
        session: ClientSession = request.app["session"]
        async with session.request(request.method, upstream + request.path_qs, data=body or None,
                                   headers=headers, allow_redirects=False,
                                   auto_decompress=False) as resp:
            payload = await resp.read()
            out_headers = {k: v for k, v in resp.headers.items() if k.lower() not in HOP_BY_HOP}
        state["forwarded"] += 1
        if request.method == "HEAD":
            # No body, but the object's size must reach the client (GDAL sizes files by HEAD).
            length = resp.headers.get("Content-Length")
            out = web.Response(status=resp.status, headers=out_headers)
            if length is not None:
                out.headers["Content-Length"] = length
            return out
        return web.Response(status=resp.status, body=payload, headers=out_headers)

    async def control_stats(request: web.Request) -> web.Response:
        return web.json_response({"requests": state["requests"], "faults": state["faults"],
                                  "forwarded": state["forwarded"], "fraction": state["fraction"]})

    async def control_set(request: web.Request) -> web.Response:
        cfg = await request.json()
        if "fraction" in cfg:
            state["fraction"] = float(cfg["fraction"])
        if "seed" in cfg:
            state["rng"] = random.Random(int(cfg["seed"]))
        return web.json_response({"fraction": state["fraction"]})

    async def start(app):
        app["session"] = ClientSession(timeout=ClientTimeout(total=120))

    async def stop(app):
        await app["session"].close()

    app = web.Application(client_max_size=1 << 30)
    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    # Control endpoints under a path no S3 bucket can have (bucket names cannot contain '_').
    app.router.add_get("/__faults__/stats", control_stats)
    app.router.add_post("/__faults__/set", control_set)
    app.router.add_route("*", "/{tail:.*}", proxy)
    return app


class FaultProxyProcess:
    """The proxy in its own process on 127.0.0.1, with its control endpoints. It binds a port of its own
    (port 0) and reports it; the port's listener is checked to be that process (``tests.equipment``)."""

    def __init__(self, upstream: str, fraction: float = 0.0, seed: int = 0, timeout_s: float = 20):
        from tests.equipment import start_announced
        self.proc, self.port, self._log = start_announced(
            [sys.executable, "-m", "tests.s3_fault_proxy", "--upstream", upstream,
             "--port", "0", "--fraction", str(fraction), "--seed", str(seed)],
            timeout=timeout_s, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def _call(self, path: str, payload: dict | None = None) -> dict:
        import urllib.request
        data = None if payload is None else json.dumps(payload).encode()
        req = urllib.request.Request(self.endpoint + path, data=data,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as resp:
            return json.loads(resp.read())

    def stats(self) -> dict:
        return self._call("/__faults__/stats")

    def set(self, fraction: float | None = None, seed: int | None = None) -> dict:
        cfg = {k: v for k, v in (("fraction", fraction), ("seed", seed)) if v is not None}
        return self._call("/__faults__/set", cfg)

    def close(self) -> None:
        from tests.equipment import stop
        stop(self.proc)
        self._log.unlink(missing_ok=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="S3 fault-injecting proxy (test equipment)")
    ap.add_argument("--upstream", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0, help="0 (the default): a free port, printed at start")
    ap.add_argument("--fraction", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    # The socket is bound here (port 0: one the kernel picks) and its port printed once it listens.
    sock = listen_socket(args.host, args.port)
    announce(sock)
    web.run_app(make_app(args.upstream, args.fraction, args.seed), sock=sock, print=None, access_log=None)


if __name__ == "__main__":
    main()
