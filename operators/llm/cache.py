"""Response cache in the output store: ``<out>/_cache/llm/<k[:2]>/<k>.json``, one object per answer.

The key is a hash of the rendered request: endpoint, model, every message as sent (images by content
hash), the reply schema and the sampling parameters (see ``LLMCaller.key_for``): editing a prompt file,
pointing at other prompts or another endpoint asks again. Only valid
(schema-conforming) answers are stored, so a rerun or a resumed run re-sends exactly the requests that
never got one. Objects are written atomically by :class:`Store`, so a crash leaves no half entry.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from typing import Any, Mapping

from operators.io.storage import Store

log = logging.getLogger(__name__)

CACHE_PREFIX = "_cache/llm"


def _transient_errors() -> tuple:
    """What an object-store read raises when the store hiccups (botocore's are not OSError)."""
    try:
        from botocore.exceptions import BotoCoreError, ClientError
        return OSError, BotoCoreError, ClientError
    except ImportError:  # pragma: no cover
        return (OSError,)


def cache_key(parts: Mapping[str, Any]) -> str:
    canonical = json.dumps(parts, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()


class ResponseCache:
    def __init__(self, root: str, prefix: str = CACHE_PREFIX, read_attempts: int = 3, retry_s: float = 0.2):
        self.store = Store(root).child(prefix)
        self.read_attempts, self.retry_s = read_attempts, retry_s

    @staticmethod
    def _rel(key: str) -> str:
        return f"{key[:2]}/{key}.json"

    def get(self, key: str) -> dict | None:
        """The entry, or None: not there, unreadable, or the store failing even after retries (a miss
        costs one request; a crash would cost the run)."""
        for attempt in range(self.read_attempts):
            try:
                return json.loads(self.store.read_bytes(self._rel(key)))
            except FileNotFoundError:
                return None
            except ValueError:
                return None
            except _transient_errors() as exc:
                if attempt + 1 == self.read_attempts:
                    log.warning("cache read failed (%s); treating it as a miss", type(exc).__name__)
                    return None
                time.sleep(self.retry_s * 2 ** attempt)
        return None

    def put(self, key: str, entry: dict) -> None:
        self.store.write_bytes(self._rel(key), json.dumps(entry).encode())

    async def aget(self, key: str) -> dict | None:
        # Object-store reads block; keep the actor's event loop serving other requests meanwhile.
        return await asyncio.to_thread(self.get, key)

    async def aput(self, key: str, entry: dict) -> None:
        await asyncio.to_thread(self.put, key, entry)
