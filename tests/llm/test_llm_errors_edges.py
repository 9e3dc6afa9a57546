"""operators.llm.errors at its edges (the cases a provider table does not hold): old vLLM bodies, bodies
that are not JSON, integer codes, the Retry-After boundary, the retryable 4xx statuses. Written for the
survivors of a mutation sample drawn before they existed (docs/testing.md, stop 51)."""
from __future__ import annotations

import pytest

from operators.llm.errors import LONG_RETRY_AFTER_S, error_object, limit_period, read_error


def test_an_old_vllm_error_body_is_the_error_itself_and_a_plain_dict_is_not_one():
    old = {"object": "error", "message": "The model `x` does not exist."}
    assert error_object(old) == old
    assert error_object(b'{"object": "error", "message": "m"}') == {"object": "error", "message": "m"}
    assert error_object({"detail": "Not Found"}) == {} and error_object({"object": "list", "data": []}) == {}


def test_a_body_that_is_not_json_is_kept_as_the_message_and_read_by_its_status():
    r = read_error(502, b"<html>502 Bad Gateway (TPD)</html>")
    assert (r.kind, r.code, r.period, r.message) == ("retry", "", "", "<html>502 Bad Gateway (TPD)</html>")
    assert len(read_error(500, "x" * 2000).message) == 500
    assert read_error(400, "not json").kind == "reject"


def test_an_integer_code_is_no_code_name():
    # Gemini's OpenAI endpoint: {"code": 429, "status": "RESOURCE_EXHAUSTED"}: the name is the status
    r = read_error(429, [{"error": {"code": 429, "message": "Resource has been exhausted.",
                                    "status": "RESOURCE_EXHAUSTED"}}])
    assert (r.kind, r.code) == ("wait", "RESOURCE_EXHAUSTED")


def test_a_limit_period_is_read_for_rate_limits_and_quotas_only():
    assert read_error(503, {"error": {"message": "overloaded, try later (TPD)"}}).period == ""
    assert read_error(429, {"error": {"message": "Rate limit reached on tokens per day (TPD)"}}).period == "day"


@pytest.mark.parametrize("tag, period", [("RPM", "minute"), ("TPM", "minute"), ("IPM", "minute"),
                                         ("RPH", "hour"), ("TPH", "hour"), ("RPD", "day"), ("TPD", "day"),
                                         ("IPD", "day"), ("TPMo", "month"), ("RPMo", "month")])
def test_each_limit_tag_names_its_period_and_the_longest_named_wins(tag, period):
    assert limit_period({"message": f"Rate limit reached ({tag}): retry later"}) == period
    assert limit_period({"message": f"Limit {tag} and RPM both reached"}) == period      # the longer wins
    assert limit_period({"message": f"no tag in {tag.lower()}x"}) == ""


@pytest.mark.parametrize("after, kind", [(LONG_RETRY_AFTER_S - 1, "wait"), (LONG_RETRY_AFTER_S, "quota"),
                                         (LONG_RETRY_AFTER_S + 1, "quota"), (None, "wait")])
def test_a_retry_after_of_an_hour_or_more_is_a_daily_allowance(after, kind):
    assert LONG_RETRY_AFTER_S == 3600.0
    assert read_error(429, {"error": {"code": "429", "message": "Rate limit is exceeded."}}, after).kind == kind


@pytest.mark.parametrize("status, kind", [(408, "retry"), (409, "retry"), (410, "reject"), (499, "reject"),
                                          (500, "retry"), (404, "reject")])
def test_statuses_without_a_body_code(status, kind):
    assert read_error(status, {"error": {"message": "m"}}).kind == kind


def test_a_limit_tag_in_a_refusal_is_not_a_period():
    assert read_error(400, {"error": {"message": "max_tokens too large for this model (TPD tier)"}}).period == ""


def test_gemini_s_quota_id_names_the_period_before_its_metric():
    err = {"error": {"code": 429, "status": "RESOURCE_EXHAUSTED", "message": "m", "details": [
        {"@type": "type.googleapis.com/google.rpc.QuotaFailure",
         "violations": [{"quotaId": "GenerateRequestsPerMinutePerProjectPerModel", "quotaMetric": "RequestsPerDay"}]}]}}
    assert (read_error(429, err).period, read_error(429, err).kind) == ("minute", "wait")


def test_a_list_body_is_read_from_its_first_error():
    first = {"code": 429, "message": "first", "status": "RESOURCE_EXHAUSTED"}
    assert error_object([{"error": first}, "trailing text"]) == first
    assert error_object([]) == {} and error_object(["no object"]) == {}


def test_a_reading_is_a_value_callers_share_and_cannot_change():
    import dataclasses
    r = read_error(429, {"error": {"code": "rate_limit_exceeded", "message": "m"}})
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.kind = "quota"
    assert {r, read_error(429, {"error": {"code": "rate_limit_exceeded", "message": "m"}})} == {r}


@pytest.mark.quick
def test_a_reason_keeps_the_provider_s_first_300_characters():
    """A reason is short enough for a log line and an errors table, and keeps all of the first 300
    characters a provider wrote (the moving mutation sample's survivor cut one: 299)."""
    from operators.llm.errors import ErrorReading
    message = "".join(chr(ord("a") + i % 26) for i in range(400))
    r = ErrorReading("reject", "invalid_request_error", "", message)
    assert r.reason == f"invalid_request_error: {message[:300]}"
    assert ErrorReading("quota", "", "day", "x" * 300).reason == "error, per day: " + "x" * 300
