"""Pool-wide rate limits, counted the way providers count them, in state that heals itself.

One :class:`RateLimiter` actor per account (named by endpoint and a hash of endpoint and key, in one
namespace: every job against that account on the cluster shares one budget) grants permits; each LLM
actor asks through a :class:`LeaseClient`. The limiter keeps a rolling log of its grants (time,
requests, tokens), the pause/slow-down state, what each client last said it holds, and the quirks the
pool learnt per model. A grant is charged when made (prompt + images + the completion cap, as a
provider charges on arrival) and leaves the log with its window; nothing is released. So a lost or
repeated call, a dead actor or a restarted limiter costs at most one window of budget and needs no
repair: holdings are absolute counts, a give-back names its grant, a client silent for
``client_silence_s`` stops counting.

A grant needs room in the window (``rpm``/``tpm`` less ``safety``) and in the trailing ``burst_s`` (its
share of the limits), so a pool starts at its pace. A permit reaching its actor more than
``permit_ttl_s`` after it was asked for (a CPU-starved actor) is given back and asked again (at most
``max_give_backs`` times in a row; then it is used), and the
window is ``60 s + permit_ttl_s`` long: any 60 s of arrivals holds one window's grants. A 429 storm (at
least ``storm_share`` of the last ``storm_window_s``'s grants, or too few grants to tell) pauses every
grant for the provider's ``Retry-After``, then runs the pool at ``backoff_factor`` of its limits (of
its in-flight cap when no rate is set), recovering by ``recover_step`` every ``recover_s``; when the
pause ends ONE request (the probe) goes out and the rest wait for its answer (bounded by
``probe_wait_s``). A scattered 429 makes only its own request wait. A quota 429 (``insufficient_quota``)
stops the account's grants until a job starts again (:meth:`RateLimiterCore.start_job`).
"""
from __future__ import annotations

import asyncio
import collections
import hashlib
import logging
import math
import os
import random
import time
import uuid
from dataclasses import dataclass
from urllib.parse import urlparse

log = logging.getLogger(__name__)

NAMESPACE = "changeforge-llm"
NAMESPACE_ENV = "CHANGEFORGE_LLM_NAMESPACE"   # another namespace: a budget of its own (tests: one per test)
# In the limiter's name: a detached limiter left on a cluster by an older changeforge speaks an older
# protocol (its methods' arguments), and must not be found by a newer job (nor the other way round).
PROTOCOL = 4


@dataclass
class RateLimits:
    rpm: float = 0.0           # requests per minute for the whole pool; 0 = unlimited
    tpm: float = 0.0           # tokens per minute (prompt + images + max_tokens, at arrival); 0 = unlimited
    max_in_flight: int = 256   # requests outstanding at once across the pool (0 = unlimited)
    burst_s: float = 1.0       # a trailing burst_s holds at most its share of the limits
    safety: float = 0.01       # aim this fraction below the limits: arrival jitter must not tip a window over
    permit_ttl_s: float = 1.0  # a permit that reaches its actor later than this after asking is asked again
    backoff_factor: float = 0.7   # on a 429 storm: limits (or the in-flight cap) times this
    min_factor: float = 0.05
    recover_s: float = 10.0       # every this many seconds without a storm ...
    recover_step: float = 0.1     # ... the factor grows back by this much (up to 1)
    pause_s: float = 1.0          # pause on a 429 without Retry-After
    storm_share: float = 0.2      # 429s at or above this share of recent grants: the pool pauses and slows
    storm_window_s: float = 10.0  # "recent"
    storm_min_requests: int = 20  # fewer grants than this: too little to tell, every 429 is a storm
    client_silence_s: float = 30.0   # clients holding permits report often; one silent this long is gone
                                     # (its actor or node lost) and its permits stop counting
    probe_wait_s: float = 130.0   # after a pool-wide pause, how long the one probe may go unanswered
                                  # (a request's timeout and a little) before another one is let out


