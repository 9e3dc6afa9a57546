"""One small API over local folders and ``s3://`` prefixes.

Everything that touches object storage goes through :class:`Store`, so the jobs run the same on a
laptop folder and on S3 (AWS or any S3-compatible server named by the standard ``AWS_ENDPOINT_URL``).
pyarrow's filesystem layer does the talking; rasterio gets the matching GDAL settings from
:func:`gdal_env`.
"""
from __future__ import annotations

import os
import posixpath
import uuid
from dataclasses import dataclass
from urllib.parse import urlparse

import pyarrow.fs as pafs


def is_s3(uri: str) -> bool:
    return str(uri).startswith("s3://")


def _s3_filesystem() -> pafs.S3FileSystem:
    # pyarrow honours AWS_ENDPOINT_URL by itself; region must be set or it probes AWS for it.
    kwargs = {}
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        parsed = urlparse(endpoint)
        kwargs["endpoint_override"] = parsed.netloc or parsed.path
        kwargs["scheme"] = parsed.scheme or "https"
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
    return pafs.S3FileSystem(region=region, **kwargs)


@dataclass(frozen=True)
class Store:
    """A root URI (local folder or ``s3://bucket/prefix``) with relative-path file operations."""

    root: str

    def __post_init__(self):
        object.__setattr__(self, "root", str(self.root).rstrip("/") or "/")

    # -- addressing -------------------------------------------------------------------------
    @property
    def fs(self) -> pafs.FileSystem:
        return _s3_filesystem() if is_s3(self.root) else pafs.LocalFileSystem()

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
        info = self.fs.get_file_info(self.path(rel))
        return info.type != pafs.FileType.NotFound

    def read_bytes(self, rel: str = "") -> bytes:
        with self.fs.open_input_stream(self.path(rel)) as f:
            return f.read()

    def write_bytes(self, rel: str, data: bytes) -> str:
        """Write ``data`` so that a reader sees either nothing or the whole object.

        S3 puts are atomic already; on a local disk we write a temporary file and rename it, so a
        crash never leaves a truncated PNG or Parquet shard that a resumed run would trust.
        """
        fs = self.fs
        target = self.path(rel)
        if is_s3(self.root):
            with fs.open_output_stream(target) as f:
                f.write(data)
        else:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            tmp = f"{target}.tmp-{uuid.uuid4().hex[:8]}"
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, target)
        return self.uri(rel)

    def delete(self, rel: str) -> None:
        try:
            self.fs.delete_file(self.path(rel))
        except (FileNotFoundError, OSError):
            pass

    def list(self, rel: str = "", suffixes: tuple[str, ...] = (), recursive: bool = True) -> list[str]:
        """Relative paths of files under ``rel`` (sorted). Folder-marker objects are skipped."""
        base = self.path(rel)
        selector = pafs.FileSelector(base, allow_not_found=True, recursive=recursive)
        out = []
        for info in self.fs.get_file_info(selector):
            if info.type != pafs.FileType.File:
                continue
            name = info.path
            if name.endswith("/") or posixpath.basename(name).startswith((".", "_$folder$")):
                continue
            if ".tmp-" in posixpath.basename(name):
                continue
            if suffixes and not name.lower().endswith(tuple(s.lower() for s in suffixes)):
                continue
            out.append(posixpath.relpath(name, self._base))
        return sorted(out)


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
