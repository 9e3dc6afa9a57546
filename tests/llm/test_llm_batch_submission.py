"""One submission per line, by construction (operators/llm/batch.py): a driver stopped at every step of a
submission, a creation whose answer is lost, only this run's lines submitted. Each line is counted at the
test server (``batch_submissions``: how often each custom_id arrived in a created batch). No Ray.

"Killed" here is the driver stopped by an exception at a step (its process state lost: the rerun is a new
BatchState and a new BatchDriver with nothing but what the output store holds), which is what a SIGKILL
leaves, since every object is written whole."""
import asyncio
import logging

import pytest

from operators.llm.batch import BatchAPI, BatchDriver, BatchSettings, BatchState
from operators.llm.cache import ResponseCache
from operators.llm.client import DEFERRED
from tests.llm.test_llm_money import KEY, caller_for, requests

STEPS = ["pending", "uploaded", "file recorded", "created", "recorded"]


class Killed(BaseException):
    """The driver dies here (not an Exception: nothing in the driver may catch it)."""


def defer(server, state, cache, reqs):
    async def go():
        caller = caller_for(server, cache=cache, batch=state)
        try:
            return await asyncio.gather(*(caller.call(r) for r in reqs))
        finally:
            await caller.aclose()
    return asyncio.run(go())


def driver_for(server, state, run_id, **settings):
    return BatchDriver(state, BatchAPI(server.base_url, KEY, timeout_s=10, sleep=lambda s: None),
                       BatchSettings(poll_s=0.05, **settings), job="t", run_id=run_id)


@pytest.mark.parametrize("at", [1, 2])
@pytest.mark.parametrize("step", STEPS)
def test_a_driver_killed_at_any_step_of_a_submission_submits_each_line_once(openai_server, tmp_path, step, at):
    root, cache = str(tmp_path), ResponseCache(str(tmp_path))
    reqs = lambda: requests(5, tag="kill")                    # noqa: E731
    state = BatchState(root, "t", "run1")
    assert all(r.error_type == DEFERRED for r in defer(openai_server, state, cache, reqs()))
    driver = driver_for(openai_server, state, "run1", max_requests_per_file=2)   # three files: 2 + 2 + 1
    seen = []

    def kill(name):
        seen.append(name)
        if name == step and seen.count(step) == at:
            raise Killed(step)
    driver.step = kill
    with pytest.raises(Killed):
        driver.submit()
    # The rerun: another run, a new state and driver; its pass defers the lines again, then submits.
    state2 = BatchState(root, "t", "run2")
    assert all(r.error_type == DEFERRED for r in defer(openai_server, state2, cache, reqs()))
    rerun = driver_for(openai_server, state2, "run2", max_requests_per_file=2)
    rerun.submit()
    assert rerun.wait()["completed"] == 5
    stats = openai_server.stats()
    assert len(stats["batch_submissions"]) == 5 and set(stats["batch_submissions"].values()) == {1}, stats[
        "batch_submissions"]
    assert not state2.pending() and rerun.submit() == []
    done = defer(openai_server, BatchState(root, "t", "run3"), cache, reqs())
    assert all(r.ok and r.batch_id for r in done) and stats["total"] == 0


def test_a_creation_whose_answer_is_lost_is_found_at_the_provider_not_created_again(openai_server, tmp_path):
    """The provider creates the batch and the answer is lost (504): the driver finds it among the account's
    batches by its input file and records it; no line is submitted twice."""
    openai_server.configure(batch_create_lost=2)
    state, cache = BatchState(str(tmp_path), "t", "run1"), ResponseCache(str(tmp_path))
    defer(openai_server, state, cache, requests(4, tag="lost"))
    driver = driver_for(openai_server, state, "run1", max_requests_per_file=2)
    assert len(driver.submit()) == 2
    assert driver.wait()["completed"] == 4
    stats = openai_server.stats()
    assert stats["creates_lost"] == 2 and stats["batches_created"] == 2
    assert set(stats["batch_submissions"].values()) == {1} and len(stats["batch_submissions"]) == 4


