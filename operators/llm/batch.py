"""Provider Batch APIs (``/v1/files`` + ``/v1/batches``, about half the real-time price) behind the normal
pipeline: the same request builders, cache, validators, selection and tables.

A stage run with a :class:`BatchState` does not send a request the cache cannot answer: its caller
writes the request's line (``custom_id`` = the request's cache key, ``body`` = what real time would
send) to ``<out>/_batch/<job>/lines/`` and the item waits (no row). The driver (:class:`BatchDriver`)
then submits the waiting lines in files split to the provider's limits, polls them (progress, a
bounded wait) and stores each answered line under ``results/``. The next pass of the pipeline takes
each result as the reply to its request (checked, booked at the batch price with its ``batch_id``, put
in the response cache), and the items go on to their next stage, whose lines go out the same way.

Everything lives in the output store, so a killed driver loses nothing, and each line is submitted
once by construction: ``pending/<id>.json`` records a submission's lines before its file is uploaded and
its file id before the batch is created; ``batches/<id>.json`` records each batch and its custom_ids. A
creation without an answer, and a rerun's pending submission, is looked for at the provider (its input
file, its ``submission`` metadata) before ``create`` is sent again; a rerun polls the recorded batches
instead of submitting their lines again. Submission streams (one line at a time into a file on local
disk, uploaded from there), only the lines the current run deferred (``runs/<run_id>/``), in waves under
the provider's enqueued-token limit when one is set. Errors are read by their code
(:mod:`operators.llm.errors`): a quota stops the job, a 4xx is not sent again. A failed or expired line is
submitted once more (or sent in real time with ``fallback="realtime"``), then becomes its item's error
row with the provider's reason (``failed/``; a later run tries it once more). ``export_lines`` /
``import_results`` do the same through files for offline runners (``vllm run-batch -i in.jsonl -o
out.jsonl`` reads and writes these formats).
"""
from __future__ import annotations

import json
import logging
import os
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass

from operators.io.storage import Store
from operators.llm.errors import QUOTA_CODES, ErrorReading, read_error

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
    max_enqueued_tokens: int = 0            # the provider's enqueued-token limit per model (0: none): files go
                                            # in waves whose open batches stay under it
    keep_files: bool = False                # keep a batch's input, output and error files at the provider


class BatchState:
    """One job's batch files in the output store (written by LLM actors and the driver; every object
    written whole, so a kill leaves no half entry)."""

    def __init__(self, root: str, job: str, run_id: str = ""):
        self.store = Store(root).child(f"{BATCH_PREFIX}/{job}")
        self.run_id = run_id     # the run whose lines these callers defer (``runs/<run_id>/``)

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
            if record.get("final") and self._this_run(record):
                return "failed", record
            if record.get("final"):
                return "", None          # failed for good in an earlier run: this run tries it once more
            if record.get("fallback") == "realtime":
                return "realtime", record
        return "", None

    def remember(self, key: str, run_id: str, entry: dict) -> None:
        """A batch answer this run took and booked, kept for its later passes when there is no response
        cache (``--no-cache``): they take it from here, booked nowhere, instead of booking it again."""
        self.store.write_bytes(f"taken/{run_id}/{key}.json", json.dumps(entry).encode())

    def remembered(self, key: str, run_id: str) -> dict | None:
        try:
            return json.loads(self.store.read_bytes(f"taken/{run_id}/{key}.json"))
        except FileNotFoundError:
            return None

    def _this_run(self, record: dict) -> bool:
        """Whether a line's failure is this run's (without a run id: every failure counts)."""
        return not self.run_id or record.get("run") == self.run_id

    def defer(self, key: str, item: str, body: dict, tokens: int = 0) -> None:
        """The request waits for a batch (``tokens``: its prompt estimate and completion cap, what a
        provider counts against its enqueued-token limit). Written once: a rerun finds its line waiting."""
        rel = f"lines/{key}.json"
        if not self.store.exists(rel):
            self.store.write_bytes(rel, json.dumps({"custom_id": key, "method": "POST", "url": ENDPOINT,
                                                    "body": body, "item": item, "tokens": int(tokens)}).encode())
        if self.run_id:    # this run wants the line: only such lines are submitted (a stale one is not paid)
            self.store.write_bytes(f"runs/{self.run_id}/{key}.json", b"{}")

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

    def pending(self) -> list[dict]:
        """Submissions begun and not recorded as batches yet (a driver killed in between)."""
        return [self.read("pending", k) for k in sorted(self.keys("pending"))]

    def waiting(self, run_id: str | None = None) -> list[str]:
        """Lines to submit: waiting, not answered, not failed for good, not in a batch still open nor in a
        submission begun; with ``run_id``, only the lines that run deferred."""
        return sorted(self._unsent(run_id) & (self.keys(f"runs/{run_id}") if run_id else self.keys("lines")))

    def stale(self, run_id: str) -> list[str]:
        """Lines waiting that ``run_id`` did not defer (an earlier run's, e.g. under another setting)."""
        return sorted(self._unsent() - self.keys(f"runs/{run_id}"))

    def _unsent(self, run_id: str | None = None) -> set[str]:
        """Lines not answered, not in an open batch or a submission begun, not failed for good (with
        ``run_id``: in that run; a line an earlier run failed is tried once more) nor sent in real time."""
        out = {cid for b in self.batches() if not b.get("done") for cid in b["custom_ids"]}
        out |= {cid for p in self.pending() for cid in p["custom_ids"]}
        failed = set()
        for k in self.keys("failed"):
            record = self.read("failed", k)
            if record.get("final") and (not run_id or record.get("run") == run_id) or \
                    record.get("fallback") == "realtime":
                failed.add(k)
        return self.keys("lines") - self.keys("results") - failed - out


