"""A provider's error read by its code, never by its wording (operators/llm/errors.py): the real providers'
error bodies as they document them, through the real code (real time through the caller, the Batch
API's /files and /batches, a batch's refused lines), and the rule against a reference written from
it on generated cases. Against the test server (no Ray)."""
import asyncio

import pytest
from hypothesis import given
from hypothesis import strategies as st

from operators.llm.batch import BatchAPI, BatchAPIError, BatchDriver, BatchSettings, BatchState
from operators.llm.cache import ResponseCache
from operators.llm.errors import LONG_RETRY_AFTER_S, QUOTA_CODES, read_error
from tests.llm.test_llm_batch_submission import defer
from tests.llm.test_llm_money import KEY, caller_for, requests

OPENAI_BILLING = "https://platform.openai.com/account/rate-limits"

# (name, HTTP status, body as the provider sends it, headers, what it calls for)
PROVIDERS = [
    # OpenAI: out of credit or over the monthly budget: insufficient_quota (its message names billing).
    ("openai insufficient_quota", 429, {"error": {
        "message": "You exceeded your current quota, please check your plan and billing details. For more "
                   "information on this error, read the docs: https://platform.openai.com/docs/guides/error-codes/api-errors.",
        "type": "insufficient_quota", "param": None, "code": "insufficient_quota"}}, {}, "quota"),
    # OpenAI per-minute limits: rate_limit_exceeded; the message ends with a URL (wait, whatever it says).
    ("openai TPM", 429, {"error": {
        "message": "Rate limit reached for gpt-4o-mini in organization org-abc123 on tokens per min (TPM): Limit "
                   f"200000, Used 199000, Requested 2500. Please try again in 450ms. Visit {OPENAI_BILLING} to learn more.",
        "type": "tokens", "param": None, "code": "rate_limit_exceeded"}}, {"retry-after-ms": "450"}, "wait"),
    ("openai RPM with the billing page", 429, {"error": {
        "message": "Rate limit reached for gpt-4o in organization org-abc123 on requests per min (RPM): Limit 500, "
                   "Used 500, Requested 1. Please try again in 120ms. Visit https://platform.openai.com/account/billing "
                   "to add a payment method and increase your quota.",
        "type": "requests", "param": None, "code": "rate_limit_exceeded"}}, {}, "wait"),
    # OpenAI per-day limits: the same code, the limit type TPD / RPD.
    ("openai TPD", 429, {"error": {
        "message": "Rate limit reached for gpt-4o in organization org-abc123 on tokens per day (TPD): Limit 90000, "
                   f"Used 89000, Requested 2500. Please try again in 16m0.2s. Visit {OPENAI_BILLING} to learn more.",
        "type": "tokens", "param": None, "code": "rate_limit_exceeded"}}, {}, "quota"),
    ("openai RPD", 429, {"error": {
        "message": "Rate limit reached for gpt-4o-mini in organization org-abc123 on requests per day (RPD): Limit "
                   f"10000, Used 10000, Requested 1. Please try again in 8.64s. Visit {OPENAI_BILLING} to learn more.",
        "type": "requests", "param": None, "code": "rate_limit_exceeded"}}, {}, "quota"),
    ("openai 400", 400, {"error": {"message": "Invalid 'messages[1].content[1].image_url.url': expected a valid URL.",
                                   "type": "invalid_request_error", "param": "messages", "code": "invalid_value"}},
     {}, "reject"),
    ("openai 500", 500, {"error": {"message": "The server had an error while processing your request. Sorry about that!",
                                   "type": "server_error", "param": None, "code": None}}, {}, "retry"),
    # Azure OpenAI: code "429", the wait in Retry-After; a used-up daily allowance asks for a day.
    ("azure per-minute", 429, {"error": {"code": "429", "message":
        "Requests to the ChatCompletions_Create Operation under Azure OpenAI API version 2024-06-01 have exceeded "
        "token rate limit of your current OpenAI S0 pricing tier. Please retry after 6 seconds. Please go here: "
        "https://aka.ms/oai/quotaincrease if you would like to further increase the default rate limit."}},
     {"Retry-After": "6"}, "wait"),
    ("azure a day", 429, {"error": {"code": "429", "message":
        "Requests to the ChatCompletions_Create Operation under Azure OpenAI API version 2024-06-01 have exceeded "
        "token rate limit of your current AIServices S0 pricing tier. Please retry after 86400 seconds. Please "
        "contact Azure support service if you would like to further increase the default rate limit."}},
     {"Retry-After": "86400"}, "quota"),
    # Gemini's OpenAI endpoint: a list around the error; RESOURCE_EXHAUSTED, the limit in QuotaFailure's quotaId.
    ("gemini per-minute", 429, [{"error": {"code": 429, "message":
        "You exceeded your current quota, please check your plan and billing details. For more information on "
        "this error, head to: https://ai.google.dev/gemini-api/docs/rate-limits.", "status": "RESOURCE_EXHAUSTED",
        "details": [{"@type": "type.googleapis.com/google.rpc.QuotaFailure", "violations": [
            {"quotaMetric": "generativelanguage.googleapis.com/generate_content_free_tier_requests",
             "quotaId": "GenerateRequestsPerMinutePerProjectPerModel-FreeTier",
             "quotaDimensions": {"location": "global", "model": "gemini-2.0-flash"}, "quotaValue": "15"}]},
            {"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": "23s"}]}}], {}, "wait"),
    ("gemini per-day", 429, [{"error": {"code": 429, "message":
        "You exceeded your current quota, please check your plan and billing details. For more information on "
        "this error, head to: https://ai.google.dev/gemini-api/docs/rate-limits.", "status": "RESOURCE_EXHAUSTED",
        "details": [{"@type": "type.googleapis.com/google.rpc.QuotaFailure", "violations": [
            {"quotaMetric": "generativelanguage.googleapis.com/generate_content_free_tier_requests",
             "quotaId": "GenerateRequestsPerMinutePerProjectPerModel-FreeTier", "quotaValue": "15"},
            {"quotaMetric": "generativelanguage.googleapis.com/generate_content_free_tier_requests",
             "quotaId": "GenerateRequestsPerDayPerProjectPerModel-FreeTier", "quotaValue": "1500"}]}]}}], {}, "quota"),
    ("gemini shared capacity", 429, [{"error": {"code": 429, "message": "Resource has been exhausted (e.g. check quota).",
                                                "status": "RESOURCE_EXHAUSTED"}}], {}, "wait"),
    # Moonshot (Kimi): the error type says which; the limit's unit is in the message (TPD).
    ("moonshot RPM", 429, {"error": {"message": "Your account org-abc<ak-xyz> request reached organization max RPM: 3, "
                                                "please try again after 1 seconds", "type": "rate_limit_reached_error"}},
     {}, "wait"),
    ("moonshot TPD", 429, {"error": {"message": "Your account org-abc<ak-xyz> request reached organization TPD rate "
                                                "limit, current: 1508351, limit: 1500000",
                                     "type": "rate_limit_reached_error"}}, {}, "quota"),
    ("moonshot balance", 429, {"error": {"message": "Your account org-abc<ak-xyz> is suspended due to insufficient "
                                                    "balance, please recharge your account or check your plan and billing details",
                                         "type": "exceeded_current_quota_error"}}, {}, "quota"),
    # Moonshot answers an account out of balance with 403 too (its errors page: "403 Forbidden (insufficient
    # balance)"; the body as MoonshotAI/Kimi-K2#5 shows it): the type, not the status, says quota. Its other
    # documented 403, permission_denied_error, is a refusal.
    ("moonshot 403 balance", 403, {"error": {"message": "Your account org-abc<ak-xyz> is not active, organization "
                                                        "<org-abc> exceeded current quota, please check your plan and "
                                                        "billing details", "type": "exceeded_current_quota_error"}},
     {}, "quota"),
    ("moonshot 403 permission", 403, {"error": {"message": "The API you are accessing is not open",
                                                "type": "permission_denied_error"}}, {}, "reject"),
    ("moonshot overloaded", 429, {"error": {"message": "The engine is currently overloaded, please try again later",
                                            "type": "engine_overloaded_error"}}, {}, "wait"),
    # vLLM: {"object": "error", ...} (older) or {"error": {...}}, code as an integer; a 400 is final.
    ("vllm 400", 400, {"object": "error", "message": "This model's maximum context length is 32768 tokens. However, "
                       "you requested 40000 tokens (38500 in the messages, 1500 in the completion). Please reduce the "
                       "length of the messages or completion.", "type": "BadRequestError", "param": None, "code": 400},
     {}, "reject"),
    ("vllm 503", 503, {"error": {"message": "The server is overloaded", "type": "ServiceUnavailableError",
                                 "param": None, "code": 503}}, {}, "retry"),
]
IDS = [p[0] for p in PROVIDERS]