def test_a_lost_creation_among_many_batches_is_found_page_by_page(openai_server, tmp_path):
    """Other batches made after ours (while its answer was lost) push it past the first page of the list:
    the lookup pages back until it finds it."""
    from operators.llm.batch import CreateUnanswered
    openai_server.configure(batch_create_lost=1)
    state, cache = BatchState(str(tmp_path), "t", "run1"), ResponseCache(str(tmp_path))
    other = BatchAPI(openai_server.base_url, KEY, timeout_s=10)
    defer(openai_server, state, cache, requests(1, tag="page"))
    driver = driver_for(openai_server, state, "run1")
    create = driver.api.create

    def create_then_others(*args, **kwargs):
        try:
            return create(*args, **kwargs)
        except CreateUnanswered:
            for i in range(5):
                other.create(other.upload(b'{"custom_id": "o%d", "method": "POST", "url": "/v1/chat/completions", '
                                          b'"body": {}}\n' % i), "24h")
            raise
    driver.api.create = create_then_others
    pages = driver.api.list_batches
    driver.api.list_batches = lambda limit=100: pages(limit=2)              # pages of two
    assert len(driver.submit()) == 1
    stats = openai_server.stats()
    assert stats["batches_created"] == 6 and stats["creates_lost"] == 1    # ours once, and the five others
    assert stats["batch_submissions"] == {**{f"o{i}": 1 for i in range(5)}, state.batches()[0]["custom_ids"][0]: 1}


def test_only_this_runs_lines_are_submitted_and_stale_ones_are_listed(openai_server, tmp_path, caplog):
    root, cache = str(tmp_path), ResponseCache(str(tmp_path))
    defer(openai_server, BatchState(root, "t", "old"), cache, requests(3, tag="stale", prefix=" old setting"))
    state = BatchState(root, "t", "new")
    defer(openai_server, state, cache, requests(2, tag="fresh"))
    driver = driver_for(openai_server, state, "new")
    with caplog.at_level(logging.WARNING, logger="operators.llm.batch"):
        driver.submit()
    assert driver.wait()["completed"] == 2
    submitted = openai_server.stats()["batch_submissions"]
    stale = BatchState(root, "t").stale("new")
    assert len(submitted) == 2 and not set(submitted) & set(stale) and len(stale) == 3
    assert any("3 waiting batch lines are not this run's" in r.getMessage() for r in caplog.records)
    assert len(state.keys("lines")) == 3                                  # left where they were, not paid


def test_lines_of_a_submission_begun_are_not_exported_elsewhere(openai_server, tmp_path):
    """A driver killed after its file id was recorded (the batch may exist at the provider): those lines
    are not waiting for anyone else, e.g. an export to an offline runner, which would pay them twice."""
    root, cache = str(tmp_path), ResponseCache(str(tmp_path))
    state = BatchState(root, "t", "run1")
    defer(openai_server, state, cache, requests(3, tag="begun"))
    driver = driver_for(openai_server, state, "run1", max_requests_per_file=2)

    def kill(name):
        if name == "file recorded":
            raise Killed(name)
    driver.step = kill
    with pytest.raises(Killed):
        driver.submit()
    [begun] = BatchState(root, "t").pending()
    offline = BatchDriver(BatchState(root, "t"), None, BatchSettings(), run_id="run1")
    assert offline.export_lines(str(tmp_path / "in.jsonl")) == 1
    assert not set(begun["custom_ids"]) & set(offline.state.waiting("run1"))


# -- the pass loop: every pair finished or failed with a reason ----------------------------------------
def run_job(server, tmp_path, monkeypatch, one_pass, todo, **cfg_overrides):
    """run_llm_job with each pass's pipeline replaced by ``one_pass(n, todo, state, cache)``."""
    from operators.io.storage import Store
    from operators.llm import job_passes
    from operators.llm.client import LLMConfig, Secret
    from operators.llm.job_options import LLMJobConfig
    from operators.llm.job_passes import run_llm_job
    from operators.llm.stage import StageSpec
    cache = ResponseCache(str(tmp_path))
    passes = []

    def pipeline(todo, *args, run_id, part, **kwargs):
        passes.append(part)
        one_pass(len(passes) - 1, todo, BatchState(str(tmp_path), "caption", run_id), cache)
        return {}
    monkeypatch.setattr(job_passes, "run_stages", pipeline)
    cfg = LLMJobConfig(output=str(tmp_path), model="test-model", base_url=server.base_url, batch_api=True,
                       batch_poll_s=0.05, **cfg_overrides)
    spec = StageSpec(name="caption_generate", input_table="pairs", build_request=None, handle_result=None,
                     llm=LLMConfig(model="test-model", base_url=server.base_url), api_key=Secret(KEY))
    run_llm_job(cfg, todo, None, {}, [spec], lambda: None, None, out=Store(str(tmp_path)), job="caption",
                run_id="r1")
    return passes


