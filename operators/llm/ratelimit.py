"""Pool-wide rate limits, counted the way providers count them.

Limits that hold "for the whole pool across every actor and node" need one place that counts. The
:class:`RateLimiter` actor keeps a request bucket (RPM), a token bucket (TPM) and an in-flight count;
every LLM actor leases permits from it through a :class:`LeaseClient`.

How tokens are counted. Providers charge a request against TPM *when it arrives*, at its prompt
(text + images) plus the completion cap (``max_tokens``), and do not give the unused cap back within
the window. So each permit is charged its own estimate of exactly that when it is granted, and
nothing is refunded when the reply used fewer tokens (a refund would let the next minute overrun as
the provider counts it). Only an *under*-estimate is booked afterwards (reported usage above the
estimate), which errs on the safe side.

Bucket shape: capacity ``burst = max(1, rate_per_s * burst_s)`` and refill ``(limit - burst) / 60`` per
second, so that no 60 s window ever holds more than ``limit`` (burst + 60 s of refill = limit), aimed
1% low (``safety``) for arrival jitter.

A storm of 429s slows the whole pool: :meth:`RateLimiterCore.throttle` pauses every grant for the
``Retry-After`` the provider sent (empty buckets afterwards, so the pool resumes at a pace, not a
burst), then runs at ``backoff_factor`` of the rate (and of the in-flight count), recovering by
``recover_step`` every ``recover_s`` seconds without a storm (AIMD, as TCP does). A 429 is a storm
unless it is *scattered*: under ``storm_share`` of the attempts finished in the last
``storm_window_s`` (and at least ``storm_min_requests`` finished). A scattered 429 makes only its own
request wait its ``Retry-After``: pausing and slowing the pool on each one collapsed it to its
``min_factor`` floor under a steady 10 % of 429s (benchmarks/fault_load.py: 4 req/s instead of 20).

Grants are paced by the buckets, but a provider counts *arrivals*: an actor starved of CPU can hold
permits for seconds and then send them in a bunch, so a 60 s window of arrivals could hold more than
any 60 s of grants. So the limiter also keeps the provider's own count (:class:`SendWindow`): clients
report when each permitted request went out, and a permit is granted only if the sends of the trailing
60 s, plus every permit granted and not yet reported (it may go out any moment), stay within the limit.

The actor restarts when it dies (``max_restarts``). A restarted limiter starts with empty buckets,
which is exactly as safe as running on (the minute before the crash spent at most its burst plus its
refill); clients notice the new instance by its epoch and hand it the permits they still hold and their
sends of the last minute, so the in-flight count and the window are rebuilt. Its name comes from the endpoint and a hash of endpoint and key
(:func:`limiter_name`, never the key itself) in a fixed namespace, so two jobs against one account on
one cluster share one budget.
"""
from __future__ import annotations

import asyncio
import collections
import hashlib
import logging
import math
import random
import time
import uuid
from dataclasses import dataclass
from urllib.parse import urlparse

log = logging.getLogger(__name__)

NAMESPACE = "changeforge-llm"
# In the limiter's name: a detached limiter left on a cluster by an older changeforge speaks an older
# protocol (its methods' arguments), and must not be found by a newer job (nor the other way round).
PROTOCOL = 2


@dataclass
class RateLimits:
    rpm: float = 0.0           # requests per minute for the whole pool; 0 = unlimited
    tpm: float = 0.0           # tokens per minute (prompt + images + max_tokens, at arrival); 0 = unlimited
    max_in_flight: int = 256   # requests outstanding at once across the pool
    burst_s: float = 1.0       # bucket capacity, in seconds of the rate
    safety: float = 0.01       # aim this fraction below the limits: arrival jitter must not tip a window over
    backoff_factor: float = 0.7   # on a 429: rate and in-flight cap times this
    min_factor: float = 0.05
    recover_s: float = 10.0       # every this many seconds without a 429 ...
    recover_step: float = 0.1     # ... the factor grows back by this much (up to 1)
    pause_s: float = 1.0          # pause on a 429 without Retry-After
    storm_share: float = 0.2      # 429s at or above this share of recent attempts: the pool pauses and slows
    storm_window_s: float = 10.0  # "recent": attempts finished in this many seconds
    storm_min_requests: int = 20  # fewer finished than this: too little to tell, every 429 is a storm
    client_silence_s: float = 600.0   # a client holding permits and silent this long is gone (lost node):
                                      # its permits stop counting. Keep it above any request's timeout.