def _retry_after(headers):
    for name, scale in (("retry-after-ms", 1e-3), ("Retry-After", 1.0)):
        if name in headers:
            return float(headers[name]) * scale
    return None


@pytest.mark.parametrize("name,status,body,headers,kind", PROVIDERS, ids=IDS)
def test_the_rule_reads_each_providers_body(name, status, body, headers, kind):
    assert read_error(status, body, _retry_after(headers)).kind == kind


@pytest.mark.parametrize("name,status,body,headers,kind", [p for p in PROVIDERS if p[1] == 429 or p[4] == "quota"],
                         ids=[p[0] for p in PROVIDERS if p[1] == 429 or p[4] == "quota"])
def test_real_time_stops_on_a_quota_and_waits_on_a_rate_limit(openai_server, name, status, body, headers, kind):
    """Through the caller against the test server answering with the provider's own reply once: a quota
    stops at once (one request, QuotaExhausted); a rate limit is waited and the request answered."""
    openai_server.configure(error_reply={"status": status, "body": body, "headers": headers, "times": 1,
                                         "paths": ["chat"]})

    async def go():
        caller = caller_for(openai_server, max_retry_after_s=0.05, backoff_base_s=0.01)
        try:
            return await asyncio.wait_for(caller.call(requests(1, tag=name.replace(" ", "_"))[0]), 30)
        finally:
            await caller.aclose()
    result = asyncio.run(go())
    stats = openai_server.stats()
    assert stats["error_replies"] == {"chat": 1}
    if kind == "quota":
        assert not result.ok and result.error_type == "QuotaExhausted", (result.error_type, result.error)
        assert stats["total"] == 1 and "quota" in result.error
    else:
        assert result.ok and result.attempts == 2 and stats["total"] == 2, (result.error_type, result.error)