def _fits(used: float, recent: float, amount: float, cap: float, burst: float) -> bool:
    """``amount`` more fits the window (``used`` of ``cap``; a request over the whole cap goes alone)
    and the burst (the last request may cross it: large requests are not paced below the limit)."""
    return recent < burst if used + amount <= cap else used == 0


class RateLimiterCore:
    """The bookkeeping, without Ray (unit-testable with a fake clock; also usable in-process)."""

    def __init__(self, limits: RateLimits, clock=time.monotonic):
        self.clock = clock
        self.log: collections.deque = collections.deque()   # [time, requests, tokens] per grant
        self.first_id = 0                                    # grant id of log[0]
        self.in_log = [0, 0.0]                               # requests, tokens in the log
        self.held: dict[str, tuple[int, float]] = {}         # client -> (permits held, when it said so)
        self.recent_429: collections.deque = collections.deque()
        self.learnt: dict[str, list] = {}                    # model -> [quirks, confirmed quirks or None]
        self.epoch = uuid.uuid4().hex[:12]                   # this instance (a restart is a new one)
        self.started = time.time()
        self.totals = {"granted": 0, "released": 0, "throttled": 0, "tokens_charged": 0.0, "given_back": 0}
        self.limits = None
        self.stopped = ""                                    # why the account cannot be used (quota)
        self.need_probe = False                              # a pause ended: one request tests the water
        self.probe: tuple[int, float] | None = None          # (grant id, deadline) of that request
        self.update_limits(limits)

    def update_limits(self, limits: RateLimits) -> None:
        """A job (re)started against this account with these limits: they hold from now on (what was
        granted stays in the log and counts)."""
        if limits != self.limits:
            self.limits = limits
            self.window_s = max(60.0 + limits.permit_ttl_s, limits.storm_window_s)
            self.factor, self.paused_until = 1.0, -math.inf
            self.last_storm = self.clock()
            self.need_probe, self.probe = False, None

    def start_job(self, limits: RateLimits) -> None:
        """A job starts against this account: its limits hold, and an earlier job's quota stop is
        forgotten (the account may have been topped up; if not, the first request says so again)."""
        self.update_limits(limits)
        self.stopped = ""

    # -- the log ---------------------------------------------------------------------------------
    def _trim(self, now: float) -> None:
        while self.log and self.log[0][0] <= now - self.window_s:
            _, n, tokens = self.log.popleft()
            self.first_id += 1
            self.in_log[0], self.in_log[1] = self.in_log[0] - n, self.in_log[1] - tokens

    def _since(self, start: float) -> tuple[int, float]:
        """Requests and tokens granted after ``start`` (the log's tail)."""
        n, tokens = 0, 0.0
        for t, k, tok in reversed(self.log):
            if t <= start:
                break
            n, tokens = n + k, tokens + tok
        return n, tokens

    def _budgets(self, now: float) -> list[tuple]:
        """Per limit set: (0 requests / 1 tokens, used in the window, used in the burst, window cap,
        burst cap) at the current factor. A limit under one request per window counts as one."""
        recent = self._since(now - self.limits.burst_s)
        out = []
        for which, per_minute in ((0, self.limits.rpm), (1, self.limits.tpm)):
            if per_minute > 0:
                cap = max(1.0, per_minute * (1.0 - self.limits.safety) * self.factor)
                out.append((which, self.in_log[which], recent[which], cap, max(1.0, cap / 60 * self.limits.burst_s)))
        return out

    def _next_change(self, now: float) -> float:
        """Seconds until the oldest grant of the burst, or of the window, leaves it (room may open)."""
        first = None
        for t, _, _ in reversed(self.log):
            if t <= now - self.limits.burst_s:
                break
            first = t
        exits = ([self.log[0][0] + self.window_s] if self.log else []) + \
            ([first + self.limits.burst_s] if first is not None else [])
        return min(exits, default=now + 0.05) - now

    def in_flight(self, now: float) -> int:
        horizon = now - self.limits.client_silence_s
        for client in [c for c, (n, seen) in self.held.items() if seen < horizon or n <= 0]:
            del self.held[client]
        return sum(n for n, _ in self.held.values())

    # -- the calls (every one safe to repeat) -----------------------------------------------------
    def lease(self, estimates: list[float], client: str | None = None, holding: int = 0) -> tuple:
        """Grant permits to a prefix of ``estimates`` (each charged its own token estimate); ``client``
        says it holds ``holding`` permits besides. Returns (granted, wait_s, grant id, permit_ttl_s,
        probe, stopped): when nothing is granted, ``wait_s`` says when to ask again; ``probe``: the one
        permit is the first after a pool-wide pause (its answer goes to :meth:`probe_answered`);
        ``stopped``: the account's quota is exhausted (nothing will be granted)."""
        now = self.clock()
        self._trim(now)
        self._recover(now)
        ttl = self.limits.permit_ttl_s
        if client is not None:
            self.held[client] = (max(0, int(holding)), now)
        if self.stopped:
            return 0, 0.0, None, ttl, False, self.stopped
        if now < self.paused_until:
            return 0, self.paused_until - now, None, ttl, False, ""
        probing = self.need_probe
        if probing:
            if self.probe is not None and now < self.probe[1]:
                return 0, 0.05, None, ttl, False, ""           # the probe is out: wait for its answer
            estimates = estimates[:1]                          # none yet, or it went unanswered: one goes
        cap = self.limits.max_in_flight or math.inf
        if cap < math.inf and not (self.limits.rpm > 0 or self.limits.tpm > 0):
            cap = max(1.0, math.floor(cap * self.factor))      # no rate to lower: concurrency is the lever
        room = cap - self.in_flight(now)
        budgets = self._budgets(now)
        granted, tokens = 0, 0.0
        while granted < min(len(estimates), room):
            cost = max(0.0, float(estimates[granted]))
            done = (granted, tokens)
            if not all(_fits(used + done[w], recent + done[w], (1, cost)[w], cap, burst)
                       for w, used, recent, cap, burst in budgets):
                break
            granted, tokens = granted + 1, tokens + cost
        if not granted:
            return 0, 0.05 if room <= 0 else min(0.25, max(0.005, self._next_change(now))), None, ttl, False, ""
        self.log.append([now, granted, tokens])
        self.in_log[0], self.in_log[1] = self.in_log[0] + granted, self.in_log[1] + tokens
        if client is not None:
            self.held[client] = (max(0, int(holding)) + granted, now)
        self.totals["granted"] += granted
        self.totals["tokens_charged"] += tokens
        grant_id = self.first_id + len(self.log) - 1
        if probing:
            self.probe = (grant_id, now + self.limits.probe_wait_s)
            self.totals["probes"] = self.totals.get("probes", 0) + 1
        return granted, 0.0, grant_id, ttl, probing, ""

    def probe_answered(self, grant_id: int) -> None:
        """The probe of grant ``grant_id`` was answered (not with a 429): the pool goes on."""
        if self.probe is not None and self.probe[0] == grant_id:
            self.need_probe, self.probe = False, None

    def stop(self, reason: str) -> None:
        """The provider said the account's quota is exhausted: no more grants until a job starts again."""
        if not self.stopped:
            log.error("LLM account stopped: %s", reason)
        self.stopped = self.stopped or str(reason)[:500]

    def give_back(self, grant_id: int) -> None:
        """The permits of grant ``grant_id`` were not sent (they reached their actor too late)."""
        if self.probe is not None and self.probe[0] == grant_id:
            self.probe = None                                  # not sent: the next grant is the probe
        index = grant_id - self.first_id
        if 0 <= index < len(self.log):
            entry = self.log[index]
            self.in_log[0], self.in_log[1] = self.in_log[0] - entry[1], self.in_log[1] - entry[2]
            self.totals["given_back"] += entry[1]
            entry[1], entry[2] = 0, 0.0

    def report(self, client: str, holding: int, extra_tokens: float = 0.0, usage: dict | None = None) -> str:
        """``client`` holds ``holding`` permits now; its replies used ``extra_tokens`` more than
        estimated (booked now: the provider counted them); ``usage``: counters for the progress line."""
        now = self.clock()
        self.held[client] = (max(0, int(holding)), now)
        if extra_tokens > 0:
            self._trim(now)
            self.log.append([now, 0, float(extra_tokens)])
            self.in_log[1] += float(extra_tokens)
            self.totals["tokens_charged"] += float(extra_tokens)
        for k, v in (usage or {}).items():
            self.totals[k] = self.totals.get(k, 0) + v
        return self.epoch

    def throttle(self, retry_after_s: float | None = None) -> float:
        """The provider said 429. A storm pauses the whole pool, then runs it slower; one storm
        (replies to requests already in flight) lowers the rate once. Returns how long the refused
        request itself must wait before asking again: 0 in a storm (its lease waits for the pause)."""
        now = self.clock()
        pause = retry_after_s if retry_after_s is not None else self.limits.pause_s
        self.totals["throttled"] += 1
        horizon = now - self.limits.storm_window_s
        while self.recent_429 and self.recent_429[0] < horizon:
            self.recent_429.popleft()
        self.recent_429.append(now)
        self._trim(now)
        recent = self._since(horizon)[0]
        if recent >= self.limits.storm_min_requests and len(self.recent_429) < self.limits.storm_share * recent \
                and now >= self.paused_until:
            self.totals["scattered_429"] = self.totals.get("scattered_429", 0) + 1
            return pause
        if now >= self.paused_until:   # a new storm, not another reply from the same one
            self.factor = max(self.limits.min_factor, self.factor * self.limits.backoff_factor)
            log.warning("429 storm from the endpoint: pool paused %.1f s, then at %.0f%% of its limits",
                        pause, 100 * self.factor)
        self.paused_until = max(self.paused_until, now + pause)
        self.last_storm = now
        # When the pause ends one request goes first; the rest wait for its answer (a second storm
        # costs one 429, not a burst of them).
        self.need_probe, self.probe = True, None
        return 0.0

    def _recover(self, now: float) -> None:
        while self.factor < 1.0 and now - self.last_storm >= self.limits.recover_s:
            self.last_storm += self.limits.recover_s
            self.factor = min(1.0, self.factor + self.limits.recover_step)

    def quirks(self, model: str, learnt=(), confirmed: bool = False) -> tuple[list, list | None]:
        """What requests to ``model`` must leave out or change (learnt from 400s by any actor), and the
        set some request was answered with (None: none yet). ``learnt``: what the caller knows;
        ``confirmed``: a request sent with exactly that was answered."""
        book = self.learnt.setdefault(model, [set(), None])
        book[0] |= set(learnt)
        if confirmed:
            book[1] = set(learnt)
        return sorted(book[0]), None if book[1] is None else sorted(book[1])

    def stats(self) -> dict:
        return dict(self.totals, in_flight=self.in_flight(self.clock()), elapsed_s=time.time() - self.started,
                    factor=self.factor, epoch=self.epoch, log_entries=len(self.log), stopped=self.stopped)


