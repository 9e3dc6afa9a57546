"""Provider Batch APIs (``/v1/files`` + ``/v1/batches``, about half the real-time price) behind the normal
pipeline: the same request builders, cache, validators, selection and tables.

A stage run with a :class:`BatchState` does not send a request the cache cannot answer: its caller
writes the request's line (``custom_id`` = the request's cache key, ``body`` = what real time would
send) to ``<out>/_batch/<job>/lines/`` and the item waits (no row). The driver (:class:`BatchDriver`)
then submits the waiting lines in files split to the provider's limits, polls them (progress, a
bounded wait) and stores each answered line under ``results/``. The next pass of the pipeline takes
each result as the reply to its request (checked, booked at the batch price with its ``batch_id``, put
in the response cache), and the items go on to their next stage, whose lines go out the same way.

Everything lives in the output store, so a killed driver loses nothing: ``batches/<id>.json`` records
each submitted batch and its custom_ids, and a rerun polls those instead of submitting their lines
again; a line with a result or in an open batch is never submitted again. A failed or expired line is
submitted once more (or sent in real time with ``fallback="realtime"``), then becomes its item's error
row with the provider's reason (``failed/``). ``export_lines`` / ``import_results`` do the same through
files for offline runners (``vllm run-batch -i in.jsonl -o out.jsonl`` reads and writes these formats).
"""
from __future__ import annotations

import json
import logging
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass

from operators.io.storage import Store

log = logging.getLogger(__name__)

BATCH_PREFIX = "_batch"
ENDPOINT = "/v1/chat/completions"


@dataclass
class BatchSettings:
    max_requests_per_file: int = 50_000     # OpenAI's limits per batch file
    max_bytes_per_file: int = 190_000_000   # 200 MB, less a margin for the multipart envelope
    poll_s: float = 30.0                    # seconds between polls
    max_wait_s: float = 26 * 3600.0         # a batch not done by then: the job stops (a rerun polls on)
    fallback: str = "batch"                 # a failed line's one retry: another batch, or "realtime"
    completion_window: str = "24h"


class BatchState:
    """One job's batch files in the output store (written by LLM actors and the driver; every object
    written whole, so a kill leaves no half entry)."""

    def __init__(self, root: str, job: str):
        self.store = Store(root).child(f"{BATCH_PREFIX}/{job}")

    # -- the actors' side ----------------------------------------------------------------------
    def lookup(self, key: str) -> tuple[str, dict | None]:
        """("result", line) a reply came back; ("failed", record) the line failed for good;
        ("realtime", record) it failed once and is to be sent in real time; ("", None) none yet."""
        for kind in ("results", "failed"):
            try:
                record = json.loads(self.store.read_bytes(f"{kind}/{key}.json"))
            except FileNotFoundError:
                continue
            if kind == "results":
                return "result", record
            if record.get("final"):
                return "failed", record
            if record.get("fallback") == "realtime":
                return "realtime", record
        return "", None

    def defer(self, key: str, item: str, body: dict) -> None:
        """The request waits for a batch. Written once: a rerun finds its line already waiting."""
        rel = f"lines/{key}.json"
        if not self.store.exists(rel):
            self.store.write_bytes(rel, json.dumps({"custom_id": key, "method": "POST", "url": ENDPOINT,
                                                    "body": body, "item": item}).encode())

    # -- the driver's side ---------------------------------------------------------------------
    def keys(self, kind: str) -> set[str]:
        return {rel.rsplit("/", 1)[-1][:-5] for rel in self.store.list(kind, suffixes=(".json",))}

    def read(self, kind: str, key: str) -> dict:
        return json.loads(self.store.read_bytes(f"{kind}/{key}.json"))

    def write(self, kind: str, key: str, record: dict) -> None:
        self.store.write_bytes(f"{kind}/{key}.json", json.dumps(record).encode())

    def remove(self, kind: str, key: str) -> None:
        try:
            self.store.delete(f"{kind}/{key}.json")
        except FileNotFoundError:
            pass

    def batches(self) -> list[dict]:
        return [self.read("batches", k) for k in sorted(self.keys("batches"))]

    def waiting(self) -> list[str]:
        """Lines to submit: waiting, not answered, not failed for good, not in a batch still open."""
        open_ids = {cid for b in self.batches() if not b.get("done") for cid in b["custom_ids"]}
        done = self.keys("results")
        failed = {k for k in self.keys("failed") if self.read("failed", k).get("final")
                  or self.read("failed", k).get("fallback") == "realtime"}
        return sorted(self.keys("lines") - done - failed - open_ids)