class _Sleeps:
    def __init__(self):
        self.delays = []

    def __call__(self, s):
        self.delays.append(s)


@pytest.mark.parametrize("path", ["files", "batches"])
@pytest.mark.parametrize("name,status,body,headers,kind", PROVIDERS, ids=IDS)
def test_the_batch_endpoints_read_errors_the_same_way(openai_server, path, name, status, body, headers, kind):
    """/files and /batches: a quota is a BatchAPIError of kind quota (the job exits 3, no traceback), a 4xx
    is not sent again, a rate limit waits and goes on; a 5xx on the upload is retried, on a creation it is
    not (the batch may exist: the driver looks for it)."""
    openai_server.configure(error_reply={"status": status, "body": body, "headers": headers, "times": 1,
                                         "paths": [path]})
    sleeps = _Sleeps()
    api = BatchAPI(openai_server.base_url, KEY, timeout_s=10, sleep=sleeps)
    file_id = api.upload(b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n') \
        if path == "batches" else None
    try:
        if path == "files":
            api.upload(b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n')
        else:
            api.create(file_id, "24h")
        outcome = "answered"
    except BatchAPIError as exc:
        outcome = exc.kind
    stats = openai_server.stats()
    assert stats["error_replies"] == {path: 1}
    if kind in ("quota", "reject"):
        assert outcome == kind and sleeps.delays == []
    elif kind == "retry" and path == "batches":
        assert outcome == "retry" and sleeps.delays == []       # a creation is never sent again unasked
    else:
        assert outcome == "answered" and len(sleeps.delays) == 1
    if kind == "wait" and _retry_after(headers) is not None:
        assert sleeps.delays == [pytest.approx(min(300.0, _retry_after(headers)))]


def _driver(server, state, **settings):
    return BatchDriver(state, BatchAPI(server.base_url, KEY, timeout_s=10), BatchSettings(poll_s=0.05, **settings))


def _refused_batch(server, tmp_path, status: int, code: str, n: int, tag: str):
    """``n`` lines deferred and submitted in one batch whose lines the provider refuses with ``status``
    and ``code``: (state, cache, driver)."""
    server.configure(batch_fail_rate=1.0, batch_fail_status=status, batch_fail_code=code)
    state, cache = BatchState(str(tmp_path), "t"), ResponseCache(str(tmp_path))
    driver = _driver(server, state)
    defer(server, state, cache, requests(n, tag=tag))
    driver.submit()
    return state, cache, driver


def test_a_refused_batch_line_fails_at_once_and_is_never_submitted_again(openai_server, tmp_path):
    state, cache, driver = _refused_batch(openai_server, tmp_path, 400, "invalid_request_error", 3, "bad")
    assert driver.wait() == {"completed": 0, "failed": 3, "retried": 0, "open": 0}
    final = defer(openai_server, state, cache, requests(3, tag="bad"))
    assert all(r.error_type == "BatchFailed" and "invalid_request_error" in r.error for r in final)
    assert driver.submit() == [] and set(openai_server.stats()["batch_submissions"].values()) == {1}


def test_a_batch_line_refused_for_the_quota_waits_for_the_rerun_and_stops_the_job(openai_server, tmp_path):
    state, cache, driver = _refused_batch(openai_server, tmp_path, 429, "insufficient_quota", 2, "broke")
    assert driver.wait() == {"completed": 0, "failed": 0, "retried": 0, "open": 0}
    assert "insufficient_quota" in driver.quota
    assert len(state.waiting()) == 2 and not state.keys("failed")       # not failed: the rerun submits them
    openai_server.configure(batch_fail_rate=0.0)
    rerun = _driver(openai_server, BatchState(str(tmp_path), "t"))
    rerun.submit()
    assert rerun.wait()["completed"] == 2 and not rerun.quota


def test_a_batch_level_failure_keeps_the_providers_reason(openai_server, tmp_path):
    """A batch the provider failed whole (its validation: the reason in the batch's ``errors``): each line's
    failure record carries that reason, not "failed before answering the line" alone."""
    reason = "Model 'gpt-4o-2024-05-13' is not supported for batch in this region."
    openai_server.configure(batch_status="failed", batch_errors=[
        {"code": "model_not_found", "message": reason, "param": "body.model", "line": 1}])
    state, cache = BatchState(str(tmp_path), "t"), ResponseCache(str(tmp_path))
    driver = _driver(openai_server, state)
    defer(openai_server, state, cache, requests(2, tag="enq"))
    driver.submit()
    assert driver.wait()["retried"] == 2
    records = [state.read("failed", k) for k in state.keys("failed")]
    assert len(records) == 2 and all("model_not_found" in r["reason"] and reason in r["reason"] for r in records)


# -- the rule on generated cases, against a reference written from it ----------------------------------
def reference(status: int, code: str, period: str, retry_after: float | None) -> str:
    """The documented rule, from what a case was made of (not from its body)."""
    if status == 402 or code in QUOTA_CODES:
        return "quota"
    if status == 429:
        if period in ("day", "month") or (retry_after is not None and retry_after >= LONG_RETRY_AFTER_S):
            return "quota"
        return "wait"
    if status >= 500 or status in (408, 409):
        return "retry"
    return "reject"


# Wording that must change nothing: quota words, billing URLs, lower-case periods.
NOISE = ["You exceeded your current quota, please check your plan and billing details.",
         "Visit https://platform.openai.com/account/billing to learn more.", "daily limit", "monthly quota",
         "per day", "credit balance is too low", "Please retry after 20 seconds.", "quota exceeded", "rpd", "tpd",
         "https://aka.ms/oai/quotaincrease", "Resource has been exhausted (e.g. check quota).", ""]
PERIOD_TAG = {"minute": ["TPM", "RPM"], "day": ["TPD", "RPD"], "": [""]}
GEMINI_ID = {"minute": "GenerateRequestsPerMinutePerProjectPerModel-FreeTier",
             "day": "GenerateRequestsPerDayPerProjectPerModel-FreeTier",
             "month": "GenerateContentPaidTierInputTokensPerModelPerMonth", "": ""}


@st.composite
def cases(draw):
    shape = draw(st.sampled_from(["openai", "azure", "gemini", "moonshot", "vllm"]))
    status = draw(st.sampled_from([400, 401, 402, 403, 404, 408, 409, 422, 429, 429, 429, 500, 502, 503, 504]))
    code = draw(st.sampled_from(["", "rate_limit_exceeded", "insufficient_quota", "exceeded_current_quota_error",
                                 "rate_limit_reached_error", "engine_overloaded_error", "invalid_request_error",
                                 "RESOURCE_EXHAUSTED", "429", "server_error", "billing_hard_limit_reached"]))
    period = draw(st.sampled_from(["", "minute", "day"] + (["month"] if shape == "gemini" else [])))
    retry_after = draw(st.one_of(st.none(), st.floats(0, 200_000, allow_nan=False)))
    noise = " ".join(draw(st.lists(st.sampled_from(NOISE), max_size=3)))
    tag = draw(st.sampled_from(PERIOD_TAG.get(period, [""])))
    if shape == "gemini":
        err = {"code": status, "message": noise, "status": code or "RESOURCE_EXHAUSTED",
               "details": [{"@type": "type.googleapis.com/google.rpc.QuotaFailure",
                            "violations": [{"quotaId": GEMINI_ID[period]}] if period else []}]}
        body, code = [{"error": err}], code or "RESOURCE_EXHAUSTED"
    elif shape == "vllm":
        body = {"object": "error", "message": f"{noise} {f'on tokens ({tag})' if tag else ''}", "type": code or
                "BadRequestError", "param": None, "code": status}
        code = code or "BadRequestError"
    else:
        where = {"openai": f"on tokens per {period} ({tag}): Limit 1, Used 1, Requested 1.",
                 "moonshot": f"request reached organization {tag} rate limit, current: 2, limit: 1",
                 "azure": ""}[shape] if tag else ""
        err = {"message": f"{noise} {where}".strip()}
        if code:
            err["type" if shape == "moonshot" else "code"] = code
        body = {"error": err}
    if shape == "azure" or (shape == "vllm" and not tag):
        period = ""                                            # nowhere to say it: only Retry-After tells
    return status, body, code, period, retry_after


@given(cases())
def test_the_rule_equals_the_reference_on_generated_errors(case):
    status, body, code, period, retry_after = case
    assert read_error(status, body, retry_after).kind == reference(status, code, period, retry_after)


@pytest.mark.parametrize("path,body,stop", [
    ("files", PROVIDERS[0][2], "QuotaStop"), ("batches", PROVIDERS[3][2], "QuotaStop"),
    ("files", PROVIDERS[5][2], "BatchStopped")])
def test_a_batch_endpoint_refusal_stops_the_job_with_its_reason_not_a_traceback(openai_server, tmp_path, monkeypatch,
                                                                                  path, body, stop):
    """Through run_llm_job (its pass's pipeline replaced by the callers deferring the lines): a quota at
    /files or /batches is QuotaStop (the jobs print it and exit 3), a 400 is BatchStopped (exit 3 too)."""
    from operators.io.storage import Store
    from operators.llm import job_passes
    from operators.llm.client import LLMConfig, Secret
    from operators.llm.job_options import LLMJobConfig
    from operators.llm.job_passes import QuotaStop, run_llm_job
    from operators.llm.stage import StageSpec
    status = 400 if stop == "BatchStopped" else 429
    openai_server.configure(error_reply={"status": status, "body": body, "times": 1, "paths": [path]})
    state, cache = BatchState(str(tmp_path), "caption", "r1"), ResponseCache(str(tmp_path))

    def one_pass(todo, *args, **kwargs):
        defer(openai_server, state, cache, requests(len(todo), tag="job"))
        return {}
    monkeypatch.setattr(job_passes, "run_stages", one_pass)
    cfg = LLMJobConfig(output=str(tmp_path), model="test-model", base_url=openai_server.base_url, batch_api=True,
                       batch_poll_s=0.05)
    spec = StageSpec(name="caption_generate", input_table="pairs", build_request=None, handle_result=None,
                     llm=LLMConfig(model="test-model", base_url=openai_server.base_url), api_key=Secret(KEY))
    with pytest.raises((QuotaStop, job_passes.BatchesOpen)) as stopped:
        run_llm_job(cfg, [{"pair_id": "job0"}], None, {}, [spec], lambda: None, None, out=Store(str(tmp_path)),
                    job="caption", run_id="r1")
    assert type(stopped.value).__name__ == stop
    assert (body["error"].get("code") or body["error"].get("type")) in str(stopped.value)
    assert openai_server.stats()["batch_submissions"] == {}               # nothing submitted


def test_polling_outlasts_a_blip_of_server_errors(openai_server, tmp_path):
    """Twelve 503s in a row to GET /batches/{id} (three polls' worth of retries): the wait polls on and
    collects the batch, where giving up after one poll's retries stopped the job."""
    state, cache = BatchState(str(tmp_path), "t"), ResponseCache(str(tmp_path))
    defer(openai_server, state, cache, requests(2, tag="blip"))
    sleeps = _Sleeps()
    driver = BatchDriver(state, BatchAPI(openai_server.base_url, KEY, timeout_s=10, sleep=sleeps),
                         BatchSettings(poll_s=0.05), sleep=sleeps)
    driver.submit()
    openai_server.configure(error_reply={"status": 503, "body": PROVIDERS[-1][2], "times": 12, "paths": ["poll"]})
    assert driver.wait() == {"completed": 2, "failed": 0, "retried": 0, "open": 0}
    assert openai_server.stats()["error_replies"] == {"poll": 12}