class BatchAPIError(Exception):
    """A ``/files`` or ``/batches`` call that ended without an answer to go on with, read by the
    provider's error code (:func:`operators.llm.errors.read_error`): ``kind`` quota (the job stops, exit
    3), reject (a 4xx: not retried), or retry/wait/unreachable after every allowed attempt."""

    def __init__(self, method: str, path: str, kind: str, reason: str):
        super().__init__(f"batch API {method} {path}: {reason}")
        self.kind, self.reason = kind, reason


class CreateUnanswered(BatchAPIError):
    """``POST /batches`` sent without an answer (a timeout, a connection lost, a 5xx): the provider may
    have created the batch. Never sent again blindly: the driver looks for it first."""


class BatchAPI:
    """``/v1/files`` and ``/v1/batches`` of an OpenAI-compatible endpoint (plain HTTP, bounded). Each
    error is read by its code: a quota stops, a rate limit waits its ``Retry-After``, a 5xx or a lost
    connection is retried (except a batch creation, which may have happened), other 4xx are final."""

    def __init__(self, base_url: str, api_key: str = "", timeout_s: float = 300.0, attempts: int = 4,
                 rate_limit_attempts: int = 30, max_retry_after_s: float = 300.0, sleep=time.sleep):
        if attempts < 1:   # every call is sent at least once; 0 would fail before asking
            raise ValueError(f"attempts must be at least 1, got {attempts}")
        self.base_url, self.timeout_s, self.attempts = base_url.rstrip("/"), timeout_s, attempts
        self.rate_limit_attempts, self.max_retry_after_s, self.sleep = rate_limit_attempts, max_retry_after_s, sleep
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def _request(self, method: str, path: str, data=None, content_type: str = "application/json",
                 resend: bool = True, length: int | None = None):
        """``resend`` False: a request that must not be sent twice unasked (a batch creation): no answer
        raises :class:`CreateUnanswered` instead of sending it again. ``data`` may be a callable giving a
        fresh iterable of chunks (a file streamed from disk, ``length`` bytes)."""
        failures = waits = 0
        while True:
            body = data() if callable(data) else data
            headers = {**self.headers, **({"Content-Type": content_type} if data is not None else {})}
            if length is not None:
                headers["Content-Length"] = str(length)
            req = urllib.request.Request(f"{self.base_url}{path}", data=body, method=method, headers=headers)
            delay = None
            try:
                with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                    return resp.read()
            except urllib.error.HTTPError as exc:
                content = exc.read()
                retry_after = _retry_after_s(exc.headers)
                reading = read_error(exc.code, content, retry_after)
                reason = f"HTTP {exc.code} ({reading.reason})"[:600]
                if reading.kind in ("quota", "reject"):
                    raise BatchAPIError(method, path, reading.kind, reason) from None
                if reading.kind == "wait":
                    waits += 1
                    if waits > self.rate_limit_attempts:
                        raise BatchAPIError(method, path, "wait", f"{reason} after {waits} attempts") from None
                    delay = min(self.max_retry_after_s, retry_after if retry_after is not None else 2.0 ** min(waits, 6))
                elif not resend:
                    raise CreateUnanswered(method, path, "retry", reason) from None
            except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as exc:
                never_sent = isinstance(getattr(exc, "reason", None), ConnectionRefusedError) or \
                    isinstance(exc, ConnectionRefusedError)
                if not resend and not never_sent:
                    raise CreateUnanswered(method, path, "retry", f"no answer ({type(exc).__name__})") from None
                reason = f"no answer ({type(exc).__name__})"
            if delay is None:
                failures += 1
                if failures >= self.attempts:
                    raise BatchAPIError(method, path, "retry", f"{reason} after {failures} attempts") from None
                delay = min(30.0, 2.0 ** (failures - 1))
            self.sleep(delay)

    def upload(self, content: bytes, filename: str = "batch.jsonl") -> str:
        return self.upload_chunks(lambda: [content], len(content), filename)

    def upload_file(self, path: str, filename: str = "batch.jsonl") -> str:
        """A file on disk, streamed (the driver never holds it whole)."""
        import os

        def chunks():
            with open(path, "rb") as f:
                while True:
                    block = f.read(1 << 20)
                    if not block:
                        return
                    yield block
        return self.upload_chunks(chunks, os.path.getsize(path), filename)

    def upload_chunks(self, chunks, size: int, filename: str = "batch.jsonl") -> str:
        boundary = uuid.uuid4().hex
        head = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
                f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{filename}\"\r\n"
                f"Content-Type: application/jsonl\r\n\r\n").encode()
        tail = f"\r\n--{boundary}--\r\n".encode()

        def body():
            yield head
            yield from chunks()
            yield tail
        return json.loads(self._request("POST", "/files", body, f"multipart/form-data; boundary={boundary}",
                                        length=len(head) + size + len(tail)))["id"]

    def create(self, file_id: str, window: str, metadata: dict | None = None) -> dict:
        """Sent once: no answer raises :class:`CreateUnanswered` (the caller looks for the batch)."""
        return json.loads(self._request("POST", "/batches", json.dumps(
            {"input_file_id": file_id, "endpoint": ENDPOINT, "completion_window": window,
             "metadata": metadata or {}}).encode(), resend=False))

    def list_batches(self, limit: int = 100):
        """The account's batches, newest first, a page at a time (``GET /batches?limit&after``)."""
        after = ""
        while True:
            page = json.loads(self._request("GET", f"/batches?limit={limit}" + (f"&after={after}" if after else "")))
            data = page.get("data") or []
            yield from data
            if not page.get("has_more") or not data:
                return
            after = str(data[-1].get("id", ""))

    def retrieve(self, batch_id: str) -> dict:
        return json.loads(self._request("GET", f"/batches/{batch_id}"))

    def content(self, file_id: str) -> bytes:
        return self._request("GET", f"/files/{file_id}/content")

    def delete_file(self, file_id: str) -> None:
        self._request("DELETE", f"/files/{file_id}")

    def cancel(self, batch_id: str) -> dict:
        return json.loads(self._request("POST", f"/batches/{batch_id}/cancel", b"{}"))


