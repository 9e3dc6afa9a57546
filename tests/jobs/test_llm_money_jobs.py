"""The captions job's money end to end (Ray Data + the test server): --batch-api gives the selection of
a real-time run on the same replies at the batch price and a rerun sends nothing; a quota 429 stops
the job within seconds, non-zero, and the rerun re-sends nothing that was answered."""
import time

import pytest

from jobs.caption import main, run
from tests.jobs.test_caption_job import ALL_PAIRS, LEVIR, accounted, config, tables

pytestmark = pytest.mark.slow

CANDIDATE = ("pair_id", "candidate_index", "caption", "overall", "selected")


def test_batch_run_selects_as_real_time_does_at_the_batch_price_and_a_rerun_sends_nothing(
        ray_session, openai_server, tmp_path):
    run(config(openai_server, LEVIR, tmp_path / "realtime"))
    realtime = tables(tmp_path / "realtime")
    openai_server.reset()
    openai_server.configure(batch_delay_s=0.3)
    summary = run(config(openai_server, LEVIR, tmp_path / "batch", batch_api=True, batch_poll_s=0.1,
                         batch_max_requests=20))
    batch = tables(tmp_path / "batch")
    stats = openai_server.stats()
    assert stats["total"] == 0                                 # nothing in real time
    assert set(stats["batch_submissions"].values()) == {1} and len(stats["batch_submissions"]) == 22
    assert summary["stopped"] == "" and accounted(batch) == ALL_PAIRS
    key = lambda c: (c["pair_id"], c["candidate_index"])       # noqa: E731
    assert [tuple(c[k] for k in CANDIDATE) for c in sorted(batch["captions"], key=key)] == \
        [tuple(c[k] for k in CANDIDATE) for c in sorted(realtime["captions"], key=key)]
    assert sorted((p["pair_id"], p["selected_captions"]) for p in batch["pairs"]) == \
        sorted((p["pair_id"], p["selected_captions"]) for p in realtime["pairs"])
    # One usage row per request, each naming its batch, at half the real-time cost.
    assert len(batch["usage"]) == 22 and all(u["batch_id"] and not u["cached"] for u in batch["usage"])
    rt_cost = {u["cache_key"]: u["cost_usd"] for u in realtime["usage"]}
    assert [u["cost_usd"] for u in batch["usage"]] == pytest.approx([rt_cost[u["cache_key"]] / 2
                                                                    for u in batch["usage"]])
    # The rerun: every pair finished, nothing submitted or sent.
    again = run(config(openai_server, LEVIR, tmp_path / "batch", batch_api=True, batch_poll_s=0.1))
    assert openai_server.stats()["batch_submissions"] == stats["batch_submissions"]
    assert openai_server.stats()["total"] == 0 and again["usage"]["logical_requests"] == 0


def argv(server, out, **extra):
    args = ["--input", str(LEVIR), "--output", str(out), "--model", "test-model", "--base-url", server.base_url,
            "--timeout-s", "5", "--max-retries", "2", "--backoff-base-s", "0.05", "--actors", "2",
            "--concurrent-batches", "2", "--batch-size", "2", "--progress-every-s", "1",
            "--price-per-mtok-in", "0.5", "--price-per-mtok-out", "1.5"]
    for k, v in extra.items():
        args += [f"--{k.replace('_', '-')}", str(v)]
    return args


def test_a_quota_429_stops_the_job_within_seconds_and_the_rerun_pays_nothing_twice(
        ray_session, openai_server, tmp_path, capsys):
    # The account runs dry at the judge of one pair (its generation and other pairs' requests answered).
    openai_server.configure(faults=[{"kind": "quota", "rate": 1.0, "match": "test_2_0000_0000",
                                     "match_text": "strict reviewer"}])
    out = tmp_path / "out"
    started = time.monotonic()
    code = main(argv(openai_server, out))
    took = time.monotonic() - started
    printed = capsys.readouterr().out
    assert code != 0 and "quota" in printed.splitlines()[-1]
    first = openai_server.stats()
    assert first["by_status"].get("429") and max(first["seen_by_key"].values()) == 1   # nothing retried
    assert took < 120                                           # the job, Ray start included, on a loaded VM
    answered = set(first["ok_by_key"])
    assert answered
    t = tables(out)
    assert accounted(t) == ALL_PAIRS                            # every pair in pairs/ or errors/
    assert any(e["error_type"] == "QuotaExhausted" for e in t["errors"])
    assert all(u["status"] == "ok" or u["prompt_tokens"] is None or u["prompt_tokens"] == 0 for u in t["usage"])

    # The account topped up (a fresh server): the rerun completes and re-sends none of the answered.
    openai_server.restore_defaults()
    openai_server.reset()
    assert main(argv(openai_server, out)) == 0
    second = openai_server.stats()
    assert not answered & set(second["ok_by_key"])
    assert sorted(p["pair_id"] for p in tables(out)["pairs"]) == [p for p in ALL_PAIRS if p != "test_113_0256"]