def limiter_name(base_url: str | None, api_key: str = "") -> str:
    """Name of the limiter for an endpoint and key: the endpoint's host in clear (to find it in the
    dashboard), and a hash of endpoint and key (never the key). One account, one budget."""
    endpoint = (base_url or "").rstrip("/")
    host = urlparse(endpoint).netloc or "default"
    digest = hashlib.sha256(f"{endpoint}\n{api_key}".encode()).hexdigest()[:16]
    return f"changeforge-llm-v{PROTOCOL}:{host}:{digest}"


def limiter_namespace() -> str:
    """The Ray namespace of the account limiters: ``CHANGEFORGE_LLM_NAMESPACE`` or the shared one."""
    return os.environ.get(NAMESPACE_ENV) or NAMESPACE


def _define_rate_limiter():
    """The actor's class, defined on first use (``RateLimiter``, below): importing Ray (about 0.3 s)
    is left to the processes that start or call a limiter, not every command that imports this module
    (``publish``, ``--help``, ``status``). None without Ray."""
    try:
        import ray
    except ImportError:  # pragma: no cover
        return None

    class RateLimiter(RateLimiterCore):
        """The named actor. Sync and single-threaded: every call is a little arithmetic. Restarted,
        it starts with an empty log (as safe as a provider's window that just began)."""

    RateLimiter.__qualname__ = "RateLimiter"   # as a class defined at module level
    return ray.remote(num_cpus=0, max_concurrency=1, max_restarts=-1, max_task_retries=0)(RateLimiter)