class BatchAPI:
    """``/v1/files`` and ``/v1/batches`` of an OpenAI-compatible endpoint (plain HTTP, bounded)."""

    def __init__(self, base_url: str, api_key: str = "", timeout_s: float = 300.0, attempts: int = 4):
        self.base_url, self.timeout_s, self.attempts = base_url.rstrip("/"), timeout_s, attempts
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def _request(self, method: str, path: str, data: bytes | None = None, content_type: str = "application/json"):
        for attempt in range(self.attempts):
            req = urllib.request.Request(f"{self.base_url}{path}", data=data, method=method,
                                         headers={**self.headers, **({"Content-Type": content_type} if data else {})})
            try:
                with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                    return resp.read()
            except urllib.error.HTTPError as exc:
                if exc.code < 500 and exc.code != 429 or attempt + 1 == self.attempts:
                    raise RuntimeError(f"batch API {method} {path}: HTTP {exc.code}: "
                                       f"{exc.read()[:300].decode('utf-8', 'replace')}") from None
            except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
                if attempt + 1 == self.attempts:
                    raise RuntimeError(f"batch API {method} {path}: {type(exc).__name__}") from None
            time.sleep(min(30.0, 2.0 ** attempt))
        raise AssertionError("unreachable")

    def upload(self, content: bytes, filename: str = "batch.jsonl") -> str:
        boundary = uuid.uuid4().hex
        body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
                f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{filename}\"\r\n"
                f"Content-Type: application/jsonl\r\n\r\n").encode() + content + f"\r\n--{boundary}--\r\n".encode()
        return json.loads(self._request("POST", "/files", body, f"multipart/form-data; boundary={boundary}"))["id"]

    def create(self, file_id: str, window: str, metadata: dict | None = None) -> dict:
        return json.loads(self._request("POST", "/batches", json.dumps(
            {"input_file_id": file_id, "endpoint": ENDPOINT, "completion_window": window,
             "metadata": metadata or {}}).encode()))

    def retrieve(self, batch_id: str) -> dict:
        return json.loads(self._request("GET", f"/batches/{batch_id}"))

    def content(self, file_id: str) -> bytes:
        return self._request("GET", f"/files/{file_id}/content")

    def cancel(self, batch_id: str) -> dict:
        return json.loads(self._request("POST", f"/batches/{batch_id}/cancel", b"{}"))


FINAL_STATUSES = ("completed", "failed", "expired", "cancelled")


def split_files(lines: list[bytes], max_requests: int, max_bytes: int) -> list[list[int]]:
    """Indices of ``lines`` grouped into files within the provider's request and byte limits."""
    files, current, size = [], [], 0
    for i, line in enumerate(lines):
        if len(line) > max_bytes:
            raise ValueError(f"one batch line is {len(line) / 1e6:.1f} MB, over the {max_bytes / 1e6:.0f} MB "
                             "file limit: lower --max-image-side or use --image-format jpeg")
        if current and (len(current) >= max_requests or size + len(line) > max_bytes):
            files.append(current)
            current, size = [], 0
        current.append(i)
        size += len(line)
    if current:
        files.append(current)
    return files


def line_bytes(line: dict) -> bytes:
    return (json.dumps({k: line[k] for k in ("custom_id", "method", "url", "body")}) + "\n").encode()


