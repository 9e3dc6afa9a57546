"""One small API over local folders and ``s3://`` prefixes.

Everything that touches object storage goes through :class:`Store`, so the jobs run the same on a
laptop folder and on S3 (AWS or any S3-compatible server named by the standard ``AWS_ENDPOINT_URL``).
pyarrow's filesystem layer does the talking; rasterio gets the matching GDAL settings from
:func:`gdal_env`.
"""
from __future__ import annotations

import contextlib
import logging
import os
import posixpath
import tempfile
import uuid
from dataclasses import dataclass
from urllib.parse import urlparse

import pyarrow.fs as pafs

log = logging.getLogger(__name__)

def is_s3(uri: str) -> bool:
    return str(uri).startswith("s3://")


_S3_CLIENTS: dict = {}


def s3_client():
    """A boto3 S3 client per process and endpoint (boto3 honours AWS_ENDPOINT_URL by itself).

    boto3 rather than pyarrow's S3 layer for objects: single PUTs are atomic and work the same on
    AWS and S3-compatible servers, where pyarrow's always-multipart writes do not always.
    """
    import boto3
    from botocore.config import Config

    key = (os.getpid(), os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL"))
    if key not in _S3_CLIENTS:
        # Throttling (503 SlowDown), 5xx and dropped connections are retried inside each call,
        # adaptive mode also slowing this client down; AWS_MAX_ATTEMPTS / AWS_RETRY_MODE override.
        retries = {"total_max_attempts": int(os.environ.get("AWS_MAX_ATTEMPTS", "10")),
                   "mode": os.environ.get("AWS_RETRY_MODE", "adaptive")}
        _S3_CLIENTS[key] = boto3.client("s3", config=Config(retries=retries,
                                                            max_pool_connections=32))
    return _S3_CLIENTS[key]


# Errors worth another attempt: throttling, server-side 5xx, dropped or timed-out connections.
# botocore retries some of these inside a call, but not a body stream cut off mid-read.
_TRANSIENT_CODES = {"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout",
                    "RequestTimeoutException", "InternalError", "ServiceUnavailable", "500", "502",
                    "503", "504"}


def is_transient(exc: BaseException) -> bool:
    """True for storage errors that a retry can cure (never for a missing object or bad data)."""
    if isinstance(exc, FileNotFoundError):
        return False
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    try:
        from botocore import exceptions as bx
    except ImportError:  # pragma: no cover
        return False
    if isinstance(exc, bx.ClientError):
        err = exc.response.get("Error", {})
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
        return str(err.get("Code")) in _TRANSIENT_CODES or int(status) >= 500
    return isinstance(exc, (bx.EndpointConnectionError, bx.ConnectionClosedError, bx.ReadTimeoutError,
                            bx.ConnectTimeoutError, bx.IncompleteReadError, bx.ResponseStreamingError))


def retry_transient(fn, what: str, attempts: int = 5, base_delay_s: float = 0.2):
    """``fn()``, retried with exponential backoff and jitter on transient storage errors."""
    import random
    import time
    for attempt in range(1, attempts + 1):
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - filtered just below
            if attempt == attempts or not is_transient(exc):
                raise
            delay = base_delay_s * 2 ** (attempt - 1) * (0.5 + random.random())
            log.warning("%s: %s (attempt %d/%d), retrying in %.1f s", what,
                        type(exc).__name__, attempt, attempts, delay)
            time.sleep(delay)


def _bucket_key(path: str) -> tuple[str, str]:
    bucket, _, key = path.partition("/")
    return bucket, key


@dataclass(frozen=True)
class Store:
    """A root URI (local folder or ``s3://bucket/prefix``) with relative-path file operations."""

    root: str

    def __post_init__(self):
        object.__setattr__(self, "root", str(self.root).rstrip("/") or "/")

    # -- addressing -------------------------------------------------------------------------
    @property
    def fs(self) -> pafs.FileSystem:
        """pyarrow filesystem for local roots (S3 goes through :func:`s3_client`)."""
        return pafs.LocalFileSystem()

    @property
    def _base(self) -> str:
        if is_s3(self.root):
            return self.root[len("s3://"):]
        return os.path.abspath(self.root)

    def path(self, rel: str = "") -> str:
        """Filesystem path (no scheme) as pyarrow wants it."""
        return posixpath.join(self._base, rel) if rel else self._base

    def uri(self, rel: str = "") -> str:
        """Full URI of ``rel``, as a user or rasterio would write it."""
        if is_s3(self.root):
            return "s3://" + self.path(rel)
        return self.path(rel)

    def child(self, rel: str) -> "Store":
        return Store(self.uri(rel))

    # -- operations -------------------------------------------------------------------------
    def exists(self, rel: str) -> bool:
        if is_s3(self.root):
            from botocore.exceptions import ClientError
            bucket, key = _bucket_key(self.path(rel))
            try:
                s3_client().head_object(Bucket=bucket, Key=key)
                return True
            except ClientError as exc:
                if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                    return False
                raise
        return os.path.exists(self.path(rel))

    def size(self, rel: str = "") -> int:
        if is_s3(self.root):
            bucket, key = _bucket_key(self.path(rel))
            return int(s3_client().head_object(Bucket=bucket, Key=key)["ContentLength"])
        return os.path.getsize(self.path(rel))

    def read_bytes(self, rel: str = "") -> bytes:
        if is_s3(self.root):
            from botocore.exceptions import ClientError
            bucket, key = _bucket_key(self.path(rel))
            try:
                return s3_client().get_object(Bucket=bucket, Key=key)["Body"].read()
            except ClientError as exc:
                if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey"):
                    raise FileNotFoundError(f"no such object: {self.uri(rel)}") from None
                raise
        with open(self.path(rel), "rb") as f:
            return f.read()

    def write_bytes(self, rel: str, data: bytes) -> str:
        """Write ``data`` so that a reader sees either nothing or the whole object.

        S3 puts are atomic already; on a local disk we write a temporary file and rename it, so a
        crash never leaves a truncated PNG or Parquet shard that a resumed run would trust.
        """
        target = self.path(rel)
        if is_s3(self.root):
            bucket, key = _bucket_key(target)
            s3_client().put_object(Bucket=bucket, Key=key, Body=data)
        else:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            tmp = f"{target}.tmp-{uuid.uuid4().hex[:8]}"
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, target)
        return self.uri(rel)

    @contextlib.contextmanager
    def open_output(self, rel: str):
        """A binary file to write ``rel`` in pieces (an output too large to build in memory first),
        published whole when the block ends without an error, as :meth:`write_bytes` does: a local
        temporary file renamed, or on S3 a temporary file uploaded (multipart when large) at the end."""
        target = self.path(rel)
        if is_s3(self.root):
            with tempfile.NamedTemporaryFile(prefix="changeforge-", suffix=".part") as f:
                yield f
                f.flush()
                bucket, key = _bucket_key(target)
                retry_transient(lambda: s3_client().upload_file(f.name, bucket, key), f"upload {self.uri(rel)}")
            return
        os.makedirs(os.path.dirname(target), exist_ok=True)
        tmp = f"{target}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            with open(tmp, "wb") as f:
                yield f
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)

    def delete(self, rel: str) -> None:
        if is_s3(self.root):
            bucket, key = _bucket_key(self.path(rel))
            s3_client().delete_object(Bucket=bucket, Key=key)
            return
        try:
            os.remove(self.path(rel))
        except FileNotFoundError:
            pass

    def list(self, rel: str = "", suffixes: tuple[str, ...] = (), recursive: bool = True) -> list[str]:
        """Relative paths of files under ``rel`` (sorted). Folder markers and temp files skipped."""
        return sorted(self.stamps(rel, suffixes, recursive))

    def stamps(self, rel: str = "", suffixes: tuple[str, ...] = (), recursive: bool = True) -> dict[str, str]:
        """:meth:`list`'s files with a *stamp* each: ``<size>:<mtime ns>`` on a local disk, ``<size>:<ETag>``
        on S3. From the listing itself (no extra request): a changed stamp means the file may have
        changed, an unchanged one that it did not (operators.io.lineage)."""
        base = self.path(rel)
        entries: list[tuple[str, str]] = []
        if is_s3(self.root):
            bucket, prefix = _bucket_key(base)
            prefix = prefix.rstrip("/") + "/" if prefix else ""
            kwargs = {} if recursive else {"Delimiter": "/"}
            for page in s3_client().get_paginator("list_objects_v2").paginate(
                    Bucket=bucket, Prefix=prefix, **kwargs):
                entries += [(f"{bucket}/{o['Key']}", f"{o.get('Size', '')}:{str(o.get('ETag', '')).strip(chr(34))}")
                            for o in page.get("Contents", [])]
        else:
            selector = pafs.FileSelector(base, allow_not_found=True, recursive=recursive)
            entries = [(i.path, f"{i.size}:{i.mtime_ns}") for i in self.fs.get_file_info(selector)
                       if i.type == pafs.FileType.File]
        out = {}
        for name, stamp in entries:
            leaf = posixpath.basename(name)
            if name.endswith("/") or not leaf or leaf.startswith(".") or "_$folder$" in leaf or ".tmp-" in leaf:
                continue
            if suffixes and not name.lower().endswith(tuple(x.lower() for x in suffixes)):
                continue
            out[posixpath.relpath(name, self._base)] = stamp
        return out