class TokenBucket:
    """Token bucket whose capacity plus one minute of refill equals the per-minute limit."""

    def __init__(self, per_minute: float, burst_s: float, now: float, start_empty: bool = False):
        self.unlimited = not per_minute or per_minute <= 0
        if self.unlimited:
            return
        self.full_capacity = min(max(1.0, per_minute / 60.0 * burst_s), per_minute)
        self.full_refill = max(per_minute - self.full_capacity, 1e-9) / 60.0
        self.capacity, self.refill_per_s = self.full_capacity, self.full_refill
        self.level = 0.0 if start_empty else self.capacity
        self.stamp = now

    def _refill(self, now: float) -> None:
        if now <= self.stamp:        # held (see drain_until)
            return
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

    def scale(self, factor: float, now: float) -> None:
        """Run at ``factor`` of the configured rate (and burst)."""
        if not self.unlimited:
            self._refill(now)
            self.capacity = max(1.0, self.full_capacity * factor)
            self.refill_per_s = self.full_refill * factor
            self.level = min(self.level, self.capacity)

    def drain_until(self, now: float, until: float) -> None:
        """Empty, and no refill before ``until`` (a pause must not end in a burst)."""
        if not self.unlimited:
            self._refill(now)
            self.level = min(self.level, 0.0)
            self.stamp = max(self.stamp, until)

    def seconds_until(self, amount: float, now: float) -> float:
        if self.unlimited:
            return 0.0
        self._refill(now)
        missing = min(amount, self.capacity) - self.level
        return max(0.0, missing / self.refill_per_s)


class SendWindow:
    """The provider's count: requests and tokens that went out in the trailing ``window_s``, plus the
    permits granted and not yet reported sent or unused (counted as if they went out now)."""

    def __init__(self, window_s: float = 60.0):
        self.window_s = window_s
        self.rpm = self.tpm = 0.0             # with the safety margin; 0 = unlimited
        self.sent: collections.deque = collections.deque()      # (time, requests, tokens)
        self.sent_requests, self.sent_tokens = 0, 0.0
        self.unsent_requests, self.unsent_tokens = 0, 0.0

    def _trim(self, now: float) -> None:
        while self.sent and self.sent[0][0] <= now - self.window_s:
            _, n, tokens = self.sent.popleft()
            self.sent_requests -= n
            self.sent_tokens -= tokens

    def fits(self, now: float, cost: float, more_requests: int, more_tokens: float) -> bool:
        """Can one more request of ``cost`` tokens go out, after ``more_*`` granted in this call?"""
        self._trim(now)
        if self.rpm and self.sent_requests + self.unsent_requests + more_requests + 1 > self.rpm:
            return False
        if self.tpm and cost > 0:
            held = self.sent_tokens + self.unsent_tokens + more_tokens
            if held + cost > self.tpm and held > 0:   # a request larger than the limit goes alone
                return False
        return True

    def wait_s(self, now: float) -> float:
        """When to ask again: a report of the permits out is due soon; else the oldest send expires."""
        if self.unsent_requests:
            return 0.05
        return max(0.001, self.sent[0][0] + self.window_s - now) if self.sent else 0.05

    def granted(self, n: int, tokens: float) -> None:
        self.unsent_requests += n
        self.unsent_tokens += tokens

    def record_sent(self, sends, granted_here: bool = True) -> None:
        """``sends``: (time, tokens) of requests that went out. ``granted_here``: their permits were
        counted as unsent by this instance (not by a limiter that has since restarted)."""
        for t, tokens in sends:
            self.sent.append((t, 1, tokens))
            self.sent_requests += 1
            self.sent_tokens += tokens
        if granted_here:
            self.forget(len(sends), sum(tokens for _, tokens in sends))

    def forget(self, n: int, tokens: float) -> None:
        """``n`` permits of ``tokens`` no longer about to go out (given back unused, or lost)."""
        self.unsent_requests = max(0, self.unsent_requests - n)
        self.unsent_tokens = max(0.0, self.unsent_tokens - tokens)

    def book_tokens(self, now: float, tokens: float) -> None:
        """Tokens the provider counted beyond the estimate (an under-estimate), at ``now``."""
        self.sent.append((now, 0, tokens))
        self.sent_tokens += tokens