def errors_of(tmp_path):
    from operators.io.storage import Store
    from operators.io.tables import ERRORS_SCHEMA, read_table
    t = read_table(Store(str(tmp_path)), "errors", ERRORS_SCHEMA)
    return [] if t is None else t.to_pylist()


def fail_pair(tmp_path, pair, why):
    from operators.io.storage import Store
    from operators.io.tables import ERRORS_SCHEMA, error_record, write_table_shard
    write_table_shard(Store(str(tmp_path)), "errors", [error_record(pair, "caption_judge", why, run_id="r1")],
                      ERRORS_SCHEMA, "r1")


def test_a_pair_needing_more_passes_than_stages_allow_still_ends_with_its_row(openai_server, tmp_path, monkeypatch):
    """A pair whose requests go out in five rounds (a retry and re-asks in a stage) is taken to its end,
    here its error row of the last pass; the old bound (2 x stages + 2 = 4 passes) left it silently."""
    def one_pass(n, todo, state, cache):
        if n < 5:
            defer(openai_server, state, cache, requests(1, tag=f"round{n}"))
        else:
            fail_pair(tmp_path, "p0", "InvalidReply after the re-asks")
    passes = run_job(openai_server, tmp_path, monkeypatch, one_pass, [{"pair_id": "p0"}])
    assert len(passes) == 6
    assert [(e["item"], e["error_type"]) for e in errors_of(tmp_path)] == [("p0", "error")]


def test_a_pair_left_with_neither_row_nor_line_is_an_error_row_and_a_stop(openai_server, tmp_path, monkeypatch):
    from operators.llm.job_passes import PairsLeftOver, stop_line

    def one_pass(n, todo, state, cache):
        if n == 0:
            defer(openai_server, state, cache, requests(1, tag="only"))
            fail_pair(tmp_path, "done", "a reason")                 # the other pair ends with its row
    with pytest.raises(PairsLeftOver) as stopped:
        run_job(openai_server, tmp_path, monkeypatch, one_pass, [{"pair_id": "lost"}, {"pair_id": "done"}])
    assert "1 pairs no row after pass 2 and no batch line waiting for it" in stop_line(stopped.value)
    left = [e for e in errors_of(tmp_path) if e["error_type"] == "LeftOver"]
    assert [e["item"] for e in left] == ["lost"] and left[0]["run_id"] == "r1"


def test_passes_are_bounded_and_a_pair_never_done_is_an_error_row(openai_server, tmp_path, monkeypatch):
    from operators.llm.job_passes import PairsLeftOver

    def one_pass(n, todo, state, cache):
        defer(openai_server, state, cache, requests(1, tag=f"forever{n}"))
    with pytest.raises(PairsLeftOver, match="not finished after 6 batch passes"):
        run_job(openai_server, tmp_path, monkeypatch, one_pass, [{"pair_id": "p0"}], max_reasks=2)
    assert [e["error_type"] for e in errors_of(tmp_path)] == ["LeftOver"]


def test_a_line_failed_for_good_is_tried_once_more_by_a_later_run(openai_server, tmp_path):
    """As real time re-sends a failed pair on a rerun: a batch line that failed twice in run 1 (its pair's
    error row) is submitted once more by run 2, and answered; within run 1 it was not submitted again."""
    openai_server.configure(batch_fail_rate=1.0)
    root, cache = str(tmp_path), ResponseCache(str(tmp_path))
    state = BatchState(root, "t", "run1")
    driver = driver_for(openai_server, state, "run1")
    for _ in range(2):
        defer(openai_server, state, cache, requests(2, tag="again"))
        driver.submit(), driver.wait()
    first = defer(openai_server, state, cache, requests(2, tag="again"))
    assert all(r.error_type == "BatchFailed" for r in first) and driver.submit() == []
    assert set(openai_server.stats()["batch_submissions"].values()) == {2}
    openai_server.configure(batch_fail_rate=0.0)
    state2 = BatchState(root, "t", "run2")
    assert all(r.error_type == DEFERRED for r in defer(openai_server, state2, cache, requests(2, tag="again")))
    rerun = driver_for(openai_server, state2, "run2")
    assert len(rerun.submit()) == 1 and rerun.wait()["completed"] == 2
    assert all(r.ok for r in defer(openai_server, state2, cache, requests(2, tag="again")))
    assert set(openai_server.stats()["batch_submissions"].values()) == {3}