def __getattr__(name: str):
    # ``ratelimit.RateLimiter`` lands here once; the actor class is then a module global like any other.
    if name == "RateLimiter":
        actor_class = globals()["RateLimiter"] = _define_rate_limiter()
        return actor_class
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def start_rate_limiter(name: str, limits: RateLimits, namespace: str | None = None, detached: bool = False):
    """Create (or find, and set the limits of) the pool's limiter. By default it lives as long as
    the driver that created it; ``detached`` ones outlive it (one budget shared by several jobs)."""
    import ray

    opts = dict(name=name, get_if_exists=True)
    if namespace:
        opts["namespace"] = namespace
    if detached:
        opts["lifetime"] = "detached"
    actor_class = globals().get("RateLimiter") or __getattr__("RateLimiter")
    actor = actor_class.options(**opts).remote(limits)
    ray.get(actor.start_job.remote(limits), timeout=120)
    return actor


class LimiterUnavailable(Exception):
    """The rate limiter did not answer within the client's wait (``actor_wait_s``)."""


class QuotaExhausted(Exception):
    """The provider said the account's quota (credit, daily allowance) is used up: nothing more can be
    sent until it is topped up; retrying only waits."""


def _retryable() -> tuple:
    try:
        from ray.exceptions import RayActorError
        return RayActorError, asyncio.TimeoutError
    except ImportError:  # pragma: no cover
        return (asyncio.TimeoutError,)