class RateLimiterCore:
    """The bookkeeping, without Ray (unit-testable with a fake clock; also usable in-process)."""

    def __init__(self, limits: RateLimits, clock=time.monotonic, restarted: bool = False, wall=None):
        self.clock = clock
        # Send times come from the clients' wall clocks; a fake clock (tests) drives both.
        self.wall = wall or (time.time if clock is time.monotonic else clock)
        self.window = SendWindow()
        self.epoch = uuid.uuid4().hex[:12]
        self.restarted = restarted
        self.totals = {"granted": 0, "released": 0, "prompt_tokens": 0, "completion_tokens": 0,
                       "cost_usd": 0.0, "cached": 0, "failed": 0, "throttled": 0, "tokens_charged": 0.0}
        self.started = time.time()
        self.in_flight = 0
        # What each client (one LLM actor's LeaseClient) holds: [last heard, in flight, unsent, unsent
        # tokens], so that the permits of an actor lost with its node can be let go.
        self.clients: dict[str, list] = {}
        self.last_sweep = clock()
        self.recent_done: collections.deque = collections.deque()   # (time, attempts finished)
        self.recent_429: collections.deque = collections.deque()    # time of each 429
        self.configure(limits, start_empty=restarted)

    def configure(self, limits: RateLimits, start_empty: bool = False) -> None:
        now = self.clock()
        self.limits = limits
        margin = 1.0 - limits.safety
        self.requests = TokenBucket(limits.rpm * margin, limits.burst_s, now, start_empty)
        self.tokens = TokenBucket(limits.tpm * margin, limits.burst_s, now, start_empty)
        self.window.rpm = limits.rpm * margin if limits.rpm and limits.rpm > 0 else 0.0
        self.window.tpm = limits.tpm * margin if limits.tpm and limits.tpm > 0 else 0.0
        self.factor = 1.0
        self.in_flight_cap = float(limits.max_in_flight) if limits.max_in_flight else math.inf
        self.paused_until = now
        self.last_429 = -math.inf
        self.last_recovery = now

    # -- permits --------------------------------------------------------------------------------
    def _book(self, client: str | None, in_flight: int = 0, unsent: int = 0, unsent_tokens: float = 0.0) -> None:
        if client is None:
            return
        book = self.clients.setdefault(client, [0.0, 0, 0, 0.0])
        book[0] = self.clock()
        book[1] = max(0, book[1] + in_flight)
        book[2] = max(0, book[2] + unsent)
        book[3] = max(0.0, book[3] + unsent_tokens)
        if not (book[1] or book[2]):
            del self.clients[client]          # holds nothing: nothing to let go of

    def _forget_silent_clients(self, now: float) -> None:
        """A client that holds permits and has not been heard from for ``client_silence_s`` went down
        with its node: its permits leave the in-flight count and the window (else every lost node
        shrinks the pool for good, and enough of them stop it)."""
        if now - self.last_sweep < 1.0:
            return
        self.last_sweep = now
        horizon = now - self.limits.client_silence_s
        for client, (seen, in_flight, unsent, unsent_tokens) in list(self.clients.items()):
            if seen < horizon:
                del self.clients[client]
                self.in_flight = max(0, self.in_flight - in_flight)
                self.window.forget(unsent, unsent_tokens)
                self.totals["permits_of_lost_clients"] = self.totals.get("permits_of_lost_clients", 0) + in_flight
                log.warning("a client silent for %.0f s held %d permits; let go (its actor is gone)",
                            now - seen, in_flight)

    def lease(self, estimates: list[float], epoch: str | None = None,
              client: str | None = None) -> tuple[int, float, str]:
        """Grant permits to a prefix of ``estimates`` (each charged its own token estimate).
        Returns (granted, wait_s, epoch); when nothing is granted, ``wait_s`` says when to ask again.
        A client that knew another epoch gets nothing until it has :meth:`adopt`-ed its permits.
        ``client`` names the caller, so that its permits can be let go if it is lost."""
        if epoch is not None and epoch != self.epoch:
            return 0, 0.0, self.epoch
        now = self.clock()
        self._forget_silent_clients(now)
        if client in self.clients:
            self.clients[client][0] = now
        self._recover(now)
        if now < self.paused_until:
            return 0, self.paused_until - now, self.epoch
        wall = self.wall()
        room = self.in_flight_cap - self.in_flight
        by_requests = self.requests.available(now)
        granted, granted_tokens, window_full = 0, 0.0, False
        while granted < len(estimates) and granted < room and granted + 1 <= by_requests:
            cost = estimates[granted]
            if not self.window.fits(wall, max(cost, 0.0), granted, granted_tokens):
                window_full = True
                break
            if cost > 0 and not self.tokens.unlimited:
                # A request larger than the whole bucket still passes once the bucket is full.
                if self.tokens.available(now) < min(cost, self.tokens.capacity):
                    break
                self.tokens.take(cost, now)
            granted += 1
            granted_tokens += max(cost, 0.0)
            self.totals["tokens_charged"] += max(cost, 0.0)
        if granted:
            self.requests.take(granted, now)
            self.window.granted(granted, granted_tokens)
            self._book(client, granted, granted, granted_tokens)
            self.in_flight += granted
            self.totals["granted"] += granted
            return granted, 0.0, self.epoch
        if room <= 0:
            return 0, 0.02, self.epoch
        if window_full:
            self.totals["window_waits"] = self.totals.get("window_waits", 0) + 1
            return 0, self.window.wait_s(wall), self.epoch
        wait = max(self.requests.seconds_until(1, now),
                   self.tokens.seconds_until(estimates[0], now) if estimates else 0.0)
        return 0, max(0.001, wait), self.epoch

    def acquire(self, n: int, tokens_each: float | list[float]) -> tuple[int, float]:
        """``n`` requests of ``tokens_each`` tokens (or one estimate per request): (granted, wait_s)."""
        estimates = list(tokens_each) if isinstance(tokens_each, (list, tuple)) else [tokens_each] * n
        granted, wait, _ = self.lease(estimates[:n])
        wall = self.wall()     # in-process callers send at once
        self.window.record_sent([(wall, max(e, 0.0)) for e in estimates[:granted]])
        return granted, wait

    def release(self, n_done: int, token_correction: float = 0.0, usage: dict | None = None) -> None:
        """``n_done`` permits come back. ``token_correction`` (reported - estimated tokens) is booked
        only when positive: the provider does not refund an unused completion cap within the window."""
        self.in_flight = max(0, self.in_flight - n_done)
        self.totals["released"] += n_done
        if n_done > 0:
            self.recent_done.append((self.clock(), n_done))
        if token_correction > 0:
            self.tokens.take(token_correction, self.clock())
            self.window.book_tokens(self.wall(), token_correction)
            self.totals["tokens_charged"] += token_correction
        for k, v in (usage or {}).items():
            self.totals[k] = self.totals.get(k, 0) + v

    def settle(self, n_done: int, token_correction: float, usage: dict | None, epoch: str | None,
               sends=(), unused: tuple[int, float] = (0, 0.0), client: str | None = None) -> str:
        """:meth:`release` from a client that knows ``epoch``, with the (time, tokens) of the permitted
        requests that went out and the count and tokens of permits given back unused. Refused (nothing
        booked) if ``epoch`` is stale."""
        if epoch is not None and epoch != self.epoch:
            return self.epoch
        self.window.record_sent(sends)
        self.window.forget(*unused)
        self._book(client, -n_done, -(len(sends) + unused[0]), -(sum(t for _, t in sends) + unused[1]))
        self.release(n_done, token_correction, usage)
        return self.epoch

    def adopt(self, outstanding: int, unreported: tuple[int, float] = (0, 0.0), recent_sends=(),
              client: str | None = None) -> str:
        """A client of an earlier instance still holds ``outstanding`` permits, of which ``unreported``
        (count, tokens) are not yet reported sent or unused, and sent ``recent_sends`` in the last
        minute: count them all, so neither the in-flight cap nor the window starts blind."""
        self.in_flight += max(0, int(outstanding))
        self.window.granted(int(unreported[0]), float(unreported[1]))
        self._book(client, max(0, int(outstanding)), int(unreported[0]), float(unreported[1]))
        self.window.record_sent(recent_sends, granted_here=False)
        return self.epoch

    # -- 429 feedback ---------------------------------------------------------------------------
    def throttle(self, retry_after_s: float | None = None) -> float:
        """The provider said 429. A storm (see the module doc) pauses the whole pool, then runs it
        slower; one storm (replies to requests already in flight) lowers the rate once. A scattered
        429 leaves the pool alone. Returns how long the refused request itself must wait before it
        asks for a permit again: 0 when the pool is paused (its lease waits for the pause)."""
        now = self.clock()
        pause = retry_after_s if retry_after_s is not None else self.limits.pause_s
        self.totals["throttled"] += 1
        horizon = now - self.limits.storm_window_s
        while self.recent_done and self.recent_done[0][0] < horizon:
            self.recent_done.popleft()
        while self.recent_429 and self.recent_429[0] < horizon:
            self.recent_429.popleft()
        self.recent_429.append(now)
        finished = sum(n for _, n in self.recent_done)
        scattered = (finished >= self.limits.storm_min_requests
                     and len(self.recent_429) < self.limits.storm_share * finished)
        if scattered and now >= self.paused_until:
            self.totals["scattered_429"] = self.totals.get("scattered_429", 0) + 1
            return pause
        if now >= self.paused_until:   # a new event, not another reply from the same storm
            self.factor = max(self.limits.min_factor, self.factor * self.limits.backoff_factor)
            if self.requests.unlimited and self.tokens.unlimited:
                # No rate to lower: concurrency is the only lever.
                self.in_flight_cap = max(1.0, math.floor(min(self.in_flight_cap, max(1, self.in_flight)) *
                                                         self.limits.backoff_factor))
            self.requests.scale(self.factor, now)
            self.tokens.scale(self.factor, now)
            log.warning("429 from the endpoint: pool paused %.1f s, then at %.0f%% of the rate, in-flight cap %s",
                        pause, 100 * self.factor, self.in_flight_cap)
        self.paused_until = max(self.paused_until, now + pause)
        self.requests.drain_until(now, self.paused_until)
        self.tokens.drain_until(now, self.paused_until)
        self.last_429 = self.last_recovery = now
        return 0.0

    def _recover(self, now: float) -> None:
        if self.factor >= 1.0 and self.in_flight_cap >= (self.limits.max_in_flight or math.inf):
            return
        while now - self.last_recovery >= self.limits.recover_s:
            self.last_recovery += self.limits.recover_s
            self.factor = min(1.0, self.factor + self.limits.recover_step)
            cap = self.limits.max_in_flight or math.inf
            if self.in_flight_cap < cap:
                self.in_flight_cap = min(cap, math.ceil(self.in_flight_cap * (1 + self.limits.recover_step * 2)) + 1)
            self.requests.scale(self.factor, now)
            self.tokens.scale(self.factor, now)
            if self.factor >= 1.0 and self.in_flight_cap >= cap:
                break

    def update_limits(self, limits: RateLimits) -> None:
        """A job (re)started against this account with these limits: they hold from now on."""
        if limits != self.limits:
            log.info("rate limits changed: %s -> %s", self.limits, limits)
            self.configure(limits, start_empty=True)

    def stats(self) -> dict:
        return dict(self.totals, in_flight=self.in_flight, elapsed_s=time.time() - self.started,
                    factor=self.factor, epoch=self.epoch, restarted=self.restarted)