def split_uri(uri: str) -> tuple[Store, str]:
    """``s3://b/dir/file.tif`` -> (Store('s3://b/dir'), 'file.tif'); local paths likewise."""
    uri = str(uri)
    if is_s3(uri):
        head, tail = posixpath.split(uri[len("s3://"):])
        return Store("s3://" + head), tail
    head, tail = os.path.split(os.path.abspath(uri))
    return Store(head), tail


def read_uri(uri: str) -> bytes:
    store, name = split_uri(uri)
    return store.read_bytes(name)


def gdal_path(uri: str) -> str:
    """Path rasterio/GDAL can open: ``s3://b/k`` becomes ``/vsis3/b/k``; local paths unchanged."""
    uri = str(uri)
    if is_s3(uri):
        return "/vsis3/" + uri[len("s3://"):]
    return uri


def gdal_env() -> dict[str, str]:
    """GDAL options that point /vsis3/ at the same endpoint boto3 and pyarrow use.

    GDAL ignores AWS_ENDPOINT_URL and wants host:port plus HTTPS and path-style flags instead.
    """
    env = {
        # Listing a "directory" before every open costs a request per scene on S3.
        "GDAL_DISABLE_READDIR_ON_OPEN": "EMPTY_DIR",
        "CPL_VSIL_CURL_ALLOWED_EXTENSIONS": "",
        # GDAL reads windows of scenes over HTTP: retry throttling and server errors as boto3 does.
        "GDAL_HTTP_MAX_RETRY": os.environ.get("GDAL_HTTP_MAX_RETRY", "10"),
        "GDAL_HTTP_RETRY_DELAY": os.environ.get("GDAL_HTTP_RETRY_DELAY", "0.5"),
        "GDAL_HTTP_RETRY_CODES": os.environ.get("GDAL_HTTP_RETRY_CODES", "429,500,502,503,504"),
    }
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        parsed = urlparse(endpoint)
        env["AWS_S3_ENDPOINT"] = parsed.netloc
        env["AWS_HTTPS"] = "NO" if parsed.scheme == "http" else "YES"
        env["AWS_VIRTUAL_HOSTING"] = "FALSE"
    env = {k: v for k, v in env.items() if v != ""}
    return env


def forwarded_env() -> dict[str, str]:
    """Non-secret variables a Ray worker needs to reach the same storage endpoint.

    Credentials are deliberately not forwarded through runtime_env (it is visible in the dashboard):
    on a cluster they come from the instance profile, locally workers inherit the driver's env.
    """
    names = ["AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_REGION", "AWS_DEFAULT_REGION"]
    return {n: os.environ[n] for n in names if os.environ.get(n)}
