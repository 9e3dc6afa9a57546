"""Response cache in the output store: ``<out>/_cache/llm/<k[:2]>/<k>.json``, one object per answer.

The key is a hash of everything that determines the answer we would pay for: model, prompt template
version, the images' content hashes, request parameters and the stage/candidate index. Only valid
(schema-conforming) answers are stored, so a rerun or a resumed run re-sends exactly the requests that
never got one. Objects are written atomically by :class:`Store`, so a crash leaves no half entry.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
from typing import Any, Mapping

from operators.io.storage import Store

CACHE_PREFIX = "_cache/llm"


def cache_key(parts: Mapping[str, Any]) -> str:
    canonical = json.dumps(parts, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()


class ResponseCache:
    def __init__(self, root: str, prefix: str = CACHE_PREFIX):
        self.store = Store(root).child(prefix)

    @staticmethod
    def _rel(key: str) -> str:
        return f"{key[:2]}/{key}.json"

    def get(self, key: str) -> dict | None:
        try:
            return json.loads(self.store.read_bytes(self._rel(key)))
        except (FileNotFoundError, OSError, ValueError):
            return None

    def put(self, key: str, entry: dict) -> None:
        self.store.write_bytes(self._rel(key), json.dumps(entry).encode())

    async def aget(self, key: str) -> dict | None:
        # Object-store reads block; keep the actor's event loop serving other requests meanwhile.
        return await asyncio.to_thread(self.get, key)

    async def aput(self, key: str, entry: dict) -> None:
        await asyncio.to_thread(self.put, key, entry)