def limiter_name(base_url: str | None, api_key: str = "") -> str:
    """Name of the limiter for an endpoint and key: the endpoint's host in clear (to find it in the
    dashboard), and a hash of endpoint and key (never the key). One account, one budget."""
    endpoint = (base_url or "").rstrip("/")
    host = urlparse(endpoint).netloc or "default"
    digest = hashlib.sha256(f"{endpoint}\n{api_key}".encode()).hexdigest()[:16]
    return f"changeforge-llm-v{PROTOCOL}:{host}:{digest}"


try:
    import ray

    @ray.remote(num_cpus=0, max_concurrency=1, max_restarts=-1, max_task_retries=0)
    class RateLimiter(RateLimiterCore):
        """The named actor. Sync and single-threaded: every call is a few arithmetic operations."""

        def __init__(self, limits: RateLimits):
            restarted = ray.get_runtime_context().was_current_actor_reconstructed
            if restarted:
                log.warning("rate limiter restarted: empty buckets, waiting for clients to report their permits")
            super().__init__(limits, restarted=restarted)

    def start_rate_limiter(name: str, limits: RateLimits, namespace: str | None = None, detached: bool = False):
        """Create (or find, and set the limits of) the pool's limiter. By default it lives as long as
        the driver that created it; ``detached`` ones outlive it (one budget shared by several jobs)."""
        opts = dict(name=name, get_if_exists=True)
        if namespace:
            opts["namespace"] = namespace
        if detached:
            opts["lifetime"] = "detached"
        actor = RateLimiter.options(**opts).remote(limits)
        ray.get(actor.update_limits.remote(limits))
        return actor