def test_schema_failures_are_re_asked_in_batches_as_real_time_re_asks_them(openai_server, tmp_path):
    """Replies that break the schema (the server drops a required item from 70 % of the replies it makes):
    batch re-asks each, in the next round, with the same question, reply and complaint real time sends,
    as many times (--max-reasks 2), so both end with the same answers, failures and attempts."""
    from tests.llm.test_llm_money import run_all
    openai_server.configure(faults=[{"kind": "wrong_count", "rate": 0.7}])
    realtime = run_all(openai_server, requests(12, tag="schema"))
    assert {r.attempts for r in realtime} > {1} and any(r.ok for r in realtime)   # re-asks happened
    openai_server.reset()
    state, cache = BatchState(str(tmp_path), "t", "run1"), ResponseCache(str(tmp_path))
    driver = driver_for(openai_server, state, "run1")
    taken = {}                                                 # each request's result in the pass that took it
    for _ in range(4):
        results = defer(openai_server, state, cache, requests(12, tag="schema"))
        taken.update({i: r for i, r in enumerate(results) if r.error_type != DEFERRED and i not in taken})
        if len(taken) == 12:
            break
        driver.submit(), driver.wait()
    results = [taken[i] for i in range(12)]
    same = lambda r: (r.ok, r.value, r.attempts, r.error_type, r.prompt_tokens, r.completion_tokens)  # noqa: E731
    assert [same(r) for r in results] == [same(r) for r in realtime]
    assert {r.error_type for r in realtime} == {"", "InvalidReply"}          # both outcomes occur here
    assert openai_server.stats()["total"] == 0 and set(openai_server.stats()["batch_submissions"].values()) == {1}


# -- the provider's enqueued-token limit ---------------------------------------------------------------
def defer_json_mode(server, state, cache, reqs):
    """Deferred in JSON mode: the schema in the prompt, so the lines' token estimates are the server's count."""
    async def go():
        caller = caller_for(server, cache=cache, batch=state, response_format="json_object")
        try:
            return await asyncio.gather(*(caller.call(r) for r in reqs))
        finally:
            await caller.aclose()
    return asyncio.run(go())


def test_files_go_in_waves_under_the_enqueued_token_limit(openai_server, tmp_path):
    state, cache = BatchState(str(tmp_path), "t", "run1"), ResponseCache(str(tmp_path))
    defer_json_mode(openai_server, state, cache, requests(6, tag="wave"))
    tokens = sorted(state.read("lines", k)["tokens"] for k in state.keys("lines"))
    limit = tokens[-1] + tokens[-2]                            # room for two lines at a time
    openai_server.configure(batch_enqueued_limit=limit, batch_delay_s=0.2)
    driver = driver_for(openai_server, state, "run1", max_enqueued_tokens=limit)
    driver.submit()
    left = driver.wait()
    assert driver.wave_counts.get("completed", 0) + left["completed"] == 6
    stats = openai_server.stats()
    assert stats["batches_refused"] == 0 and 3 <= stats["batches_created"] and stats["enqueued_peak"] <= limit
    assert set(stats["batch_submissions"].values()) == {1} and len(stats["batch_submissions"]) == 6


