"""The captions job's money end to end (Ray Data + the test server): --batch-api gives the selection of
a real-time run on the same replies at the batch price and a rerun sends nothing; a quota 429 stops
the job at once (nothing waited for), non-zero, and the rerun re-sends nothing that was answered. A
driver SIGKILLed mid-submission: tests/jobs/test_llm_batch_kill_job.py (the job) and
tests/llm/test_llm_batch_kill.py (every step of a submission)."""
import pytest

from jobs.caption import main, run
from tests.conftest import own_llm_namespace
from tests.jobs.test_caption_job import ALL_PAIRS, LEVIR, accounted, config, tables

pytestmark = pytest.mark.slow

CANDIDATE = ("pair_id", "candidate_index", "caption", "overall", "selected")


@pytest.fixture(scope="module")
def realtime(ray_session, openai_test_server_process, tmp_path_factory):
    """The tables of a real-time run on data/levir-cd, the reference both batch tests compare with: the test
    server answers a request the same way every time, so one run serves both (each ran its own, the same,
    before)."""
    server = openai_test_server_process
    server.restore_defaults()
    server.reset()
    out = tmp_path_factory.mktemp("money-realtime") / "realtime"
    with own_llm_namespace("money-realtime"):
        run(config(server, LEVIR, out))
    server.reset()
    return tables(out)


def test_batch_run_selects_as_real_time_does_at_the_batch_price_and_a_rerun_sends_nothing(
        realtime, ray_session, openai_server, tmp_path):
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


def limiter_stats(namespace: str) -> dict:
    """The counters of the account limiter the job left in this test's namespace (it is detached)."""
    import ray
    [named] = [a for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == namespace]
    return ray.get(ray.get_actor(named["name"], namespace=namespace).stats.remote(), timeout=60)


def test_a_quota_429_stops_the_job_at_once_and_the_rerun_pays_nothing_twice(
        ray_session, openai_server, llm_namespace, tmp_path, capsys):
    # The account runs dry at the judge of one pair (its generation and other pairs' requests answered).
    openai_server.configure(faults=[{"kind": "quota", "rate": 1.0, "match": "test_2_0000_0000",
                                     "match_text": "strict reviewer"}])
    out = tmp_path / "out"
    code = main(argv(openai_server, out))
    printed = capsys.readouterr().out
    assert code != 0 and "quota" in printed.splitlines()[-1]
    first = openai_server.stats()
    assert max(first["seen_by_key"].values()) == 1              # nothing retried
    answered = set(first["ok_by_key"])
    assert answered
    t = tables(out)
    assert accounted(t) == ALL_PAIRS                            # every pair in pairs/ or errors/
    # At once, nothing waited for: the one 429 was the quota's, the pool was never paused for it (not
    # taken for a rate limit), and every request not answered failed on the stop (QuotaExhausted), none
    # by waiting out the limiter (LimiterUnavailable) or retries (TransportError). The one other error
    # is the pair without a change mask, set aside before any request.
    assert first["by_status"] == {"200": first["total"] - 1, "429": 1}
    limiter = limiter_stats(llm_namespace)
    assert limiter["throttled"] == 0 and "insufficient_quota" in limiter["stopped"]
    assert {e["error_type"] for e in t["errors"] if e["stage"] != "prepare"} == {"QuotaExhausted"}
    assert all(u["status"] == "ok" or u["prompt_tokens"] is None or u["prompt_tokens"] == 0 for u in t["usage"])

    # The account topped up (a fresh server): the rerun completes and re-sends none of the answered.
    openai_server.restore_defaults()
    openai_server.reset()
    assert main(argv(openai_server, out)) == 0
    second = openai_server.stats()
    assert not answered & set(second["ok_by_key"])
    assert sorted(p["pair_id"] for p in tables(out)["pairs"]) == [p for p in ALL_PAIRS if p != "test_113_0256"]