except ImportError:  # pragma: no cover
    RateLimiter = None  # type: ignore[assignment]


def _actor_errors() -> tuple:
    try:
        from ray.exceptions import ActorUnavailableError, RayActorError
        return RayActorError, ActorUnavailableError
    except ImportError:  # pragma: no cover
        return ()


class LeaseClient:
    """Per-actor side of the limiter: one lease call for all requests waiting (each with its own
    estimate), releases batched in the background. Survives a limiter restart: calls are retried
    for ``actor_wait_s`` and the permits this client holds are handed to the new instance.

    ``limiter`` is a Ray actor handle, a :class:`RateLimiterCore` (in-process), or None (no limits)."""

    def __init__(self, limiter, max_lease: int = 64, release_every_s: float = 0.05, actor_wait_s: float = 120.0):
        self.limiter = limiter
        self.local = isinstance(limiter, RateLimiterCore)
        self.max_lease = max_lease
        self.release_every_s = release_every_s
        self.actor_wait_s = actor_wait_s
        self.epoch: str | None = None
        self.client_id = uuid.uuid4().hex[:16]   # the limiter's name for this client's permits
        self.granted_total = 0
        self.settled_total = 0
        self._queue: collections.deque = collections.deque()   # (estimate, future)
        self._fetcher: asyncio.Task | None = None
        self._pending_release = 0
        self._pending_tokens = 0.0
        self._pending_usage: dict = {}
        self._flusher: asyncio.Task | None = None
        self._flush_lock: asyncio.Lock | None = None
        self._sync_lock: asyncio.Lock | None = None
        # The provider's count (see SendWindow): when each permitted request went out, reported with the
        # next flush; permits given back unused; what is granted and not yet reported; the sends the
        # limiter has booked in the last minute (handed to a restarted limiter).
        self._sends: list = []                 # (wall time, tokens)
        self._unused = [0, 0.0]
        self._unreported = [0, 0.0]
        self._booked_sends: collections.deque = collections.deque()

    async def _call(self, method: str, *args):
        if self.local:
            return getattr(self.limiter, method)(*args)
        errors = _actor_errors()
        deadline = time.monotonic() + self.actor_wait_s
        delay = 0.1
        while True:
            try:
                return await getattr(self.limiter, method).remote(*args)
            except errors as exc:
                if time.monotonic() > deadline:
                    raise
                log.warning("rate limiter unavailable (%s); retrying", type(exc).__name__)
                await asyncio.sleep(delay * random.uniform(0.5, 1.0))
                delay = min(2.0, delay * 2)

    async def _sync_epoch(self, epoch: str, asked_with: str | None) -> None:
        """The limiter is a new instance: hand it the permits granted by the old one and not yet settled.
        A lease and a settle can notice the restart at once; the permits must be handed over once
        (counted twice, the in-flight count never comes back down and a pool at its cap waits forever)."""
        if self._sync_lock is None:
            self._sync_lock = asyncio.Lock()
        async with self._sync_lock:
            if self.epoch != asked_with:
                return                      # another caller has handed them over already: just ask again
            if self.epoch is not None:
                outstanding = self.granted_total - self.settled_total
                log.warning("rate limiter restarted; re-registering %d permits in flight", outstanding)
                self._trim_booked_sends()
                epoch = await self._call("adopt", outstanding, tuple(self._unreported), list(self._booked_sends),
                                         self.client_id)
            self.epoch = epoch

    async def acquire(self, tokens_estimate: float) -> None:
        if self.limiter is None:
            return
        fut = asyncio.get_running_loop().create_future()
        self._queue.append((tokens_estimate, fut))
        if self._fetcher is None or self._fetcher.done():
            self._fetcher = asyncio.ensure_future(self._fetch())
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self._give_back(tokens_estimate)   # granted just as we were cancelled
            raise
        # The caller sends now (nothing awaits between here and the request going out): this is the
        # time the provider counts, however long the permit took to reach a CPU-starved actor.
        self._sends.append((time.time(), max(tokens_estimate, 0.0)))
        self._schedule_flush()

    def _give_back(self, tokens_estimate: float) -> None:
        """A granted permit that will not be used."""
        self._unused[0] += 1
        self._unused[1] += max(tokens_estimate, 0.0)
        self.release()

    async def _fetch(self) -> None:
        while True:
            while self._queue and self._queue[0][1].done():
                self._queue.popleft()       # cancelled waiters
            if not self._queue:
                return
            batch = [w for w in list(self._queue)[: self.max_lease] if not w[1].done()]
            asked_with = self.epoch
            try:
                granted, wait_s, epoch = await self._call("lease", [e for e, _ in batch], asked_with, self.client_id)
            except Exception as exc:  # noqa: BLE001 - the limiter is gone for good: fail the waiters
                for _, fut in batch:
                    if not fut.done():
                        fut.set_exception(exc)
                continue
            if epoch != asked_with:
                await self._sync_epoch(epoch, asked_with)
                if not granted:
                    continue
            self.granted_total += granted
            self._unreported[0] += granted
            self._unreported[1] += sum(max(e, 0.0) for e, _ in batch[:granted])
            for estimate, fut in batch[:granted]:
                try:
                    self._queue.remove((estimate, fut))
                except ValueError:
                    pass
                if fut.done():          # cancelled while we asked
                    self._give_back(estimate)
                else:
                    fut.set_result(True)
            if not granted:
                await asyncio.sleep(wait_s)

    def release(self, token_correction: float = 0.0, usage: dict | None = None) -> None:
        """Book a finished request (or an unused permit); flushed to the actor in the background."""
        if self.limiter is None:
            return
        self._pending_release += 1
        self._pending_tokens += max(0.0, token_correction)
        self.add_usage(usage)

    def add_usage(self, usage: dict | None) -> None:
        """Counters for the progress line (also for answers served from the cache)."""
        if self.limiter is None:
            return
        for k, v in (usage or {}).items():
            self._pending_usage[k] = self._pending_usage.get(k, 0) + v
        self._schedule_flush()

    def _schedule_flush(self) -> None:
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.ensure_future(self._flush_later())

    async def throttle(self, retry_after_s: float | None) -> float:
        """Tell the pool about a 429 (in a storm every actor pauses, then the rate drops). Returns
        how long the refused request must wait on its own (a scattered 429: its Retry-After)."""
        if self.limiter is None:
            return 0.0
        return float(await self._call("throttle", retry_after_s) or 0.0)

    async def _flush_later(self) -> None:
        await asyncio.sleep(self.release_every_s)
        await self.flush()

    def _trim_booked_sends(self) -> None:
        """Only the last minute's sends are handed to a restarted limiter: keep no more (a long run's
        every send would otherwise pile up here)."""
        horizon = time.time() - 60.0
        while self._booked_sends and self._booked_sends[0][0] <= horizon:
            self._booked_sends.popleft()

    def _has_news(self) -> bool:
        return bool(self._pending_release or self._pending_usage or self._sends or self._unused[0])

    async def flush(self) -> None:
        if self.limiter is None or not self._has_news():
            return
        if self._flush_lock is None:
            self._flush_lock = asyncio.Lock()
        async with self._flush_lock:
            if not self._has_news():
                return
            n, tok, usage = self._pending_release, self._pending_tokens, self._pending_usage
            sends, unused = self._sends, tuple(self._unused)
            self._pending_release, self._pending_tokens, self._pending_usage = 0, 0.0, {}
            self._sends, self._unused = [], [0, 0.0]
            while True:
                asked_with = self.epoch
                epoch = await self._call("settle", n, tok, usage, asked_with, sends, unused, self.client_id)
                if epoch == asked_with or asked_with is None:
                    self.epoch = self.epoch or epoch
                    self.settled_total += n
                    self._unreported[0] -= len(sends) + unused[0]
                    self._unreported[1] -= sum(t for _, t in sends) + unused[1]
                    self._booked_sends.extend(sends)
                    self._trim_booked_sends()
                    return
                await self._sync_epoch(epoch, asked_with)