def _retry_after_s(headers) -> float | None:
    for name, scale in (("retry-after-ms", 1e-3), ("retry-after", 1.0)):
        value = headers.get(name) if headers is not None else None
        if value:
            try:
                return max(0.0, float(value) * scale)
            except ValueError:
                continue
    return None


FINAL_STATUSES = ("completed", "failed", "expired", "cancelled")
LOG_EVERY_S = 10.0   # the wait's progress line: on its first poll, then at most this often


def progress_line(open_batches: int, progress: dict, elapsed_s: float) -> str:
    """The wait's progress line, from the open batches' ``request_counts`` summed (``total``,
    ``completed``, ``failed``): the time left at the rate so far (unknown until a line has ended)."""
    finished = progress["completed"] + progress["failed"]
    eta = f"{elapsed_s / finished * (progress['total'] - finished):.0f} s" if finished else "unknown"
    return (f"batches: {open_batches} open, {progress['total']} requests submitted, "
            f"{progress['completed']} completed, {progress['failed']} failed, ETA {eta}")


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


LINE_FILE_PREFIX = "changeforge-batch-"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:      # another user's process: alive
        return True
    return True


def sweep_line_files(directory: str | None = None) -> list[str]:
    """Remove the batch files a driver killed while filling them left in the temporary directory
    (named with their driver's pid; that process no longer runs). They hold the requests' content,
    images included, and nothing reads them again: the lines they held are still in the state, and
    are submitted from there. Returns the paths removed."""
    directory = directory or tempfile.gettempdir()
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        pid = name[len(LINE_FILE_PREFIX):].split("-", 1)[0]
        if not (name.startswith(LINE_FILE_PREFIX) and name.endswith(".jsonl") and pid.isdigit()):
            continue
        if int(pid) == os.getpid() or _pid_alive(int(pid)):
            continue
        try:
            os.unlink(os.path.join(directory, name))
            removed.append(os.path.join(directory, name))
        except OSError:
            pass
    if removed:
        log.info("removed %d batch file(s) a killed driver left in %s", len(removed), directory)
    return removed