async def _bounded(awaitable, seconds: float):
    """``awaitable`` within ``seconds``. asyncio.timeout where there is one: wait_for can swallow a
    cancellation (a reporter task then never ends)."""
    if not hasattr(asyncio, "timeout"):  # pragma: no cover - Python 3.10
        return await asyncio.wait_for(awaitable, seconds)
    async with asyncio.timeout(seconds):
        return await awaitable


class LeaseClient:
    """An actor's side of the limiter: one lease call for every request waiting (each with its own
    estimate); what this actor holds, its under-estimates and usage counters reported in the
    background (and at every batch's end). Every call to the limiter is bounded by ``actor_wait_s``
    (retried meanwhile: a restarted limiter answers again); past it, the waiting requests fail with
    :class:`LimiterUnavailable`, which becomes their error rows.

    ``limiter`` is a Ray actor handle, a :class:`RateLimiterCore` (in-process), or None (no limits)."""

    def __init__(self, limiter, max_lease: int = 64, actor_wait_s: float = 120.0, report_every_s: float = 0.05,
                 max_give_backs: int = 3):
        self.limiter = limiter
        self.max_give_backs = max_give_backs
        self.local = isinstance(limiter, RateLimiterCore)
        self.max_lease, self.actor_wait_s, self.report_every_s = max_lease, actor_wait_s, report_every_s
        self.client_id = uuid.uuid4().hex[:16]
        self.holding = 0                     # permits granted to this client and not yet finished
        self.stale = 0                       # grants that came too late and were given back
        self.stopped = ""                    # the account's quota is exhausted (from the limiter or a reply)
        self._queue: collections.deque = collections.deque()   # (estimate, future)
        self._fetcher: asyncio.Task | None = None
        self._reporter: asyncio.Task | None = None
        self._extra_tokens, self._usage = 0.0, {}
        self._reported = (0, 0.0)            # holding as last reported, and when
        self._lock: asyncio.Lock | None = None
        self._late_in_a_row = 0              # late grants given back since the last one used

    async def _call(self, method: str, *args, wait_s: float | None = None):
        if self.local:
            return getattr(self.limiter, method)(*args)
        deadline = time.monotonic() + (self.actor_wait_s if wait_s is None else wait_s)
        delay = 0.05
        while True:
            left = deadline - time.monotonic()
            try:
                return await _bounded(getattr(self.limiter, method).remote(*args), max(0.05, min(left, 30.0)))
            except _retryable() as exc:
                if time.monotonic() + delay > deadline:
                    raise LimiterUnavailable(f"rate limiter unavailable ({type(exc).__name__}) for "
                                             f"{self.actor_wait_s:.0f} s") from None
                log.warning("rate limiter unavailable (%s); retrying", type(exc).__name__)
                await asyncio.sleep(delay * random.uniform(0.5, 1.0))
                delay = min(2.0, delay * 2)

    async def acquire(self, tokens_estimate: float) -> int | None:
        """Wait for a permit charged ``tokens_estimate``; the caller sends at once. Returns the grant id
        when this permit is the probe after a pool-wide pause (its answer goes to :meth:`probe_answered`),
        else None. Raises :class:`QuotaExhausted` once the account is stopped."""
        if self.stopped:
            raise QuotaExhausted(self.stopped)
        if self.limiter is None:
            return None
        fut = asyncio.get_running_loop().create_future()
        self._queue.append((tokens_estimate, fut))
        if self._fetcher is None or self._fetcher.done():
            self._fetcher = asyncio.ensure_future(self._fetch())
        try:
            probe = await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self.release()        # granted just as we were cancelled
            raise
        return probe

    async def _fetch(self) -> None:
        while True:
            while self._queue and self._queue[0][1].done():
                self._queue.popleft()       # cancelled waiters
            if not self._queue:
                return
            batch = [w for w in list(self._queue)[: self.max_lease] if not w[1].done()]
            asked = time.monotonic()
            try:
                granted, wait_s, grant_id, ttl, probe, stopped = await self._call(
                    "lease", [e for e, _ in batch], self.client_id, self.holding)
            except Exception as exc:  # noqa: BLE001 - past its wait: the requests waiting fail, later ones ask again
                self._fail_waiting(LimiterUnavailable(str(exc)))
                continue
            if stopped:
                self.stopped = stopped
                self._fail_waiting(QuotaExhausted(stopped))
                continue
            if granted and not self.local and time.monotonic() - asked > ttl \
                    and self._late_in_a_row < self.max_give_backs:
                # Reached us too late (a CPU-starved actor): sent now, it would join a bunch of stale
                # grants at the provider. Given back (best effort: if lost, it costs one window), a
                # bounded number of times in a row: a limiter that always answers late must not
                # stall the pool (then the late permit is used).
                self.stale += granted
                self._late_in_a_row += 1
                asyncio.ensure_future(self._quietly("give_back", grant_id))
                continue
            if granted:
                self._late_in_a_row = 0
            for estimate, fut in batch[:granted]:
                self._queue.remove((estimate, fut))
                if not fut.done():
                    self.holding += 1
                    fut.set_result(grant_id if probe else None)
            if granted:
                self._wake()
            else:
                await asyncio.sleep(min(wait_s, 2.0))

    def _fail_waiting(self, exc: Exception) -> None:
        for _, fut in self._queue:
            if not fut.done():
                fut.set_exception(exc)

    def probe_answered(self, grant_id: int | None) -> None:
        """The probe after a pool-wide pause was answered: the pool goes on (best effort; if lost, the
        limiter lets another probe out after ``probe_wait_s``)."""
        if grant_id is not None and self.limiter is not None:
            asyncio.ensure_future(self._quietly("probe_answered", grant_id))

    async def stop(self, reason: str) -> None:
        """The account's quota is exhausted: this client and (through the limiter) the pool stop."""
        self.stopped = self.stopped or reason
        self._fail_waiting(QuotaExhausted(reason))
        if self.limiter is not None:
            await self._quietly("stop", reason)

    def release(self, token_correction: float = 0.0, usage: dict | None = None) -> None:
        """A request with a permit finished (or its permit went unused). ``token_correction`` (reported
        - estimated tokens) is booked only when positive: a provider does not refund the unused cap."""
        if self.limiter is None:
            return
        self.holding = max(0, self.holding - 1)
        self._extra_tokens += max(0.0, token_correction)
        self.add_usage(dict(usage or {}, released=1))

    def add_usage(self, usage: dict | None) -> None:
        """Counters for the progress line (also for answers served from the cache)."""
        if self.limiter is None:
            return
        for k, v in (usage or {}).items():
            self._usage[k] = self._usage.get(k, 0) + v
        self._wake()

    def _wake(self) -> None:
        try:
            if self._reporter is None or self._reporter.done():
                self._reporter = asyncio.ensure_future(self._report_loop())
        except RuntimeError:
            pass                      # outside an event loop: the next flush reports

    async def _report_loop(self) -> None:
        """Reports every ``report_every_s`` while there is news or this client holds permits (else
        they would stop counting while its requests are still out)."""
        while self.holding or self._usage or self._extra_tokens or self._reported[0]:
            await asyncio.sleep(self.report_every_s)
            if self._usage or self._extra_tokens or self._reported[0] != self.holding \
                    or time.monotonic() - self._reported[1] > 2.0:
                await self.flush()

    async def _quietly(self, method: str, *args) -> bool:
        try:
            await self._call(method, *args)
            return True
        except Exception as exc:  # noqa: BLE001 - best effort; the state heals within a window
            log.warning("rate limiter %s failed: %s", method, exc)
            return False

    async def flush(self) -> None:
        """Report now (batch and job end). Never raises: unsent counters are kept for the next report,
        and what this client holds is an absolute count, so a lost report costs nothing lasting."""
        if self.limiter is None:
            return
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            extra, usage = self._extra_tokens, self._usage
            self._extra_tokens, self._usage = 0.0, {}
            holding = self.holding
            if await self._quietly("report", self.client_id, holding, extra, usage):
                self._reported = (holding, time.monotonic())
            else:
                self._extra_tokens += extra
                for k, v in usage.items():
                    self._usage[k] = self._usage.get(k, 0) + v

    async def throttle(self, retry_after_s: float | None) -> float:
        """Tell the pool about a 429 (in a storm every actor pauses, then the rate drops). Returns
        how long the refused request must wait on its own (a scattered 429: its Retry-After)."""
        if self.limiter is None:
            return 0.0
        try:
            return float(await self._call("throttle", retry_after_s) or 0.0)
        except Exception:  # noqa: BLE001 - the limiter is away: wait as the provider asked
            return retry_after_s if retry_after_s is not None else 1.0

    async def quirks(self, model: str, learnt, confirmed: bool = False):
        """Share what this actor learnt about ``model`` and get the pool's (None: no limiter, or it did
        not answer within a few seconds)."""
        if self.limiter is None:
            return None
        try:
            return await self._call("quirks", model, sorted(learnt), confirmed, wait_s=min(5.0, self.actor_wait_s))
        except Exception:  # noqa: BLE001 - learning alone is slower, not wrong
            return None