def test_a_batch_refused_for_the_enqueued_limit_fails_no_line_and_goes_again_in_waves(openai_server, tmp_path, caplog):
    state, cache = BatchState(str(tmp_path), "t", "run1"), ResponseCache(str(tmp_path))
    defer_json_mode(openai_server, state, cache, requests(4, tag="refused"))
    tokens = sorted(state.read("lines", k)["tokens"] for k in state.keys("lines"))
    openai_server.configure(batch_enqueued_limit=tokens[-1] + tokens[-2])
    driver = driver_for(openai_server, state, "run1")          # no limit set: one file of four lines
    assert len(driver.submit()) == 1
    with caplog.at_level(logging.WARNING, logger="operators.llm.batch"):
        assert driver.wait() == {"completed": 0, "failed": 0, "retried": 4, "open": 0}
    assert not state.keys("failed") and len(state.waiting("run1")) == 4       # no line failed: all wait again
    assert any("token_limit_exceeded" in r.getMessage() for r in caplog.records)
    waves = driver_for(openai_server, state, "run1", max_enqueued_tokens=tokens[-1] + tokens[-2])
    waves.submit()
    assert waves.wave_counts.get("completed", 0) + waves.wait()["completed"] == 4
    assert openai_server.stats()["batches_refused"] == 1


@pytest.mark.parametrize("keep", [False, True])
def test_a_batchs_files_are_deleted_at_the_provider_once_its_results_are_stored(openai_server, tmp_path, keep):
    # An output file and an error file: half the lines fail, drawn per line by the server (the custom ids
    # hold the server's port). Of 24 lines, all on one side happens once in 8 million runs; of 6 it was 1 in 32.
    openai_server.configure(batch_fail_rate=0.5)
    state, cache = BatchState(str(tmp_path), "t", "run1"), ResponseCache(str(tmp_path))
    defer(openai_server, state, cache, requests(24, tag="files"))
    driver = driver_for(openai_server, state, "run1", keep_files=keep)
    driver.submit()
    counts = driver.wait()
    assert counts["completed"] and counts["retried"] and len(state.keys("results")) == counts["completed"]
    stats = openai_server.stats()
    assert (stats["files_stored"], stats["files_deleted"]) == ((3, 0) if keep else (0, 3))


def test_ctrl_c_leaves_the_submitted_batches_for_the_rerun(openai_server, tmp_path):
    """Ctrl-C while the driver waits: the batches are not cancelled (their answers are still coming, and
    paid for); they stay recorded, and the rerun polls them and takes their answers."""
    openai_server.configure(batch_hold=True)
    root, cache = str(tmp_path), ResponseCache(str(tmp_path))
    state = BatchState(root, "t", "run1")
    defer(openai_server, state, cache, requests(3, tag="ctrlc"))

    def interrupted(seconds):
        raise KeyboardInterrupt
    driver = BatchDriver(state, BatchAPI(openai_server.base_url, KEY, timeout_s=10), BatchSettings(poll_s=0.05),
                         run_id="run1", sleep=interrupted)
    [batch_id] = driver.submit()
    with pytest.raises(KeyboardInterrupt):
        driver.wait()
    assert BatchAPI(openai_server.base_url, KEY).retrieve(batch_id)["status"] == "in_progress"
    openai_server.configure(batch_hold=False)
    rerun = driver_for(openai_server, BatchState(root, "t", "run2"), "run2")
    assert rerun.submit() == [] and rerun.wait()["completed"] == 3
    assert set(openai_server.stats()["batch_submissions"].values()) == {1}


def test_a_re_ask_that_falls_back_to_real_time_makes_only_the_re_asks_left(openai_server, tmp_path):
    """--batch-fallback realtime: a schema re-ask whose batch line failed goes on in real time with the
    re-asks left (--max-reasks 2, one made in batch): two real-time sends, not three; every reply billed
    and booked (the batch reply at the batch price), none twice."""
    openai_server.configure(faults=[{"kind": "wrong_count", "rate": 1.0}])     # every reply breaks the schema
    state, cache = BatchState(str(tmp_path), "t", "run1"), ResponseCache(str(tmp_path))
    driver = driver_for(openai_server, state, "run1", fallback="realtime")
    defer(openai_server, state, cache, requests(1, tag="left"))
    driver.submit(), driver.wait()                             # answered, unusable
    assert [r.error_type for r in defer(openai_server, state, cache, requests(1, tag="left"))] == [DEFERRED]
    openai_server.configure(batch_fail_rate=1.0)               # the re-ask's line fails: it goes in real time
    driver.submit()
    assert driver.wait()["retried"] == 1
    [result] = defer(openai_server, state, cache, requests(1, tag="left"))
    assert result.error_type == "InvalidReply" and openai_server.stats()["total"] == 2
    assert result.attempts == 3 and result.batch_id and result.cost_usd > 0