class _LineFile:
    """One batch file being filled, on local disk (never in memory): its lines' keys, items and size.
    Its name carries the driver's pid, so that a later run removes it if the driver was killed."""

    def __init__(self):
        fd, self.path = tempfile.mkstemp(prefix=f"{LINE_FILE_PREFIX}{os.getpid()}-", suffix=".jsonl")
        self._f = os.fdopen(fd, "wb")
        self.keys: list[str] = []
        self.items: dict[str, str] = {}
        self.size = self.tokens = 0

    @property
    def count(self) -> int:
        return len(self.keys)

    def add(self, key: str, item: str, encoded: bytes, tokens: int = 0) -> None:
        self.tokens += tokens
        self._f.write(encoded)
        self.keys.append(key)
        self.items[key] = item
        self.size += len(encoded)

    def discard(self) -> None:
        if not self._f.closed:
            self._f.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def line_bytes(line: dict) -> bytes:
    return (json.dumps({k: line[k] for k in ("custom_id", "method", "url", "body")}) + "\n").encode()


def line_reading(line: dict) -> ErrorReading:
    """What a batch output or error line that is not an answer calls for, read by its status and code:
    a reply with an error status (``response.status_code`` and its body's error) as real time reads it;
    a line the batch never ran (``error``: ``batch_expired``, ``batch_cancelled``, ``server_error``) is
    retried, unless its code names the account's quota."""
    response = line.get("response") or {}
    status = response.get("status_code")
    if isinstance(status, int) and status != 200:
        return read_error(status, response.get("body"))
    err = line.get("error") if isinstance(line.get("error"), dict) else {}
    reading = read_error(429 if str(err.get("code", "")).lower() in QUOTA_CODES else 500, {"error": err})
    if reading.kind != "quota":
        reading = ErrorReading("retry", reading.code, "", reading.message)
    return reading


