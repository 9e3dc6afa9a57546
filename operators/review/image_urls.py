"""URLs through which Label Studio shows a dataset's images where they already are: its local-files
serving for a folder on disk, presigned GET URLs for S3. Never inline base64 (tasks stay small, and the
reviewer sees exactly the bytes the dataset publishes)."""
from __future__ import annotations

import os
from urllib.parse import quote

from operators.io.storage import Store, is_s3

LOCAL_FILES_PREFIX = "/data/local-files/?d="


def local_files_root_for(images_root: str) -> str:
    """Default document root for a local images folder: its parent. Label Studio refuses a local storage
    on the document root itself, so the images folder must be a subfolder of it."""
    return os.path.dirname(os.path.abspath(images_root.rstrip("/")))


class ImageUrls:
    """``url(rel)`` for a path relative to ``images`` (a folder or an ``s3://`` prefix)."""

    def __init__(self, images: Store, local_files_root: str = "", expiry_s: int = 7 * 24 * 3600):
        self.images = images
        self.s3 = is_s3(images.root)
        self.expiry_s = int(expiry_s)
        self.local_files_root = "" if self.s3 else os.path.abspath(local_files_root or local_files_root_for(images.root))
        if not self.s3:
            inside = os.path.relpath(images.path(), self.local_files_root)
            if inside == "." or inside.startswith(".."):
                raise ValueError(f"images folder {images.path()} must be a subfolder of the Label Studio "
                                 f"document root {self.local_files_root}")

    @property
    def mode(self) -> str:
        return "presigned-s3" if self.s3 else "local-files"

    def url(self, rel: str) -> str:
        if self.s3:
            bucket, _, key = self.images.path(rel).partition("/")
            return self._presigner().generate_presigned_url("get_object", Params={"Bucket": bucket, "Key": key},
                                                      ExpiresIn=self.expiry_s)
        path = os.path.relpath(self.images.path(rel), self.local_files_root)
        return LOCAL_FILES_PREFIX + quote(path.replace(os.sep, "/"), safe="/")

    def _presigner(self):
        """A client signing with SigV4 (AWS no longer accepts SigV2 presigned URLs in most regions)."""
        if getattr(self, "_client", None) is None:
            import boto3
            from botocore.config import Config
            self._client = boto3.client("s3", config=Config(signature_version="s3v4"))
        return self._client

    def storage_path(self) -> str | None:
        """The folder to register as Label Studio local import storage (local mode only)."""
        return None if self.s3 else self.images.path()
