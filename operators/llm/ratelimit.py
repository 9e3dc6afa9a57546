"""Pool-wide rate limits: one named Ray actor holds the buckets, every LLM actor leases from it.

Limits that hold "for the whole pool across every actor and node" need one place that counts. The
:class:`RateLimiter` actor keeps a request bucket (RPM), a token bucket (TPM) and an in-flight count.
Clients (:class:`LeaseClient`, one per LLM actor) lease permits in batches sized to the number of
requests currently waiting, so at hundreds of requests per second there are only tens of actor calls;
completed requests are released in batches too, carrying the difference between the token estimate
debited up front and the usage the API reported, which the actor books against the token bucket.

Bucket shape: capacity ``burst = max(1, rate_per_s * burst_s)`` and refill ``(limit - burst) / 60`` per
second, so that no 60 s window ever holds more than ``limit`` grants (burst + 60 s of refill = limit),
while the long-run rate is ``limit - burst`` per minute (98% of the limit at the default 1 s burst).
Both limits are applied 1% low (``safety``): requests granted at an even pace still reach the endpoint
with some jitter, and a window must not tip over the limit because of it.
The usage counters the clients report make the actor the place the driver polls for progress.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass
class RateLimits:
    rpm: float = 0.0           # requests per minute for the whole pool; 0 = unlimited
    tpm: float = 0.0           # tokens per minute (prompt + completion); 0 = unlimited
    max_in_flight: int = 256   # requests outstanding at once across the pool
    burst_s: float = 1.0       # bucket capacity, in seconds of the rate
    safety: float = 0.01       # aim this fraction below the limits: arrival jitter must not tip a window over


class TokenBucket:
    """Classic token bucket whose capacity plus one minute of refill equals the per-minute limit."""

    def __init__(self, per_minute: float, burst_s: float, now: float):
        self.unlimited = not per_minute or per_minute <= 0
        if self.unlimited:
            return
        self.capacity = max(1.0, per_minute / 60.0 * burst_s)
        self.capacity = min(self.capacity, per_minute)
        self.refill_per_s = max(per_minute - self.capacity, 1e-9) / 60.0
        self.level = self.capacity
        self.stamp = now

    def _refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.stamp) * self.refill_per_s)
        self.stamp = now

    def available(self, now: float) -> float:
        if self.unlimited:
            return math.inf
        self._refill(now)
        return self.level

    def take(self, amount: float, now: float) -> None:
        if not self.unlimited:
            self._refill(now)
            self.level -= amount

    def seconds_until(self, amount: float, now: float) -> float:
        if self.unlimited:
            return 0.0
        self._refill(now)
        missing = min(amount, self.capacity) - self.level
        return max(0.0, missing / self.refill_per_s)


class RateLimiterCore:
    """The bookkeeping, without Ray (unit-testable with a fake clock)."""

    def __init__(self, limits: RateLimits, clock=time.monotonic):
        self.limits = limits
        self.clock = clock
        now = clock()
        margin = 1.0 - limits.safety
        self.requests = TokenBucket(limits.rpm * margin, limits.burst_s, now)
        self.tokens = TokenBucket(limits.tpm * margin, limits.burst_s, now)
        self.in_flight = 0
        self.totals = {"granted": 0, "released": 0, "prompt_tokens": 0, "completion_tokens": 0,
                       "cost_usd": 0.0, "cached": 0, "failed": 0}
        self.started = time.time()

    def acquire(self, n: int, tokens_each: float) -> tuple[int, float]:
        """Grant up to ``n`` requests of ``tokens_each`` estimated tokens. Returns (granted, wait_s):
        when nothing is granted, ``wait_s`` says when to ask again."""
        now = self.clock()
        room = max(0, self.limits.max_in_flight - self.in_flight) if self.limits.max_in_flight else n
        by_requests = self.requests.available(now)
        by_tokens = self.tokens.available(now)
        granted = min(n, room, int(by_requests) if by_requests != math.inf else n)
        if tokens_each > 0 and by_tokens != math.inf:
            # A request larger than the whole bucket still passes once the bucket is full.
            need = min(tokens_each, self.tokens.capacity)
            afford = 0 if by_tokens < need else max(1, int(by_tokens // tokens_each))
            granted = min(granted, afford)
        granted = max(0, granted)
        if granted:
            self.requests.take(granted, now)
            self.tokens.take(granted * tokens_each, now)
            self.in_flight += granted
            self.totals["granted"] += granted
            return granted, 0.0
        if room == 0:
            return 0, 0.02
        wait = max(self.requests.seconds_until(1, now), self.tokens.seconds_until(tokens_each, now))
        return 0, max(0.001, wait)

    def release(self, n_done: int, token_correction: float = 0.0, usage: dict | None = None) -> None:
        """``n_done`` permits come back; ``token_correction`` (actual - estimated tokens) is booked."""
        self.in_flight = max(0, self.in_flight - n_done)
        self.totals["released"] += n_done
        if token_correction:
            self.tokens.take(token_correction, self.clock())
        for k, v in (usage or {}).items():
            self.totals[k] = self.totals.get(k, 0) + v

    def stats(self) -> dict:
        return dict(self.totals, in_flight=self.in_flight, elapsed_s=time.time() - self.started)


try:
    import ray

    @ray.remote(num_cpus=0, max_concurrency=1)
    class RateLimiter(RateLimiterCore):
        """The named actor. Sync and single-threaded: every call is a few arithmetic operations."""

        def __init__(self, limits: RateLimits):
            super().__init__(limits)

    def start_rate_limiter(name: str, limits: RateLimits):
        """Create (or find) the pool's limiter. It lives as long as the driver that created it."""
        return RateLimiter.options(name=name, get_if_exists=True).remote(limits)
