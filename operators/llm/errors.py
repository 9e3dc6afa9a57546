"""A provider's error read by its code, never by its wording: what an error reply calls for.

One rule for real time (``/chat/completions``) and the Batch API (``/files``, ``/batches``, a batch's
failed lines), from the fields the providers document:

- **quota** (the job stops, exit 3; a rerun after the account is topped up or the day is over goes on):
  an error code or type that names the account's credit (OpenAI ``insufficient_quota``, Moonshot
  ``exceeded_current_quota_error``, ``billing_hard_limit_reached``), HTTP 402, or a rate limit whose
  *limit type* is per day or per month: OpenAI's and Moonshot's limit tag (``(TPD)``, ``RPD``, as in
  "on tokens per day (TPD): Limit ..."), Gemini's ``QuotaFailure`` ``quotaId``
  (``GenerateRequestsPerDayPerProjectPerModel``), or a ``Retry-After`` of an hour or more (Azure answers
  a used-up daily allowance with ``Retry-After: 86400``);
- **wait** (a rate limit: the pool slows down and the request is sent again): every other 429,
  whatever its message says. OpenAI's per-minute messages end with a billing URL, Gemini's per-minute
  ones say "You exceeded your current quota", Azure's name "quotaincrease": none of that is read;
- **retry** (answered, so not billed; backoff): 5xx, 408, 409;
- **reject** (not retried: the same request gets the same answer): every other 4xx, 400 included.

The message is read for one thing only, the limit tag a provider puts there in place of a field (OpenAI
and Moonshot have no limit-type field): an upper-case ``RPD``/``TPD``/``RPM``/``TPM``-style token, never
words such as "quota" or "billing".
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

QUOTA_CODES = frozenset({"insufficient_quota", "exceeded_current_quota_error", "billing_hard_limit_reached",
                         "billing_not_active", "quota_exceeded_error"})
LONG_RETRY_AFTER_S = 3600.0   # a rate limit asking for an hour or more is a daily allowance, not a minute's
# OpenAI "... on tokens per day (TPD): Limit ...", Moonshot "... organization TPD rate limit, current: ...":
# the limit's unit, as the provider tags it (case-sensitive, a whole token).
_LIMIT_TAG = re.compile(r"(?<![A-Za-z])(RPM|TPM|IPM|RPD|TPD|IPD|RPH|TPH|TPMo|RPMo)(?![A-Za-z])")
_DAY_TAGS = {"RPD", "TPD", "IPD", "TPMo", "RPMo"}
# Gemini (google.rpc.QuotaFailure): quotaId such as GenerateRequestsPerDayPerProjectPerModel-FreeTier.
_QUOTA_ID_PERIOD = re.compile(r"Per(Minute|Day|Month|Hour|Second)", re.I)


@dataclass(frozen=True)
class ErrorReading:
    kind: str                # quota | wait | retry | reject
    code: str = ""           # the provider's code / type, as given
    period: str = ""         # the limit's period where the error names one: minute, hour, day, month
    message: str = ""

    @property
    def reason(self) -> str:
        what = self.code or "error"
        if self.period:
            what += f", per {self.period}"
        return f"{what}: {self.message[:300]}"


def error_object(body) -> dict:
    """The ``error`` object of an error reply (bytes, text or parsed JSON): OpenAI's ``{"error": {...}}``,
    Gemini's OpenAI endpoint's ``[{"error": {...}}]``, vLLM's older ``{"object": "error", ...}``; {} if none."""
    if isinstance(body, (bytes, bytearray, str)):
        try:
            body = json.loads(body)
        except ValueError:
            return {}
    if isinstance(body, list) and body and isinstance(body[0], dict):
        body = body[0]
    if not isinstance(body, dict):
        return {}
    err = body.get("error")
    if isinstance(err, dict):
        return err
    if body.get("object") == "error" or "message" in body and ("type" in body or "code" in body):
        return body
    return {}


def _codes(err: dict) -> list[str]:
    return [str(err[k]) for k in ("code", "type", "status") if isinstance(err.get(k), str) and err.get(k)]


def limit_period(err: dict) -> str:
    """The period of the limit an error names: Gemini's QuotaFailure quotaIds (the longest named wins: a
    per-day violation among per-minute ones is still a day), else the provider's limit tag in the message."""
    periods = []
    for detail in err.get("details") or []:
        if not isinstance(detail, dict):
            continue
        for v in detail.get("violations") or []:
            if isinstance(v, dict):
                for field in ("quotaId", "quotaMetric"):
                    m = _QUOTA_ID_PERIOD.search(str(v.get(field, "")))
                    if m:
                        periods.append(m.group(1).lower())
                        break
    if not periods:
        periods = ["month" if t.endswith("Mo") else "day" if t in _DAY_TAGS else
                   "hour" if t.endswith("H") else "minute" for t in _LIMIT_TAG.findall(str(err.get("message", "")))]
    order = ["second", "minute", "hour", "day", "month"]
    return max(periods, key=order.index) if periods else ""


def read_error(status: int, body, retry_after_s: float | None = None) -> ErrorReading:
    """What an error reply with HTTP ``status`` and ``body`` calls for (see the module doc)."""
    err = error_object(body)
    codes = _codes(err)
    code = " ".join(dict.fromkeys(codes))
    message = str(err.get("message", "")) if err else (body.decode("utf-8", "replace") if isinstance(
        body, (bytes, bytearray)) else str(body or ""))[:500]
    period = limit_period(err) if status == 429 or any(c in QUOTA_CODES for c in codes) else ""
    if status == 402 or any(c.lower() in QUOTA_CODES for c in codes):
        return ErrorReading("quota", code, period, message)
    if status == 429:
        if period in ("day", "month"):
            return ErrorReading("quota", code, period, message)
        if retry_after_s is not None and retry_after_s >= LONG_RETRY_AFTER_S:
            return ErrorReading("quota", code, period, f"(Retry-After {retry_after_s:.0f} s) {message}")
        return ErrorReading("wait", code, period, message)
    if status >= 500 or status in (408, 409):
        return ErrorReading("retry", code, period, message)
    return ErrorReading("reject", code, period, message)