class BatchDriver:
    """The driver's side: submit the waiting lines, poll the open batches, store what came back."""

    def __init__(self, state: BatchState, api: BatchAPI | None, settings: BatchSettings, job: str = "",
                 sleep=time.sleep, clock=time.monotonic):
        self.state, self.api, self.settings, self.job = state, api, settings, job
        self.sleep, self.clock = sleep, clock

    def submit(self) -> list[str]:
        """Submit every waiting line (split to the limits); each batch is recorded before the next is
        made, so a kill between them loses no id. Returns the new batch ids."""
        keys = self.state.waiting()
        if not keys:
            return []
        lines = [self.state.read("lines", k) for k in keys]
        encoded = [line_bytes(line) for line in lines]
        ids = []
        by_model: dict[str, list[int]] = {}       # a batch file holds one model's requests
        for i, line in enumerate(lines):
            by_model.setdefault(str(line["body"].get("model")), []).append(i)
        groups = [[idx[j] for j in group] for idx in by_model.values()
                  for group in split_files([encoded[i] for i in idx], self.settings.max_requests_per_file,
                                           self.settings.max_bytes_per_file)]
        for group in groups:
            file_id = self.api.upload(b"".join(encoded[i] for i in group))
            batch = self.api.create(file_id, self.settings.completion_window, {"job": self.job})
            self.state.write("batches", batch["id"], {
                "id": batch["id"], "input_file_id": file_id, "custom_ids": [keys[i] for i in group],
                "items": {keys[i]: lines[i].get("item", "") for i in group}, "submitted": time.time(), "done": False})
            ids.append(batch["id"])
            log.info("batch %s submitted: %d requests, %.1f MB", batch["id"], len(group),
                     sum(len(encoded[i]) for i in group) / 1e6)
        return ids

    def wait(self) -> dict:
        """Poll every open batch until all are done (bounded by ``max_wait_s``), storing their lines.
        Returns counts {completed, failed, retried, open}."""
        start = self.clock()
        counts = {"completed": 0, "failed": 0, "retried": 0, "open": 0}
        last_log = -1e9
        while True:
            open_batches = [b for b in self.state.batches() if not b.get("done")]
            progress = {"total": 0, "completed": 0, "failed": 0}
            for b in open_batches:
                info = self.api.retrieve(b["id"])
                rc = info.get("request_counts") or {}
                for k in progress:
                    progress[k] += int(rc.get(k) or 0)
                if info.get("status") in FINAL_STATUSES:
                    for k, v in self._collect(b, info).items():
                        counts[k] += v
            still = [b for b in self.state.batches() if not b.get("done")]
            if not still:
                return counts
            elapsed = self.clock() - start
            if self.clock() - last_log >= max(self.settings.poll_s, 10.0) or last_log < 0:
                finished = progress["completed"] + progress["failed"]
                eta = elapsed / finished * (progress["total"] - finished) if finished else float("nan")
                log.info("batches: %d open, %d requests submitted, %d completed, %d failed, ETA %s", len(still),
                         progress["total"], progress["completed"], progress["failed"],
                         "unknown" if eta != eta else f"{eta:.0f} s")
                last_log = self.clock()
            if elapsed >= self.settings.max_wait_s:
                counts["open"] = len(still)
                return counts
            self.sleep(self.settings.poll_s)

    def _collect(self, b: dict, info: dict) -> dict:
        """A batch that ended: its answered lines to ``results/``, failed or missing ones retried once
        (or marked for real time), then failed for good. The batch is marked done last (a kill before
        that collects it again, which rewrites the same objects)."""
        lines = []
        for field in ("output_file_id", "error_file_id"):
            if info.get(field):
                lines += [json.loads(x) for x in self.api.content(info[field]).decode().splitlines() if x.strip()]
        counts = self.store_results(lines, b["id"], expected=b["custom_ids"], ended=info.get("status", ""))
        b["done"], b["status"] = True, info.get("status")
        self.state.write("batches", b["id"], b)
        return counts

    def store_results(self, lines: list[dict], batch_id: str, expected: list[str] | None = None,
                      ended: str = "completed") -> dict:
        counts = {"completed": 0, "failed": 0, "retried": 0}
        seen = set()
        for line in lines:
            cid = str(line.get("custom_id", ""))
            seen.add(cid)
            response = line.get("response") or {}
            if not line.get("error") and response.get("status_code") == 200 and isinstance(response.get("body"), dict):
                self.state.write("results", cid, {"batch_id": batch_id, "body": response["body"]})
                self.state.remove("lines", cid)
                counts["completed"] += 1
                continue
            err = line.get("error") or {}
            reason = err.get("message") or err.get("code") or \
                f"HTTP {response.get('status_code')}: {json.dumps(response.get('body'))[:300]}"
            counts[self._fail(cid, f"{err.get('code') or 'error'}: {reason}")] += 1
        for cid in set(expected or ()) - seen:
            counts[self._fail(cid, f"batch {batch_id} {ended} before answering the line")] += 1
        return counts

    def _fail(self, cid: str, reason: str) -> str:
        try:
            record = self.state.read("failed", cid)
        except FileNotFoundError:
            record = {"failures": 0}
        record["failures"] = int(record.get("failures", 0)) + 1
        record["reason"] = reason[:1000]
        record["final"] = record["failures"] >= 2
        record["fallback"] = "" if record["final"] else self.settings.fallback
        self.state.write("failed", cid, record)
        return "failed" if record["final"] else "retried"

    # -- offline runners ------------------------------------------------------------------------
    def export_lines(self, path: str) -> int:
        """Write the waiting lines to ``path`` (JSONL, the batch input format); returns how many."""
        keys = self.state.waiting()
        with open(path, "wb") as f:
            for k in keys:
                f.write(line_bytes(self.state.read("lines", k)))
        return len(keys)

    def import_results(self, path: str) -> dict:
        """Store the lines of a batch output file (``vllm run-batch -o``, or a provider's output and
        error files concatenated)."""
        with open(path, encoding="utf-8") as f:
            lines = [json.loads(x) for x in f if x.strip()]
        return self.store_results(lines, batch_id=f"import:{path.rsplit('/', 1)[-1]}")