except ImportError:  # pragma: no cover
    RateLimiter = None  # type: ignore[assignment]


class LeaseClient:
    """Per-actor side of the limiter: batches leases and releases to keep actor calls rare."""

    def __init__(self, limiter, max_lease: int = 64, release_every_s: float = 0.05):
        self.limiter = limiter
        self.max_lease = max_lease
        self.release_every_s = release_every_s
        self.permits = 0
        self.waiting = 0
        self._lock: asyncio.Lock | None = None
        self._pending_release = 0
        self._pending_tokens = 0.0
        self._pending_usage: dict = {}
        self._flusher: asyncio.Task | None = None

    async def acquire(self, tokens_estimate: float) -> None:
        if self.limiter is None:
            return
        if self._lock is None:
            self._lock = asyncio.Lock()
        self.waiting += 1
        try:
            while True:
                if self.permits > 0:
                    self.permits -= 1
                    return
                async with self._lock:
                    if self.permits > 0:
                        continue
                    want = max(1, min(self.max_lease, self.waiting))
                    granted, wait_s = await self.limiter.acquire.remote(want, tokens_estimate)
                    self.permits += granted
                if not granted:
                    await asyncio.sleep(wait_s)
        finally:
            self.waiting -= 1

    def release(self, token_correction: float = 0.0, usage: dict | None = None) -> None:
        """Book a finished request (or an unused permit); flushed to the actor in the background."""
        if self.limiter is None:
            return
        self._pending_release += 1
        self._pending_tokens += token_correction
        self.add_usage(usage)

    def add_usage(self, usage: dict | None) -> None:
        """Counters for the progress line (also for answers served from the cache)."""
        if self.limiter is None:
            return
        for k, v in (usage or {}).items():
            self._pending_usage[k] = self._pending_usage.get(k, 0) + v
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.ensure_future(self._flush_later())

    async def _flush_later(self) -> None:
        await asyncio.sleep(self.release_every_s)
        await self.flush()

    async def flush(self) -> None:
        if self.limiter is None or not (self._pending_release or self._pending_usage):
            return
        n, tok, usage = self._pending_release, self._pending_tokens, self._pending_usage
        self._pending_release, self._pending_tokens, self._pending_usage = 0, 0.0, {}
        await self.limiter.release.remote(n, tok, usage)