def answer_offline(server, lines_file, replies_file):
    """What ``vllm run-batch -i lines -o replies`` does: each line's body sent to a chat endpoint, each reply
    written in the batch output format (here the test server answers, as it answers real time)."""
    import json
    import urllib.request
    out = []
    for line in (json.loads(x) for x in lines_file.read_text().splitlines() if x.strip()):
        assert set(line) == {"custom_id", "method", "url", "body"} and line["url"] == "/v1/chat/completions"
        req = urllib.request.Request(server.base_url.rstrip("/") + "/chat/completions",
                                     data=json.dumps(line["body"]).encode(), method="POST",
                                     headers={"Content-Type": "application/json", "Authorization": "Bearer x"})
        with urllib.request.urlopen(req, timeout=30) as resp:
            body = json.loads(resp.read())
        out.append({"id": f"vllm-{line['custom_id'][:8]}", "custom_id": line["custom_id"], "error": None,
                    "response": {"status_code": 200, "request_id": f"r-{line['custom_id'][:8]}", "body": body}})
    replies_file.write_text("".join(json.dumps(o) + "\n" for o in reversed(out)))   # any order
    return len(out)


@pytest.mark.timeout(900)   # four runs of the job (and the module's real-time one) on a loaded 2-core machine
def test_batch_export_then_import_runs_the_job_through_files_and_a_second_import_pays_nothing(
        realtime, ray_session, openai_server, tmp_path):
    out, files = tmp_path / "out", tmp_path / "files"
    files.mkdir()
    batch = dict(batch_api=True, batch_poll_s=0.1)
    # 1. The generations go out to a file, and the run stops (nothing sent, nothing booked).
    first = run(config(openai_server, LEVIR, out, batch_export=str(files / "in1.jsonl"), **batch))
    assert "in1.jsonl" in first["stopped"] and openai_server.stats()["total"] == 0
    assert answer_offline(openai_server, files / "in1.jsonl", files / "out1.jsonl") == 11
    # 2. Their replies in; the judge requests out.
    second = run(config(openai_server, LEVIR, out, batch_import=str(files / "out1.jsonl"),
                        batch_export=str(files / "in2.jsonl"), **batch))
    assert "in2.jsonl" in second["stopped"] and openai_server.stats()["total"] == 11   # only the offline runner's
    assert answer_offline(openai_server, files / "in2.jsonl", files / "out2.jsonl") == 11
    # 3. Those in: every pair done, the selection real time made on the same replies.
    sent = openai_server.stats()["total"]
    third = run(config(openai_server, LEVIR, out, batch_import=str(files / "out2.jsonl"),
                       batch_export=str(files / "in3.jsonl"), **batch))
    assert third["stopped"] == "" and openai_server.stats()["total"] == sent
    t = tables(out)
    assert accounted(t) == ALL_PAIRS and len(t["pairs"]) == 11
    key = lambda c: (c["pair_id"], c["candidate_index"])       # noqa: E731
    assert [tuple(c[k] for k in CANDIDATE) for c in sorted(t["captions"], key=key)] == \
        [tuple(c[k] for k in CANDIDATE) for c in sorted(realtime["captions"], key=key)]
    # Each request paid once, at the batch price, naming its file; a later run's cache hits are booked free.
    paid = [u for u in t["usage"] if not u["cached"]]
    assert len(paid) == 22 and {u["batch_id"] for u in paid} == {"import:out1.jsonl", "import:out2.jsonl"}
    assert sorted(u["cache_key"] for u in paid) == sorted(u["cache_key"] for u in realtime["usage"])
    rt_cost = {u["cache_key"]: u["cost_usd"] for u in realtime["usage"]}
    assert [u["cost_usd"] for u in paid] == pytest.approx([rt_cost[u["cache_key"]] / 2 for u in paid])
    assert all(u["cost_usd"] is None for u in t["usage"] if u["cached"])
    rows = len(t["usage"])
    # 4. The same replies imported again: nothing sent, exported or booked.
    again = run(config(openai_server, LEVIR, out, batch_import=str(files / "out2.jsonl"),
                       batch_export=str(files / "in4.jsonl"), **batch))
    assert again["stopped"] == "" and again["usage"]["logical_requests"] == 0
    assert openai_server.stats()["total"] == sent
    assert not (files / "in4.jsonl").exists() or not (files / "in4.jsonl").read_text().strip()
    assert len(tables(out)["usage"]) == rows