class BatchDriver:
    """The driver's side: submit the waiting lines, poll the open batches, store what came back."""

    def __init__(self, state: BatchState, api: BatchAPI | None, settings: BatchSettings, job: str = "",
                 sleep=time.sleep, clock=time.monotonic, run_id: str = ""):
        self.state, self.api, self.settings, self.job, self.run_id = state, api, settings, job, run_id
        self.sleep, self.clock = sleep, clock
        self.quota = ""    # a line refused for the account's quota: the job stops (exit 3), the line waits
        self.wave_counts: dict = {}   # what the waits between waves collected (wait() reports the rest)

    def submit(self) -> list[str]:
        """Submit the waiting lines (this run's, with ``run_id``), streamed: lines are read one at a time into
        a file on local disk per model until the provider's limits, and each file is uploaded (streamed)
        and submitted before the next is filled, so the driver holds one line, never a file's worth.

        One submission per line, by construction: the lines' keys are recorded (``pending/``) before the
        upload, the file id before ``create``; a creation without an answer is looked for at the provider
        (its input file, its ``submission`` metadata) before it is asked again, and a rerun resumes every
        pending submission the same way before anything new. Returns the new batch ids."""
        sweep_line_files()
        ids = self.resume_pending()
        keys = self.state.waiting(self.run_id or None)
        if self.run_id:
            stale = self.state.stale(self.run_id)
            if stale:
                log.warning("%d waiting batch lines are not this run's (an earlier run's, e.g. under other settings): "
                            "left in %s, not submitted, not paid: %s%s", len(stale), self.state.store.uri("lines"),
                            ", ".join(stale[:5]), ", ..." if len(stale) > 5 else "")
        files: dict[str, _LineFile] = {}        # a batch file holds one model's requests
        try:
            for key in keys:
                try:
                    line = self.state.read("lines", key)
                except FileNotFoundError:
                    continue
                encoded = line_bytes(line)
                if len(encoded) > self.settings.max_bytes_per_file:
                    self._fail(key, f"the batch line is {len(encoded) / 1e6:.1f} MB, over the "
                               f"{self.settings.max_bytes_per_file / 1e6:.0f} MB file limit: lower --max-image-side "
                               "or use --image-format jpeg", final=True)
                    continue
                model, tokens = str(line["body"].get("model")), int(line.get("tokens") or 0)
                limit = self.settings.max_enqueued_tokens
                f = files.get(model)
                if f is not None and (f.count >= self.settings.max_requests_per_file or
                                      f.size + len(encoded) > self.settings.max_bytes_per_file or
                                      limit and f.tokens + tokens > limit):
                    sent = self._send_in_wave(files.pop(model), model)
                    if sent is None:
                        return ids
                    ids.append(sent)
                    f = None
                if f is None:
                    f = files[model] = _LineFile()
                f.add(key, str(line.get("item", "")), encoded, tokens)
                del line, encoded
            for model in list(files):
                sent = self._send_in_wave(files.pop(model), model)
                if sent is None:
                    return ids
                ids.append(sent)
        finally:
            for f in files.values():
                f.discard()
        return ids

    def _send_in_wave(self, f: "_LineFile", model: str) -> str | None:
        """Submit ``f`` once the model's open batches leave room for it under ``max_enqueued_tokens``
        (waiting for them: their lines are collected as ``wait`` collects them). None: the wait ran out
        (or a quota stopped it) and ``f`` was not sent; its lines wait for the next pass or the rerun."""
        limit = self.settings.max_enqueued_tokens
        if limit and self.enqueued(model) and self.enqueued(model) + f.tokens > limit:
            log.info("%d tokens enqueued for %s: the next file (%d tokens) waits for them (--batch-max-enqueued-"
                     "tokens %d)", self.enqueued(model), model, f.tokens, limit)
            waited = self.wait()
            self.wave_counts = {k: self.wave_counts.get(k, 0) + v for k, v in waited.items() if k != "open"}
            if waited["open"] or self.quota:
                f.discard()
                return None
        return self._send(f, model)

    def enqueued(self, model: str) -> int:
        """Tokens of ``model``'s batches still open (as recorded at submission)."""
        return sum(int(b.get("tokens") or 0) for b in self.state.batches()
                   if not b.get("done") and b.get("model", model) == model)

    def step(self, name: str) -> None:
        """A point between the steps of a submission (tests stop the driver here)."""

    def _send(self, f: "_LineFile", model: str = "") -> str:
        record = {"id": uuid.uuid4().hex, "custom_ids": f.keys, "items": f.items, "file_id": "",
                  "begun": time.time(), "bytes": f.size, "tokens": f.tokens, "model": model}
        self.state.write("pending", record["id"], record)
        self.step("pending")
        f._f.close()
        try:
            file_id = self.api.upload_file(f.path)
        finally:
            f.discard()
        self.step("uploaded")
        record["file_id"] = file_id
        self.state.write("pending", record["id"], record)
        self.step("file recorded")
        return self._record(record, self._create(record, look_first=False))

    def resume_pending(self) -> list[str]:
        """The submissions a killed driver began: one whose file id was never recorded cannot have been
        created (its lines wait again); one with a file id is looked for at the provider and recorded,
        or created now if it is not there."""
        ids = []
        for record in self.state.pending():
            if not record.get("file_id"):
                self.state.remove("pending", record["id"])
                continue
            ids.append(self._record(record, self._create(record, look_first=True)))
        return ids

    def _create(self, record: dict, look_first: bool) -> dict:
        last = None
        for attempt in range(self.api.attempts):
            if look_first or attempt:
                found = self._find(record)
                if found is not None:
                    log.info("batch %s found at the provider for submission %s (not created again)",
                             found.get("id"), record["id"])
                    return found
            try:
                return self.api.create(record["file_id"], self.settings.completion_window,
                                       {"job": self.job, "submission": record["id"]})
            except CreateUnanswered as exc:
                last = exc
                log.warning("%s: looking for the batch at the provider before asking again", exc)
                self.sleep(min(30.0, 2.0 ** attempt))
        raise BatchAPIError("POST", "/batches", "retry", f"{last.reason if last else 'no answer'}; the batch of "
                            f"submission {record['id']} is not at the provider either: a rerun looks for it again")

    def _find(self, record: dict) -> dict | None:
        """The provider's batch made from this submission's file (or naming it in its metadata), looked for
        among the account's batches, newest first, back to an hour before the submission began."""
        for b in self.api.list_batches():
            if b.get("input_file_id") == record["file_id"] or \
                    (b.get("metadata") or {}).get("submission") == record["id"]:
                return b
            created = b.get("created_at")
            if isinstance(created, (int, float)) and created < record["begun"] - 3600:
                return None
        return None

    def _record(self, record: dict, batch: dict) -> str:
        self.step("created")
        self.state.write("batches", batch["id"], {
            "id": batch["id"], "input_file_id": record["file_id"], "custom_ids": record["custom_ids"],
            "items": record["items"], "submitted": time.time(), "done": False, "submission": record["id"],
            "tokens": int(record.get("tokens") or 0), "model": record.get("model", "")})
        self.step("recorded")
        self.state.remove("pending", record["id"])
        log.info("batch %s submitted: %d requests, %.1f MB", batch["id"], len(record["custom_ids"]),
                 record.get("bytes", 0) / 1e6)
        return batch["id"]

    def wait(self) -> dict:
        """Poll every open batch until all are done (bounded by ``max_wait_s``), storing their lines.
        Returns counts {completed, failed, retried, open}."""
        start = self.clock()
        counts = {"completed": 0, "failed": 0, "retried": 0, "open": 0}
        last_log = None
        while True:
            open_batches = [b for b in self.state.batches() if not b.get("done")]
            progress = {"total": 0, "completed": 0, "failed": 0}
            for b in open_batches:
                try:
                    info = self.api.retrieve(b["id"])
                except BatchAPIError as exc:
                    if exc.kind not in ("retry", "wait"):
                        raise
                    # A blip (5xx, a lost connection, a rate limit) while the batch runs for hours: the
                    # next poll asks again, as long as the wait lasts (--batch-max-wait-s).
                    log.warning("%s; polling on", exc)
                    continue
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
            if last_log is None or self.clock() - last_log >= max(self.settings.poll_s, LOG_EVERY_S):
                log.info("%s", progress_line(len(still), progress, elapsed))
                last_log = self.clock()
            if elapsed >= self.settings.max_wait_s:
                counts["open"] = len(still)
                return counts
            self.sleep(self.settings.poll_s)

    def _collect(self, b: dict, info: dict) -> dict:
        """A batch that ended: its answered lines to ``results/``, failed or missing ones retried once
        (or marked for real time), then failed for good, with the provider's reason (a line's own error,
        else the batch's ``errors``, e.g. ``token_limit_exceeded``). The batch is marked done last (a kill
        before that collects it again, which rewrites the same objects)."""
        lines = []
        for field in ("output_file_id", "error_file_id"):
            if info.get(field):
                lines += [json.loads(x) for x in self.api.content(info[field]).decode().splitlines() if x.strip()]
        ended = info.get("status", "")
        errors = [e for e in ((info.get("errors") or {}).get("data") or []) if isinstance(e, dict)]
        if errors:
            ended += " (" + "; ".join(f"{e.get('code') or 'error'}: {e.get('message') or ''}".strip()
                                      for e in errors[:3])[:600] + ")"
        if any(str(e.get("code", "")) == "token_limit_exceeded" for e in errors) and not lines:
            # Refused whole for the provider's enqueued-token limit: no line ran, none was billed, none
            # failed. They wait for the next wave (--batch-max-enqueued-tokens keeps the waves under it).
            log.warning("batch %s refused for the enqueued-token limit (%s): its %d lines go again when there is "
                        "room; set --batch-max-enqueued-tokens to the provider's limit", b["id"], ended,
                        len(b["custom_ids"]))
            counts = {"completed": 0, "failed": 0, "retried": len(b["custom_ids"])}
        else:
            counts = self.store_results(lines, b["id"], expected=b["custom_ids"], ended=ended)
        b["done"], b["status"] = True, info.get("status")
        if errors:
            b["errors"] = errors[:10]
        self.state.write("batches", b["id"], b)
        if not self.settings.keep_files:
            self._delete_files(b, info)
        return counts

    def _delete_files(self, b: dict, info: dict) -> None:
        """A batch's files at the provider, once its results are stored (a provider keeps them, and counts
        them against the account's storage, until they are deleted). Best effort: one that is already
        gone, or a refusal, is logged and left."""
        for file_id in dict.fromkeys(f for f in (b.get("input_file_id"), info.get("output_file_id"),
                                                  info.get("error_file_id")) if f):
            try:
                self.api.delete_file(file_id)
            except BatchAPIError as exc:
                log.warning("batch %s: its file %s was not deleted at the provider (%s)", b["id"], file_id, exc.reason)

    def store_results(self, lines: list[dict], batch_id: str, expected: list[str] | None = None,
                      ended: str = "completed") -> dict:
        """Each line read by its status and code (:func:`line_reading`): answered -> ``results/``; a
        quota -> left waiting, and the job stops (``quota``); a 4xx -> failed for good at once (the same
        request gets the same answer); anything else -> retried once, then failed for good."""
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
            reading = line_reading(line)
            if reading.kind == "quota":
                self.quota = self.quota or f"batch {batch_id}: {reading.reason}"
                continue                     # not answered, not billed: waits for the rerun
            counts[self._fail(cid, reading.reason, final=reading.kind == "reject")] += 1
        for cid in set(expected or ()) - seen:
            counts[self._fail(cid, f"batch {batch_id} {ended} before answering the line")] += 1
        return counts

    def _fail(self, cid: str, reason: str, final: bool = False) -> str:
        try:
            record = self.state.read("failed", cid)
        except FileNotFoundError:
            record = {"failures": 0}
        record["failures"] = int(record.get("failures", 0)) + 1
        record["reason"] = reason[:1000]
        record["final"] = final or record["failures"] >= 2
        record["run"] = self.run_id
        record["fallback"] = "" if record["final"] else self.settings.fallback
        self.state.write("failed", cid, record)
        return "failed" if record["final"] else "retried"

    # -- offline runners ------------------------------------------------------------------------
    def export_lines(self, path: str) -> int:
        """Write the waiting lines to ``path`` (JSONL, the batch input format); returns how many."""
        keys = self.state.waiting(self.run_id or None)
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
